"""Allocation policies: how the GPU expert-slot budget is split across MoE layers."""

from __future__ import annotations

import numpy as np

from oled.policies.base import AllocationPolicy, LayerStats
from oled.registry import component


def uniform_split(total_slots: int, num_layers: int, num_experts: int) -> list[int]:
    """Equal slots per layer (earlier layers take the remainder), capped at num_experts."""
    if total_slots < num_layers:
        raise ValueError(
            f"{total_slots} slots is below the minimum of {num_layers} (one per layer)"
        )
    base, extra = divmod(min(total_slots, num_layers * num_experts), num_layers)
    return [min(num_experts, base + (i < extra)) for i in range(num_layers)]


def proportional_split(
    demand: np.ndarray, *, total_slots: int, floor: int, num_experts: int
) -> list[int]:
    """Slots proportional to demand, each in [floor, num_experts], sum <= total_slots.

    Water-filling: layers that hit the cap keep it and the rest is re-split; largest remainders
    take the leftover slots.
    """
    n = len(demand)
    floor = max(1, min(floor, total_slots // n, num_experts))
    total = min(total_slots, n * num_experts)
    demand = np.maximum(np.asarray(demand, np.float64), 1e-9)
    caps = np.full(n, float(num_experts))
    alloc = np.full(n, float(floor))
    free = np.ones(n, bool)
    for _ in range(n):
        if not free.any():
            break
        spare = total - alloc[~free].sum() - floor * free.sum()
        share = floor + spare * demand * free / demand[free].sum()
        over = free & (share >= caps)
        alloc = np.where(free, share, alloc)
        if not over.any():
            break
        alloc[over] = caps[over]
        free &= ~over
    alloc = np.minimum(alloc, caps)
    out = np.floor(alloc).astype(np.int64)
    left = int(total - out.sum())
    if left > 0:
        frac = np.where(out < caps, alloc - out, -1.0)
        for i in np.argsort(-frac, kind="stable")[:left]:
            if out[i] < num_experts:
                out[i] += 1
    return [int(x) for x in out]


@component("allocation", "uniform")
class UniformAllocation(AllocationPolicy):
    """The same number of slots in every MoE layer (TIDE, mixtral-offloading, HybriMoE)."""

    def __init__(self) -> None:
        self.replan = False

    def allocate(
        self, *, total_slots: int, num_layers: int, num_experts: int, stats: LayerStats | None
    ) -> list[int]:
        """Equal split."""
        return uniform_split(total_slots, num_layers, num_experts)


@component("allocation", "adaptive")
class AdaptiveAllocation(AllocationPolicy):
    """OLED: slots per layer from its measured working set and reuse, re-planned per block.

    demand = working_set ** ws_power * ((1 - reuse_weight) + reuse_weight * reuse); each layer
    keeps at least `floor_fraction` of the uniform share (and at least one slot). Uniform until
    every layer has been measured. A re-plan that would move fewer than `min_shift` of all slots
    keeps the current split: moving slots evicts warm experts, so small shifts cost more than
    they win.
    """

    def __init__(
        self,
        *,
        ws_power: float = 1.0,
        reuse_weight: float = 0.5,
        floor_fraction: float = 0.25,
        min_shift: float = 0.1,
        replan: bool = True,
    ) -> None:
        self.ws_power = ws_power
        self.reuse_weight = reuse_weight
        self.floor_fraction = floor_fraction
        self.min_shift = min_shift
        self.replan = replan
        self._last: list[int] | None = None

    def allocate(
        self, *, total_slots: int, num_layers: int, num_experts: int, stats: LayerStats | None
    ) -> list[int]:
        """Proportional split by demand, uniform without stats."""
        if stats is None or not stats.ready:
            self._last = uniform_split(total_slots, num_layers, num_experts)
            return self._last
        ws = np.maximum(stats.working_set, 1.0)
        demand = ws**self.ws_power * (1 - self.reuse_weight + self.reuse_weight * stats.reuse)
        floor = int(self.floor_fraction * total_slots / num_layers)
        split = proportional_split(
            demand, total_slots=total_slots, floor=floor, num_experts=num_experts
        )
        last = self._last
        if last is not None and len(last) == len(split):
            moved = sum(max(0, a - b) for a, b in zip(split, last, strict=True))
            if moved < self.min_shift * total_slots:
                return last
        self._last = split
        return split


@component("allocation", "curves")
class CurvesAllocation(AllocationPolicy):
    """Slots per layer by marginal gain on measured miss curves (utility-based partitioning):
    the split with the fewest misses on the tuning trace the curves file was fitted on
    (`oled trace curves`), never more than the equal split's there (oled.policies.curves).
    Fixed for the run. `curves`: the file (a relative path is taken from the recipe's folder);
    without one, the equal split."""

    path_params = ("curves",)

    def __init__(self, *, curves: str | None = None) -> None:
        from oled.policies.curves import MissCurves

        self.curves = MissCurves.load(curves) if curves else None
        self.replan = False

    def allocate(
        self, *, total_slots: int, num_layers: int, num_experts: int, stats: LayerStats | None
    ) -> list[int]:
        """The least-misses split; ValueError when the curves are of another model shape."""
        from oled.policies.curves import split

        c = self.curves
        if c is None:
            return uniform_split(total_slots, num_layers, num_experts)
        if (c.num_layers, c.num_experts) != (num_layers, num_experts):
            raise ValueError(
                f"miss curves of {c.num_layers} layers x {c.num_experts} experts "
                f"({c.source.get('trace', '?')}) for a model of {num_layers} x {num_experts}"
            )
        return split(c.misses, total_slots)
