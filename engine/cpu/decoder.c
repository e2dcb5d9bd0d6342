/* A decode step's stack of decoder layers on the CPU in one call (engine/cpu/decoder.py): per
   layer, the same kernels in the same order as the per-layer Python path (engine/models/llama.py,
   layers.py, attention.py) runs them, so every number is the same, bit for bit; only the Python
   between them is gone (a decode step of a small model spent more time there than in the kernels).

   The kernels come in as function pointers from their own libraries (attention.c, linear.c,
   ops.c, quant_linear.c, lora.c). What this file computes itself, the rotary embedding and the KV-cache
   write, is what torch computed: x * cos + roll(x, D/2) * signed sin, each product and the sum
   rounded on its own (no fused multiply-add), and row copies.

   Rows with a LoRA adapter get its product added right after each projection (qkv, o, gate_up, down),
   by lora.c's kernel, the one the per-layer path calls too. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "isa.h"
#include "lora.h"
#include "parallel.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char* gs_isa(void) { return "C"; }

typedef void (*quant_linear_fn)(int type, const float* x, int64_t rows, int64_t ldx, const uint8_t* weight,
                                int64_t n, int64_t k, int64_t panel_stride, const float* bias, float* out,
                                int64_t ldo);
typedef void (*panel_linear_fn)(const float* x, int64_t rows, int64_t ldx, const float* panels, int64_t n,
                                int64_t k, const float* bias, float* out, int64_t ldo);
typedef void (*paged_decode_fn)(const float* q, int64_t q_s0, int64_t q_s1, const float* k_cache,
                                const float* v_cache, const int32_t* block_tables, int64_t bt_s0,
                                const int32_t* context_lens, float* out, int64_t B, int64_t Hq, int64_t Hkv,
                                int64_t D, int64_t bs, float scale, int64_t split_heads, int64_t window,
                                const float* sinks);
typedef void (*add_rms_norm_fn)(const float* x, int64_t ldx, const float* residual, int64_t ldr,
                                const float* weight, float eps, int64_t rows, int64_t hidden, float* out,
                                int64_t ldo, float* res_out, int64_t ldro);
typedef void (*silu_mul_fn)(const float* y, int64_t ldy, int64_t rows, int64_t inter, float* out, int64_t ldo);

struct kernels {
    quant_linear_fn quant_linear;
    panel_linear_fn panel_linear;
    paged_decode_fn paged_decode;
    add_rms_norm_fn add_rms_norm;
    silu_mul_fn silu_mul;
    lora_add_fn lora_add;  /* NULL: the stack takes no step with adapters (decoder.py) */
};

/* one part of a projection's output rows: quantized (qtype >= 0: quant_linear's type, panels
   `stride` bytes apart) or float32 panels (qtype -1) */
struct part {
    int64_t qtype, n, k, stride;
    const void* weight;
};

#define MAX_PARTS 4
/* a projection: its parts side by side in the output, then the bias (added after, as torch adds
   it to the parts' concatenation; a single part takes the bias inside the kernel) */
struct projection {
    int64_t parts, n;
    struct part part[MAX_PARTS];
    const float* bias;
};

struct layer {
    const float *input_norm, *post_norm;
    struct projection qkv, o, gate_up, down;
    float *k_cache, *v_cache;
    int64_t window;  /* the layer's sliding window (0: none) */
    int64_t group;  /* its KV cache group: the slots and block tables it takes (engine/sched/kv_groups.py) */
};

struct model {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps, scale;
    const struct layer* layer;
    struct kernels fn;
};

/* out[rows, proj.n] (row stride ldo) = x @ W.T (+ bias) */
static void project(const struct model* m, const struct projection* p, const float* x, int64_t rows, int64_t ldx,
                    float* out, int64_t ldo) {
    const float* bias_inside = p->parts == 1 ? p->bias : NULL;
    int64_t col = 0;
    for (int64_t i = 0; i < p->parts; ++i) {
        const struct part* q = &p->part[i];
        if (q->qtype >= 0)
            m->fn.quant_linear((int)q->qtype, x, rows, ldx, (const uint8_t*)q->weight, q->n, q->k, q->stride,
                               bias_inside, out + col, ldo);
        else
            m->fn.panel_linear(x, rows, ldx, (const float*)q->weight, q->n, q->k, bias_inside, out + col, ldo);
        col += q->n;
    }
    if (p->parts > 1 && p->bias)
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < p->n; ++j) out[r * ldo + j] += p->bias[j];
}

enum { QKV, O, GATE_UP, DOWN, PROJECTIONS };

/* y += the LoRA product of rows with an adapter, for projection `kind` of layer l (lora: [layers,
   PROJECTIONS], NULL where no row has an adapter; an entry NULL where that projection has no slots) */
static void add_lora(const struct model* m, const struct lora_projection* const* lora, const int32_t* lora_slots,
                     int64_t l, int kind, int64_t rows, const float* x, int64_t ldx, float* y, int64_t ldy) {
    if (!lora) return;
    const struct lora_projection* p = lora[l * PROJECTIONS + kind];
    if (p) m->fn.lora_add(p, lora_slots, rows, x, ldx, y, ldy);
}

/* qk[b, h, :] <- x * cos + roll(x, D/2) * sin over the q and k heads of a row of the fused qkv
   output (apply_rotary's arithmetic); v is left where it is */
static void rotate(const float* qkv, int64_t heads, int64_t D, const float* cos, const float* sin, float* out) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; ++h) {
        const float* x = qkv + h * D;
        float* o = out + h * D;
        for (int64_t d = 0; d < D; ++d) {
            const float a = x[d] * cos[d];
            const float b = x[d < half ? d + half : d - half] * sin[d];
            o[d] = a + b;
        }
    }
}

/* One decode step through every layer. x [B, hidden]: the embeddings in, the last layer's output
   out; residual [B, hidden]: out only (the stream before the final norm's add). cos, sin [B, D]:
   the rotary tables of the rows' positions (rotary_tables); per KV cache group g: slots[g] [B] int64,
   block_tables[g] [B, W] int32 (row stride bt_s0[g]); context_lens [B] int32. LoRA (NULL: no row has an
   adapter): lora [layers, PROJECTIONS] (add_lora), lora_slots [B] int32, each row's slot (-1: none). */
void decode_layers(const struct model* m, int64_t B, float* x, float* residual, const float* cos, const float* sin,
                   const int64_t* const* group_slots, const int32_t* const* group_tables, const int64_t* group_bt_s0,
                   const int32_t* context_lens, int64_t split_heads, const struct lora_projection* const* lora,
                   const int32_t* lora_slots) {
    const int64_t H = m->hidden, D = m->head_dim, Hq = m->heads, Hkv = m->kv_heads, I = m->inter;
    const int64_t qkv_n = (Hq + 2 * Hkv) * D, rot_n = (Hq + Hkv) * D;
    float* h = (float*)malloc(sizeof(float) * B * H);
    float* qkv = (float*)malloc(sizeof(float) * B * qkv_n);
    float* rotated = (float*)malloc(sizeof(float) * B * rot_n);
    float* attn = (float*)malloc(sizeof(float) * B * Hq * D);
    float* gate_up = (float*)malloc(sizeof(float) * B * 2 * I);
    float* act = (float*)malloc(sizeof(float) * B * I);
    for (int64_t l = 0; l < m->layers; ++l) {
        const struct layer* L = &m->layer[l];
        const int64_t* slots = group_slots[L->group];
        const int32_t* block_tables = group_tables[L->group];
        const int64_t bt_s0 = group_bt_s0[L->group];
        /* norm_linear: rms_norm(x) on the first layer (the residual is x), else x + residual */
        if (l == 0) {
            m->fn.add_rms_norm(x, H, NULL, 0, L->input_norm, m->eps, B, H, h, H, NULL, 0);
            memcpy(residual, x, sizeof(float) * B * H);
        } else {  /* residual <- x + residual in place: element by element */
            m->fn.add_rms_norm(x, H, residual, H, L->input_norm, m->eps, B, H, h, H, residual, H);
        }
        project(m, &L->qkv, h, B, H, qkv, qkv_n);
        add_lora(m, lora, lora_slots, l, QKV, B, h, H, qkv, qkv_n);
        for (int64_t b = 0; b < B; ++b) {
            rotate(qkv + b * qkv_n, Hq + Hkv, D, cos + b * D, sin + b * D, rotated + b * rot_n);
            const int64_t slot = slots[b];
            memcpy(L->k_cache + slot * Hkv * D, rotated + b * rot_n + Hq * D, sizeof(float) * Hkv * D);
            memcpy(L->v_cache + slot * Hkv * D, qkv + b * qkv_n + (Hq + Hkv) * D, sizeof(float) * Hkv * D);
        }
        m->fn.paged_decode(rotated, rot_n, D, L->k_cache, L->v_cache, block_tables, bt_s0, context_lens, attn, B,
                           Hq, Hkv, D, m->block_size, m->scale, split_heads, L->window, NULL);
        project(m, &L->o, attn, B, Hq * D, x, H);  /* x now holds the attention block's output */
        add_lora(m, lora, lora_slots, l, O, B, attn, Hq * D, x, H);
        m->fn.add_rms_norm(x, H, residual, H, L->post_norm, m->eps, B, H, h, H, residual, H);
        project(m, &L->gate_up, h, B, H, gate_up, 2 * I);
        add_lora(m, lora, lora_slots, l, GATE_UP, B, h, H, gate_up, 2 * I);
        m->fn.silu_mul(gate_up, 2 * I, B, I, act, I);
        project(m, &L->down, act, B, I, x, H);
        add_lora(m, lora, lora_slots, l, DOWN, B, act, I, x, H);
    }
    free(h); free(qkv); free(rotated); free(attn); free(gate_up); free(act);
}
