"""Fitting miss curves on a trace (`oled trace curves`): every MoE layer's misses at every
capacity under a retention policy, every miss copied (oled.policies.curves uses them)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from oled.policies.allocation import UniformAllocation
from oled.policies.base import CostModel, RetentionPolicy
from oled.policies.compensation import TransferOnly
from oled.policies.curves import MissCurves
from oled.policies.planner import Planner
from oled.progress import track
from oled.trace.format import Trace
from oled.trace.simulate import drive


def fit_curves(
    trace: Trace,
    retention: Callable[[], RetentionPolicy],
    *,
    stage_capacity: int = 8,
    source: dict | None = None,
    progress: bool = False,
) -> MissCurves:
    """Replay `trace` once per capacity c = 1..E with c slots in every layer (layers are
    independent when every miss is copied), counting each layer's misses; `retention()` makes a
    fresh policy. `source`: what to record about the fit beside the curves."""
    m = trace.meta
    misses = np.zeros((m.num_moe_layers, m.num_experts + 1), np.int64)
    for c in track(range(1, m.num_experts + 1), "capacities", show=progress):
        planner = Planner.for_model(
            m.num_moe_layers,
            m.num_experts,
            m.top_k,
            c * m.num_moe_layers,
            stage_capacity=stage_capacity,
            cost=CostModel.profile("h200"),
            allocation=UniformAllocation(),
            retention=retention(),
            compensation=TransferOnly(),
        )
        drive(trace, planner)
        misses[:, c] = planner.stats.requests - planner.stats.hits
        misses[:, 0] = planner.stats.requests  # no slot: every request misses
    return MissCurves(misses, {"forwards": trace.num_steps, **(source or {})})
