"""Replay a trace through the Planner and policy objects with a modelled timeline; Belady bound.

Timeline of one MoE layer (all times in ms, from the layer's start t0 = previous layer's end +
cost.layer_ms): the GPU computes the hits at once (gpu_ms(hits)); copies run on one copy-engine
queue (copy_ms(copies + staged)), then the GPU computes the copied experts (gpu_ms(n)); the
CPU runs its experts one after another (cpu_layer_ms: the call, then cpu_ms(tokens) each) in
parallel. The layer ends when
the GPU and the CPU are both done. Copies ahead into the next layer queue behind the layer's
own; that layer's hits wait for them. Stall = time the GPU waits for copies (after its hits, or
before them for copies ahead).

Copies ahead (`prefetch_limit` > 0) come from `ahead_from`: "previous", what the next layer
routed the forward before (LayerPlan.ahead_*, planned with each layer); or "router", the next
layer's routing as the engine predicts it from the layer's router input, which traces record
(Trace.ahead): after planning layer l, where the planner predicts layer l + 1
(Planner.predicts), `Planner.prefetch(l + 1, recorded prediction, after=plan of l)`, as the
engine does. A trace that records no prediction replays no copies ahead from the router
(SimResult.ahead_source says so).

With several devices (`devices` > 1, runtime.devices), each device plans its contiguous share
of every layer's experts on its own planner, policies, budget (per device, over its share) and
queues (oled.policies.share); a layer ends when the slowest device is done and the pairs are
all-reduced (CostModel.allreduce_ms), and every device starts the next layer then.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np

from oled.policies import Policies
from oled.policies.base import (
    AllocationPolicy,
    CompensationPolicy,
    CostModel,
    Load,
    RetentionPolicy,
    StepContext,
    lowest,
)
from oled.policies.planner import AheadFrom, LayerPlan, Planner, PlannerStats, layer_times
from oled.policies.share import SharePlanner, share_ids
from oled.trace.format import Trace


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
    copy_ms_per_iteration: float  # link time per forward (modelled), copies ahead included
    hidden_copy_share: float  # of the link time, the share the GPU did not wait for
    ms_per_iteration: float  # mean modelled forward time
    p90_ms_per_iteration: float
    iterations: int
    capacities: list[int]  # at the end of the trace
    capacity_history: list[list[int]]  # [S][L] capacities each forward ran with
    # of the misses after a generation's first forward, the share that the same layer routed in
    # the forward before (what a prediction from that forward could have copied a forward early)
    misses_routed_before: float = 0.0
    stats: dict[str, list[int]] = field(default_factory=dict)  # summed over the devices
    devices: int = 1
    # each device's figures (its share's requests, hits, misses, copies, CPU experts, stall)
    per_device: list[dict[str, float]] = field(default_factory=list)
    allreduce_ms_per_iteration: float = 0.0  # modelled, within ms_per_iteration
    # where copies ahead came from: "router (recorded)" (the trace's recorded prediction),
    # "previous" (the forward before), "none (the trace records no prediction)" (ahead_from
    # "router" on a trace without one) or "none" (prefetch_limit 0)
    ahead_source: str = "none"
    ahead_per_iteration: float = 0.0  # copies ahead per forward (in copies_per_iteration)
    ahead_used_per_iteration: float = 0.0  # of those, experts the next layer then needed

    def to_dict(self) -> dict:
        """JSON-friendly."""
        return asdict(self)


@dataclass
class _Clock:
    """Copy-engine and CPU queues, as absolute times within the current forward."""

    copy_free: float = 0.0
    cpu_free: float = 0.0
    stall: float = 0.0
    copy_busy: float = 0.0  # link time, all forwards
    ahead: dict[int, float] = field(default_factory=dict)  # layer -> its copies ahead done

    def shift(self, t: float) -> None:
        """A new forward starts at `t` of the last one's clock."""
        self.copy_free = max(0.0, self.copy_free - t)
        self.cpu_free = max(0.0, self.cpu_free - t)
        self.ahead = {k: max(0.0, v - t) for k, v in self.ahead.items()}

    def layer(self, t0: float, plan: LayerPlan, cost: CostModel) -> float:
        """Advance through one layer (planner.layer_times from the queues' state); returns its
        end time."""
        ready = self.ahead.pop(plan.layer, t0)  # copies ahead into this layer's slots
        self.stall += max(0.0, ready - t0)
        copy_start = max(t0, self.copy_free)
        cpu_start = max(t0, self.cpu_free) if len(plan.cpu_experts) else t0
        hits_end, copy_done, gpu_end, cpu_end = layer_times(
            plan, cost, hits_start=max(t0, ready), copy_start=copy_start, cpu_start=cpu_start
        )
        if copy_done > copy_start:
            self.copy_free, self.copy_busy = copy_done, self.copy_busy + copy_done - copy_start
        if gpu_end > hits_end:  # experts that wait for this layer's copies
            self.stall += max(0.0, copy_done - hits_end)
        if len(plan.cpu_experts):
            self.cpu_free = cpu_end
        if len(plan.ahead_experts):
            self.copy_ahead(t0, plan.ahead_layer, len(plan.ahead_experts), cost)
        return max(gpu_end, cpu_end)

    def copy_ahead(self, t0: float, layer: int, n: int, cost: CostModel) -> None:
        """`n` copies ahead into `layer`'s slots, queued behind the copies issued so far in the
        layer that started at `t0`; `layer`'s hits wait for them."""
        ms = float(cost.copy_ms(n))
        self.copy_free = max(t0, self.copy_free) + ms
        self.copy_busy += ms
        self.ahead[layer] = self.copy_free


ROUTER_RECORDED = "router (recorded)"
NOT_RECORDED = "none (the trace records no prediction)"


def _ahead_source(trace: Trace, prefetch_limit: int, ahead_from: AheadFrom) -> str:
    """Where a simulation's copies ahead come from (SimResult.ahead_source)."""
    if prefetch_limit <= 0:
        return "none"
    if ahead_from == "previous":
        return "previous"
    return ROUTER_RECORDED if trace.ahead_ids is not None else NOT_RECORDED


def simulate(
    trace: Trace,
    *,
    allocation: AllocationPolicy,
    retention: RetentionPolicy,
    compensation: CompensationPolicy,
    cost: CostModel,
    total_slots: int,
    stage_capacity: int = 8,
    prefetch_limit: int = 0,
    ahead_from: AheadFrom = "router",
    devices: int = 1,
    fresh_policies: Callable[[], Policies] | None = None,
) -> SimResult:
    """Replay `trace` through a fresh Planner built from these policy objects. Copies ahead
    (`prefetch_limit` > 0) replay with ahead_from "previous" (the trace's own past forwards)
    and with "router" from the next-layer prediction the trace records (Trace.ahead); a trace
    that records none replays no copies ahead from the router (SimResult.ahead_source says
    which it was). `devices` > 1: each device its share
    of the experts, `total_slots` slots of its own and policies of its own: the first device
    the given ones, each other device `fresh_policies()` (new objects of the same policies),
    or copies of the given ones when it is None."""
    m = trace.meta
    if m.num_experts % devices:
        raise ValueError(f"{m.num_experts} experts per layer do not split over {devices} devices")
    given: Policies = {
        "allocation": allocation,
        "retention": retention,
        "compensation": compensation,
    }
    source = _ahead_source(trace, prefetch_limit, ahead_from)
    fresh = fresh_policies or partial(_copied, given)
    each = [given, *(fresh() for _ in range(1, devices))]  # copied before a planner holds one
    fleet = _Fleet(
        [
            _Device.make(
                trace,
                rank,
                devices,
                each[rank],
                cost=cost,
                total_slots=total_slots,
                stage_capacity=stage_capacity,
                prefetch_limit=prefetch_limit if source in ("previous", ROUTER_RECORDED) else 0,
                ahead_from=ahead_from,
            )
            for rank in range(devices)
        ],
        cost,
        trace,
        recorded=source == ROUTER_RECORDED,
    )
    drive(trace, fleet, on_step=fleet.on_step)
    result = fleet.result()
    result.ahead_source = source
    return result


def _copied(policies: Policies) -> Policies:
    """Copies of policy objects, for another device; a ValueError naming `fresh_policies` for
    those that cannot be copied."""
    try:
        return copy.deepcopy(policies)
    except TypeError as exc:
        names = ", ".join(type(p).__name__ for p in policies.values())
        raise ValueError(
            f"policies {names} cannot be copied for each device ({exc}): give fresh_policies"
        ) from None


class Driven(Protocol):
    """What `drive` drives: a Planner, or the devices of a simulation."""

    def end_block(self) -> object: ...
    def begin_step(self, *, step: int, block: int) -> None: ...
    def plan(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> object: ...
    def observe(
        self, layer: int, ids: np.ndarray, weights: np.ndarray, ctx: StepContext
    ) -> None: ...


@dataclass
class _Device:
    """One device of a simulation: its planner (of its share's experts, in their ids
    `local` [E], when there are several), queues and misses routed before."""

    planner: Planner
    local: np.ndarray | None
    before: _RoutedBefore
    clock: _Clock = field(default_factory=_Clock)

    @classmethod
    def make(
        cls,
        trace: Trace,
        rank: int,
        devices: int,
        policies: Policies,
        **settings: Any,
    ) -> _Device:
        m = trace.meta
        kind = Planner if devices == 1 else SharePlanner
        planner = kind.for_model(
            m.num_moe_layers, m.num_experts // devices, m.top_k, **policies, **settings
        )
        local = None if devices == 1 else share_ids(m.num_experts, devices, rank)
        return cls(planner, local, _RoutedBefore(m.num_moe_layers))

    def ids(self, ids: np.ndarray) -> np.ndarray:
        """Routing ids [T, K] in this device's expert ids."""
        return ids if self.local is None else self.local[ids]

    def plan(
        self,
        layer: int,
        ids: np.ndarray,
        weights: np.ndarray,
        t0: float,
        cost: CostModel,
        predicted: np.ndarray | None = None,
    ) -> float:
        """Plan the layer from `t0` under the load of this device's queues; its end time.
        `predicted`: the next layer's predicted routing ids [T, K] (global ids), copied ahead
        from behind this layer's copies where the planner predicts that layer."""
        load = Load(
            copy_queue_ms=max(0.0, self.clock.copy_free - t0),
            cpu_queue_ms=max(0.0, self.clock.cpu_free - t0),
        )
        planner = self.planner
        p = planner.plan(layer, self.ids(ids), weights, load)
        self.before.count(layer, p)
        end = self.clock.layer(t0, p, cost)
        if predicted is not None and planner.predicts(layer + 1):
            experts, _ = planner.prefetch(layer + 1, self.ids(predicted), after=p)
            if len(experts):
                self.clock.copy_ahead(t0, layer + 1, len(experts), cost)
        return end

    def figures(self, forwards: int) -> dict[str, float]:
        """This device's figures for the report."""
        st = self.planner.stats
        return {
            "requests": int(st.requests.sum()),
            "hits": int(st.hits.sum()),
            "misses": int(st.misses.sum()),
            "copies": int(st.copies.sum() + st.staged.sum()),
            "cpu_experts": int(st.cpu_experts.sum()),
            "stall_ms": float(self.clock.stall),
            "copy_ms_per_iteration": self.clock.copy_busy / max(1, forwards),
        }


class _Fleet:
    """The devices of a simulation, layer by layer: each plans its share; the layer ends when
    the slowest is done and (several devices) the pairs [T, K, H] fp32 are all-reduced."""

    def __init__(
        self, devices: list[_Device], cost: CostModel, trace: Trace, *, recorded: bool = False
    ) -> None:
        """`recorded`: copies ahead from the next-layer prediction the trace records."""
        self.devices, self.cost, self.trace = devices, cost, trace
        self.recorded = recorded
        self.predicted: list[np.ndarray] | None = None  # the forward's, per layer l < L - 1
        m = trace.meta
        self.step_ms = np.zeros(trace.num_steps)
        self.history = np.zeros((trace.num_steps, m.num_moe_layers), np.int64)
        self.allreduce = 0.0  # ms, all forwards
        self.t = 0.0

    def end_block(self) -> None:
        for d in self.devices:
            d.planner.end_block()

    def begin_step(self, *, step: int, block: int) -> None:
        for d in self.devices:
            d.planner.begin_step(step=step, block=block)

    def on_step(self, s: int, ctx: StepContext) -> None:
        """Forward `s` starts: the last one's time kept, every device's queues shifted."""
        if s:
            self.step_ms[s - 1] = self.t
        for d in self.devices:
            if s:
                d.clock.shift(self.t)
            if ctx.step == 0:  # a new generation: nothing routed before it
                d.before.reset()
        self.history[s] = np.sum([d.planner.capacities for d in self.devices], axis=0)  # [L]
        self.predicted = self.trace.ahead(s) if self.recorded else None
        self.t = 0.0

    def plan(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Plan one layer (routing ids, weights [T, K]) on every device, from the same start."""
        t0 = self.t + self.cost.layer_ms
        nxt = self.predicted
        predicted = nxt[layer] if nxt is not None and layer < len(nxt) else None
        end = max(d.plan(layer, ids, weights, t0, self.cost, predicted) for d in self.devices)
        pairs = ids.size * self.trace.meta.hidden_size * 4  # bytes of the [T, K, H] fp32 pairs
        ms = self.cost.allreduce_ms(pairs, len(self.devices))
        self.allreduce += ms
        self.t = end + ms

    def observe(self, layer: int, ids: np.ndarray, weights: np.ndarray, ctx: StepContext) -> None:
        for d in self.devices:
            d.planner.observe(layer, d.ids(ids), weights, ctx)

    def result(self) -> SimResult:
        """The simulation's result: counts summed over the devices, times of the slowest."""
        if self.trace.num_steps:
            self.step_ms[-1] = self.t
        devices = self.devices
        counters = np.sum([d.planner.state.counters for d in devices], axis=0)  # [L, C]
        clock = _Clock(
            stall=max(d.clock.stall for d in devices),
            copy_busy=max(d.clock.copy_busy for d in devices),
        )
        capacities = np.sum([d.planner.capacities for d in devices], axis=0)  # [L]
        result = _result(
            self.trace,
            PlannerStats(counters),
            capacities,
            self.step_ms,
            self.history,
            clock,
            self.cost,
        )
        misses = sum(d.before.misses for d in devices)
        seen = sum(d.before.seen for d in devices)
        result.misses_routed_before = seen / misses if misses else 0.0
        n = max(1, self.trace.num_steps)
        result.devices = len(devices)
        result.per_device = [d.figures(n) for d in devices] if len(devices) > 1 else []
        result.allreduce_ms_per_iteration = self.allreduce / n
        return result


def drive(
    trace: Trace,
    planner: Driven,
    on_step: Callable[[int, StepContext], None] | None = None,
) -> None:
    """Drive `planner` through every forward of `trace`: blocks ended where the block changes,
    each MoE layer planned (`planner.plan(layer, ids, weights)`; a Planner's with no load) and
    then observed; `on_step(s, ctx)` before forward s is planned."""
    prev_block = None
    for s, (ctx, routing) in enumerate(trace):
        if prev_block is not None and ctx.block != prev_block:
            planner.end_block()
        prev_block = ctx.block
        planner.begin_step(step=ctx.step, block=ctx.block)
        if on_step is not None:
            on_step(s, ctx)
        for layer, (ids, w) in enumerate(routing):
            planner.plan(layer, ids, w)
        for layer, (ids, w) in enumerate(routing):
            planner.observe(layer, ids, w, ctx)


def _result(
    trace: Trace,
    st: PlannerStats,
    capacities: np.ndarray,
    step_ms: np.ndarray,
    history: np.ndarray,
    clock: _Clock,
    cost: CostModel,
) -> SimResult:
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
        stall_ms=float(clock.stall),
        ahead_per_iteration=float(st.predicted.sum()) / n,
        ahead_used_per_iteration=float(st.predicted_hits.sum()) / n,
        copy_ms_per_iteration=clock.copy_busy / n,
        hidden_copy_share=1 - min(clock.stall, clock.copy_busy) / clock.copy_busy
        if clock.copy_busy
        else 1.0,
        ms_per_iteration=float(step_ms.mean()) if len(step_ms) else 0.0,
        p90_ms_per_iteration=float(np.percentile(step_ms, 90)) if len(step_ms) else 0.0,
        iterations=trace.num_steps,
        capacities=capacities.tolist(),
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


def belady_bypass(trace: Trace, capacities: list[int] | list[list[int]] | np.ndarray) -> float:
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


class ClairvoyantRetention(RetentionPolicy):
    """Belady's choice inside the planner (replays of `trace` only): the victims are the cached
    experts whose next use in the trace is furthest ahead (ties to the lower id). With
    transfer-only compensation, where a layer holds every expert a forward needs, it is the
    bound for any retention under the planner's rules (every miss cached, the forward's own
    experts kept), as Belady's with bypass is for any cache. Where a forward needs more, the
    overflow goes through the stage, and another policy may miss less."""

    def __init__(self, trace: Trace) -> None:
        L, S, E = trace.meta.num_moe_layers, trace.num_steps, trace.meta.num_experts
        step_of_row = np.repeat(np.arange(S), np.diff(trace.row_offsets))  # [rows]
        used = np.full((L, S + 1, E), np.inf, np.float32)  # [L, S + 1, E]: s where e is used
        used[np.arange(L)[:, None, None], step_of_row[None, :, None], trace.ids] = step_of_row[
            None, :, None
        ]
        # the next forward after s that uses e (inf: none), a running minimum from the end
        self.next_use = np.minimum.accumulate(used[:, :0:-1], axis=1)[:, ::-1]  # [L, S, E]
        self.forward = -1

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Before the trace's first forward."""
        super().reset(num_layers=num_layers, num_experts=num_experts)
        self.forward = -1

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray, step: int = 0) -> None:
        """Count the forwards: one call per layer and forward, in order."""
        self.forward += layer == 0

    def victims(self, layer: int, candidates: np.ndarray, n: int) -> np.ndarray:
        """The furthest next uses."""
        return lowest(-self.next_use[layer, self.forward], candidates, n)

    def reuse(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """1 / forwards until the next use (0 when never used again)."""
        return 1.0 / (self.next_use[layer, self.forward, experts] - self.forward)
