"""Compensation policies: per missed expert, copy it to the GPU (True) or run it on the CPU."""

from __future__ import annotations

import numpy as np

from oled.policies.base import CompensationPolicy, CostModel, Load
from oled.policies.state import InState, Kind, Stateful
from oled.registry import component


def best_split(
    *,
    cpu_cost: np.ndarray,
    order: np.ndarray,
    load: Load,
    cost: CostModel,
    future: np.ndarray | None = None,
) -> np.ndarray:
    """Copy the first k misses of `order`, the rest on the CPU; k minimises the objective.

    objective(k) = max(copy queue + copy_ms(k), cpu queue + CPU work of the rest)
                   + sum of `future` over the misses left on the CPU;
    the CPU work of a non-empty rest includes the layer's call (`cpu_call_ms`).
    Evaluated for every k at once with cumulative sums.
    """
    n = len(order)
    left = np.empty(n + 1)  # CPU work (plus future cost) left after copying the first k
    left[0] = 0.0
    obj = cpu_cost[order].cumsum(out=left[1:])
    cpu_left = load.cpu_queue_ms + (obj[-1] - left)  # [n + 1] CPU finish
    cpu_left[:-1] += cost.cpu_call_ms  # k < n leaves experts on the CPU
    copy_t = load.copy_queue_ms + cost.copy_ms(np.arange(n + 1))  # [n + 1] copy finish
    obj = np.maximum(copy_t, cpu_left)
    if future is not None:
        future[order].cumsum(out=left[1:])
        obj += left[-1] - left
    best = int(obj.argmin())
    out = np.zeros(n, bool)
    out[order[:best]] = True
    return out


def copying_all_is_best(cpu_cost: np.ndarray, load: Load, cost: CostModel) -> bool:
    """True when no CPU expert can finish before the copies of all misses would (the usual
    case in decoding): then k = n is the unique minimum of `best_split`'s objective for any
    future cost >= 0, since every k < n leaves at least the fastest CPU expert on the CPU."""
    n = len(cpu_cost)
    if not n:
        return False
    copy_all = load.copy_queue_ms + cost.copy_ms(n)
    fastest = float(cpu_cost.min())
    return fastest > 0 and load.cpu_queue_ms + cost.cpu_call_ms + fastest > copy_all


@component("compensation", "cooperative")
class CooperativeCompensation(CompensationPolicy):
    """OLED: load- and reuse-aware copy-or-CPU choice minimising the layer's finish time.

    Misses are ranked by what copying saves (their CPU time + future_weight x reuse x the copy
    cost of missing them again); the first k are copied, k minimising max(copy queue + copies,
    CPU queue + CPU work) + future_weight x reuse x copy cost of every miss left on the CPU.
    CPU work is counted `slowdown` times its cost-model time, for CPU experts slower in the
    engine than calibrated (with torch's CPU experts 2.2x, beside copies; in C the engine's time
    is 0.9-1.2x the model's, so the default is 1). `slowdown` is `cpu_slowdown`, so the same
    recipe decides the same on every run. Live adaptation is
    opt-in: with `learn_rate` > 0 it follows the engine's measured CPU-expert time over the
    cost model's (an average moving by `learn_rate` per measured layer), and decisions then
    depend on the moment's timings (`adaptive`).
    """

    compiled_as = Kind(5, "cooperative", {"future_weight": "double", "horizon": "double"})

    def __init__(
        self,
        *,
        future_weight: float = 1.0,
        horizon: int = 1,
        cpu_slowdown: float = 1.0,
        learn_rate: float = 0.0,
    ) -> None:
        if cpu_slowdown <= 0 or not 0 <= learn_rate <= 1:
            raise ValueError(
                f"cpu_slowdown must be > 0 and learn_rate in [0, 1], got {cpu_slowdown}, "
                f"{learn_rate}"
            )
        self.future_weight = future_weight
        self.horizon = horizon  # future iterations whose misses count (expected cost x horizon)
        self.cpu_slowdown = cpu_slowdown
        self.learn_rate = learn_rate
        self.slowdown = cpu_slowdown

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Forget what was learned: `slowdown` back to `cpu_slowdown`."""
        self.slowdown = self.cpu_slowdown

    @property
    def adaptive(self) -> bool:
        """Live adaptation is on (learn_rate > 0)."""
        return self.learn_rate > 0

    def observe_cpu(self, *, layer: int, modeled_ms: float, measured_ms: float) -> None:
        """Move `slowdown` towards measured / modeled (clipped to [0.25, 50])."""
        if modeled_ms > 0 and self.learn_rate:
            ratio = min(max(measured_ms / modeled_ms, 0.25), 50.0)
            self.slowdown += self.learn_rate * (ratio - self.slowdown)

    def decide(
        self,
        *,
        layer: int,
        experts: np.ndarray,
        tokens: np.ndarray,
        reuse: np.ndarray,
        load: Load,
        cost: CostModel,
    ) -> np.ndarray:
        """Greedy prefix split over the ranked misses."""
        cpu_cost = self.slowdown * np.asarray(cost.cpu_ms(tokens))  # misses have tokens > 0
        if self.future_weight * self.horizon >= 0 and copying_all_is_best(cpu_cost, load, cost):
            return np.ones(len(experts), bool)  # reuse >= 0, so the future cost is too
        miss_again = np.minimum(cpu_cost, cost.copy_ms_per_expert)
        future = (self.future_weight * self.horizon) * reuse * miss_again
        order = (-(cpu_cost + future)).argsort(kind="stable")
        return best_split(cpu_cost=cpu_cost, order=order, load=load, cost=cost, future=future)


@component("compensation", "makespan")
class MakespanCompensation(CompensationPolicy):
    """HybriMoE-style scheduler: heaviest misses to the GPU until CPU and copy queues balance."""

    compiled_as = Kind(4, "makespan")

    def __init__(self) -> None:
        pass

    def decide(
        self,
        *,
        layer: int,
        experts: np.ndarray,
        tokens: np.ndarray,
        reuse: np.ndarray,
        load: Load,
        cost: CostModel,
    ) -> np.ndarray:
        """Minimise max(copy finish, CPU finish)."""
        cpu_cost = np.asarray(cost.cpu_ms(tokens))  # misses have tokens > 0
        if copying_all_is_best(cpu_cost, load, cost):
            return np.ones(len(experts), bool)
        order = (-cpu_cost).argsort(kind="stable")
        return best_split(cpu_cost=cpu_cost, order=order, load=load, cost=cost)


@component("compensation", "batch_threshold")
class BatchThreshold(CompensationPolicy):
    """llama.cpp: copy an expert to the GPU when it has at least `min_tokens` tokens, else CPU."""

    compiled_as = Kind(3, "batch", {"min_tokens": "double"})

    def __init__(self, *, min_tokens: int = 32) -> None:
        self.min_tokens = min_tokens

    def decide(
        self,
        *,
        layer: int,
        experts: np.ndarray,
        tokens: np.ndarray,
        reuse: np.ndarray,
        load: Load,
        cost: CostModel,
    ) -> np.ndarray:
        """tokens >= min_tokens."""
        return np.asarray(tokens) >= self.min_tokens


@component("compensation", "transfer_only")
class TransferOnly(CompensationPolicy):
    """Copy every miss to the GPU (mixtral-offloading, MoE-Infinity)."""

    compiled_as = Kind(1, "transfer")

    def __init__(self) -> None:
        pass

    def decide(
        self,
        *,
        layer: int,
        experts: np.ndarray,
        tokens: np.ndarray,
        reuse: np.ndarray,
        load: Load,
        cost: CostModel,
    ) -> np.ndarray:
        """All True."""
        return np.ones(len(experts), bool)


@component("compensation", "cpu_only")
class CpuOnly(CompensationPolicy):
    """Run every miss on the CPU (Fiddler-style)."""

    compiled_as = Kind(2, "cpu")

    def __init__(self) -> None:
        pass

    def decide(
        self,
        *,
        layer: int,
        experts: np.ndarray,
        tokens: np.ndarray,
        reuse: np.ndarray,
        load: Load,
        cost: CostModel,
    ) -> np.ndarray:
        """All False."""
        return np.zeros(len(experts), bool)


@component("compensation", "resident")
class Resident(TransferOnly):
    """Every expert on the GPU: the cache is prefilled at load time; any miss is copied."""

    def prefill(self, *, layer: int, capacity: int) -> np.ndarray | None:
        """The first `capacity` expert ids (all of them when capacity == num_experts)."""
        return np.arange(capacity)


@component("compensation", "interval_refresh")
class IntervalRefresh(CpuOnly):
    """TIDE: every `interval` forwards each layer loads its experts with the most tokens.

    Between refreshes every miss runs on the CPU. At a refresh the layer's cache is reloaded with
    the (up to capacity) experts of that forward that have the most tokens.
    """

    compiled_as = Kind(6, "interval", {"interval": "int64_t", "min_tokens": "double"})

    def __init__(self, *, interval: int = 4, min_tokens: int = 1) -> None:
        self.interval = interval
        self.min_tokens = min_tokens  # experts below this token count are never loaded

    def refresh(
        self, *, layer: int, step: int, block: int, capacity: int, tokens: np.ndarray
    ) -> np.ndarray | None:
        """Top experts by token count on refresh forwards."""
        if step % self.interval:
            return None
        top = np.argsort(-tokens, kind="stable")[:capacity]
        return top[tokens[top] >= max(1, self.min_tokens)]


@component("compensation", "static_hot")
class StaticHot(Stateful, CpuOnly):
    """Fiddler / kTransformers: the hottest experts of a profile stay on the GPU; misses on the CPU.

    The profile is `counts` ([num_layers][num_experts] token counts) or, when absent, learned
    over the first `learn_blocks` blocks, after which the hot set is loaded once.
    """

    compiled_as = Kind(7, "static_hot", {"learn_blocks": "double"})

    learned = InState()  # [L, E] token counts so far
    seen = InState()  # [L] whether learned holds any forward
    loaded = InState()  # [L] whether the hot set is loaded

    def __init__(self, *, counts: list[list[float]] | None = None, learn_blocks: int = 1) -> None:
        self.counts = None if counts is None else np.asarray(counts, np.float64)
        self.learn_blocks = learn_blocks
        self.reset(num_layers=0, num_experts=0)

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Forget the learned profile."""
        self.own_state(num_layers=num_layers, num_experts=num_experts)
        self.learned.fill(0.0)
        self.seen.fill(0)
        self.loaded.fill(0)

    def _hot(self, counts: np.ndarray, capacity: int) -> np.ndarray:
        top = np.argsort(-counts, kind="stable")[:capacity]
        return top[counts[top] > 0]

    def prefill(self, *, layer: int, capacity: int) -> np.ndarray | None:
        """The profile's hottest experts, when a profile is given."""
        if self.counts is None:
            return None
        self.loaded[layer] = 1
        return self._hot(self.counts[layer], capacity)

    def refresh(
        self, *, layer: int, step: int, block: int, capacity: int, tokens: np.ndarray
    ) -> np.ndarray | None:
        """Learn during the first blocks, then load the hot set once."""
        if self.loaded[layer]:
            return None
        if block < self.learn_blocks:
            self.learned[layer] += tokens
            self.seen[layer] = 1
            return None
        self.loaded[layer] = 1
        return self._hot(
            self.learned[layer] if self.seen[layer] else tokens.astype(np.float64), capacity
        )
