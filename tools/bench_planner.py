"""Time `Planner.plan` per call: 32 tokens x top-8 over 256 experts, 19 MoE layers, on
synthetic routing: two prompt-like skews with many misses per layer, and decode-like routing
where one token changes its routes per forward (a few misses per layer, as decoding has).

With `--trace FILE` (a routing trace, `oled trace record` or `tools/bench_offload.py --trace`) it
times the planner alone on that recorded routing instead, decode forwards only (the first forward,
which runs the prompt, is left out), as `oled bench` reports `plan µs/layer` in place: the two
figures on one host show what running between the engine's launches costs the planner.

Each configuration is timed with the Python planner and the compiled one (oled.policies.native),
which decide alike.

Usage: PYTHONPATH=. python tools/bench_planner.py [--steps 200] [--trace FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from oled.policies import ANCHORS, anchor_policies
from oled.policies.base import CostModel, Load
from oled.policies.planner import Planner
from oled.trace.format import Trace


def routing(
    rng: np.random.Generator, steps: int, layers: int, tokens: int, k: int, e: int, skew: float
):
    """Adjacent steps route alike: a base routing with 10% of routes redrawn per step.

    Experts are drawn with Gumbel top-k over per-layer logits of scale `skew` (0 = uniform,
    about 160 distinct experts per layer for 32 x 8; 2.5 gives about 70, like trained LLaDA2).
    """
    logits = skew * rng.standard_normal((layers, 1, e))
    base = np.argsort(-(logits + rng.gumbel(size=(layers, tokens, e))), axis=-1)[..., :k]
    ids = np.repeat(base[None], steps, axis=0)
    redraw = rng.random(ids.shape) < 0.1
    ids[redraw] = rng.integers(0, e, int(redraw.sum()))
    weights = rng.random(ids.shape).astype(np.float32)
    return ids, weights


def decode_routing(rng: np.random.Generator, steps: int, layers: int, tokens: int, k: int, e: int):
    """Each layer routes among its 56 favourite experts; per forward two tokens (commits) draw
    new routes, a twentieth of the time from all experts: about 4 misses per layer in a 64-slot
    cache, as in decoding the mini-shape model at 25%."""
    pools = [rng.choice(e, 56, replace=False) for _ in range(layers)]
    ids = np.empty((steps, layers, tokens, k), np.int64)
    cur = np.stack([[rng.choice(p, k, replace=False) for _ in range(tokens)] for p in pools])
    for s in range(steps):
        for t in rng.choice(tokens, 2, replace=False):
            for layer in range(layers):
                pool = np.arange(e) if rng.random() < 0.05 else pools[layer]
                cur[layer, t] = rng.choice(pool, k, replace=False)
        ids[s] = cur
    return ids, rng.random(ids.shape).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--slots-per-layer", type=int, default=64)
    ap.add_argument("--trace", default=None, help="time the planner on this recorded routing")
    args = ap.parse_args()
    if args.trace:
        bench_trace(Trace.load(args.trace), args.slots_per_layer)
        return
    layers, tokens, k, e = 19, 32, 8, 256
    for skew in (0.0, 2.5):
        rng = np.random.default_rng(0)
        bench(f"skew {skew}", routing(rng, args.steps, layers, tokens, k, e, skew), args)
    rng = np.random.default_rng(0)
    bench("decode-like", decode_routing(rng, args.steps, layers, tokens, k, e), args)


def bench(name: str, routed: tuple[np.ndarray, np.ndarray], args) -> None:
    """Print microseconds per plan (best of 3 passes) for each anchor configuration."""
    ids, weights = routed
    distinct = np.mean([len(np.unique(ids[s, 0])) for s in range(len(ids))])
    print(f"{name}: {distinct:.0f} distinct experts per layer per forward")
    load = Load()
    for anchor in ANCHORS:
        for compiled in PLANNERS:
            us, hit_rate, misses = min(
                run(anchor, compiled, ids, weights, args.slots_per_layer, load) for _ in range(3)
            )
            print(
                f"  {anchor:10s} {PLANNERS[compiled]:8s} {us:6.1f} us per plan  "
                f"hit rate {hit_rate:.3f}  misses per plan {misses:.1f}"
            )


PLANNERS = {False: "python", True: "compiled"}


def fresh_planner(
    anchor: str, layers: int, experts: int, top_k: int, slots: int, compiled: bool
) -> Planner:
    """A planner with the anchor configuration's fresh policies, `slots` per layer, an 8-slot
    stage and the H200 cost profile, compiled or in Python."""
    return Planner.for_model(
        layers,
        experts,
        top_k,
        layers * slots,
        stage_capacity=8,
        cost=CostModel.profile("h200"),
        compiled=compiled,
        **anchor_policies(anchor),
    )


def run(
    name: str, compiled: bool, ids, weights, slots_per_layer: int, load: Load
) -> tuple[float, float, float]:
    """One pass over the routing with fresh policies: (us per plan, hit rate, misses per plan)."""
    steps, layers, _, k = ids.shape
    planner = fresh_planner(name, layers, 256, k, slots_per_layer, compiled)
    t0 = time.perf_counter()
    for s in range(steps):
        planner.begin_step(step=s, block=s // 8)
        for layer in range(layers):
            planner.plan(layer, ids[s, layer], weights[s, layer], load)
    us = (time.perf_counter() - t0) / (steps * layers) * 1e6
    stats = planner.stats
    return us, stats.hit_rate(), float(stats.misses.sum() / stats.plans.sum())


def bench_trace(trace: Trace, slots_per_layer: int) -> None:
    """Print microseconds per decode plan (best of 3 passes) on the trace, per anchor."""
    m = trace.meta
    steps = [(ctx, routing) for ctx, routing in trace]
    print(f"trace: {len(steps)} forwards x {m.num_moe_layers} MoE layers, {m.num_experts} experts")
    for anchor in ANCHORS:
        for compiled in PLANNERS:
            us = min(replay(anchor, compiled, steps, m, slots_per_layer) for _ in range(3))
            print(f"  {anchor:10s} {PLANNERS[compiled]:8s} {us:6.1f} us per decode plan")


def replay(anchor: str, compiled: bool, steps, meta, slots_per_layer: int) -> float:
    """One pass with fresh policies, as the engine drives the planner (begin_step, a plan per
    layer, observe after the forward, end_block between blocks): us per decode plan."""
    planner = fresh_planner(
        anchor, meta.num_moe_layers, meta.num_experts, meta.top_k, slots_per_layer, compiled
    )
    spent, block = 0.0, None
    for s, (ctx, routing) in enumerate(steps):
        if block is not None and ctx.block != block:
            planner.end_block()
        block = ctx.block
        planner.begin_step(step=ctx.step, block=ctx.block)
        t0 = time.perf_counter()
        for layer, (ids, w) in enumerate(routing):
            planner.plan(layer, ids, w)
        if s:  # the prompt forward apart
            spent += time.perf_counter() - t0
        for layer, (ids, w) in enumerate(routing):
            planner.observe(layer, ids, w, ctx)
    return spent / max(1, (len(steps) - 1) * meta.num_moe_layers) * 1e6


if __name__ == "__main__":
    main()
