"""Time `Planner.plan` per call: 32 tokens x top-8 over 256 experts, 19 MoE layers.

Usage: PYTHONPATH=. python tools/bench_planner.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from oled.offload.planner import Planner
from oled.policies import ANCHORS, anchor_policies
from oled.policies.base import CostModel, Load


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--slots-per-layer", type=int, default=64)
    args = ap.parse_args()
    for skew in (0.0, 2.5):
        bench(args.steps, args.slots_per_layer, skew)


def bench(steps: int, slots_per_layer: int, skew: float) -> None:
    """Print microseconds per plan (best of 3 passes) for each combination."""
    layers, tokens, k, e = 19, 32, 8, 256
    ids, weights = routing(np.random.default_rng(0), steps, layers, tokens, k, e, skew)
    distinct = np.mean([len(np.unique(ids[s, 0])) for s in range(steps)])
    print(f"skew {skew}: {distinct:.0f} distinct experts per layer per forward")
    load = Load()
    for name in ANCHORS:
        best = min(run(name, ids, weights, slots_per_layer, load) for _ in range(3))
        print(f"  {name:10s} {best[0]:6.1f} us per plan  hit rate {best[1]:.3f}")


def run(name: str, ids, weights, slots_per_layer: int, load: Load) -> tuple[float, float]:
    """One pass over the routing with fresh policies: (us per plan, hit rate)."""
    steps, layers, _, k = ids.shape
    planner = Planner(
        num_layers=layers, num_experts=256, top_k=k, total_slots=layers * slots_per_layer,
        stage_capacity=8, **anchor_policies(name),
        cost=CostModel.profile("h200"),
    )  # fmt: skip
    t0 = time.perf_counter()
    for s in range(steps):
        planner.begin_step(step=s, block=s // 8)
        for layer in range(layers):
            planner.plan(layer, ids[s, layer], weights[s, layer], load)
    us = (time.perf_counter() - t0) / (steps * layers) * 1e6
    return us, planner.stats.hit_rate()


if __name__ == "__main__":
    main()
