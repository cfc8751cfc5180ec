"""The compiled planner: `Planner.plan` in C (plan.c) for the built-in policies, over the
planner's own plan state (oled.policies.state).

plan.c is built on first use with the system's C compiler into the cache directory
($OLED_HOME/native), with its header generated from the state's description, and loaded with
ctypes (oled.clib). It decides exactly as the Python planner: the same floating-point
operations in the same order, the same tie rules (tests check every field of every plan).
Policies it does not know, and machines without a compiler, keep the Python planner. It holds
the addresses of the planner's PlanState, which is allocated once and never replaced, and of
its own buffers.

On load the C side's contract (each struct's size and fields, its tables of names) is checked
against the Python mirrors derived from the same description: any difference is a
ContractError before anything runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oled.clib import PYTHON_PLANNER, ContractError, Library, NativeUnavailable, address
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.policies.base import CompensationPolicy, Load, RetentionPolicy
from oled.policies.planner import LayerPlan
from oled.policies.state import COUNTERS, HEADER, REGIONS, Kind, plan_part

if TYPE_CHECKING:
    from oled.policies.planner import Planner

__all__ = ["PYTHON_PLANNER", "CompiledPlan", "ContractError", "NativeUnavailable", "library"]

_HERE = Path(__file__).parent
SOURCE, INCLUDE = _HERE / "plan.c", _HERE / "plan.h"  # drive.c (oled.offload) builds them too
# the built-in policies plan.c implements, each with its `compiled_as` kind
RETENTION: dict[type, Kind] = {
    cls: cls.compiled_as
    for cls in (R.LRURetention, R.LFURetention, R.ScoreEMARetention, R.ConfidenceRetention)
}
COMPENSATION: dict[type, Kind] = {
    cls: cls.compiled_as
    for cls in (
        C.TransferOnly,
        C.Resident,
        C.CpuOnly,
        C.BatchThreshold,
        C.MakespanCompensation,
        C.CooperativeCompensation,
        C.IntervalRefresh,
        C.StaticHot,
    )
}
BIND, PLAN = plan_part(list(RETENTION), list(COMPENSATION))
_H = HEADER.at
_PREDICTED_HITS = COUNTERS.at.predicted_hits

_p = ctypes.c_void_p
_i = ctypes.c_int64
_d = ctypes.c_double


def declare(lib: ctypes.CDLL) -> None:
    """plan.c's entry points' signatures (drive.c's: oled.offload.driver)."""
    lib.oled_plan.restype = _i
    lib.oled_plan.argtypes = [_p, _i, _i, _i, _i, _i, _d, _d, _d, _i]
    lib.oled_layout.restype = None
    lib.oled_layout.argtypes = [_i, _p]


LIBRARY = Library("plan", (SOURCE,), (PLAN,), includes=(INCLUDE,), declare=declare)


def library() -> ctypes.CDLL:
    """plan.c built (once per source and machine), loaded and its contract checked;
    NativeUnavailable when that fails, a ContractError whenever the contract does not hold."""
    return LIBRARY.load()


def unsupported(retention: RetentionPolicy, compensation: CompensationPolicy) -> str | None:
    """Why the compiled planner cannot run these policies (None when it can)."""
    for policy, known in ((retention, RETENTION), (compensation, COMPENSATION)):
        kind = known.get(type(policy))
        if kind is None:
            return f"{type(policy).__name__} has no compiled version"
        for name, ctype in kind.params.items():
            value = getattr(policy, name)
            if ctype == "int64_t" and value != int(value):
                return f"{type(policy).__name__}.{name} = {value} is not a whole number"
    if isinstance(compensation, C.IntervalRefresh) and compensation.interval < 1:
        return f"IntervalRefresh.interval must be >= 1, got {compensation.interval}"
    return None


def _set_params(bind: Any, kind: Kind, policy: object) -> None:
    """The policy's parameters into its kind's block of the Bind."""
    if not kind.params:
        return
    block = getattr(bind, kind.c_name)
    for name, ctype in kind.params.items():
        value = getattr(policy, name)
        setattr(block, name, int(value) if ctype == "int64_t" else float(value))


class CompiledPlan:
    """`Planner.plan` through plan.c over the planner's plan state (bound once: the state is
    allocated once) and buffers of its own (the routing's grow, with the Bind, in `_routing`)."""

    def __init__(self, planner: Planner) -> None:
        self.lib = library()
        self.planner = p = planner
        self.state = p.state  # held for the Bind's life: it points into it
        L, E = p.num_layers, p.num_experts
        self.E = E
        lens = np.zeros(2, np.int64)  # scratch, out (plan.c)
        self.lib.oled_layout(E, address(lens))
        self.scratch = np.zeros(int(lens[0]), np.int64)
        self.out = np.zeros(int(lens[1]), np.int64)
        b = self.bind = BIND.ctype(
            num_layers=L,
            num_experts=E,
            stage_capacity=p.stage_capacity,
            stats_alpha=p.stats_alpha,
            scratch=address(self.scratch),
            out=address(self.out),
        )
        for name, at in self.state.addresses().items():
            setattr(b, name, at)
        ret, comp = RETENTION[type(p.retention)], COMPENSATION[type(p.compensation)]
        b.ret_kind, b.comp_kind = ret.value, comp.value
        _set_params(b, ret, p.retention)
        _set_params(b, comp, p.compensation)
        cost = p.cost
        b.copy_per, b.copy_fixed = cost.copy_ms_per_expert, cost.copy_fixed_ms
        b.cpu_fixed, b.cpu_tok = cost.cpu_fixed_ms, cost.cpu_ms_per_token
        b.cpu_call = cost.cpu_call_ms
        b.cpu_many_fixed, b.cpu_many_tok = cost.cpu_many_fixed_ms, cost.cpu_many_ms_per_token
        b.cpu_few = cost.many_from  # inf: one line for every count
        self._routing(64 * p.top_k)
        self.ref = ctypes.byref(b)
        self.lru = p.retention if isinstance(p.retention, R.LRURetention) else None
        c = p.compensation
        self.cooperative = c if isinstance(c, C.CooperativeCompensation) else None

    def _routing(self, pairs: int) -> None:
        """Room for the routing of `pairs` (token, expert) pairs, and the Bind pointed at it."""
        self.ids = np.zeros(pairs, np.int64)  # flat [T * K]
        self.weights = np.zeros(pairs, np.float64)
        self.bind.ids, self.bind.weights = address(self.ids), address(self.weights)
        self.bind.routing_cap = pairs

    def attach_maps(self, maps: np.ndarray) -> None:
        """Write each plan's slot maps into `maps` [L, R, E] int64 (Planner.attach_maps, which
        holds it)."""
        self._maps = maps
        self.bind.maps, self.bind.map_rows = address(maps), maps.shape[1]

    def plan(
        self, layer: int, ids: np.ndarray, weights: np.ndarray, load: Load | None
    ) -> LayerPlan:
        """Planner.plan, compiled."""
        self.run(layer, ids, weights, load)
        return self.unpack(layer)

    def run(self, layer: int, ids: np.ndarray, weights: np.ndarray, load: Load | None) -> None:
        """Plan the layer in C; the plan stays in the output buffer (`unpack`)."""
        p = self.planner
        n = ids.size
        self.reserve(n)
        np.copyto(self.ids[:n], ids.reshape(-1), casting="same_kind")
        np.copyto(self.weights[:n], weights.reshape(-1))
        copy_q, cpu_q = (load.copy_queue_ms, load.cpu_queue_ms) if load else (0.0, 0.0)
        rc = self.lib.oled_plan(
            self.ref, layer, n, p.step, p.clock, p.block, copy_q, cpu_q, self.slowdown(), p.gpu_only
        )
        self.finish(layer, rc, ids)

    def slowdown(self) -> float:
        """The cooperative compensation's learned CPU slowdown (1 for other policies)."""
        return self.cooperative.slowdown if self.cooperative is not None else 1.0

    def reserve(self, pairs: int) -> None:
        """Room for the routing of `pairs` pairs (drive.c reads it in itself)."""
        if pairs > len(self.ids):
            self._routing(pairs)

    def finish(self, layer: int, rc: int, ids: np.ndarray) -> None:
        """After a plan in C (return code `rc`): the Python objects' part of its state."""
        if rc == -1:
            bad = ids[(ids < 0) | (ids >= self.E)]
            raise ValueError(f"layer {layer}: expert ids {bad[:8].tolist()} outside [0, {self.E})")
        if self.lru is not None:
            self.lru.now = self.planner.clock

    def unpack(self, layer: int) -> LayerPlan:
        """The LayerPlan that the last `run` left in the output buffer."""
        p = self.planner
        h = self.out[: _H.size].tolist()  # where each array starts (plan.c's pack)
        out = self.out[: h[_H.end]].copy()  # the plan's own
        parts = {k: out[h[i] : h[i + 1]] for i, k in enumerate(REGIONS.names)}
        counts = parts.pop("counts")  # [E] tokens per expert
        predicted_hits = p.ahead.score(layer, counts)  # of those copied at the layer before
        self.state.counters[layer, _PREDICTED_HITS] += predicted_hits
        slot_of = out[h[_H.slot_map] :].view(np.int32)[: self.E]
        return LayerPlan(
            layer=layer,
            slot_of=slot_of,
            predicted_hits=predicted_hits,
            map_rows=h[_H.map_rows],
            **parts,
        )
