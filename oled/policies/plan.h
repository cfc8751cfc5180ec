/* What plan.c gives drive.c: the layout of a plan in Bind.out, the contract's rows and the
 * entry points. */
#ifndef OLED_PLAN_H
#define OLED_PLAN_H

#include <stddef.h>
#include <stdint.h>

/* The plan's arrays, in this order; packed into `out` after a header of HEADER int64s:
 * header[i] = where array i starts in out (array i ends where array i + 1 starts), then the
 * fields below. */
enum {
    OUT_HITS, OUT_MISSES, OUT_GPU, OUT_COPY_E, OUT_COPY_S, OUT_STAGE_E, OUT_STAGE_S, OUT_CPU_E,
    OUT_CPU_T, OUT_EVICTED, OUT_COUNTS, N_OUT
};
enum {
    H_SLOT_MAP = N_OUT, /* where the slot map copy starts (int32 [E]) */
    H_END,              /* the end of the plan */
    H_FREE,             /* the cache's free slots after the plan */
    H_MAP_ROWS,         /* the slot-map rows written (0 without maps) */
    HEADER = 16
};
/* Rows of a layer's expert -> slot maps: MAP_STAGED + r for staged round r. */
enum { MAP_HIT, MAP_COPIED, MAP_STAGED };
/* Rounds the stage holds: round r's experts in its part r % STAGE_ROUNDS, so that one round's
 * copies overlap the previous round's pass. */
enum { STAGE_ROUNDS = 2 };

typedef struct Bind Bind;

/* The contract that the Python side checks its mirrors against on load (oled.policies.native):
 * per struct its fields {name, offsetof, sizeof} in declaration order and, as `size`, its
 * sizeof; per table its entries {name, value, 0} and -1 as `size`. */
typedef struct {
    const char *name;
    int64_t value, size;
} ContractRow;
typedef struct {
    const char *name;
    int64_t size, n_rows;
    const ContractRow *rows;
} Contract;
#define FIELD(type, f) {#f, (int64_t)offsetof(type, f), (int64_t)sizeof(((type *)0)->f)}
#define ENTRY(name, value) {name, value, 0}
#define N_ROWS(rows) ((int64_t)(sizeof(rows) / sizeof((rows)[0])))
#define STRUCT(type, fields) {#type, (int64_t)sizeof(type), N_ROWS(fields), fields}
#define TABLE(name, entries) {name, -1, N_ROWS(entries), entries}

int64_t oled_plan(const Bind *b, int64_t layer, int64_t n, int64_t step, int64_t block,
                  double copy_q, double cpu_q, double slowdown, int64_t gpu_only);
int64_t oled_route_in(const Bind *b, const int64_t *ids, const float *weights, int64_t n);
/* plan.c's contract: *out = its tables; returns their number (drive.c has its own). */
int64_t oled_plan_contract(const Contract **out);
/* sizeof(ContractRow), sizeof(Contract) into sizes[0], sizes[1]. */
void oled_contract_sizes(int64_t *sizes);

#endif
