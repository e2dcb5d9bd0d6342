/* Runs one CPU kernel (engine/cpu/<kernel>.c, linked in) cross-built for ARM, under qemu, for
   tests/arm_library.py: `driver FUNCTION` calls the kernel's function of that name once.

   stdin: the function's arguments in order, each a tag byte and its value: 'i' int64, 'f' float32,
   'p' an input array, 'o' an array the function writes (int64 byte count, -1 for NULL, then the
   bytes: an output's present content, so that what the function does not write comes back as it
   was). stdout: each 'o' array's bytes after the call, in order. `driver gs_isa` prints the path and
   the threading of the build, a line each. Threads: OMP_NUM_THREADS, for OpenMP and the pthreads
   pool alike. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char* gs_isa(void);
const char* gs_threading(void);
void gs_set_num_threads(int n);

/* every kernel's functions: only the linked kernel's are defined, the others are NULL */
#define WEAK __attribute__((weak))
WEAK void paged_decode(const float* q, int64_t q_s0, int64_t q_s1, const float* k_cache, const float* v_cache,
                       const int32_t* block_tables, int64_t bt_s0, const int32_t* context_lens, float* out,
                       int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t bs, float scale, int64_t split_heads,
                       int64_t window, const float* sinks);
WEAK void pack_panels(const float* w, int64_t n, int64_t k, float* panels);
WEAK void panel_linear(const float* x, int64_t rows, int64_t ldx, const float* panels, int64_t n, int64_t k,
                       const float* bias, float* out, int64_t ldo);
WEAK void add_rms_norm(const float* x, int64_t ldx, const float* residual, int64_t ldr, const float* weight,
                       float eps, int64_t rows, int64_t hidden, float* out, int64_t ldo, float* res_out,
                       int64_t ldro);
WEAK void silu_mul(const float* y, int64_t ldy, int64_t rows, int64_t inter, float* out, int64_t ldo);
WEAK void quant_linear(int type, const float* x, int64_t rows, int64_t ldx, const uint8_t* weight, int64_t n,
                       int64_t k, int64_t panel_stride, const float* bias, float* out, int64_t ldo);
WEAK void quantize_rows(const float* x, int64_t rows, int64_t ldx, int64_t k, int8_t* xq, float* dx);

#define MAX_ARGS 20

struct arg {
    char tag;
    int64_t i, bytes;
    float f;
    void* p;
};

static int read_exactly(void* dst, size_t n) { return fread(dst, 1, n, stdin) == n; }

/* the next argument from stdin: 1, 0 at the end, -1 on a malformed one */
static int read_arg(struct arg* a) {
    memset(a, 0, sizeof *a);
    if (fread(&a->tag, 1, 1, stdin) != 1) return 0;
    switch (a->tag) {
    case 'i': return read_exactly(&a->i, 8) ? 1 : -1;
    case 'f': return read_exactly(&a->f, 4) ? 1 : -1;
    case 'p': case 'o':
        if (!read_exactly(&a->bytes, 8)) return -1;
        if (a->bytes < 0) return 1;
        a->p = aligned_alloc(64, (size_t)(a->bytes + 63) / 64 * 64 + 64);  /* 64-byte aligned, as torch's */
        return a->p && read_exactly(a->p, (size_t)a->bytes) ? 1 : -1;
    default: return -1;
    }
}

#define I(n) a[n].i
#define F(n) a[n].f
#define P(n) a[n].p

/* calls `name` on the arguments; 0 where this build has no such function or the count is wrong */
static int call(const char* name, struct arg* a, int count) {
#define IS(fn, args) (!strcmp(name, #fn) && fn && count == (args))
    if (IS(paged_decode, 18))
        paged_decode(P(0), I(1), I(2), P(3), P(4), P(5), I(6), P(7), P(8), I(9), I(10), I(11), I(12), I(13), F(14), I(15),
                     I(16), P(17));
    else if (IS(pack_panels, 4))
        pack_panels(P(0), I(1), I(2), P(3));
    else if (IS(panel_linear, 9))
        panel_linear(P(0), I(1), I(2), P(3), I(4), I(5), P(6), P(7), I(8));
    else if (IS(add_rms_norm, 12))
        add_rms_norm(P(0), I(1), P(2), I(3), P(4), F(5), I(6), I(7), P(8), I(9), P(10), I(11));
    else if (IS(silu_mul, 6))
        silu_mul(P(0), I(1), I(2), I(3), P(4), I(5));
    else if (IS(quant_linear, 11))
        quant_linear((int)I(0), P(1), I(2), I(3), P(4), I(5), I(6), I(7), P(8), P(9), I(10));
    else if (IS(quantize_rows, 6))
        quantize_rows(P(0), I(1), I(2), I(3), P(4), P(5));
    else
        return 0;
    return 1;
#undef IS
}

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: driver FUNCTION < arguments\n");
        return 2;
    }
    const char* threads = getenv("OMP_NUM_THREADS");
    gs_set_num_threads(threads ? atoi(threads) : 1);
    if (!strcmp(argv[1], "gs_isa")) {
        printf("%s\n%s\n", gs_isa(), gs_threading());
        return 0;
    }
    struct arg a[MAX_ARGS];
    int count = 0, status = 0;
    while (count < MAX_ARGS && (status = read_arg(&a[count])) == 1) ++count;
    if (count == MAX_ARGS || status < 0) {
        fprintf(stderr, "malformed arguments\n");
        return 3;
    }
    if (!call(argv[1], a, count)) {
        fprintf(stderr, "no %s taking %d arguments in this build\n", argv[1], count);
        return 4;
    }
    for (int n = 0; n < count; ++n)
        if (a[n].tag == 'o' && a[n].p) fwrite(a[n].p, 1, (size_t)a[n].bytes, stdout);
    for (int n = 0; n < count; ++n) free(a[n].p);
    return 0;
}
