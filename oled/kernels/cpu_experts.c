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
 * gate weight; and, for benchmarks, (3) a plain read of the weights. A block's rows are read from
 * memory once, prefetched into L2, several rows at a time against up to 8 tokens whose rows stay
 * in L1 (more tokens pass over the block again, from L2). Rounding follows the resident path's
 * points (oled.model.experts._weighted_mlp): the gate/up product, the SiLU, the SwiGLU product
 * and the down product each round to the weights' dtype; sums run in fp32. One row's sum is one
 * thread's: 16 lanes over the row (fused multiply-adds where the CPU has them), then a fixed
 * tree, so the result is the same for every thread count and vector width.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define OLED_EXPERTS_CONTRACT
#include "experts_state.h"

#define LANES 16 /* fp32 lanes of one row's partial sums */
#define TOKENS 8 /* tokens whose sums share one pass over the rows */
#define ROWS 16  /* rows per work item */
#define AHEAD 4096 /* weights prefetched this many values ahead (into the rows that follow) */
#define KEEP 1     /* their locality: into L2 (a non-temporal prefetch would leave L2 out) */
#define X_BYTES 32768 /* fp32 token rows kept in L1 across a block's rows */

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
#ifdef __AVX512F__
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16); /* one widening per 16 */
#else
    lanes_u16 h;
    memcpy(&h, p, sizeof h);
    lanes_u32 u = __builtin_convertvector(h, lanes_u32) << 16;
#endif
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

/* Sums of R weight rows w[r] (n values each, n a multiple of LANES) with TG token rows of x
 * (stride xs): out[r * TOKENS + t]. */
typedef void dots_fn(const uint16_t *const *w, const float *x, int64_t xs, int64_t n, float *out);

#define STEP(R, TG, K)                                                                           \
    for (int r = 0; r < R; r++) {                                                                \
        lanes a = load16(w[r] + (K));                                                            \
        for (int t = 0; t < TG; t++) acc[r][t] += load32(x + t * xs + (K)) * a;                  \
    }
#define DOTS(R, TG)                                                                              \
    static void dots_##R##_##TG(const uint16_t *const *w, const float *x, int64_t xs, int64_t n, \
                                float *out) {                                                    \
        lanes acc[R][TG] = {{{0}}};                                                              \
        int64_t k = 0;                                                                           \
        for (; k + 2 * LANES <= n; k += 2 * LANES) {                                             \
            for (int r = 0; r < R; r++) __builtin_prefetch(w[r] + k + AHEAD, 0, KEEP);           \
            STEP(R, TG, k)                                                                       \
            STEP(R, TG, k + LANES)                                                               \
        }                                                                                        \
        if (k < n) {                                                                             \
            STEP(R, TG, k)                                                                       \
        }                                                                                        \
        for (int r = 0; r < R; r++)                                                              \
            for (int t = 0; t < TG; t++) out[r * TOKENS + t] = lane_sum(acc[r][t]);              \
    }
#define DOTS_TG(R)                                                                               \
    DOTS(R, 1) DOTS(R, 2) DOTS(R, 3) DOTS(R, 4) DOTS(R, 5) DOTS(R, 6) DOTS(R, 7) DOTS(R, 8)
DOTS_TG(1)
DOTS_TG(2)
DOTS_TG(4)
#define DOTS_ROW(R)                                                                              \
    {dots_##R##_1, dots_##R##_2, dots_##R##_3, dots_##R##_4,                                     \
     dots_##R##_5, dots_##R##_6, dots_##R##_7, dots_##R##_8}
static dots_fn *const DOTS_FN[3][TOKENS] = {DOTS_ROW(1), DOTS_ROW(2), DOTS_ROW(4)};

/* R (1, 2 or 4) bf16 weight rows at element offsets `at` of the table `base` against `tg` <=
 * TOKENS token rows of x: out[r * TOKENS + t]. */
static void dots(const void *base, const int64_t *at, int rows, const float *x, int64_t xs,
                 int64_t n, int tg, float *out) {
    const uint16_t *w[4];
    for (int r = 0; r < rows; r++) w[r] = (const uint16_t *)base + at[r];
    DOTS_FN[rows == 4 ? 2 : rows - 1][tg - 1](w, x, xs, n, out);
}

/* Rows taken together for tg tokens: more while the accumulators fit in the registers. */
static inline int together(int tg) { return tg <= 4 ? 4 : 2; }

/* Tokens of one pass over a block of rows (n values each) out of `left`: as many as keep their
 * fp32 rows within X_BYTES (in the L1 cache across the block's rows), in passes of even size. */
static inline int pass_tokens(int64_t left, int64_t n) {
    int64_t most = X_BYTES / (4 * n), passes;
    if (most < 1) most = 1;
    if (most > TOKENS) most = TOKENS;
    passes = (left + most - 1) / most;
    return (int)((left + passes - 1) / passes);
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
    float sums[4 * TOKENS];
    for (int64_t p = p0; p < p1;) {
        int tg = pass_tokens(p1 - p, h);
        for (int64_t r = r0; r < r1;) {
            int m = together(tg) / 2 < r1 - r ? together(tg) / 2 : (int)(r1 - r); /* of each */
            int64_t gate = (e * 2 * in + r) * h, up = gate + in * h, at[4];
            for (int q = 0; q < m; q++) at[q] = gate + q * h, at[m + q] = up + q * h;
            dots(j->w13, at, 2 * m, j->xf + p * h, h, h, tg, sums);
            for (int q = 0; q < m; q++)
                for (int t = 0; t < tg; t++) {
                    float gv = round_bf16(sums[q * TOKENS + t]);
                    float uv = round_bf16(sums[(m + q) * TOKENS + t]);
                    float silu = round_bf16(gv / (1.0f + expf(-gv)));
                    j->act[(p + t) * in + r + q] = round_bf16(silu * uv);
                }
            r += m;
        }
        p += tg;
    }
}

/* Phase 2: group g's hidden rows [r0, r0 + ROWS) for all its pairs: out [N, H] = round(act @
 * w2 row) x the pair's gate weight. */
static void down(const ExpertJob *j, int64_t g, int64_t r0) {
    int64_t h = j->hidden, in = j->inter, e = j->expert[g];
    int64_t p0 = j->offs[g], p1 = j->offs[g + 1], r1 = r0 + ROWS < h ? r0 + ROWS : h;
    float sums[4 * TOKENS];
    for (int64_t p = p0; p < p1;) {
        int tg = pass_tokens(p1 - p, in);
        for (int64_t r = r0; r < r1;) {
            int rows = together(tg);
            while (rows > r1 - r) rows /= 2;
            int64_t at[4];
            for (int q = 0; q < rows; q++) at[q] = (e * h + r + q) * in;
            dots(j->w2, at, rows, j->act + p * in, in, in, tg, sums);
            for (int q = 0; q < rows; q++)
                for (int t = 0; t < tg; t++)
                    j->out[(p + t) * h + r + q] = round_bf16(sums[q * TOKENS + t]) * j->weight[p + t];
            r += rows;
        }
        p += tg;
    }
}

/* Phase 3 (the ceiling that benchmarks set the others against): a plain read of group g's
 * weights, bytes [c * READ, (c + 1) * READ) of its w13 then its w2 rows. */
#define READ 65536
typedef uint64_t words __attribute__((vector_size(64)));
static _Atomic uint64_t read_sum;

static void read_block(const ExpertJob *j, int64_t g, int64_t c) {
    int64_t e = j->expert[g], n13 = 2 * j->inter * j->hidden * 2, n2 = j->hidden * j->inter * 2;
    int64_t b13 = (n13 + READ - 1) / READ, at = (c < b13 ? c : c - b13) * READ;
    const char *base = c < b13 ? (const char *)j->w13 + e * n13 : (const char *)j->w2 + e * n2;
    int64_t end = c < b13 ? n13 : n2;
    end = at + READ < end ? at + READ : end;
    words s = {0};
    for (int64_t k = at; k < end; k += sizeof s) {
        words v;
        memcpy(&v, base + k, sizeof v);
        s += v;
    }
    uint64_t t = 0;
    for (int l = 0; l < 8; l++) t += s[l];
    atomic_fetch_add(&read_sum, t);
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
    else if (w->phase == 2)
        down(w->job, i / w->blocks, (i % w->blocks) * ROWS);
    else
        read_block(w->job, i / w->blocks, i % w->blocks);
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

/* One phase on the OpenMP runtime's whole team of `job->threads` (libgomp's GOMP_parallel, the
 * call that `#pragma omp parallel` compiles to), so that torch's threads do the work instead of
 * spinning beside it; returns when every item is done. Every phase asks for the same team, even
 * one of fewer items than threads (the others find none): a region of another size makes the
 * runtime form its team anew, which cost 0.5-0.7 ms an expert on 16 cores when the first phase
 * of a 1-token call asked for one thread per pair. */
static void team_phase(const ExpertJob *job, int ph, int64_t items, int64_t blocks) {
    if (items <= 0) return;
    int64_t gen = atomic_load(&pool.gen) + 1;
    Work w = {job, ph, items, blocks};
    atomic_store(&pool.next, gen << GEN_SHIFT);
    atomic_store(&pool.gen, gen);
    ((parallel_fn)job->parallel)(team_member, &w, (unsigned)job->threads, 0);
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

/* -- entry points ------------------------------------------------------------------------------ */

static pthread_mutex_t one_job = PTHREAD_MUTEX_INITIALIZER;

/* Compute a job (its groups sorted, offs[G] = N pairs) on `job->threads` threads: the OpenMP
 * team's when `job->parallel` is set, else the library's own; returns the threads used. One job
 * at a time per process. */
int64_t oled_experts(const ExpertJob *job) {
    pthread_mutex_lock(&one_job);
    int workers = job->parallel ? (int)job->threads - 1 : grow(job->threads > 1 ? (int)job->threads : 1);
    int64_t groups = job->groups, pairs = job->offs[groups];
    int64_t inner = (job->inter + ROWS - 1) / ROWS, outer = (job->hidden + ROWS - 1) / ROWS;
    phase(job, 0, pairs, 1, workers);
    phase(job, 1, groups * inner, inner, workers);
    phase(job, 2, groups * outer, outer, workers);
    pthread_mutex_unlock(&one_job);
    return workers + 1;
}

/* Group a layer's CPU pairs by expert as a stable sort by expert would (an expert's pairs in
 * their order): a counting sort over the experts, so that a decode call's grouping costs no
 * more than the pairs. Returns N, the pairs with an expert, or -1 when a slot is past the
 * experts (nothing is written then but the counts). */
int64_t oled_group(PairGroups *g) {
    int64_t n_experts = g->experts, at = 0, groups = 0, largest = 0;
    memset(g->count, 0, (size_t)n_experts * sizeof *g->count);
    for (int64_t p = 0; p < g->pairs; p++) {
        int64_t s = g->slot[p];
        if (s >= n_experts) return -1;
        if (s >= 0) g->count[s]++;
    }
    for (int64_t e = 0; e < n_experts; e++) { /* count[e] becomes expert e's next place */
        int64_t c = g->count[e];
        g->count[e] = at;
        if (!c) continue;
        g->expert[groups] = e;
        g->offs[groups++] = at;
        largest = c > largest ? c : largest;
        at += c;
    }
    g->offs[groups] = at;
    for (int64_t p = 0; p < g->pairs; p++) {
        int64_t s = g->slot[p];
        if (s < 0) continue;
        int64_t i = g->count[s]++;
        g->order[i] = p;
        g->token[i] = p / g->k;
        g->weight[i] = g->pair_weight[p];
    }
    g->groups = groups;
    g->largest = largest;
    return at;
}

/* Read the groups' weights once on `job->threads` threads, as oled_experts streams them (the
 * ceiling for its speed); returns the sum of their 64-bit words. */
int64_t oled_experts_read(const ExpertJob *job) {
    pthread_mutex_lock(&one_job);
    int workers = job->parallel ? (int)job->threads - 1 : grow(job->threads > 1 ? (int)job->threads : 1);
    int64_t n13 = 2 * job->inter * job->hidden * 2, n2 = job->hidden * job->inter * 2;
    int64_t blocks = (n13 + READ - 1) / READ + (n2 + READ - 1) / READ;
    atomic_store(&read_sum, 0);
    phase(job, 3, job->groups * blocks, blocks, workers);
    int64_t sum = (int64_t)atomic_load(&read_sum);
    pthread_mutex_unlock(&one_job);
    return sum;
}
