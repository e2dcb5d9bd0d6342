/* Parallel loops for the kernels: OpenMP where the compiler has it (-fopenmp: torch's own libgomp
   runtime, so torch.set_num_threads sizes it), else a pool of pthreads kept for the process's life
   (Apple's compiler has no OpenMP), sized by gs_set_num_threads.

   gs_parallel_for(n, serial, fn, ctx): fn(ctx, begin, end) over contiguous shares of [0, n), one per
   thread (all in the caller's thread when `serial`). gs_parallel_for_each(n, fn, ctx): fn(ctx, i,
   i + 1) for each i, handed out one at a time (for tasks of uneven cost). One parallel loop at a
   time per library: a second caller waits. */
#ifndef GS_PARALLEL_H
#define GS_PARALLEL_H

#include <stdint.h>

typedef void (*gs_range_fn)(void* ctx, int64_t begin, int64_t end);

#if defined(_OPENMP)
#include <omp.h>

const char* gs_threading(void) { return "OpenMP"; }
void gs_set_num_threads(int n) { (void)n; /* torch's omp_set_num_threads governs */ }

static inline void gs_parallel_for(int64_t n, int serial, gs_range_fn fn, void* ctx) {
    if (n <= 0) return;
    #pragma omp parallel if (!serial)
    {
        const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t begin = n * t / count, end = n * (t + 1) / count;
        if (begin < end) fn(ctx, begin, end);
    }
}

static inline void gs_parallel_for_each(int64_t n, gs_range_fn fn, void* ctx) {
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) fn(ctx, i, i + 1);
}

#else
#include <pthread.h>
#include <stdatomic.h>

#define GS_MAX_THREADS 256

static struct {
    pthread_mutex_t call;  /* one loop at a time */
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    int wanted, started;   /* threads asked for (the caller included), workers started */
    int64_t generation;    /* bumped per loop: workers wait for a new one */
    int workers, finished; /* workers in this loop, and those done with it */
    int64_t n;
    int dynamic;
    atomic_llong next;
    gs_range_fn fn;
    void* ctx;
} gs_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
             PTHREAD_COND_INITIALIZER, 1, 0, 0, 0, 0, 0, 0, 0, NULL, NULL};

const char* gs_threading(void) { return "pthreads"; }
void gs_set_num_threads(int n) {
    pthread_mutex_lock(&gs_pool.call);
    gs_pool.wanted = n < 1 ? 1 : n > GS_MAX_THREADS ? GS_MAX_THREADS : n;
    pthread_mutex_unlock(&gs_pool.call);
}

/* share `t` of `count` (the caller is share 0) */
static void gs_run_share(int64_t t, int64_t count) {
    if (gs_pool.dynamic) {
        for (int64_t i; (i = atomic_fetch_add(&gs_pool.next, 1)) < gs_pool.n;) gs_pool.fn(gs_pool.ctx, i, i + 1);
        return;
    }
    const int64_t begin = gs_pool.n * t / count, end = gs_pool.n * (t + 1) / count;
    if (begin < end) gs_pool.fn(gs_pool.ctx, begin, end);
}

static void* gs_worker(void* arg) {
    const int64_t index = (int64_t)(intptr_t)arg;  /* 1, 2, ... */
    int64_t seen = 0;
    pthread_mutex_lock(&gs_pool.lock);
    for (;;) {
        while (gs_pool.generation == seen) pthread_cond_wait(&gs_pool.wake, &gs_pool.lock);
        seen = gs_pool.generation;
        if (index >= gs_pool.workers + 1) continue;  /* not needed for this loop */
        const int64_t count = gs_pool.workers + 1;
        pthread_mutex_unlock(&gs_pool.lock);
        gs_run_share(index, count);
        pthread_mutex_lock(&gs_pool.lock);
        if (++gs_pool.finished == gs_pool.workers) pthread_cond_signal(&gs_pool.done);
    }
    return NULL;
}

static void gs_run(int64_t n, int threads, int dynamic, gs_range_fn fn, void* ctx) {
    pthread_mutex_lock(&gs_pool.call);
    int count = threads < gs_pool.wanted ? threads : gs_pool.wanted;
    while (gs_pool.started < count - 1) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, gs_worker, (void*)(intptr_t)(gs_pool.started + 1)) != 0) break;
        pthread_detach(thread);
        ++gs_pool.started;
    }
    if (count > gs_pool.started + 1) count = gs_pool.started + 1;
    pthread_mutex_lock(&gs_pool.lock);
    gs_pool.n = n, gs_pool.dynamic = dynamic, gs_pool.fn = fn, gs_pool.ctx = ctx;
    atomic_store(&gs_pool.next, 0);
    gs_pool.workers = count - 1, gs_pool.finished = 0;
    ++gs_pool.generation;
    pthread_cond_broadcast(&gs_pool.wake);
    pthread_mutex_unlock(&gs_pool.lock);
    gs_run_share(0, count);
    pthread_mutex_lock(&gs_pool.lock);
    while (gs_pool.finished < gs_pool.workers) pthread_cond_wait(&gs_pool.done, &gs_pool.lock);
    pthread_mutex_unlock(&gs_pool.lock);
    pthread_mutex_unlock(&gs_pool.call);
}

static inline void gs_parallel_for(int64_t n, int serial, gs_range_fn fn, void* ctx) {
    if (n <= 0) return;
    if (serial || n == 1) { fn(ctx, 0, n); return; }
    gs_run(n, n < GS_MAX_THREADS ? (int)n : GS_MAX_THREADS, 0, fn, ctx);
}

static inline void gs_parallel_for_each(int64_t n, gs_range_fn fn, void* ctx) {
    if (n <= 0) return;
    if (n == 1) { fn(ctx, 0, 1); return; }
    gs_run(n, n < GS_MAX_THREADS ? (int)n : GS_MAX_THREADS, 1, fn, ctx);
}
#endif

#endif
