/* The offload engine's static layer call in C (oled/offload/driver.py builds it with plan.c, from
 * oled/policies/): the plan (oled_plan), then every launch of the layer through the CUDA runtime,
 * in the order of the engine's Python path (oled/offload/launches.py): the copies into cache
 * slots (timed from the copy stream to where they are complete), the CPU experts' activations
 * to pinned host memory, the slot maps, the hits' pass graph, the wait for the copies, the
 * copied experts' pass graph, then the staged rounds (each waits for the earlier users of its
 * part of the stage, copies, waits, passes).
 *
 * No CUDA header is needed: the runtime's entry points come as addresses from the libcudart
 * that torch loaded. A call declines to launch (returns 0 after planning) when a pass it needs
 * has no captured graph yet or the event pool is full; the engine then launches in Python.
 */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c11 */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "plan.h"

typedef int (*memcpy_fn)(void *dst, const void *src, size_t bytes, int kind, void *stream);
typedef int (*batch13_fn)(void **dsts, void **srcs, size_t *sizes, size_t count, void *attrs,
                          size_t *attr_index, size_t n_attrs, void *stream);
typedef int (*batch12_fn)(void **dsts, void **srcs, size_t *sizes, size_t count, void *attrs,
                          size_t *attr_index, size_t n_attrs, size_t *failed, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*graph_fn)(void *exec, void *stream);
typedef int (*create_fn)(void **event);
typedef int (*elapsed_fn)(float *ms, void *start, void *end);

enum { H2D = 1, D2H = 2 };    /* cudaMemcpyKind */
enum { LOG_COPY, LOG_STALL }; /* what a logged event pair timed */

/* Drive, Call and the tables (LAND_PARTS, the counts' columns C_*), generated from
 * oled/offload/drive_state.py.
 *
 * Encoded copies (oled.offload.encoded; decode_execs NULL: plain rows): the rows land in part p = (ring index) % LAND_PARTS of the landing tables, land_rows at a time, and part
 * p's decoder graph decodes them into their destination rows (plain13/plain2 bytes each)
 * on the decoder's stream, the rows listed in a descriptor sent on the copy stream from the
 * pinned ring desc_host ([desc_cap, desc_stride] int64; *desc_used taken, shared with the
 * Python path) to part p's row of desc_dev [LAND_PARTS, desc_stride]. Offsets are from
 * land13. land_events [2, LAND_PARTS]: each part's event after its landing, after its
 * decode (the Python path's too). */
#define OLED_DRIVE_CONTRACT /* the contract is defined here */
#include "drive_state.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define CHECK(call)                                                                              \
    do {                                                                                         \
        int err_ = (call);                                                                       \
        if (err_) {                                                                              \
            d->error = err_;                                                                     \
            return -2;                                                                           \
        }                                                                                        \
    } while (0)

/* The next event of the pool recorded on `stream` into *out. */
static int64_t record(Drive *d, void *stream, void **out) {
    void **ev = &d->events[d->used++];
    if (!*ev) CHECK(d->create(ev));
    CHECK(d->record(*ev, stream));
    *out = *ev;
    return 0;
}

/* Log an event pair that timed `kind` for the layer (read by oled_collect). */
static void log_pair(Drive *d, int64_t layer, int64_t kind, void *start, void *end) {
    int64_t *row = d->log + 4 * d->logged++;
    row[0] = layer, row[1] = kind, row[2] = (int64_t)(intptr_t)start;
    row[3] = (int64_t)(intptr_t)end;
}

/* Issue the n copies d->srcs[i] -> d->dsts[i] of d->sizes[i] bytes on the copy stream: one
 * batched call, or one call each (the w13 rows, then the w2 rows). */
static int64_t issue(Drive *d, int64_t n) {
    if (d->memcpy_batch && d->batch_min && n >= 2 * d->batch_min) {
        size_t count = (size_t)n;
        if (d->batch_abi == 12)
            CHECK(((batch12_fn)d->memcpy_batch)(d->dsts, d->srcs, d->sizes, count, d->batch_attrs,
                                                &d->attr_index, 1, &d->failed, d->copy));
        else
            CHECK(((batch13_fn)d->memcpy_batch)(d->dsts, d->srcs, d->sizes, count, d->batch_attrs,
                                                &d->attr_index, 1, d->copy));
        return 0;
    }
    for (int64_t i = 0; i < n; i++)
        CHECK(d->memcpy_async(d->dsts[i], d->srcs[i], d->sizes[i], H2D, d->copy));
    return 0;
}

/* Fill the copy arguments of experts e[i] -> rows r[i] (or row i when r is NULL) of the tables
 * (d13, d2), rows of the sources' sizes: [2n], the w13 rows, then the w2 rows. */
static void fill_rows(Drive *d, int64_t layer, const int64_t *e, const int64_t *r, int64_t n,
                      int64_t d13, int64_t d2) {
    int64_t s13 = d->src13[layer], s2 = d->src2[layer], z13 = d->size13, z2 = d->size2;
    for (int64_t i = 0; i < n; i++) {
        int64_t at = r ? r[i] : i;
        d->srcs[i] = (void *)(intptr_t)(s13 + e[i] * z13);
        d->dsts[i] = (void *)(intptr_t)(d13 + at * z13);
        d->sizes[i] = (size_t)z13;
        d->srcs[n + i] = (void *)(intptr_t)(s2 + e[i] * z2);
        d->dsts[n + i] = (void *)(intptr_t)(d2 + at * z2);
        d->sizes[n + i] = (size_t)z2;
    }
}

/* The decoder's descriptor of n experts landed in part p -> rows s[i] of (d13, d2), sent to the
 * part's descriptor row on the copy stream. */
static int64_t describe(Drive *d, int64_t p, const int64_t *s, int64_t n, int64_t d13,
                        int64_t d2) {
    int64_t *q = d->desc_host + *d->desc_used * d->desc_stride, base = d->land13;
    q[0] = 2 * n; /* then (source, destination) offsets from land13: the w13 rows, the w2 rows */
    for (int64_t i = 0; i < n; i++) {
        int64_t row = p * d->land_rows + i;
        q[1 + 2 * i] = row * d->size13;
        q[2 + 2 * i] = d13 + s[i] * d->plain13 - base;
        q[1 + 2 * (n + i)] = d->land2 - base + row * d->size2;
        q[2 + 2 * (n + i)] = d2 + s[i] * d->plain2 - base;
    }
    int64_t dev = d->desc_dev + 8 * p * d->desc_stride;
    CHECK(d->memcpy_async((void *)(intptr_t)dev, q, (size_t)(8 * (1 + 4 * n)), H2D, d->copy));
    return 0;
}

/* One landing round of n experts e[i] -> rows s[i] of (d13, d2), in the part the ring's next
 * descriptor picks: on the copy stream, wait for the part's last decode, send the descriptor,
 * land the rows; on the decoder's stream, wait for them and decode. */
static int64_t land(Drive *d, int64_t layer, const int64_t *e, const int64_t *s, int64_t n,
                    int64_t d13, int64_t d2) {
    int64_t p = *d->desc_used % LAND_PARTS;
    void *landed = d->land_events[p], *decoded = d->land_events[LAND_PARTS + p];
    CHECK(d->wait(d->copy, decoded, 0));
    if (describe(d, p, s, n, d13, d2)) return -2;
    (*d->desc_used)++;
    int64_t at = p * d->land_rows;
    fill_rows(d, layer, e, NULL, n, d->land13 + at * d->size13, d->land2 + at * d->size2);
    if (issue(d, 2 * n)) return -2;
    CHECK(d->record(landed, d->copy));
    CHECK(d->wait(d->decoder, landed, 0));
    CHECK(d->launch((void *)(intptr_t)d->decode_execs[p], d->decoder));
    CHECK(d->record(decoded, d->decoder));
    return 0;
}

/* Copy experts e[i] of the layer's sources into rows s[i] of the tables (d13, d2), timed from
 * the copy stream to where they are complete; *done: the event they complete. Encoded rows go
 * through the landing parts in rounds, decoded on the decoder's stream. */
static int64_t copies(Drive *d, int64_t layer, const int64_t *e, const int64_t *s, int64_t n,
                      int64_t d13, int64_t d2, void **done) {
    void *begin;
    if (record(d, d->copy, &begin)) return -2;
    if (!d->decode_execs) {
        fill_rows(d, layer, e, s, n, d13, d2);
        if (issue(d, 2 * n)) return -2;
    } else {
        for (int64_t lo = 0; lo < n; lo += d->land_rows) {
            int64_t k = n - lo < d->land_rows ? n - lo : d->land_rows;
            if (land(d, layer, e + lo, s + lo, k, d13, d2)) return -2;
        }
    }
    if (record(d, d->decode_execs ? d->decoder : d->copy, done)) return -2;
    log_pair(d, layer, LOG_COPY, begin, *done);
    return 0;
}

/* Descriptor rounds that copying n experts takes (0 for plain rows). */
static int64_t rounds_of(const Drive *d, int64_t n) {
    return d->decode_execs ? (n + d->land_rows - 1) / d->land_rows : 0;
}

/* The compute stream waits for `copied`, timed as the layer's stall. */
static int64_t wait(Drive *d, int64_t layer, void *copied) {
    void *start, *end;
    if (record(d, d->compute, &start)) return -2;
    CHECK(d->wait(d->compute, copied, 0));
    if (record(d, d->compute, &end)) return -2;
    log_pair(d, layer, LOG_STALL, start, end);
    return 0;
}

/* Whether the call can launch: a graph for every pass and room for its events and log rows. */
static int ready(const Drive *d, const Call *c, int64_t rows, int64_t n_copy, int64_t n_stage,
                 int64_t n_cpu) {
    if (rows < MAP_STAGED || rows > c->n_execs) return 0; /* no slot maps written, or too many */
    for (int64_t r = 0; r < rows; r++)
        if (!c->execs[r] && (r != MAP_COPIED || n_copy)) return 0;
    if (n_cpu && !c->x_host) return 0;
    int64_t rounds = rows - MAP_STAGED;
    int64_t events = 4 + 5 * rounds + 1, logs = 2 + 2 * rounds;
    int64_t descs = rounds_of(d, n_copy);
    for (int64_t lo = 0; lo < n_stage; lo += d->stage_capacity)
        descs += rounds_of(d, n_stage - lo < d->stage_capacity ? n_stage - lo : d->stage_capacity);
    if (descs && *d->desc_used + descs > d->desc_cap) return 0;
    return d->used + events <= d->n_events && d->logged + logs <= d->log_cap;
}

/* Issue the planned layer's runtime calls (the plan's arrays and sizes in d->out). */
static int64_t launch(Drive *d, const Call *c, int64_t layer, int64_t rows, int64_t n_copy,
                      int64_t n_stage, int64_t n_cpu) {
    const int64_t *out = d->out, *h = out, E = d->num_experts;
    double t0 = now();
    void *copied = NULL;
    if (n_copy && copies(d, layer, out + h[OUT_COPY_EXPERTS], out + h[OUT_COPY_SLOTS], n_copy,
                         d->cache13[layer], d->cache2[layer], &copied))
        return -2;
    double t1 = now();
    if (n_cpu) { /* the CPU experts' activations start for the host before the passes */
        CHECK(d->memcpy_async((void *)(intptr_t)c->x_host, (void *)(intptr_t)c->x_dev,
                              (size_t)c->x_bytes, D2H, d->compute));
        if (record(d, d->compute, &d->cpu_ready)) return -2;
    }
    int64_t at = layer * d->map_rows * E * 8;
    CHECK(d->memcpy_async((void *)(intptr_t)(d->maps_dev + at),
                          (void *)(intptr_t)(d->maps_host + at), (size_t)(rows * E * 8), H2D,
                          d->compute));
    double t2 = now();
    CHECK(d->launch((void *)(intptr_t)c->execs[MAP_HIT], d->compute));
    if (n_copy) {
        if (wait(d, layer, copied)) return -2;
        CHECK(d->launch((void *)(intptr_t)c->execs[MAP_COPIED], d->compute));
    }
    int64_t size = d->stage_capacity; /* round r holds staged experts [r size, (r + 1) size) */
    const int64_t *stage_e = out + h[OUT_STAGE_EXPERTS], *stage_s = out + h[OUT_STAGE_SLOTS];
    void *users[STAGE_ROUNDS]; /* after the last users of each part of the stage */
    for (int p = 0; p < STAGE_ROUNDS; p++) users[p] = d->stage_free;
    for (int64_t r = MAP_STAGED, lo = 0; r < rows; r++, lo += size) {
        int64_t k = n_stage - lo < size ? n_stage - lo : size;
        int64_t part = (r - MAP_STAGED) % STAGE_ROUNDS; /* the round's part of the stage */
        if (users[part]) CHECK(d->wait(d->copy, users[part], 0));
        if (copies(d, layer, stage_e + lo, stage_s + lo, k, d->stage13, d->stage2, &copied))
            return -2;
        if (wait(d, layer, copied)) return -2;
        CHECK(d->launch((void *)(intptr_t)c->execs[r], d->compute));
        if (record(d, d->compute, &users[part])) return -2;
        d->stage_free = users[part];
    }
    double t3 = now(), *row = d->counts + layer * N_COUNTS;
    row[C_LAUNCH_MS] += 1e3 * (t1 - t0);
    row[C_PASS_MS] += 1e3 * (t3 - t2);
    return 1;
}

/* Plan the layer over the call's routing (oled_plan's other arguments; no queued load), then
 * launch it when the call is ready; 1: launched, 0: planned only (the engine launches), -1: an
 * expert id out of range, -2: a runtime call failed (d->error), -3: the routing does not fit
 * the planner's buffers (nothing planned). A launched call's counts go to d->counts. */
int64_t oled_layer(Drive *d, const Call *c, int64_t layer, int64_t step, int64_t clock,
                   int64_t block, double slowdown, int64_t gpu_only) {
    double t0 = now();
    int64_t rc = oled_route_in(d->bind, (const int64_t *)(intptr_t)c->ids_host,
                               (const float *)(intptr_t)c->w_host, c->pairs);
    if (rc) return rc;
    rc = oled_plan(d->bind, layer, c->pairs, step, clock, block, 0.0, 0.0, slowdown, gpu_only);
    if (rc) return rc;
    double t1 = now();
    const int64_t *h = d->out, *out = d->out;
    int64_t rows = h[H_MAP_ROWS];
    int64_t n_copy = h[OUT_COPY_EXPERTS + 1] - h[OUT_COPY_EXPERTS];
    int64_t n_stage = h[OUT_STAGE_EXPERTS + 1] - h[OUT_STAGE_EXPERTS];
    int64_t n_cpu = h[OUT_CPU_EXPERTS + 1] - h[OUT_CPU_EXPERTS];
    if (!ready(d, c, rows, n_copy, n_stage, n_cpu)) return 0;
    d->cpu_ready = NULL;
    rc = launch(d, c, layer, rows, n_copy, n_stage, n_cpu);
    if (rc != 1) return rc;
    int64_t tokens = 0;
    for (int64_t i = h[OUT_CPU_TOKENS]; i < h[OUT_CPU_TOKENS + 1]; i++) tokens += out[i];
    double *row = d->counts + layer * N_COUNTS;
    row[C_HITS] += (double)(h[OUT_HITS + 1] - h[OUT_HITS]);
    row[C_MISSES] += (double)(h[OUT_MISSES + 1] - h[OUT_MISSES]);
    row[C_COPIES] += (double)(n_copy + n_stage);
    row[C_STAGED] += (double)n_stage;
    row[C_CPU_EXPERTS] += (double)n_cpu;
    row[C_CPU_TOKENS] += (double)tokens;
    row[C_GPU_EXPERTS] += (double)(h[OUT_GPU_EXPERTS + 1] - h[OUT_GPU_EXPERTS] + n_stage);
    row[C_PLAN_MS] += 1e3 * (t1 - t0);
    row[C_CALLS] += 1;
    return 1;
}

/* The logged event pairs' times into d->counts (both streams must be idle); the pool, the log
 * and the stage are free again. Returns 0, or -2 when the runtime fails (d->error). */
int64_t oled_collect(Drive *d) {
    for (int64_t i = 0; i < d->logged; i++) {
        int64_t *row = d->log + 4 * i;
        float ms = 0;
        CHECK(d->elapsed(&ms, (void *)(intptr_t)row[2], (void *)(intptr_t)row[3]));
        d->counts[row[0] * N_COUNTS + (row[1] == LOG_COPY ? C_COPY_MS : C_STALL_MS)] += ms;
    }
    d->used = d->logged = 0;
    d->stage_free = NULL;
    return 0;
}
