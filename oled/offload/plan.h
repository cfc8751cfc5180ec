/* What plan.c gives drive.c: the layout of a plan in Bind.out and the entry points. */
#ifndef OLED_PLAN_H
#define OLED_PLAN_H

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

typedef struct Bind Bind;

int64_t oled_plan(const Bind *b, int64_t layer, int64_t n, int64_t step, int64_t block,
                  double copy_q, double cpu_q, double slowdown, int64_t gpu_only);
int64_t oled_route_in(const Bind *b, const int64_t *ids, const float *weights, int64_t n);

#endif
