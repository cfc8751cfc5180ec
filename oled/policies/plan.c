/* Planner.plan in C for the built-in policies (oled/policies/native.py loads it).
 *
 * The same decisions as the Python planner (oled/policies/planner.py) and the same floating-point
 * operations in the same order: built without FMA contraction or fast math, sums in index order
 * like numpy's bincount and cumsum, stable sorts with the same tie rules. The state it reads and
 * writes (Bind, generated from oled/policies/state.py) is the planner's PlanState, allocated once.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define OLED_PLAN_CONTRACT /* the contract is defined here */
#include "plan.h"

/* The plan's arrays (plan.h: OUT_*) are built in scratch regions, then packed into `out`. */

/* Scratch regions (int64 or double), each `num_experts + 1` long; the plan's arrays follow. */
enum { S_REST, S_REFRESH, S_PREFETCH, S_WANT, S_PROTECT, S_QUEUE, S_CAND, S_ORDER, S_TMP,
       S_REUSE, S_WANT_REUSE, S_KEY, S_LEFT, S_CPU_LEFT, S_MASS, N_SCRATCH };

typedef struct {
    const Bind *b;
    int64_t layer, step, clock, E, cap; /* step: of the generation; clock: of the planner */
    int32_t *slot_of, *expert_in;
    int64_t *counts;
    double *prio; /* the row victims are chosen by */
} Layer;

static int64_t *region(int64_t *base, int64_t E, int i) { return base + (int64_t)i * (E + 1); }
static double *dregion(const Bind *b, int i) {
    return (double *)region(b->scratch, b->num_experts, i);
}

/* Stable merge sort of a[0:n] by key[a[i]], ascending (desc = 0) or descending (desc = 1). */
static void msort(int64_t *a, int64_t *tmp, int64_t n, const double *key, int desc) {
    if (n < 2) return;
    if (n <= 16) { /* insertion sort: stable */
        for (int64_t i = 1; i < n; i++) {
            int64_t v = a[i], j = i;
            double kv = key[v];
            while (j > 0 && (desc ? key[a[j - 1]] < kv : key[a[j - 1]] > kv)) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = v;
        }
        return;
    }
    int64_t h = n / 2;
    msort(a, tmp, h, key, desc);
    msort(a + h, tmp, n - h, key, desc);
    int64_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        double l = key[a[i]], r = key[a[j]];
        int take_right = desc ? r > l : r < l;
        tmp[k++] = take_right ? a[j++] : a[i++];
    }
    while (i < h) tmp[k++] = a[i++];
    while (j < n) tmp[k++] = a[j++];
    memcpy(a, tmp, (size_t)n * sizeof(int64_t));
}

/* Planner._measure: EMA of distinct experts and of the overlap with the previous forward. */
static void measure(const Layer *L, int64_t n_needed) {
    const Bind *b = L->b;
    int64_t l = L->layer, k = b->samples[l], E = L->E;
    double a = b->stats_alpha, n = (double)n_needed;
    int64_t *prev = b->last_counts + l * E;
    b->working_set[l] = k == 0 ? n : b->working_set[l] + a * (n - b->working_set[l]);
    if (k) {
        int64_t both = 0;
        for (int64_t e = 0; e < E; e++) both += L->counts[e] && prev[e];
        double overlap = n_needed ? (double)both / n : 0.0;
        double r = b->reuse[l];
        b->reuse[l] = k == 1 ? overlap : r + a * (overlap - r);
    }
    b->samples[l] = k + 1;
    memcpy(prev, L->counts, (size_t)E * sizeof(int64_t));
}

/* gate[e] = sum of the weights of the pairs routed to e, in pair order (numpy's bincount). */
static void gate_mass(double *gate, const int64_t *ids, const double *w, int64_t n, int64_t E) {
    memset(gate, 0, (size_t)E * sizeof(double));
    for (int64_t i = 0; i < n; i++) gate[ids[i]] += w[i];
}

/* RetentionPolicy.route and on_hit. */
static void route(const Layer *L, const int64_t *ids, const double *w, int64_t n,
                  const int64_t *hits, int64_t n_hits) {
    const Bind *b = L->b;
    int64_t E = L->E, off = L->layer * E;
    double *p = b->priority + off;
    switch (b->ret_kind) {
    case RET_LRU:
        for (int64_t i = 0; i < n; i++) p[ids[i]] = (double)L->clock;
        for (int64_t i = 0; i < n_hits; i++) p[hits[i]] = (double)L->clock;
        break;
    case RET_LFU:
        if (b->lfu.decay != 1.0)
            for (int64_t e = 0; e < E; e++) p[e] *= b->lfu.decay;
        for (int64_t e = 0; e < E; e++)
            if (L->counts[e]) p[e] += b->lfu.per_token ? (double)L->counts[e] : 1.0;
        break;
    case RET_EMA: {
        double *mass = dregion(b, S_MASS), keep = b->ema.alpha, add = 1.0 - b->ema.alpha;
        gate_mass(mass, ids, w, n, E);
        for (int64_t e = 0; e < E; e++) p[e] *= keep;
        for (int64_t e = 0; e < E; e++) p[e] += add * mass[e];
        break;
    }
    case RET_CONFIDENCE: {
        double *cur = b->current + off, *m = b->masked + off, *s = b->stable + off;
        gate_mass(cur, ids, w, n, E);
        for (int64_t e = 0; e < E; e++) p[e] = m[e] + s[e];
        for (int64_t e = 0; e < E; e++) p[e] += b->confidence.now_weight * cur[e];
        break;
    }
    }
}

/* RetentionPolicy.reuse of experts[0:n] into out. */
static void reuse(const Layer *L, const int64_t *experts, int64_t n, double *out) {
    const Bind *b = L->b;
    const double *p = L->prio;
    switch (b->ret_kind) {
    case RET_LRU:
        for (int64_t i = 0; i < n; i++)
            out[i] = pow(0.5, fmax(0.0, (double)L->clock - p[experts[i]]));
        break;
    case RET_LFU: {
        double top = p[0];
        for (int64_t e = 1; e < L->E; e++) top = p[e] > top ? p[e] : top;
        top = top > 1e-9 ? top : 1e-9;
        for (int64_t i = 0; i < n; i++) out[i] = p[experts[i]] / top;
        break;
    }
    case RET_EMA:
        for (int64_t i = 0; i < n; i++) out[i] = p[experts[i]] / (p[experts[i]] + 0.1);
        break;
    case RET_CONFIDENCE: {
        double scale = -1.0 / b->confidence.reuse_scale;
        for (int64_t i = 0; i < n; i++)
            out[i] = 1.0 - (double)expl((long double)(p[experts[i]] * scale));
        break;
    }
    }
}

/* The cached experts of the layer where protect is zero, by id, then the m of lowest priority
 * (ties to the lower id, as oled.policies.base.lowest): the victims; returns m. */
static int64_t victims(const Layer *L, const int64_t *protect, int64_t want, int64_t *out) {
    const Bind *b = L->b;
    int64_t *cand = region(b->scratch, L->E, S_CAND), n = 0;
    for (int64_t e = 0; e < L->E; e++)
        if (L->slot_of[e] >= 0 && !protect[e]) cand[n++] = e;
    int64_t m = want < n ? want : n;
    if (m <= 0) return 0;
    msort(cand, region(b->scratch, L->E, S_TMP), n, L->prio, 0);
    memcpy(out, cand, (size_t)m * sizeof(int64_t));
    return m;
}

/* Experts with key >= lo (key > 0 when strict), by key descending then id, at most cap. */
static int64_t top_experts(const Layer *L, const double *key, double lo, int strict,
                           int64_t *out) {
    int64_t n = 0;
    for (int64_t e = 0; e < L->E; e++)
        if (strict ? key[e] > lo : key[e] >= lo) out[n++] = e;
    msort(out, region(L->b->scratch, L->E, S_TMP), n, key, 1);
    return n < L->cap ? n : L->cap;
}

/* CompensationPolicy.refresh: -1 for None, else the number of experts written to out. */
static int64_t refresh(const Layer *L, int64_t block, int64_t *out) {
    const Bind *b = L->b;
    int64_t E = L->E, l = L->layer;
    double *key = dregion(b, S_KEY);
    if (b->comp_kind == COMP_INTERVAL) {
        if (L->step % b->interval.interval) return -1;
        for (int64_t e = 0; e < E; e++) key[e] = (double)L->counts[e];
        double lo = b->interval.min_tokens;
        return top_experts(L, key, lo > 1.0 ? lo : 1.0, 0, out);
    }
    if (b->comp_kind != COMP_STATIC_HOT || b->loaded[l]) return -1;
    double *acc = b->learned + l * E;
    if ((double)block < b->static_hot.learn_blocks) {
        for (int64_t e = 0; e < E; e++) acc[e] += (double)L->counts[e];
        b->seen[l] = 1;
        return -1;
    }
    b->loaded[l] = 1;
    if (!b->seen[l]) {
        for (int64_t e = 0; e < E; e++) key[e] = (double)L->counts[e];
        acc = key;
    }
    return top_experts(L, acc, 0.0, 1, out);
}

/* best_split (oled.policies.compensation): copy the first k of order, k minimising
 * max(copy finish, CPU finish) + the future cost of the misses left on the CPU. */
static void best_split(const Bind *b, const double *cpu_cost, const int64_t *order, int64_t n,
                       const double *future, double copy_q, double cpu_q, uint8_t *copy) {
    double *left = dregion(b, S_LEFT), *obj = dregion(b, S_CPU_LEFT);
    left[0] = 0.0;
    for (int64_t i = 0; i < n; i++) left[i + 1] = left[i] + cpu_cost[order[i]];
    for (int64_t k = 0; k <= n; k++) {
        double cpu_left = cpu_q + (left[n] - left[k]) + (k < n ? b->cpu_call : 0.0);
        double copies = k > 0 ? b->copy_fixed + b->copy_per * (double)k : 0.0;
        double copy_t = copy_q + copies;
        obj[k] = copy_t > cpu_left ? copy_t : cpu_left;
        if (copy_t != copy_t || cpu_left != cpu_left) obj[k] = NAN; /* np.maximum */
    }
    if (future) {
        for (int64_t i = 0; i < n; i++) left[i + 1] = left[i] + future[order[i]];
        for (int64_t k = 0; k <= n; k++) obj[k] += left[n] - left[k];
    }
    int64_t best = 0;
    for (int64_t k = 1; k <= n; k++)
        if (obj[k] < obj[best]) best = k;
    memset(copy, 0, (size_t)n);
    for (int64_t i = 0; i < best; i++) copy[order[i]] = 1;
}

/* copying_all_is_best (oled.policies.compensation). */
static int copy_all_best(const Bind *b, const double *cpu_cost, int64_t n, double copy_q,
                         double cpu_q) {
    if (!n) return 0;
    double copy_all = copy_q + (b->copy_fixed + b->copy_per * (double)n);
    double fastest = cpu_cost[0];
    for (int64_t i = 1; i < n; i++) fastest = cpu_cost[i] < fastest ? cpu_cost[i] : fastest;
    return fastest > 0 && cpu_q + b->cpu_call + fastest > copy_all;
}

/* CompensationPolicy.decide: copy[i] for rest[i] (tokens from counts). */
static void decide(const Layer *L, const int64_t *rest, int64_t n, const double *reuse_of,
                   double copy_q, double cpu_q, double slowdown, uint8_t *copy) {
    const Bind *b = L->b;
    int kind = (int)b->comp_kind;
    if (kind == COMP_TRANSFER || kind == COMP_CPU || kind == COMP_INTERVAL ||
        kind == COMP_STATIC_HOT) {
        memset(copy, kind == COMP_TRANSFER, (size_t)n);
        return;
    }
    if (kind == COMP_BATCH) {
        for (int64_t i = 0; i < n; i++) copy[i] = (double)L->counts[rest[i]] >= b->batch.min_tokens;
        return;
    }
    double *cpu_cost = dregion(b, S_KEY), *future = NULL;
    int64_t *order = region(b->scratch, L->E, S_ORDER);
    for (int64_t i = 0; i < n; i++) {
        double t = (double)L->counts[rest[i]];  /* CostModel.cpu_ms */
        double c = t > b->cpu_few ? b->cpu_many_fixed + b->cpu_many_tok * t
                                  : b->cpu_fixed + b->cpu_tok * t;
        cpu_cost[i] = kind == COMP_COOPERATIVE ? slowdown * c : c;
    }
    double future_weight = b->cooperative.future_weight * b->cooperative.horizon;
    if ((kind == COMP_MAKESPAN || future_weight >= 0) &&
        copy_all_best(b, cpu_cost, n, copy_q, cpu_q)) {
        memset(copy, 1, (size_t)n);
        return;
    }
    double *rank = cpu_cost;
    if (kind == COMP_COOPERATIVE) {
        future = dregion(b, S_MASS);
        rank = dregion(b, S_LEFT); /* free until best_split */
        for (int64_t i = 0; i < n; i++) {
            double miss_again = cpu_cost[i] < b->copy_per ? cpu_cost[i] : b->copy_per;
            future[i] = future_weight * reuse_of[i] * miss_again;
            rank[i] = cpu_cost[i] + future[i];
        }
    }
    for (int64_t i = 0; i < n; i++) order[i] = i;
    msort(order, region(b->scratch, L->E, S_TMP), n, rank, 1);
    best_split(b, cpu_cost, order, n, future, copy_q, cpu_q, copy);
}

/* Slots for n new experts: free ones first, then the victims' (Planner._room). */
static int64_t room(const Layer *L, int64_t n, int64_t n_free, const int64_t *protect,
                    int64_t *slots, int64_t *evicted, int64_t *n_evicted) {
    *n_evicted = 0;
    if (!n) return 0;
    int64_t f = 0;
    if (n_free)
        for (int64_t s = 0; s < L->cap && f < n; s++)
            if (L->expert_in[s] < 0) slots[f++] = s;
    if (n <= f) return n;
    int64_t m = victims(L, protect, n - f, evicted);
    for (int64_t i = 0; i < m; i++) slots[f + i] = L->slot_of[evicted[i]];
    *n_evicted = m;
    return f + m;
}

/* ExpertCache.place; returns the slots that were free among those used. */
static int64_t place(const Layer *L, const int64_t *experts, const int64_t *slots, int64_t n) {
    int64_t was_free = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t old = L->expert_in[slots[i]];
        if (old >= 0) L->slot_of[old] = -1;
        else was_free++;
    }
    for (int64_t i = 0; i < n; i++) {
        L->expert_in[slots[i]] = (int32_t)experts[i];
        L->slot_of[experts[i]] = (int32_t)slots[i];
    }
    return was_free;
}

/* The layer's slot maps (oled.policies.planner.write_maps): row MAP_HIT the slot of each
 * cached expert the plan did not just copy, MAP_COPIED the slots of the experts copied now,
 * MAP_STAGED + r the stage slots of round r's staged experts; -1 elsewhere. Returns the rows
 * written. */
static int64_t write_maps(const Bind *b, int64_t layer, const int32_t *slot_of,
                          const int64_t *copy_e, const int64_t *copy_s, int64_t n_copy,
                          const int64_t *stage_e, const int64_t *stage_s, int64_t n_stage) {
    int64_t E = b->num_experts, cap = b->stage_capacity;
    int64_t rows = MAP_STAGED + (cap ? (n_stage + cap - 1) / cap : 0);
    int64_t *m = b->maps + layer * b->map_rows * E;
    for (int64_t e = 0; e < E; e++) m[e] = slot_of[e];
    for (int64_t i = E; i < rows * E; i++) m[i] = -1;
    for (int64_t i = 0; i < n_copy; i++) {
        m[copy_e[i]] = -1;
        m[MAP_COPIED * E + copy_e[i]] = copy_s[i];
    }
    for (int64_t i = 0; i < n_stage; i++) m[(MAP_STAGED + i / cap) * E + stage_e[i]] = stage_s[i];
    return rows;
}

/* The buffer lengths (int64s) for E experts: lens = {scratch, out}; the Python side
 * allocates from these, so they live here only. */
void oled_layout(int64_t E, int64_t *lens) {
    lens[0] = (N_SCRATCH + N_OUT) * (E + 1);
    lens[1] = H_SIZE + N_OUT * (E + 1) + (E + 1) / 2;
}

/* The plan's arrays (sizes n[i]) and the layer's slot map packed into b->out. */
static void pack(const Bind *b, int64_t *o, const int64_t *n, const int32_t *slot_of) {
    int64_t E = b->num_experts, *h = b->out, at = H_SIZE;
    for (int i = 0; i < N_OUT; i++) {
        h[i] = at;
        memcpy(b->out + at, region(o, E, i), (size_t)n[i] * sizeof(int64_t));
        at += n[i];
    }
    h[H_SLOT_MAP] = at;
    memcpy(b->out + at, slot_of, (size_t)E * sizeof(int32_t));
    h[H_END] = at + (E + 1) / 2;
}

/* The routing of n pairs, ids int64 and weights fp32 (as the engine reads them back from the
 * device), into b->ids / b->weights; -3 when they do not fit. */
int64_t oled_route_in(const Bind *b, const int64_t *ids, const float *weights, int64_t n) {
    if (n > b->routing_cap) return -3;
    memcpy(b->ids, ids, (size_t)n * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) b->weights[i] = (double)weights[i];
    return 0;
}

/* Planner.plan for one MoE layer over the n routed pairs in b->ids / b->weights; returns 0, or
 * -1 when an id is outside [0, E). The decisions go to b->out (see pack). */
int64_t oled_plan(const Bind *b, int64_t layer, int64_t n, int64_t step, int64_t clock,
                  int64_t block, double copy_q, double cpu_q, double slowdown, int64_t gpu_only) {
    int64_t E = b->num_experts, *sc = b->scratch, *o = region(sc, E, N_SCRATCH);
    const int64_t *ids = b->ids;
    const double *w = b->weights;
    Layer L = {b, layer, step, clock, E, b->capacity[layer], b->slot_of + layer * E,
               b->expert_in + layer * E, region(o, E, OUT_COUNTS), b->priority + layer * E};
    int64_t n_free = b->n_free[layer]; /* the cache's free slots (ExpertCache.n_free) */
    int64_t *counts = L.counts, *hits = region(o, E, OUT_HITS), *misses = region(o, E, OUT_MISSES);
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= E) return -1;
        counts[ids[i]]++;
    }
    int64_t n_hits = 0, n_misses = 0;
    for (int64_t e = 0; e < E; e++)
        if (counts[e]) {
            if (L.slot_of[e] >= 0) hits[n_hits++] = e;
            else misses[n_misses++] = e;
        }
    measure(&L, n_hits + n_misses);
    route(&L, ids, w, n, hits, n_hits);

    /* _decide: refresh targets, then copy or CPU per remaining miss */
    int64_t *ref = region(sc, E, S_REFRESH), *prefetch = region(sc, E, S_PREFETCH);
    int64_t *rest = region(sc, E, S_REST), *protect = counts, n_prefetch = 0, n_rest = n_misses;
    int64_t n_ref = refresh(&L, block, ref);
    memcpy(rest, misses, (size_t)n_misses * sizeof(int64_t));
    if (n_ref > 0) {
        protect = region(sc, E, S_PROTECT);
        memcpy(protect, counts, (size_t)E * sizeof(int64_t));
        for (int64_t i = 0; i < n_ref; i++) protect[ref[i]] = 1;
        for (int64_t i = 0; i < n_ref; i++)
            if (L.slot_of[ref[i]] < 0) prefetch[n_prefetch++] = ref[i];
        uint8_t loading[E + 1];
        memset(loading, 0, (size_t)E);
        for (int64_t i = 0; i < n_prefetch; i++) loading[prefetch[i]] = 1;
        n_rest = 0; /* misses not loaded as refresh targets */
        for (int64_t i = 0; i < n_misses; i++)
            if (!loading[misses[i]]) rest[n_rest++] = misses[i];
    }
    int64_t *want = region(sc, E, S_WANT), *cpu = region(o, E, OUT_CPU_EXPERTS), n_want = 0, n_cpu = 0;
    double *reuse_of = dregion(b, S_REUSE), *want_reuse = dregion(b, S_WANT_REUSE);
    if (n_rest) {
        reuse(&L, rest, n_rest, reuse_of);
        uint8_t copy[E + 1];
        if (gpu_only) memset(copy, 1, (size_t)n_rest);
        else decide(&L, rest, n_rest, reuse_of, copy_q, cpu_q, slowdown, copy);
        for (int64_t i = 0; i < n_rest; i++) {
            if (copy[i]) {
                want_reuse[n_want] = reuse_of[i];
                want[n_want++] = rest[i];
            } else cpu[n_cpu++] = rest[i];
        }
    }

    /* cache slots: free ones first, then victims */
    int64_t *copy_e = region(o, E, OUT_COPY_EXPERTS), *copy_s = region(o, E, OUT_COPY_SLOTS);
    int64_t *evicted = region(o, E, OUT_EVICTED), n_evicted = 0;
    int64_t n_order = n_prefetch + n_want;
    int64_t n_cache = room(&L, n_order, n_free, protect, copy_s, evicted, &n_evicted);
    if (n_cache < n_order && n_want > 1) { /* not all fit: highest reuse into the cache */
        int64_t *pos = region(sc, E, S_ORDER), *tmp = region(sc, E, S_CAND);
        for (int64_t i = 0; i < n_want; i++) pos[i] = i;
        msort(pos, region(sc, E, S_TMP), n_want, want_reuse, 1);
        for (int64_t i = 0; i < n_want; i++) tmp[i] = want[pos[i]];
        memcpy(want, tmp, (size_t)n_want * sizeof(int64_t));
    }
    int64_t *order = region(sc, E, S_QUEUE); /* refresh targets, then wanted copies */
    memcpy(order, prefetch, (size_t)n_prefetch * sizeof(int64_t));
    memcpy(order + n_prefetch, want, (size_t)n_want * sizeof(int64_t));
    memcpy(copy_e, order, (size_t)n_cache * sizeof(int64_t));
    if (n_cache) {
        n_free -= place(&L, copy_e, copy_s, n_cache);
        if (b->ret_kind == RET_LRU)
            for (int64_t i = 0; i < n_cache; i++) L.prio[copy_e[i]] = (double)clock;
    }

    /* overflow: needed copies through the stage, or to the CPU without one */
    int64_t *stage_e = region(o, E, OUT_STAGE_EXPERTS), *stage_s = region(o, E, OUT_STAGE_SLOTS);
    int64_t n_stage = 0;
    for (int64_t i = n_cache; i < n_order; i++)
        if (counts[order[i]]) {
            if (b->stage_capacity) stage_e[n_stage++] = order[i];
            else cpu[n_cpu++] = order[i];
        }
    for (int64_t i = 0, cap = b->stage_capacity; i < n_stage; i++) /* round i / cap's part */
        stage_s[i] = i % cap + cap * (i / cap % STAGE_ROUNDS);
    int64_t *gpu = region(o, E, OUT_GPU_EXPERTS), n_gpu = n_hits;
    memcpy(gpu, hits, (size_t)n_hits * sizeof(int64_t));
    for (int64_t i = 0; i < n_cache; i++)
        if (!n_prefetch || counts[copy_e[i]]) gpu[n_gpu++] = copy_e[i];
    int64_t *cpu_t = region(o, E, OUT_CPU_TOKENS), cpu_tokens = 0;
    for (int64_t i = 0; i < n_cpu; i++) cpu_tokens += cpu_t[i] = counts[cpu[i]];

    int64_t *row = b->counters + layer * N_STATS;
    int64_t n_copied = n_gpu - n_hits;
    row[ST_PLANS] += 1;
    row[ST_REQUESTS] += n_hits + n_misses;
    row[ST_HITS] += n_hits;
    row[ST_MISSES] += n_misses;
    row[ST_COPIES] += n_cache;
    row[ST_PREFETCHES] += n_cache - n_copied;
    row[ST_STAGED] += n_stage;
    row[ST_CPU_EXPERTS] += n_cpu;
    row[ST_CPU_TOKENS] += cpu_tokens;
    row[ST_EVICTIONS] += n_evicted;
    int64_t sizes[N_OUT] = {n_hits, n_misses, n_gpu, n_cache, n_cache, n_stage, n_stage,
                            n_cpu, n_cpu, n_evicted, E};
    b->n_free[layer] = n_free;
    pack(b, o, sizes, L.slot_of);
    b->out[H_MAP_ROWS] = b->maps ? write_maps(b, layer, L.slot_of, copy_e, copy_s, n_cache,
                                             stage_e, stage_s, n_stage)
                                : 0;
    return 0;
}
