"""Host decision path shared by the offload engine and the simulator.

Per MoE layer and forward, `Planner.plan` splits the routed experts into hits and misses, asks the
compensation policy copy-or-CPU for each miss, picks eviction victims with the retention policy,
and updates the layer's slot maps. Layers are MoE-layer indices in [0, num_layers).

This module is the reference. For the built-in policies `plan` runs compiled (oled.policies.native,
plan.c) over the same arrays, with the same decisions; any other policy plans here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from oled.policies import with_oled_defaults
from oled.policies.base import (
    AllocationPolicy,
    CompensationPolicy,
    CostModel,
    LayerStats,
    Load,
    RetentionPolicy,
    StepContext,
)
from oled.policies.state import COUNTERS, MAP_ROWS, STAGE, PlanState, Stateful

if TYPE_CHECKING:
    from oled.policies.native import CompiledPlan

HIT, COPIED, STAGED = MAP_ROWS.at.hit, MAP_ROWS.at.copied, MAP_ROWS.at.staged  # STAGED + round
STAGE_ROUNDS = STAGE.at.rounds  # one round's copies overlap the previous round's pass
K = COUNTERS.at  # the counters' columns by name
_EMPTY = np.zeros(0, np.int64)
_EMPTY_F = np.zeros(0, np.float64)
_NO_LOAD = Load()
AheadFrom = Literal["router", "previous"]
AHEAD_FROM: tuple[AheadFrom, ...] = ("router", "previous")


class ExpertCache:
    """One MoE layer's GPU expert cache: views of the layer's rows of the plan state.
    Made empty with `capacity` slots (the layer's rows cleared)."""

    def __init__(self, state: PlanState, layer: int, capacity: int) -> None:
        self.layer, self.capacity = layer, capacity
        self.num_experts = state.shape[1]
        self._n_free = state.n_free
        self.slot_of = state.slot_of[layer]  # [E] expert -> slot, -1 = not cached
        self.slot_of[:] = -1
        state.expert_in[layer] = -1
        self.expert_in = state.expert_in[layer, :capacity]  # [C] slot -> expert, -1 = free
        state.capacity[layer] = capacity
        self.n_free = capacity

    @property
    def n_free(self) -> int:
        """Free slots."""
        return int(self._n_free[self.layer])

    @n_free.setter
    def n_free(self, value: int) -> None:
        self._n_free[self.layer] = value

    def cached(self) -> np.ndarray:
        """Ids of the cached experts (slot order)."""
        if not self.n_free:  # full: every slot's expert
            return self.expert_in.astype(np.int64)
        return self.expert_in[self.expert_in >= 0].astype(np.int64)

    def free_slots(self) -> np.ndarray:
        """Indices of free slots."""
        return (self.expert_in < 0).nonzero()[0]

    def place(self, experts: np.ndarray, slots: np.ndarray) -> None:
        """Put experts in slots, dropping whatever those slots held."""
        old = self.expert_in[slots]
        held = old >= 0
        self.slot_of[old[held]] = -1
        self.n_free -= len(old) - int(np.count_nonzero(held))
        self.expert_in[slots] = experts
        self.slot_of[experts] = slots

    def check(self) -> None:
        """Assert that the two maps agree (for tests)."""
        cached = self.expert_in >= 0
        assert (self.slot_of[self.expert_in[cached]] == np.flatnonzero(cached)).all()
        inv = np.flatnonzero(self.slot_of >= 0)
        assert len(inv) == cached.sum()
        assert (self.expert_in[self.slot_of[inv]] == inv).all()
        assert self.n_free == len(self.free_slots())


@dataclass
class LayerPlan:
    """Decisions for one MoE layer in one forward."""

    layer: int
    slot_of: np.ndarray  # [E] int32: expert -> slot after this plan's copies (-1 = not cached)
    gpu_experts: np.ndarray  # computed from cache slots: hits + needed copied experts
    copy_experts: np.ndarray  # copies to issue now (may include refresh prefetches)
    copy_slots: np.ndarray  # their destination slots (the victims' slots are overwritten)
    stage_experts: np.ndarray  # copied into the scratch area, not cached
    stage_slots: np.ndarray  # their scratch slots: expert i goes in round i // stage_capacity
    cpu_experts: np.ndarray  # computed on the CPU
    cpu_tokens: np.ndarray  # tokens routed to each CPU expert
    hits: np.ndarray
    misses: np.ndarray
    evicted: np.ndarray  # experts dropped from the cache by this plan's copies
    predicted_hits: int = 0  # needed experts that were copied ahead for this forward
    map_rows: int = 0  # slot-map rows written (Planner.attach_maps), else 0
    # copies ahead into the next layer's cache, issued after this plan's copies (ahead_from
    # "previous": what that layer routed the forward before, on the link's spare time)
    ahead_layer: int = -1
    ahead_experts: np.ndarray = field(default_factory=lambda: _EMPTY)
    ahead_slots: np.ndarray = field(default_factory=lambda: _EMPTY)


def layer_times(
    plan: LayerPlan,
    cost: CostModel,
    *,
    hits_start: float = 0.0,
    copy_start: float = 0.0,
    cpu_start: float = 0.0,
) -> tuple[float, float, float, float]:
    """One layer's plan by the cost model, in ms: (hits done, copies done, GPU done, CPU done).
    The GPU computes the hits from `hits_start`, the copies (cache and stage) run back to back
    from `copy_start`, the experts they bring compute once they are done, and the CPU runs its
    experts one after another from `cpu_start` (the planner's spare link time and the
    simulator's timeline)."""
    n_hits = len(plan.hits)
    hits_end = hits_start + float(cost.gpu_ms(n_hits))
    copy_done = copy_start + float(cost.copy_ms(len(plan.copy_experts) + len(plan.stage_experts)))
    n_late = len(plan.gpu_experts) - n_hits + len(plan.stage_experts)
    gpu_end = max(hits_end, copy_done) + float(cost.gpu_ms(n_late)) if n_late else hits_end
    cpu_end = cpu_start + cost.cpu_layer_ms(plan.cpu_tokens)
    return hits_end, copy_done, gpu_end, cpu_end


def write_maps(maps: np.ndarray, plan: LayerPlan, stage_capacity: int) -> int:
    """The plan's expert -> slot maps into `maps` [R, E]: row HIT the slot of each cached
    expert not copied by this plan, COPIED the slots of the experts copied now, STAGED + r the
    stage slots of round r's staged experts; -1 elsewhere. Returns the rows written."""
    stage = plan.stage_experts
    rows = STAGED + (-(-len(stage) // stage_capacity) if stage_capacity else 0)
    maps[HIT] = plan.slot_of
    maps[COPIED:rows] = -1
    if len(plan.copy_experts):
        maps[HIT, plan.copy_experts] = -1
        maps[COPIED, plan.copy_experts] = plan.copy_slots
    if len(stage):
        maps[STAGED + np.arange(len(stage)) // stage_capacity, stage] = plan.stage_slots
    return rows


@dataclass
class Resize:
    """A layer's cache changes capacity; `keep` holds (old_slot, new_slot) of kept experts."""

    layer: int
    capacity: int
    keep: np.ndarray  # [N, 2] int32


class PlannerStats:
    """Per-layer counters (the plan state's, COUNTERS); each name in `counters()` reads as an
    [L] int64 array.

    plans, requests (distinct experts needed), hits, misses, copies (into cache slots, incl.
    prefetches), prefetches (copies of experts that forward did not need), staged, cpu_experts,
    cpu_tokens, evictions, predicted (copies a layer ahead from the predicted routing: also
    in copies), predicted_hits (of those, experts the forward then needed).
    """

    def __init__(self, counters: np.ndarray) -> None:
        self.counters_array = counters  # [L, len(COUNTERS)]: the plan state's
        self.num_layers = len(counters)

    def __getattr__(self, name: str) -> np.ndarray:
        i = COUNTERS.entries.get(name)
        if i is None:
            raise AttributeError(name)
        return self.counters_array[:, i].copy()

    @staticmethod
    def counters() -> tuple[str, ...]:
        """Names of the counters."""
        return COUNTERS.names

    def hit_rate(self) -> float:
        """Hits over requests, all layers."""
        return float(self.hits.sum() / max(1, self.requests.sum()))

    def to_dict(self) -> dict[str, list[int]]:
        """JSON-friendly counters."""
        return {n: getattr(self, n).tolist() for n in COUNTERS.names}


def _most(counts: np.ndarray, experts: np.ndarray, n: int) -> np.ndarray:
    """At most n of `experts`: all of them in their order when they are n or fewer, else the n
    with the most `counts` [E] (ties in their order)."""
    if len(experts) <= n:
        return experts
    return experts[np.argsort(-counts[experts], kind="stable")[:n]]


class CopyAhead:
    """Per layer, whether copies ahead from the predicted routing pay: an EMA of the share of a
    layer's predicted experts that the layer then needed. Below `min_use` a layer copies
    nothing ahead and predicts only every `probe`-th forward, to score the prediction anew; so
    does a layer whose last copies ahead found no spare link time (`room`). A prediction is
    scored whether or not its experts were copied."""

    def __init__(
        self,
        num_layers: int,
        limit: int,
        *,
        min_use: float = 0.5,
        probe: int = 8,
        alpha: float = 0.2,
    ) -> None:
        if limit < 0:
            raise ValueError(f"prefetch_limit must be >= 0, got {limit}")
        self.limit, self.min_use, self.probe, self.alpha = limit, min_use, probe, alpha
        self.use = [1.0] * num_layers  # starts by copying ahead
        self.room = [True] * num_layers  # the link had spare time for the last copies ahead
        self._pending: list[np.ndarray | None] = [None] * num_layers  # predicted, not scored
        self._copied = [False] * num_layers

    def predicts(self, layer: int, step: int) -> bool:
        """Whether `layer`'s routing is to be predicted in forward `step`: while its copies ahead
        pay and the link had room for the last ones, else every `probe`-th forward."""
        probing = step % self.probe == 0
        return self.limit > 0 and ((self.copies(layer) and self.room[layer]) or probing)

    def copies(self, layer: int) -> bool:
        return self.use[layer] >= self.min_use

    def remember(self, layer: int, experts: np.ndarray, *, copied: bool) -> None:
        """The layer's predicted misses (copied ahead or only scored)."""
        self._pending[layer], self._copied[layer] = experts, copied

    def forget(self, layer: int) -> None:
        """Drop the layer's pending prediction unscored (its cache was rebuilt)."""
        self._pending[layer] = None

    def score(self, layer: int, used: np.ndarray) -> int:
        """Score the pending prediction against the experts the layer needs (`used` [E],
        nonzero where needed); the needed ones among those copied ahead (0 when nothing was
        copied)."""
        ahead, self._pending[layer] = self._pending[layer], None
        if ahead is None or not len(ahead):
            return 0
        hits = int(np.count_nonzero(used[ahead]))
        self.use[layer] += self.alpha * (hits / len(ahead) - self.use[layer])
        return hits if self._copied[layer] else 0


class Planner:
    """Per-layer hit/miss planning over fixed-slot expert caches.

    Copies ahead (`prefetch_limit` > 0 experts per layer at most) come from `ahead_from`:
    "router", the next layer's routing predicted by the engine (Planner.prefetch); or
    "previous", what the next layer routed the forward before, planned with each layer on the
    link's spare time (LayerPlan.ahead_*)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_experts: int,
        top_k: int,
        total_slots: int,
        stage_capacity: int,
        allocation: AllocationPolicy,
        retention: RetentionPolicy,
        compensation: CompensationPolicy,
        cost: CostModel,
        stats_alpha: float = 0.2,
        prefetch_limit: int = 0,
        ahead_from: AheadFrom = "router",
        compiled: bool | None = None,
    ) -> None:
        if ahead_from not in AHEAD_FROM:
            raise ValueError(f"unknown ahead_from {ahead_from!r}; choose from router, previous")
        if total_slots < num_layers:
            raise ValueError(
                f"expert budget of {total_slots} slots is below the minimum of {num_layers} "
                f"(one slot per MoE layer)"
            )
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.total_slots = min(total_slots, num_layers * num_experts)
        if stage_capacity < 0:
            raise ValueError(f"stage_capacity must be >= 0, got {stage_capacity}")
        self.stage_capacity = stage_capacity
        self.ahead = CopyAhead(num_layers, prefetch_limit, alpha=stats_alpha)
        self.ahead_from = ahead_from
        self._routed: list[np.ndarray | None] = [None] * num_layers  # [E] counts, last forward
        self.allocation, self.retention, self.compensation = allocation, retention, compensation
        self.cost = cost
        self.stats_alpha = stats_alpha
        self.step = 0  # the forward of the generation
        self.block = 0
        self.clock = 0  # forwards since the planner began, across generations (recency)
        self.gpu_only = False  # every miss copied, whatever the compensation says
        self.state = PlanState(num_layers=num_layers, num_experts=num_experts)  # once
        self.stats = PlannerStats(self.state.counters)
        for policy in (retention, compensation):
            if isinstance(policy, Stateful):  # the built-ins: views of the plan state
                policy.attach(self.state)
        retention.reset(num_layers=num_layers, num_experts=num_experts)
        compensation.reset(num_layers=num_layers, num_experts=num_experts)
        self.capacities = self._allocate(None)
        self.caches = [ExpertCache(self.state, i, c) for i, c in enumerate(self.capacities)]
        for layer, cap in enumerate(self.capacities):
            warm = compensation.prefill(layer=layer, capacity=cap)
            if warm is not None:
                self.prefill(layer, warm)
        self._maps: np.ndarray | None = None
        self.native = self._compile(compiled)

    @classmethod
    def for_model(
        cls,
        num_layers: int,
        num_experts: int,
        top_k: int,
        total_slots: int,
        *,
        stage_capacity: int,
        cost: CostModel,
        allocation: AllocationPolicy | None = None,
        retention: RetentionPolicy | None = None,
        compensation: CompensationPolicy | None = None,
        prefetch_limit: int = 0,
        ahead_from: AheadFrom = "router",
        compiled: bool | None = None,
    ) -> Planner:
        """A planner for `num_layers` MoE layers of `num_experts` experts (top-k routing) over
        `total_slots` cache slots, with the given policies and OLED's own where one is None
        (oled.policies.with_oled_defaults); `ahead_from`, `compiled` as in Planner."""
        policies = with_oled_defaults(
            allocation=allocation, retention=retention, compensation=compensation
        )
        return cls(
            num_layers=num_layers,
            num_experts=num_experts,
            top_k=top_k,
            total_slots=total_slots,
            stage_capacity=stage_capacity,
            cost=cost,
            prefetch_limit=prefetch_limit,
            ahead_from=ahead_from,
            compiled=compiled,
            **policies,
        )

    def _compile(self, compiled: bool | None) -> CompiledPlan | None:
        """The compiled plan when wanted (None: where available) and the policies allow it."""
        if compiled is False:
            return None
        from oled.policies import native

        why = native.unsupported(self.retention, self.compensation)
        if why is not None:  # policies of one's own plan in Python
            if compiled:
                raise native.NativeUnavailable(f"compiled planner unavailable: {why}")
            return None
        try:
            return native.CompiledPlan(self)
        except native.NativeUnavailable as e:
            if compiled:
                raise
            warnings.warn(f"compiled planner unavailable, planning in Python: {e}", stacklevel=3)
            return None

    def attach_maps(self, maps: np.ndarray) -> None:
        """From now on every plan also writes its layer's expert -> slot maps into `maps`
        [L, R, E] int64 (C-contiguous, R >= slot_map_rows; see write_maps)
        and says in `map_rows` how many rows it wrote."""
        if maps.dtype != np.int64 or not maps.flags.c_contiguous or maps.ndim != 3:
            raise ValueError("slot maps must be a C-contiguous [L, R, E] int64 array")
        need = (self.num_layers, self.slot_map_rows, self.num_experts)
        if maps.shape[0] != need[0] or maps.shape[1] < need[1] or maps.shape[2] != need[2]:
            raise ValueError(
                f"slot maps of shape {maps.shape}: need [{need[0]}, >= {need[1]}, {need[2]}]"
            )
        self._maps = maps
        if self.native is not None:
            self.native.attach_maps(maps)

    @property
    def stage_rows(self) -> int:
        """The stage's slots: STAGE_ROUNDS rounds of stage_capacity experts."""
        return STAGE_ROUNDS * self.stage_capacity

    @property
    def slot_map_rows(self) -> int:
        """The most slot-map rows a plan writes: HIT, COPIED and one per stage round."""
        rounds = -(-self.num_experts // self.stage_capacity) if self.stage_capacity else 0
        return STAGED + rounds

    @property
    def compiled(self) -> bool:
        """Whether plans run compiled (oled.policies.native)."""
        return self.native is not None

    @property
    def adaptive(self) -> bool:
        """Whether a policy follows live measured times (decisions may differ between runs)."""
        return self.compensation.adaptive

    # -- allocation -------------------------------------------------------------------------

    def _allocate(self, stats: LayerStats | None) -> list[int]:
        caps = [
            int(c)
            for c in self.allocation.allocate(
                total_slots=self.total_slots,
                num_layers=self.num_layers,
                num_experts=self.num_experts,
                stats=stats,
            )
        ]
        if len(caps) != self.num_layers or sum(caps) > self.total_slots:
            raise ValueError(f"allocation {caps} does not fit {self.total_slots} slots")
        if min(caps) < 1 or max(caps) > self.num_experts:
            raise ValueError(f"allocation {caps} has a layer outside [1, {self.num_experts}]")
        return caps

    def end_block(self) -> list[Resize] | None:
        """Re-plan the allocation at a block boundary; None when nothing changes."""
        if not self.allocation.replan:
            return None
        stats = self.layer_stats
        caps = self._allocate(stats if stats.ready else None)
        if caps == self.capacities:
            return None
        resizes = [
            self._resize(layer, cap)
            for layer, cap in enumerate(caps)
            if cap != self.capacities[layer]
        ]
        self.capacities = caps
        return resizes

    def _resize(self, layer: int, capacity: int) -> Resize:
        old = self.caches[layer]
        self.ahead.forget(layer)
        cached = old.cached()
        if len(cached) > capacity:
            drop = self.retention.victims(layer, cached, len(cached) - capacity)
            keep_mask = np.ones(self.num_experts, bool)
            keep_mask[drop] = False
            cached = cached[keep_mask[cached]]
            self.state.counters[layer, K.evictions] += len(drop)
        old_slots = old.slot_of[cached].astype(np.int64)  # a copy: the rows are cleared below
        stay = old_slots < capacity
        new_slots = old_slots.copy()
        free = np.setdiff1d(np.arange(capacity), old_slots[stay])
        new_slots[~stay] = free[: int((~stay).sum())]
        new = ExpertCache(self.state, layer, capacity)
        new.place(cached, new_slots)
        self.caches[layer] = new
        keep = np.stack([old_slots, new_slots], axis=1).astype(np.int32)
        return Resize(layer=layer, capacity=capacity, keep=keep)

    # -- per forward ------------------------------------------------------------------------

    @property
    def prefetch_limit(self) -> int:
        """Experts per layer copied ahead (0 = none)."""
        return self.ahead.limit

    @contextmanager
    def all_on_device(self) -> Iterator[None]:
        """Within: every miss is copied (no CPU experts), so the engine computes what the
        all-resident model does, bit for bit."""
        before, self.gpu_only = self.gpu_only, True
        try:
            yield
        finally:
            self.gpu_only = before

    def begin_step(self, *, step: int, block: int) -> None:
        """Optional: name the forward about to run (else inferred from `observe`); step 0 starts
        a generation, with no forward before it to copy ahead from."""
        self._to_step(step, block)
        if step == 0:
            self._routed = [None] * self.num_layers

    def prefill(self, layer: int, experts: np.ndarray) -> None:
        """Warm a cache at load time (no copy counted): fills free slots in the given order."""
        cache = self.caches[layer]
        experts = np.asarray(experts, np.int64)
        experts = experts[cache.slot_of[experts] < 0]
        _, first = np.unique(experts, return_index=True)
        experts = experts[np.sort(first)]
        free = cache.free_slots()
        n = min(len(free), len(experts))
        cache.place(experts[:n], free[:n])
        self.retention.on_insert(layer, experts[:n])

    def observe(self, layer: int, ids: np.ndarray, weights: np.ndarray, ctx: StepContext) -> None:
        """After decoding: hand the forward's routing and token states to the retention policy."""
        self.retention.observe(layer, ids, weights, ctx)
        if ctx.step + 1 > self.step:
            self._to_step(ctx.step + 1, ctx.block)

    def _to_step(self, step: int, block: int) -> None:
        """Move to forward `step`; the clock advances with it and never goes back: a new
        generation (a step below the current one) is one forward after the last."""
        self.clock += step - self.step if step >= self.step else step + 1
        self.step, self.block = step, block

    def observe_cpu(self, layer: int, cpu_tokens: np.ndarray, measured_ms: float) -> float:
        """The engine's time for a layer's CPU experts (tokens per expert) to the compensation
        policy, beside the cost model's; the cost model's time."""
        modeled = self.cost.cpu_layer_ms(cpu_tokens)
        self.compensation.observe_cpu(layer=layer, modeled_ms=modeled, measured_ms=measured_ms)
        return modeled

    def plan(
        self, layer: int, ids: np.ndarray, weights: np.ndarray, load: Load | None = None
    ) -> LayerPlan:
        """Plan one MoE layer for one forward: routing ids/weights [T, K]; with ahead_from
        "previous", also the copies ahead into the next layer (LayerPlan.ahead_*)."""
        if self.native is not None:
            plan = self.native.plan(layer, ids, weights, load)
        else:
            plan = self._plan(layer, ids, weights, load)
        if self.allocation.routing:
            self.allocation.route(layer, ids)
        if self.ahead_from == "previous" and self.ahead.limit:
            self._ahead_from_previous(layer, ids, plan)
        return plan

    def _plan(
        self, layer: int, ids: np.ndarray, weights: np.ndarray, load: Load | None
    ) -> LayerPlan:
        """The reference plan (plan.c computes the same)."""
        cache, ret = self.caches[layer], self.retention
        # few numpy calls: on the hot path each costs microseconds (its code is cold there)
        counts = np.bincount(ids.reshape(-1), minlength=self.num_experts)  # [E] tokens per expert
        needed = counts.nonzero()[0]  # counts doubles as the "needed" mask below
        missed = cache.slot_of[needed] < 0
        misses = needed[missed]
        hits = needed[~missed] if len(misses) else needed
        self._measure(layer, counts, needed)
        ret.route(layer, ids, weights, self.clock)
        if len(hits):
            ret.on_hit(layer, hits, self.clock)
        prefetch, protect, want, want_reuse, cpu = self._decide(layer, counts, misses, load)
        order, copy_experts, copy_slots, victims = self._fill(
            layer, prefetch, want, want_reuse, protect
        )
        over, cpu = self._overflow(order[len(copy_slots) :], counts, cpu)
        copied = copy_experts[counts[copy_experts] > 0] if len(prefetch) else copy_experts
        plan = LayerPlan(
            layer=layer,
            slot_of=cache.slot_of.copy(),
            gpu_experts=np.concatenate([hits, copied]) if len(copied) else hits,
            copy_experts=copy_experts,
            copy_slots=copy_slots,
            stage_experts=over,
            stage_slots=self._stage_slots(len(over)),
            cpu_experts=cpu,
            cpu_tokens=counts[cpu] if len(cpu) else _EMPTY,
            hits=hits,
            misses=misses,
            evicted=victims,
        )
        plan.predicted_hits = self._count(layer, plan, counts, len(needed), len(copied))
        if self._maps is not None:
            plan.map_rows = write_maps(self._maps[layer], plan, self.stage_capacity)
        return plan

    def _fill(
        self,
        layer: int,
        prefetch: np.ndarray,
        want: np.ndarray,
        want_reuse: np.ndarray,
        protect: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Cache slots for the refresh targets, then the wanted copies: free ones first, then
        victims' (cached, not needed, not refresh targets); the highest reuse first when not all
        fit. Places those that got a slot; returns (order: everything to load, the experts
        placed: order's first ones, their slots, the victims)."""
        n_want = len(prefetch) + len(want)
        copy_slots, victims = self._room(layer, n_want, protect)
        n_cache = len(copy_slots)
        if n_cache < n_want and len(want) > 1:  # not all fit: highest reuse into the cache
            want = want[(-want_reuse).argsort(kind="stable")]
        order = np.concatenate([prefetch, want]) if len(prefetch) else want
        copy_experts = order[:n_cache]
        if n_cache:
            self.caches[layer].place(copy_experts, copy_slots)
            self.retention.on_insert(layer, copy_experts)
        return order, copy_experts, copy_slots, victims

    def _overflow(
        self, rest: np.ndarray, counts: np.ndarray, cpu: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """What found no cache slot (`rest`, in order): needed copies go through the scratch
        stage (in rounds of stage_capacity when there are more of them than stage slots), or
        to the CPU when there is no stage; prefetches drop. Returns (staged, cpu experts)."""
        if not len(rest):
            return _EMPTY, cpu
        over = rest[counts[rest] > 0]
        if not self.stage_capacity:
            return _EMPTY, np.concatenate([cpu, over])
        return over, cpu

    def _stage_slots(self, n: int) -> np.ndarray:
        """The stage slots of n staged experts: expert i, in round r = i // stage_capacity,
        in slot i % stage_capacity of the round's part of the stage (r % STAGE_ROUNDS)."""
        if not n:
            return _EMPTY
        i, cap = np.arange(n, dtype=np.int64), self.stage_capacity
        return i % cap + cap * (i // cap % STAGE_ROUNDS)

    def _count(
        self, layer: int, plan: LayerPlan, counts: np.ndarray, n_needed: int, n_copied: int
    ) -> int:
        """Add a plan to the layer's counters (`n_copied`: the copied experts it needed);
        returns its predicted hits (CopyAhead.score)."""
        c = self.state.counters[layer]
        predicted_hits = self.ahead.score(layer, counts)  # of those copied at the layer before
        n_cache, n_cpu = len(plan.copy_experts), len(plan.cpu_experts)
        c[K.predicted_hits] += predicted_hits
        c[K.plans] += 1
        c[K.requests] += n_needed
        c[K.hits] += len(plan.hits)
        c[K.misses] += len(plan.misses)
        c[K.copies] += n_cache
        c[K.prefetches] += n_cache - n_copied
        c[K.staged] += len(plan.stage_experts)
        c[K.cpu_experts] += n_cpu
        c[K.cpu_tokens] += int(plan.cpu_tokens.sum()) if n_cpu else 0
        c[K.evictions] += len(plan.evicted)
        return predicted_hits

    def predicts(self, layer: int) -> bool:
        """Whether the engine should predict `layer`'s routing in this forward (CopyAhead)."""
        return self.ahead.predicts(layer, self.step)

    def prefetch(
        self, layer: int, ids: np.ndarray, after: LayerPlan | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Copy ahead for `layer`'s coming forward: the experts that its predicted routing ids
        [T, K] names and its cache lacks (Planner._copy_ahead, at most `prefetch_limit`; with
        `after`, the plan of the layer before, no more than the link's spare time behind its
        copies holds, spare_copies); (experts, slots) to copy now."""
        counts = np.bincount(ids.reshape(-1), minlength=self.num_experts)  # [E]
        limit = self.prefetch_limit
        if after is not None:
            limit = min(limit, self.spare_copies(after))
        return self._copy_ahead(layer, counts, limit)

    def _copy_ahead(
        self, layer: int, counts: np.ndarray, limit: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """The experts that `counts` [E] (predicted tokens per expert) names and `layer`'s cache
        lacks, most tokens first, at most `limit`, placed into free slots or those of cached
        experts the prediction does not name; (experts, slots) to copy now. None are copied
        while the layer's predictions have not paid (CopyAhead); they are only scored then."""
        cache = self.caches[layer]
        named = counts > 0
        want = _most(counts, (named & (cache.slot_of < 0)).nonzero()[0], self.prefetch_limit)
        self.ahead.room[layer] = limit > 0
        if not limit or not len(want) or not self.ahead.copies(layer):
            self.ahead.remember(layer, want, copied=False)  # scored all the same
            return _EMPTY, _EMPTY
        want = _most(counts, want, limit)
        slots, victims = self._room(layer, len(want), named)
        experts = want[: len(slots)]
        if len(experts):
            cache.place(experts, slots)
            self.retention.on_insert(layer, experts)
        self.ahead.remember(layer, experts, copied=True)
        c = self.state.counters[layer]
        c[K.copies] += len(experts)
        c[K.evictions] += len(victims)
        c[K.predicted] += len(experts)
        return experts, slots

    def _ahead_from_previous(self, layer: int, ids: np.ndarray, plan: LayerPlan) -> None:
        """Into `plan`: copies ahead for the next layer of what it routed the forward before,
        as many as the link's spare time holds (spare_copies), at most `prefetch_limit`. Then
        remember this layer's routing for the next forward."""
        nxt, routed = layer + 1, self._routed
        before = routed[nxt] if nxt < self.num_layers else None
        if before is not None:
            n = min(self.spare_copies(plan), self.prefetch_limit)
            experts, slots = self._copy_ahead(nxt, before, n)
            if len(experts):
                plan.ahead_layer, plan.ahead_experts, plan.ahead_slots = nxt, experts, slots
        routed[layer] = np.bincount(ids.reshape(-1), minlength=self.num_experts)  # [E]

    def spare_copies(self, plan: LayerPlan) -> int:
        """Copies that fit, by the cost model, between the end of `plan`'s copies and the
        next layer's demand copies (its layer end plus the work between layers), so that
        copies ahead never delay a demand miss when the model holds."""
        c = self.cost
        _, copy_done, gpu_end, cpu_end = layer_times(plan, c)
        spare = max(gpu_end, cpu_end) + c.layer_ms - copy_done - c.copy_fixed_ms
        return max(0, int(spare // c.copy_ms_per_expert)) if c.copy_ms_per_expert > 0 else 0

    def _room(self, layer: int, n: int, protect: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Up to n cache slots for new experts: free ones first, then those of the retention
        policy's victims among the cached experts where `protect` [E] is zero; (slots,
        victims)."""
        if not n:
            return _EMPTY, _EMPTY
        cache = self.caches[layer]
        free = cache.free_slots() if cache.n_free else _EMPTY
        if n <= len(free):
            return free[:n], _EMPTY
        cand = cache.cached()
        cand = cand[protect[cand] == 0]
        victims = self.retention.victims(layer, cand, min(n - len(free), len(cand)))
        if not len(victims):
            return free, _EMPTY
        return np.concatenate([free, cache.slot_of[victims]]), victims

    def _decide(
        self,
        layer: int,
        counts: np.ndarray,
        misses: np.ndarray,
        load: Load | None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Refresh targets, then one copy-or-CPU decision per remaining miss.

        Returns (prefetch: refresh targets to load, protect: [E] never evicted where nonzero
        (this forward's token counts, plus the refresh targets), want: misses to copy, their
        reuse, cpu: misses for the CPU).
        """
        cache = self.caches[layer]
        refresh = self.compensation.refresh(
            layer=layer, step=self.step, block=self.block, capacity=cache.capacity, tokens=counts
        )
        protect, prefetch, rest = counts, _EMPTY, misses
        if refresh is not None and len(refresh):
            refresh = np.asarray(refresh, np.int64)[: cache.capacity]
            protect = counts.copy()
            protect[refresh] = 1
            prefetch = refresh[cache.slot_of[refresh] < 0]
            loading = np.zeros(self.num_experts, bool)
            loading[prefetch] = True
            rest = misses[~loading[misses]]
        if not len(rest):
            return prefetch, protect, _EMPTY, _EMPTY_F, _EMPTY
        reuse = self.retention.reuse(layer, rest)
        if self.gpu_only:
            return prefetch, protect, rest, reuse, _EMPTY
        copy = self.compensation.decide(
            layer=layer,
            experts=rest,
            tokens=counts[rest],
            reuse=reuse,
            load=load or _NO_LOAD,
            cost=self.cost,
        )
        return prefetch, protect, rest[copy], reuse[copy], rest[~copy]

    def _measure(self, layer: int, counts: np.ndarray, needed: np.ndarray) -> None:
        st = self.state
        n, k, a = len(needed), int(st.samples[layer]), self.stats_alpha
        ws = float(st.working_set[layer])
        st.working_set[layer] = n if k == 0 else ws + a * (n - ws)
        if k:  # overlap needs a previous forward
            overlap = int(np.count_nonzero(st.last_counts[layer][needed])) / n if n else 0.0
            r = float(st.reuse[layer])
            st.reuse[layer] = overlap if k == 1 else r + a * (overlap - r)
        st.samples[layer] = k + 1
        st.last_counts[layer] = counts  # nonzero where used

    # -- measurements: the plan state's arrays, updated in place by every plan; read them

    @property
    def working_set(self) -> np.ndarray:
        """[L] float64: each layer's EMA of the distinct experts a forward needs."""
        return self.state.working_set

    @property
    def reuse(self) -> np.ndarray:
        """[L] float64: each layer's EMA of the share of its experts the previous forward
        needed too."""
        return self.state.reuse

    @property
    def samples(self) -> np.ndarray:
        """[L] int64: the forwards each layer has measured."""
        return self.state.samples

    @property
    def last_counts(self) -> np.ndarray:
        """[L, E] int64: each layer's tokens per expert in its last forward."""
        return self.state.last_counts

    @property
    def layer_stats(self) -> LayerStats:
        """Measured working set and reuse per layer (what the allocation policy sees)."""
        st = self.state
        return LayerStats(
            working_set=st.working_set.copy(), reuse=st.reuse.copy(), samples=st.samples.copy()
        )
