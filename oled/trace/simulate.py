"""Replay a trace through the Planner and policy objects with a modelled timeline; Belady bound.

Timeline of one MoE layer (all times in ms, from the layer's start t0 = previous layer's end +
cost.layer_ms): the GPU computes the hits at once (gpu_ms(hits)); copies run on one copy-engine
queue (copy_ms(copies + staged)), then the GPU computes the copied experts (gpu_ms(n)); the
CPU runs its experts one after another (sum of cpu_ms(tokens)) in parallel. The layer ends when
the GPU and the CPU are both done. Stall = time the GPU waits for copies after its hits.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field

import numpy as np

from oled.decoding.trace_file import Trace
from oled.policies.base import (
    AllocationPolicy,
    CompensationPolicy,
    CostModel,
    Load,
    RetentionPolicy,
)
from oled.policies.planner import LayerPlan, Planner


@dataclass
class SimResult:
    """Replay outcome (hit rates over distinct-expert requests per layer and forward)."""

    hit_rate: float
    hit_rate_per_layer: list[float]
    copies: int
    staged: int
    cpu_experts: int
    cpu_share: float  # CPU (token, expert) pairs over all routed pairs
    copies_per_iteration: float
    gb_copied_per_iteration: float
    stall_ms: float  # total over the trace
    ms_per_iteration: float  # mean modelled forward time
    p90_ms_per_iteration: float
    iterations: int
    capacities: list[int]  # at the end of the trace
    capacity_history: list[list[int]]  # [S][L] capacities each forward ran with
    # of the misses after a generation's first forward, the share that the same layer routed in
    # the forward before (what a prediction from that forward could have copied a forward early)
    misses_routed_before: float = 0.0
    stats: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-friendly."""
        return asdict(self)


@dataclass
class _Clock:
    """Copy-engine and CPU queues, as absolute times within the current forward."""

    copy_free: float = 0.0
    cpu_free: float = 0.0
    stall: float = 0.0

    def layer(self, t0: float, plan: LayerPlan, cost: CostModel) -> float:
        """Advance through one layer; returns its end time."""
        n_hits = len(plan.hits)
        gpu_end = t0 + cost.gpu_ms(n_hits)
        n_copy = len(plan.copy_experts) + len(plan.stage_experts)
        if n_copy:
            copy_done = max(t0, self.copy_free) + cost.copy_ms(n_copy)
            self.copy_free = copy_done
            n_late = len(plan.gpu_experts) - n_hits + len(plan.stage_experts)
            if n_late:
                self.stall += max(0.0, copy_done - gpu_end)
                gpu_end = max(gpu_end, copy_done) + cost.gpu_ms(n_late)
        cpu_end = t0
        if len(plan.cpu_experts):
            work = float(cost.cpu_ms(plan.cpu_tokens).sum())
            cpu_end = max(t0, self.cpu_free) + work
            self.cpu_free = cpu_end
        return max(gpu_end, cpu_end)


def simulate(
    trace: Trace,
    *,
    allocation: AllocationPolicy,
    retention: RetentionPolicy,
    compensation: CompensationPolicy,
    cost: CostModel,
    total_slots: int,
    stage_capacity: int = 8,
) -> SimResult:
    """Replay `trace` through a fresh Planner built from these policy objects."""
    m = trace.meta
    planner = Planner.for_model(
        m.num_moe_layers,
        m.num_experts,
        m.top_k,
        total_slots,
        stage_capacity=stage_capacity,
        cost=cost,
        allocation=allocation,
        retention=retention,
        compensation=compensation,
    )
    step_ms = np.zeros(trace.num_steps)
    history = np.zeros((trace.num_steps, m.num_moe_layers), np.int64)
    clock = _Clock()
    prev_block = None
    before = _RoutedBefore(m.num_moe_layers)
    for s, (ctx, routing) in enumerate(trace):
        if prev_block is not None and ctx.block != prev_block:
            planner.end_block()
        prev_block = ctx.block
        planner.begin_step(step=ctx.step, block=ctx.block)
        if ctx.step == 0:  # a new generation: nothing routed before it
            before.reset()
        history[s] = planner.capacities
        t = 0.0
        for layer, (ids, w) in enumerate(routing):
            t0 = t + cost.layer_ms
            load = Load(
                copy_queue_ms=max(0.0, clock.copy_free - t0),
                cpu_queue_ms=max(0.0, clock.cpu_free - t0),
            )
            plan = planner.plan(layer, ids, w, load)
            before.count(layer, plan)
            t = clock.layer(t0, plan, cost)
        for layer, (ids, w) in enumerate(routing):
            planner.observe(layer, ids, w, ctx)
        step_ms[s] = t
        clock.copy_free = max(0.0, clock.copy_free - t)
        clock.cpu_free = max(0.0, clock.cpu_free - t)
    result = _result(trace, planner, step_ms, history, clock.stall, cost)
    result.misses_routed_before = before.share()
    return result


def _result(
    trace: Trace,
    planner: Planner,
    step_ms: np.ndarray,
    history: np.ndarray,
    stall: float,
    cost: CostModel,
) -> SimResult:
    st = planner.stats
    n = max(1, trace.num_steps)
    copies = int(st.copies.sum() + st.staged.sum())
    pairs = trace.ids.shape[0] * trace.ids.shape[1] * trace.ids.shape[2]
    return SimResult(
        hit_rate=st.hit_rate(),
        hit_rate_per_layer=(st.hits / np.maximum(1, st.requests)).tolist(),
        copies=int(st.copies.sum()),
        staged=int(st.staged.sum()),
        cpu_experts=int(st.cpu_experts.sum()),
        cpu_share=float(st.cpu_tokens.sum() / max(1, pairs)),
        copies_per_iteration=copies / n,
        gb_copied_per_iteration=copies * cost.expert_bytes / n / 1e9,
        stall_ms=float(stall),
        ms_per_iteration=float(step_ms.mean()) if len(step_ms) else 0.0,
        p90_ms_per_iteration=float(np.percentile(step_ms, 90)) if len(step_ms) else 0.0,
        iterations=trace.num_steps,
        capacities=list(planner.capacities),
        capacity_history=history.tolist(),
        stats=st.to_dict(),
    )


class _RoutedBefore:
    """Counts the misses that the same layer routed in the forward before."""

    def __init__(self, layers: int) -> None:
        self.layers, self.misses, self.seen = layers, 0, 0
        self.reset()

    def reset(self) -> None:
        self.last: list[np.ndarray | None] = [None] * self.layers  # [L] experts routed, sorted

    def count(self, layer: int, plan: LayerPlan) -> None:
        """A layer's plan: its misses against what the layer routed the forward before."""
        last = self.last[layer]
        if last is not None:
            self.misses += len(plan.misses)
            self.seen += int(np.isin(plan.misses, last, assume_unique=True).sum())
        self.last[layer] = np.union1d(plan.hits, plan.misses)  # every expert it routed

    def share(self) -> float:
        return self.seen / self.misses if self.misses else 0.0


# -- Belady with bypass --------------------------------------------------------------------


def requests(trace: Trace, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(experts, step index) of every request of one layer: one distinct expert per forward."""
    ids = trace.ids[layer].astype(np.int64)  # [R, K]
    row_step = np.repeat(np.arange(trace.num_steps), np.diff(trace.row_offsets))
    key = np.unique(row_step[:, None] * trace.meta.num_experts + ids)  # sorted by step, expert
    return key % trace.meta.num_experts, key // trace.meta.num_experts


def _next_use(experts: np.ndarray) -> np.ndarray:
    """Index of the next request of the same expert (len(experts) when none)."""
    n = len(experts)
    order = np.lexsort((np.arange(n), experts))
    nxt = np.full(n, n, np.int64)
    same = experts[order[1:]] == experts[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_layer(experts: np.ndarray, steps: np.ndarray, capacity: np.ndarray | int) -> int:
    """Hits of offline-optimal caching with bypass over one layer's request sequence.

    `capacity` is an int or, per step index, an array (a shrinking cache evicts the furthest).
    """
    caps = np.broadcast_to(np.asarray(capacity), (int(steps.max(initial=-1)) + 1,)).tolist()
    nxt = _next_use(experts).tolist()
    never = len(experts)
    cached: dict[int, int] = {}  # expert -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, expert), lazily invalidated
    hits, cur, cap = 0, -1, 0
    for e, nu, s in zip(experts.tolist(), nxt, steps.tolist(), strict=True):
        if s != cur:
            cur, cap = s, caps[s]
            while len(cached) > cap:
                _pop_furthest(cached, heap)
        if e in cached:
            hits += 1
        elif nu == never:
            continue  # never requested again: bypass
        elif len(cached) >= cap:
            _top_valid(cached, heap)
            if -heap[0][0] <= nu:
                continue  # the new expert is the furthest: bypass (run it on the CPU)
            _pop_furthest(cached, heap)
        cached[e] = nu
        heapq.heappush(heap, (-nu, e))
    return hits


def _top_valid(cached: dict[int, int], heap: list[tuple[int, int]]) -> None:
    while cached.get(heap[0][1]) != -heap[0][0]:
        heapq.heappop(heap)


def _pop_furthest(cached: dict[int, int], heap: list[tuple[int, int]]) -> None:
    _top_valid(cached, heap)
    del cached[heapq.heappop(heap)[1]]


def belady_bypass(trace: Trace, capacities: list[int] | np.ndarray) -> float:
    """Offline-optimal hit rate (evict furthest next use; a miss may bypass the cache).

    `capacities`: per MoE layer [L], or per step and layer [S, L] for re-planned allocations
    (`SimResult.capacity_history`). Cold start: the caches begin empty.
    """
    caps = np.asarray(capacities)
    hits = total = 0
    for layer in range(trace.meta.num_moe_layers):
        experts, steps = requests(trace, layer)
        cap = caps[layer] if caps.ndim == 1 else caps[:, layer]
        hits += belady_layer(experts, steps, cap)
        total += len(experts)
    return hits / max(1, total)


def simulate_recipe(trace, recipe, *, profile: str | None = None):
    """Replay `trace` through a recipe's policies and budget (the runtime's budget kinds that
    count slots, sized for the traced model's shape; the recipe's stage capacity): (SimResult,
    Belady bound). A ValueError when the recipe's model (where it is on this machine) does
    not route like the trace."""
    from oled.offload.budget import shape_slots
    from oled.policies import with_oled_defaults
    from oled.policies.base import CostModel
    from oled.recipe.load import routes_unlike
    from oled.trace.simulate import belady_bypass, simulate

    meta = trace.meta
    mismatch = routes_unlike(meta, recipe.model.path)
    if mismatch is not None:
        raise ValueError(f"simulation: {mismatch}")
    try:
        slots = shape_slots(recipe.runtime.budget, meta.num_moe_layers, meta.num_experts)
    except ValueError as exc:
        raise ValueError(f"simulation: {exc}") from None
    cost_name = profile or recipe.runtime.cost
    if cost_name == "calibrate":
        raise ValueError("simulation needs a named cost profile: --profile h200 or cpu-ci")
    result = simulate(
        trace,
        total_slots=slots,
        cost=CostModel.profile(cost_name),
        stage_capacity=recipe.runtime.stage_capacity,
        **with_oled_defaults(**recipe.policy.build()),
    )
    bound = belady_bypass(trace, result.capacity_history)
    return result, bound
