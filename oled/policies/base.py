"""Device-free policy interfaces: step context, cost model, load, policy ABCs.

Policies see expert ids, gate weights, token confidences and queue load; they return decisions.
They never touch tensors on a device, so the engine and the simulator share the same objects.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields, replace
from typing import ClassVar, overload

import numpy as np

from oled.policies.state import Kind
from oled.registry import registry, suggest


@dataclass(frozen=True)
class StepContext:
    """One forward: indices and, per routed row, the token's state and confidence after decoding."""

    block: int
    iteration: int  # within the block (0 = first forward of the block)
    step: int  # over the whole generation
    token_state: np.ndarray  # [T] int8: oled.token_states (fixed, masked, committed)
    confidence: np.ndarray  # [T] float32; 1.0 for fixed rows
    prefix: np.ndarray | None = None  # [T] bool: pending prefix rows (None: all rows but the
    # last block_length, as in one sequence's forward; a batched forward names them)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


_MIB = 1 << 20


def _h200() -> CostModel:
    # DESIGN.md section 5: pinned copy ~0.13 ms per 6 MiB expert (46-53 GB/s);
    # grouped GEMM 0.11/0.13/0.20/0.30/0.38 ms at 8/32/64/128/256 distinct experts;
    # routing + one host sync per MoE layer: 8.8 ms / 19 layers.
    # CPU experts through the C kernel (oled/native), as the engine calibrated them on an H200
    # machine (docs/bench/run37-h200-costs.json): 0.072 ms + 0.007 ms per token an expert, and
    # 0.248 ms a layer's call (the activations to the host, the hand-off, the result back).
    cpu_fixed, cpu_tok = 0.072, 0.007
    gpu_fixed, gpu_exp = _fit_line([8, 32, 64, 128, 256], [0.11, 0.13, 0.20, 0.30, 0.38])
    return CostModel(
        copy_ms_per_expert=0.125,
        copy_fixed_ms=0.01,
        cpu_fixed_ms=cpu_fixed,
        cpu_ms_per_token=cpu_tok,
        gpu_fixed_ms=gpu_fixed,
        gpu_ms_per_expert=gpu_exp,
        expert_bytes=6 * _MIB,
        layer_ms=0.46,
        cpu_call_ms=0.248,
        # experts of more than 8 tokens run through torch's products: 0.277 and 0.310 ms at 4 and
        # 8 tokens on a 16-core H100 host (run 27: 22.7 and 20.3 GB/s), the line through them;
        # not calibrated above 8 tokens
        cpu_many_fixed_ms=0.244,
        cpu_many_ms_per_token=0.0083,
    )


def _cpu_ci() -> CostModel:
    # A 2-core CPU-only run: "copies" are memcpy into a slot table, experts run in fp32 on 2 cores.
    return CostModel(
        copy_ms_per_expert=1.5,
        copy_fixed_ms=0.05,
        cpu_fixed_ms=2.0,
        cpu_ms_per_token=0.1,
        gpu_fixed_ms=0.5,
        gpu_ms_per_expert=1.0,
        expert_bytes=6 * _MIB,
        layer_ms=2.0,
    )


@dataclass(frozen=True)
class CostModel:
    """Modelled costs in milliseconds of copies, CPU experts and GPU expert compute."""

    copy_ms_per_expert: float
    copy_fixed_ms: float
    cpu_fixed_ms: float
    cpu_ms_per_token: float
    gpu_fixed_ms: float
    gpu_ms_per_expert: float
    expert_bytes: int
    layer_ms: float = 0.0  # non-expert work per MoE layer (attention, router, host sync)
    # once per layer that computes any expert on the CPU: its activations to the host, the
    # hand-off and the rows back (a stored calibration without it reads 0)
    cpu_call_ms: float = 0.0
    # one all-reduce of a layer's pairs between devices (runtime.devices > 1): estimates of
    # NCCL between GPUs of one host (about 20 us, about 100 GB/s of bus bandwidth), not measured
    allreduce_fixed_ms: float = 0.02
    allreduce_ms_per_mb: float = 0.01
    # CPU experts of more than `cpu_few_tokens` tokens, which the engine computes through torch's
    # products instead of the C kernel: a line of their own from `many_from` on
    cpu_many_fixed_ms: float = 0.0
    cpu_many_ms_per_token: float = 0.0
    cpu_few_tokens: int = 8

    @property
    def many_from(self) -> float:
        """Tokens above which the many-token line prices a CPU expert: `cpu_few_tokens` where
        that line is measured (a per-token cost above 0), else never (inf: the first line holds
        for every count, as in a calibration stored without it)."""
        return self.cpu_few_tokens if self.cpu_many_ms_per_token > 0 else math.inf

    @overload
    def copy_ms(self, n_experts: int) -> float: ...
    @overload
    def copy_ms(self, n_experts: np.ndarray) -> float | np.ndarray: ...
    def copy_ms(self, n_experts: int | np.ndarray) -> float | np.ndarray:
        """Time to copy n experts host->GPU back to back (0 for none)."""
        if isinstance(n_experts, int):  # the planners' hot path: no array round trip
            return (
                self.copy_fixed_ms + self.copy_ms_per_expert * n_experts if n_experts > 0 else 0.0
            )
        n = np.asarray(n_experts, dtype=np.float64)
        out = np.where(n > 0, self.copy_fixed_ms + self.copy_ms_per_expert * n, 0.0)
        return float(out) if out.ndim == 0 else out

    @overload
    def cpu_ms(self, n_tokens: int) -> float: ...
    @overload
    def cpu_ms(self, n_tokens: np.ndarray) -> float | np.ndarray: ...
    def cpu_ms(self, n_tokens: int | np.ndarray) -> float | np.ndarray:
        """Time to run ONE expert on the CPU over n tokens (elementwise for arrays), on the
        many-token line above `many_from`."""
        n = np.asarray(n_tokens, dtype=np.float64)
        few = self.cpu_fixed_ms + self.cpu_ms_per_token * n
        many = self.cpu_many_fixed_ms + self.cpu_many_ms_per_token * n
        out = np.where(n > 0, np.where(n > self.many_from, many, few), 0.0)
        return float(out) if out.ndim == 0 else out

    def cpu_layer_ms(self, n_tokens: np.ndarray) -> float:
        """Time of one layer's CPU experts (tokens per expert): the call once, then each
        expert one after another (0 for none)."""
        n = np.asarray(n_tokens)
        return float(np.sum(self.cpu_ms(n))) + self.cpu_call_ms if n.size else 0.0

    @overload
    def gpu_ms(self, n_distinct_experts: int) -> float: ...
    @overload
    def gpu_ms(self, n_distinct_experts: np.ndarray) -> float | np.ndarray: ...
    def gpu_ms(self, n_distinct_experts: int | np.ndarray) -> float | np.ndarray:
        """Time of one grouped GEMM over n distinct cached experts (0 for none)."""
        n = np.asarray(n_distinct_experts, dtype=np.float64)
        out = np.where(n > 0, self.gpu_fixed_ms + self.gpu_ms_per_expert * n, 0.0)
        return float(out) if out.ndim == 0 else out

    def allreduce_ms(self, nbytes: int, devices: int) -> float:
        """Time of one all-reduce of `nbytes` over `devices` devices (0 for one): a ring sends
        and receives 2 (N - 1) / N of the bytes on each device."""
        if devices < 2:
            return 0.0
        moved = 2 * (devices - 1) / devices * nbytes / 1e6  # MB
        return self.allreduce_fixed_ms + self.allreduce_ms_per_mb * moved

    def for_transfer(self, share: float) -> CostModel:
        """The costs when a copy moves `share` of an expert's bytes (an encoded transfer,
        oled.offload.encoded): the per-expert copy time and bytes scaled by it; the fixed cost
        stays, and the device's decode is not counted."""
        return replace(
            self,
            copy_ms_per_expert=self.copy_ms_per_expert * share,
            expert_bytes=round(self.expert_bytes * share),
        )

    def to_json(self) -> str:
        """Serialise to a JSON object string."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """Parse the output of `to_json` (unknown keys are an error)."""
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown CostModel fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def profile(cls, name: str) -> CostModel:
        """A named profile: 'h200' (DESIGN.md section 5) or 'cpu-ci'."""
        if name in _PROFILES:
            return _PROFILES[name]()
        hint = suggest(name, _PROFILES)
        raise ValueError(f"unknown cost profile {name!r}{hint} (known: {sorted(_PROFILES)})")

    @staticmethod
    def profiles() -> list[str]:
        """Names accepted by `profile`."""
        return sorted(_PROFILES)


_PROFILES = {"h200": _h200, "cpu-ci": _cpu_ci}


@dataclass
class Load:
    """Work already queued when a layer is planned."""

    copy_queue_ms: float = 0.0  # copies queued and not finished
    cpu_queue_ms: float = 0.0  # CPU expert work queued and not finished


@dataclass
class LayerStats:
    """Per-MoE-layer routing statistics measured by the planner (EMA over iterations)."""

    working_set: np.ndarray  # [L] float64: distinct experts per iteration (EMA)
    reuse: np.ndarray  # [L] float64: fraction of this iteration's experts used last iteration
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [L] iterations

    @classmethod
    def empty(cls, num_layers: int) -> LayerStats:
        """No measurements yet."""
        z = np.zeros(num_layers, np.float64)
        return cls(working_set=z.copy(), reuse=z.copy(), samples=np.zeros(num_layers, np.int64))

    def update(self, layer: int, distinct: int, overlap: float, *, alpha: float = 0.2) -> None:
        """Fold in one iteration of one layer (first sample initialises the EMA)."""
        n = self.samples[layer]
        if n == 0:  # no previous iteration: no overlap yet
            self.working_set[layer] = distinct
        elif n == 1:
            self.working_set[layer] += alpha * (distinct - self.working_set[layer])
            self.reuse[layer] = overlap
        else:
            self.working_set[layer] += alpha * (distinct - self.working_set[layer])
            self.reuse[layer] += alpha * (overlap - self.reuse[layer])
        self.samples[layer] += 1

    @property
    def ready(self) -> bool:
        """True once every layer has at least one sample."""
        return bool(self.samples.size and (self.samples > 0).all())


class AllocationPolicy(ABC):
    """Splits the GPU expert-slot budget across MoE layers."""

    replan: bool = False  # whether the planner re-plans at block boundaries
    routing: bool = False  # whether the planner hands it every layer's routing (`route`)

    def route(self, layer: int, ids: np.ndarray) -> None:
        """One forward's routing ids [T, K] of `layer`, when `routing` is set."""
        return None

    @abstractmethod
    def allocate(
        self, *, total_slots: int, num_layers: int, num_experts: int, stats: LayerStats | None
    ) -> list[int]:
        """Slots per MoE layer: sum <= total_slots, each in [1, num_experts]."""


class RetentionPolicy(ABC):
    """Decides which cached experts to evict; predicts near-future reuse."""

    compiled_as: ClassVar[Kind | None] = None  # the built-ins': how plan.c implements them

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Start from an empty state (called by the planner at construction)."""
        self.num_layers = num_layers
        self.num_experts = num_experts

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray, step: int = 0) -> None:
        """This forward's routing [T, K] of `layer` at plan time, before decoding (optional).
        `step`: the planner's clock, forwards since it began; it never goes back, so recency
        compares across generations."""
        return None

    def observe(self, layer: int, ids: np.ndarray, weights: np.ndarray, ctx: StepContext) -> None:
        """After every forward: routing [T, K] of `layer` and the decoded tokens' states."""
        return None

    def on_insert(self, layer: int, experts: np.ndarray) -> None:
        """Experts were copied into the layer's cache."""
        return None

    def on_hit(self, layer: int, experts: np.ndarray, step: int) -> None:
        """Cached experts were used at `step` (the planner's clock, as in `route`)."""
        return None

    @abstractmethod
    def victims(self, layer: int, candidates: np.ndarray, n: int) -> np.ndarray:
        """Choose n of the candidate cached experts to evict."""

    def reuse(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Predicted probability that each expert is used next iteration (default 0.5)."""
        return np.full(len(experts), 0.5)


def lowest(priority: np.ndarray, candidates: np.ndarray, n: int) -> np.ndarray:
    """The n candidates with the lowest priority, ties to the lower expert id, in that order.

    A full order, not a partition: which of several equal priorities a partition picks depends
    on numpy's version and the CPU's vector instructions, and so would every eviction."""
    if n <= 0:
        return candidates[:0]
    order = np.lexsort((candidates, priority[candidates]))  # by priority, then id
    return candidates[order[:n]]


class CompensationPolicy(ABC):
    """Decides, per missed expert, copy to the GPU (True) or compute on the CPU (False)."""

    compiled_as: ClassVar[Kind | None] = None  # the built-ins': how plan.c implements them

    @abstractmethod
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
        """Boolean per missed expert: True = copy to GPU, False = CPU."""

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Start from an empty state (called by the planner at construction)."""
        return None

    def observe_cpu(self, *, layer: int, modeled_ms: float, measured_ms: float) -> None:
        """A layer's CPU experts were ready `measured_ms` after the decision (the engine's
        hand-over, waiting and compute); the cost model said `modeled_ms` (optional: a policy
        may correct its CPU costs from this, and is then `adaptive`)."""
        return None

    @property
    def adaptive(self) -> bool:
        """Whether decisions follow live measured times (then they can differ between runs of
        the same recipe); False: they follow the cost model only, the same on every run."""
        return False

    def refresh(
        self, *, layer: int, step: int, block: int, capacity: int, tokens: np.ndarray
    ) -> np.ndarray | None:
        """Experts the layer's cache should hold from now on, in priority order, or None.

        `tokens` [E] counts this forward's tokens per expert (read only: the planner keeps
        it). The planner copies the listed experts that are not cached (evicting cached experts
        outside the list that this step does not need), before per-miss decisions; misses it
        loads count as copies.
        """
        return None

    def prefill(self, *, layer: int, capacity: int) -> np.ndarray | None:
        """Experts to place in the cache before the first forward (load time), or None."""
        return None


for _kind, _base in (
    ("allocation", AllocationPolicy),
    ("retention", RetentionPolicy),
    ("compensation", CompensationPolicy),
):
    registry(_kind).expect(_base)  # what a built-in or plugin policy class must be
