/* What plan.c gives drive.c: the plan state and the layout of a plan in Bind.out (generated
 * from oled/policies/state.py into plan_state.h at build time) and the entry points. */
#ifndef OLED_PLAN_H
#define OLED_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "plan_state.h"

int64_t oled_plan(const Bind *b, int64_t layer, int64_t n, int64_t step, int64_t clock,
                  int64_t block, double copy_q, double cpu_q, double slowdown, int64_t gpu_only);
int64_t oled_route_in(const Bind *b, const int64_t *ids, const float *weights, int64_t n);
/* The buffer lengths (int64s) for E experts: lens = {scratch, out}. */
void oled_layout(int64_t E, int64_t *lens);

#endif
