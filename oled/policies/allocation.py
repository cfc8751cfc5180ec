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


def steady(new: list[int], old: list[int] | None, min_moved: float) -> list[int]:
    """`new`, unless it moves fewer than `min_moved` slots from `old`: then `old` (moving slots
    evicts warm experts, so small shifts cost more than they win)."""
    if old is None or len(old) != len(new):
        return new
    moved = sum(max(0, a - b) for a, b in zip(new, old, strict=True))
    return old if moved < min_moved else new


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
        self._last = steady(split, self._last, self.min_shift * total_slots)
        return self._last


@component("allocation", "stack")
class StackAllocation(AllocationPolicy):
    """Slots per layer by marginal gain on miss curves measured while it runs, no file needed.

    A layer's LRU stack distances (for each expert a forward needs, the experts the layer used
    at or after that expert's last use) give its misses at every capacity in one pass. LRU's
    curve drops only once a layer holds its working set, so each layer first gets the slots
    its working set needs (the `floor_quantile` of its distinct experts per forward, at most
    the equal share), and the rest goes by marginal gain (oled.policies.curves.split).
    Re-planned at block ends, once `warmup` forwards are measured (the equal split before);
    `decay` multiplies the measured histograms at each re-plan (1: every forward counts alike);
    a re-plan that would move fewer than `min_shift` of all slots keeps the current split.
    """

    RECENT = 1024  # forwards whose working sets set the floors

    def __init__(
        self,
        *,
        floor_quantile: float = 0.75,
        decay: float = 1.0,
        warmup: int = 32,
        min_shift: float = 0.0,
    ) -> None:
        if not 0 <= floor_quantile <= 1 or not 0 < decay <= 1 or warmup < 0 or min_shift < 0:
            raise ValueError(
                "floor_quantile in [0, 1], decay in (0, 1], warmup >= 0, min_shift >= 0"
            )
        self.floor_quantile, self.decay, self.warmup = floor_quantile, decay, warmup
        self.min_shift = min_shift
        self._split: list[int] | None = None
        self.replan = True
        self.routing = True
        self._log: dict[int, list[np.ndarray]] = {}  # layer -> ids of forwards not yet counted
        self._last: np.ndarray | None = None  # [L, E] int64: forward of each expert's last use
        self._hist: np.ndarray | None = None  # [L, E + 2] float64: stack distances (E + 1: cold)
        self._sizes: list[list[int]] = []  # [L] distinct experts of each forward counted
        self._t = np.zeros(0, np.int64)  # [L] forwards counted per layer

    def route(self, layer: int, ids: np.ndarray) -> None:
        """Keep the forward's ids of `layer` until the next re-plan counts them."""
        self._log.setdefault(layer, []).append(ids.reshape(-1).copy())

    def allocate(
        self, *, total_slots: int, num_layers: int, num_experts: int, stats: LayerStats | None
    ) -> list[int]:
        """The least-misses split on the curves measured so far, above working-set floors."""
        from oled.policies.curves import split

        self._count(num_layers, num_experts)
        if self._hist is None or self._forwards < self.warmup:
            return uniform_split(total_slots, num_layers, num_experts)
        tail = np.cumsum(self._hist[:, ::-1], axis=1)[:, ::-1]  # [L, E + 2]: distances >= d
        misses = np.rint(tail[:, 1 : num_experts + 2]).astype(np.int64)  # [L, E + 1]: d > c
        share = min(total_slots, num_layers * num_experts) // num_layers
        for layer, sizes in enumerate(self._sizes):
            floor = min(share, int(np.quantile(sizes, self.floor_quantile)) if sizes else 0)
            misses[layer, :floor] = np.iinfo(np.int64).max // (4 * num_layers)
        self._hist *= self.decay
        self._split = steady(split(misses, total_slots), self._split, self.min_shift * total_slots)
        return self._split

    def _count(self, num_layers: int, num_experts: int) -> None:
        """Fold the logged forwards into each layer's stack-distance histogram."""
        if self._last is None or self._hist is None:
            self._last = np.full((num_layers, num_experts), -1, np.int64)
            self._hist = np.zeros((num_layers, num_experts + 2))
            self._sizes = [[] for _ in range(num_layers)]
            self._t = np.zeros(num_layers, np.int64)
        log, self._log = self._log, {}
        for layer, forwards in log.items():
            last, hist = self._last[layer], self._hist[layer]  # views
            for ids in forwards:
                needed = np.unique(ids)  # [N]
                before = last[needed]  # [N] forward of each one's last use, -1: never
                seen = before >= 0
                hist[num_experts + 1] += int((~seen).sum())
                if seen.any():
                    # the experts used at or after each one's last use (itself included)
                    order = np.sort(last)  # [E]
                    d = num_experts - np.searchsorted(order, before[seen], side="left")
                    np.add.at(hist, d, 1)
                last[needed] = self._t[layer]
                self._t[layer] += 1
                self._sizes[layer].append(len(needed))
            del self._sizes[layer][: -self.RECENT]  # the working set of recent forwards

    @property
    def _forwards(self) -> int:
        """Forwards every layer has counted."""
        return int(self._t.min()) if len(self._t) else 0


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
            share = c.num_experts > num_experts and not c.num_experts % num_experts
            hint = (
                f" (one of {c.num_experts // num_experts} devices' shares: curves of whole "
                "layers do not fit a share; use another allocation with several devices)"
            )
            raise ValueError(
                f"miss curves of {c.num_layers} layers x {c.num_experts} experts "
                f"({c.source.get('trace', '?')}) for a model of {num_layers} x {num_experts}"
                + (hint if share else "")
            )
        return split(c.misses, total_slots)
