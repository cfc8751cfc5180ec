/* Routed bf16 experts on the CPU for the few tokens a decode forward sends to a missed expert
 * (oled/kernels/cpu.py builds and calls it): SwiGLU experts as matrix-vector products that stream
 * each expert's weights once from host memory, on many threads.
 *
 * The threads are the OpenMP team's that torch computes with, where Python finds its runtime
 * (else a pool of the library's own): torch's threads wait for work by spinning, so a second
 * pool would share the cores with them.
 *
 * Work comes in three phases, each split into items that the threads take in turn: (0) the
 * pairs' activations to fp32, (1) per expert and block of intermediate rows, the gate and up rows
 * and the SwiGLU product, (2) per expert and block of hidden rows, the down rows times the pair's
 * gate weight. Rounding follows the resident path's points (oled.model.experts._weighted_mlp):
 * the gate/up product, the SiLU, the SwiGLU product and the down product each round to the
 * weights' dtype; sums run in fp32. One row's sum is one thread's: 16 lanes over the row (fused
 * multiply-adds where the CPU has them), then a fixed tree, so the result is the same for every
 * thread count and vector width.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define OLED_EXPERTS_CONTRACT
#include "experts_state.h"

#define LANES 16 /* fp32 lanes of one row's partial sums */
#define TOKENS 4 /* tokens whose sums share one pass over a row */
#define ROWS 16  /* rows per work item */
#define AHEAD 1024 /* weights prefetched this many values ahead (into the rows that follow) */

/* -- numbers ----------------------------------------------------------------------------------- */

/* Round to nearest even in bf16 (NaN stays NaN), returned widened to fp32. */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u |= 0x00400000u;
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* 16 fp32 lanes (one AVX-512 register, two AVX2 ones: the same sums either way) */
typedef float lanes __attribute__((vector_size(4 * LANES)));
typedef uint32_t lanes_u32 __attribute__((vector_size(4 * LANES)));
typedef uint16_t lanes_u16 __attribute__((vector_size(2 * LANES)));

static inline lanes load16(const uint16_t *p) {
    lanes_u16 h;
    memcpy(&h, p, sizeof h);
    lanes_u32 u = __builtin_convertvector(h, lanes_u32) << 16;
    lanes f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline lanes load32(const float *p) {
    lanes f;
    memcpy(&f, p, sizeof f);
    return f;
}

static inline float lane_sum(lanes v) {
    float a[LANES], s8[8], s4[4];
    memcpy(a, &v, sizeof a);
    for (int l = 0; l < 8; l++) s8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* Sums of `rows` (1 or 2) weight rows (n values each, n a multiple of LANES) with TG token rows
 * of x (stride xs): out[r * TOKENS + t]. */
#define DOTS(NAME, WTYPE, LOAD, TG)                                                              \
    static void NAME##_##TG(const WTYPE *const *w, int rows, const float *x, int64_t xs,         \
                            int64_t n, float *out) {                                             \
        lanes acc[2][TG] = {{{0}}};                                                              \
        if (rows == 2) {                                                                         \
            for (int64_t k = 0; k < n; k += LANES) {                                             \
                __builtin_prefetch(w[0] + k + AHEAD, 0, 0);                                      \
                __builtin_prefetch(w[1] + k + AHEAD, 0, 0);                                      \
                lanes a = LOAD(w[0] + k), b = LOAD(w[1] + k);                                    \
                for (int t = 0; t < TG; t++) {                                                   \
                    lanes xv = load32(x + t * xs + k);                                           \
                    acc[0][t] += xv * a;                                                         \
                    acc[1][t] += xv * b;                                                         \
                }                                                                                \
            }                                                                                    \
        } else {                                                                                 \
            for (int64_t k = 0; k < n; k += LANES) {                                             \
                __builtin_prefetch(w[0] + k + AHEAD, 0, 0);                                      \
                lanes a = LOAD(w[0] + k);                                                        \
                for (int t = 0; t < TG; t++) acc[0][t] += load32(x + t * xs + k) * a;            \
            }                                                                                    \
        }                                                                                        \
        for (int r = 0; r < rows; r++)                                                           \
            for (int t = 0; t < TG; t++) out[r * TOKENS + t] = lane_sum(acc[r][t]);              \
    }
DOTS(dots16, uint16_t, load16, 1)
DOTS(dots16, uint16_t, load16, 2)
DOTS(dots16, uint16_t, load16, 3)
DOTS(dots16, uint16_t, load16, 4)

/* Up to two bf16 weight rows (`rows`) at element offsets `at` of the table `base` against
 * `tg` <= TOKENS token rows of x: out[r * TOKENS + t]. */
static void dots(const void *base, const int64_t *at, int rows, const float *x, int64_t xs,
                 int64_t n, int tg, float *out) {
    const uint16_t *w[2] = {(const uint16_t *)base + at[0], (const uint16_t *)base + at[1]};
    switch (tg) {
    case 1: dots16_1(w, rows, x, xs, n, out); break;
    case 2: dots16_2(w, rows, x, xs, n, out); break;
    case 3: dots16_3(w, rows, x, xs, n, out); break;
    default: dots16_4(w, rows, x, xs, n, out); break;
    }
}

/* -- the three phases -------------------------------------------------------------------------- */

/* Phase 0: pair p's activation row to fp32 (xf [N, H]). */
static void widen(const ExpertJob *j, int64_t p) {
    int64_t h = j->hidden;
    const uint16_t *src = j->x + j->token[p] * h;
    float *dst = j->xf + p * h;
    for (int64_t k = 0; k < h; k += LANES) {
        lanes v = load16(src + k);
        memcpy(dst + k, &v, sizeof v);
    }
}

/* Phase 1: group g's SwiGLU rows [r0, r0 + ROWS) of the intermediate for all its pairs
 * (act [N, I]): round(round(silu(round(gate))) * round(up)). */
static void swiglu(const ExpertJob *j, int64_t g, int64_t r0) {
    int64_t h = j->hidden, in = j->inter, e = j->expert[g];
    int64_t p0 = j->offs[g], p1 = j->offs[g + 1], r1 = r0 + ROWS < in ? r0 + ROWS : in;
    float sums[2 * TOKENS];
    for (int64_t r = r0; r < r1; r++) {
        int64_t at[2] = {(e * 2 * in + r) * h, (e * 2 * in + in + r) * h}; /* gate, up rows */
        for (int64_t p = p0; p < p1; p += TOKENS) {
            int tg = p1 - p < TOKENS ? (int)(p1 - p) : TOKENS;
            dots(j->w13, at, 2, j->xf + p * h, h, h, tg, sums);
            for (int t = 0; t < tg; t++) {
                float gate = round_bf16(sums[t]), up = round_bf16(sums[TOKENS + t]);
                float silu = round_bf16(gate / (1.0f + expf(-gate)));
                j->act[(p + t) * in + r] = round_bf16(silu * up);
            }
        }
    }
}

/* Phase 2: group g's hidden rows [r0, r0 + ROWS) for all its pairs: out [N, H] = round(act @
 * w2 row) x the pair's gate weight. */
static void down(const ExpertJob *j, int64_t g, int64_t r0) {
    int64_t h = j->hidden, in = j->inter, e = j->expert[g];
    int64_t p0 = j->offs[g], p1 = j->offs[g + 1], r1 = r0 + ROWS < h ? r0 + ROWS : h;
    float sums[2 * TOKENS];
    for (int64_t r = r0; r < r1; r += 2) {
        int rows = r + 1 < r1 ? 2 : 1;
        int64_t at[2] = {(e * h + r) * in, (e * h + r + rows - 1) * in};
        for (int64_t p = p0; p < p1; p += TOKENS) {
            int tg = p1 - p < TOKENS ? (int)(p1 - p) : TOKENS;
            dots(j->w2, at, rows, j->act + p * in, in, in, tg, sums);
            for (int q = 0; q < rows; q++)
                for (int t = 0; t < tg; t++)
                    j->out[(p + t) * h + r + q] = round_bf16(sums[q * TOKENS + t]) * j->weight[p + t];
        }
    }
}

/* -- the pool ---------------------------------------------------------------------------------- */

typedef struct {
    const ExpertJob *job;
    int phase;
    int64_t items, blocks; /* items of the phase; row blocks per group (phases 1, 2) */
} Work;

#define MAX_THREADS 256
#define GEN_SHIFT 40 /* the counter holds the job's generation above its next item */
#define SPIN 20000   /* polls before a worker sleeps */

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int started;              /* worker threads made */
    _Atomic int64_t gen;      /* bumped per phase */
    _Atomic int64_t next;     /* gen << GEN_SHIFT | next item */
    _Atomic int64_t finished; /* items done in this phase */
    _Atomic int active;       /* workers that take part (the caller is one more) */
    Work work;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static void run_item(const Work *w, int64_t i) {
    if (w->phase == 0)
        widen(w->job, i);
    else if (w->phase == 1)
        swiglu(w->job, i / w->blocks, (i % w->blocks) * ROWS);
    else
        down(w->job, i / w->blocks, (i % w->blocks) * ROWS);
}

/* Take items of generation `gen` until none are left; counts them done. */
static void take(int64_t gen, const Work *w) {
    int64_t mask = ((int64_t)1 << GEN_SHIFT) - 1;
    for (;;) {
        int64_t v = atomic_load(&pool.next);
        if ((v >> GEN_SHIFT) != gen || (v & mask) >= w->items) return;
        if (!atomic_compare_exchange_weak(&pool.next, &v, v + 1)) continue;
        run_item(w, v & mask);
        atomic_fetch_add(&pool.finished, 1);
    }
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *worker(void *arg) {
    int index = (int)(intptr_t)arg;
    int64_t seen = atomic_load(&pool.gen);
    for (;;) {
        int64_t gen;
        int spins = 0;
        while ((gen = atomic_load(&pool.gen)) == seen && spins < SPIN) {
            relax();
            spins++;
        }
        if (gen == seen) {
            pthread_mutex_lock(&pool.mu);
            while ((gen = atomic_load(&pool.gen)) == seen) pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = gen;
        if (index < atomic_load(&pool.active)) {
            Work w = pool.work; /* written before gen was bumped */
            take(gen, &w);
        }
    }
    return NULL;
}

/* Workers up to `threads` - 1; the number running (fewer when the system refuses more). */
static int grow(int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_mutex_lock(&pool.mu);
    while (pool.started < threads - 1) {
        pthread_t t;
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)pool.started)) break;
        pthread_detach(t);
        pool.started++;
    }
    int workers = pool.started < threads - 1 ? pool.started : threads - 1;
    pthread_mutex_unlock(&pool.mu);
    return workers;
}

typedef void (*parallel_fn)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);

static void team_member(void *data) {
    const Work *w = data;
    take(atomic_load(&pool.gen), w);
}

/* One phase on `threads` threads of the OpenMP runtime's team (libgomp's GOMP_parallel, the
 * call that `#pragma omp parallel` compiles to), so that torch's threads do the work instead of
 * spinning beside it; returns when every item is done. */
static void team_phase(const ExpertJob *job, int ph, int64_t items, int64_t blocks) {
    if (items <= 0) return;
    int64_t gen = atomic_load(&pool.gen) + 1;
    Work w = {job, ph, items, blocks};
    atomic_store(&pool.next, gen << GEN_SHIFT);
    atomic_store(&pool.gen, gen);
    unsigned threads = (unsigned)(job->threads < items ? job->threads : items);
    ((parallel_fn)job->parallel)(team_member, &w, threads, 0);
}

/* One phase on the caller and `workers` pool threads; returns when every item is done. */
static void phase(const ExpertJob *job, int ph, int64_t items, int64_t blocks, int workers) {
    if (items <= 0) return;
    if (job->parallel) {
        team_phase(job, ph, items, blocks);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    int64_t gen = atomic_load(&pool.gen) + 1;
    pool.work = (Work){job, ph, items, blocks};
    atomic_store(&pool.finished, 0);
    atomic_store(&pool.active, workers < items - 1 ? workers : (int)(items - 1));
    atomic_store(&pool.next, gen << GEN_SHIFT);
    atomic_store(&pool.gen, gen);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    Work w = pool.work;
    take(gen, &w);
    while (atomic_load(&pool.finished) < items) relax();
}

/* -- entry point ------------------------------------------------------------------------------- */

/* Compute a job (its groups sorted, offs[G] = N pairs) on `job->threads` threads: the OpenMP
 * team's when `job->parallel` is set, else the library's own; returns the threads used. One job
 * at a time per process. */
int64_t oled_experts(const ExpertJob *job) {
    static pthread_mutex_t one = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&one);
    int workers = job->parallel ? (int)job->threads - 1 : grow(job->threads > 1 ? (int)job->threads : 1);
    int64_t groups = job->groups, pairs = job->offs[groups];
    int64_t inner = (job->inter + ROWS - 1) / ROWS, outer = (job->hidden + ROWS - 1) / ROWS;
    phase(job, 0, pairs, 1, workers);
    phase(job, 1, groups * inner, inner, workers);
    phase(job, 2, groups * outer, outer, workers);
    pthread_mutex_unlock(&one);
    return workers + 1;
}
