"""The plan state: every array that plans read and write, described once and allocated once.

`ARRAYS` lists the planner's state (the layers' slot maps, its measurements, the counters and
every built-in policy's arrays) with shapes and initial values; `PlanState` allocates them
once per planner and never replaces them (its arrays cannot be reassigned), and the built-in
policies hold views into it (`InState`). The compiled planner (plan.c) reads and writes the
same arrays through `Bind`, whose pointer fields come from `ARRAYS` and whose parameter blocks
come from the built-in policies' own `compiled_as` kinds (`plan_part`). The same description
gives plan.c's generated header (`plan_state.h`: the enums, `Bind`, the contract), the ctypes
mirror and the check on load (oled.clib); so a new parameter of a built-in policy is two
edits: the policy (its attribute and its kind's `params`) and plan.c, which uses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

import numpy as np

from oled.clib import Field, Part, Struct, Table, address

COUNTERS = Table.of(
    "counters",
    "ST",
    (
        "plans",  # plans made
        "requests",  # distinct experts needed
        "hits",
        "misses",
        "copies",  # into cache slots, prefetches included
        "prefetches",  # copies of experts that forward did not need
        "staged",
        "cpu_experts",
        "cpu_tokens",
        "evictions",
        "predicted",  # copies a layer ahead from the predicted routing (also in copies)
        "predicted_hits",  # of those, experts the forward then needed
    ),
    total="N_STATS",
    doc="Columns of the counters' rows (PlanState.counters [L, N_STATS]).",
)
REGIONS = Table.of(
    "regions",
    "OUT",
    (
        "hits",
        "misses",
        "gpu_experts",
        "copy_experts",
        "copy_slots",
        "stage_experts",
        "stage_slots",
        "cpu_experts",
        "cpu_tokens",
        "evicted",
        "counts",
    ),
    total="N_OUT",
    doc="A plan's arrays, in this order, packed into Bind.out after a header of H_SIZE int64s: "
    "header[i] = where array i starts (it ends where array i + 1 starts).",
)
_N_OUT = len(REGIONS.entries)
HEADER = Table(
    "header",
    "H",
    {"slot_map": _N_OUT, "end": _N_OUT + 1, "map_rows": _N_OUT + 2, "size": 16},
    doc="The plan's header after the regions' starts: where the slot map copy (int32 [E]) "
    "starts, the end of the plan, the slot-map rows written (0 without maps); its size.",
)
MAP_ROWS = Table(
    "slot-map rows",
    "MAP",
    {"hit": 0, "copied": 1, "staged": 2},
    doc="Rows of a layer's expert -> slot maps: MAP_STAGED + r for staged round r.",
)
STAGE = Table(
    "stage",
    "STAGE",
    {"rounds": 2},
    doc="Rounds the stage holds: round r's experts in its part r % STAGE_ROUNDS, so that one "
    "round's copies overlap the previous round's pass.",
)


@dataclass(frozen=True)
class Array:
    """One array of the plan state: its shape over L (layers), E (experts) and N (counters),
    dtype and initial value."""

    name: str
    shape: str
    dtype: type[np.generic]
    fill: float
    doc: str

    def dims(self, num_layers: int, num_experts: int) -> tuple[int, ...]:
        sizes = {"L": num_layers, "E": num_experts, "N": len(COUNTERS.entries)}
        return tuple(sizes[d] for d in self.shape)

    @property
    def field(self) -> Field:
        ctype = {
            np.int32: "int32_t",
            np.int64: "int64_t",
            np.float64: "double",
            np.uint8: "uint8_t",
        }
        return Field(self.name, f"{ctype[self.dtype]} *", f"[{', '.join(self.shape)}] {self.doc}")


ARRAYS = (
    # the layers' caches: expert -> slot, slot -> expert (capacity[l] slots used), -1 = none
    Array("slot_of", "LE", np.int32, -1, "expert -> slot, -1 = not cached"),
    Array("expert_in", "LE", np.int32, -1, "slot -> expert (first capacity[l]), -1 = free"),
    Array("capacity", "L", np.int64, 0, "cache slots"),
    Array("n_free", "L", np.int64, 0, "free cache slots"),
    # the planner's measurements
    Array("working_set", "L", np.float64, 0, "EMA of distinct experts per forward"),
    Array("reuse", "L", np.float64, 0, "EMA of the overlap with the previous forward"),
    Array("samples", "L", np.int64, 0, "forwards measured"),
    Array("last_counts", "LE", np.int64, 0, "tokens per expert in the last forward"),
    Array("counters", "LN", np.int64, 0, "COUNTERS"),
    # the built-in policies' arrays
    Array("priority", "LE", np.float64, 0, "eviction priority (ConfidenceRetention: score)"),
    Array("masked", "LE", np.float64, 0, "ConfidenceRetention: masked tokens' evidence"),
    Array("stable", "LE", np.float64, 0, "ConfidenceRetention: other tokens' evidence"),
    Array("current", "LE", np.float64, 0, "ConfidenceRetention: this forward's gate mass"),
    Array("last_block", "L", np.int64, -1, "ConfidenceRetention: the block last observed"),
    Array("learned", "LE", np.float64, 0, "StaticHot: token counts so far"),
    Array("loaded", "L", np.uint8, 0, "StaticHot: whether the hot set is loaded"),
    Array("seen", "L", np.uint8, 0, "StaticHot: whether learned holds any forward"),
)


@dataclass(frozen=True)
class Kind:
    """How the compiled planner implements a built-in policy: its number (RET_* or COMP_*),
    its C name and the parameters plan.c reads (attribute -> C type) in `Bind.<c_name>`. A
    built-in policy class declares its own as `compiled_as`."""

    value: int
    c_name: str
    params: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def struct(self) -> Struct:
        name = "".join(p.title() for p in self.c_name.split("_")) + "Params"
        return Struct(name, tuple(Field(k, v) for k, v in self.params.items()))


def plan_part(retention: Sequence[Any], compensation: Sequence[Any]) -> tuple[Struct, Part]:
    """`Bind` and plan.c's header for the built-in policy classes (each with its `compiled_as`
    Kind): the kinds' enums and tables by class name, their parameter blocks, the state's
    arrays, the counters and the plan's layout."""
    kinds = {"RET": retention, "COMP": compensation}
    enums = [
        Table(f"{p} names", p, {c.compiled_as.c_name: c.compiled_as.value for c in classes})
        for p, classes in kinds.items()
    ]
    by_class = [
        Table(
            f"{name} kinds",
            p,
            {c.__name__: c.compiled_as.value for c in classes},
            c_names={c.__name__: f"{p}_{c.compiled_as.c_name.upper()}" for c in classes},
        )
        for name, (p, classes) in zip(("retention", "compensation"), kinds.items(), strict=True)
    ]
    params = {c.compiled_as.c_name: c for cs in kinds.values() for c in cs if c.compiled_as.params}
    bind = Struct(
        "Bind",
        (
            *Field.many("int64_t", "num_layers num_experts stage_capacity"),
            Field("stats_alpha", "double", "the measurements' EMA weight"),
            *(a.field for a in ARRAYS),
            Field("ret_kind", "int64_t", "RET_*"),
            Field("comp_kind", "int64_t", "COMP_*"),
            *(
                Field(n, c.compiled_as.struct, f"{c.__name__}'s parameters")
                for n, c in params.items()
            ),
            *Field.many(
                "double",
                "copy_per copy_fixed cpu_fixed cpu_tok cpu_call cpu_many_fixed cpu_many_tok cpu_few",
                "the cost model (ms; cpu_few: CostModel.many_from, in tokens)",
            ),
            Field("scratch", "int64_t *", "(N_SCRATCH + N_OUT) x (E + 1)"),
            Field("ids", "int64_t *", "[routing_cap] this forward's routing, flat"),
            Field("weights", "double *"),
            Field("routing_cap", "int64_t"),
            Field("out", "int64_t *", "H_SIZE + N_OUT x (E + 1) + E / 2 + 1"),
            Field("maps", "int64_t *", "[L, map_rows, E] slot maps for the engine, or NULL"),
            Field("map_rows", "int64_t"),
        ),
        doc="The planner's state and its policies' parameters (oled.policies.state).",
    )
    tables = (*enums, *by_class, COUNTERS, REGIONS, HEADER, MAP_ROWS, STAGE)
    structs = (*(c.compiled_as.struct for c in params.values()), bind)
    return bind, Part("plan", tables=tables, structs=structs, doc="oled/policies/state.py")


class PlanState:
    """The arrays of `ARRAYS` for `num_layers` MoE layers of `num_experts` experts, allocated
    once; read them as attributes (`state.slot_of` [L, E]) and write into them, never replace
    them (assigning one is an AttributeError), so the compiled planner can hold their
    addresses for the state's life."""

    arrays: Mapping[str, np.ndarray]
    shape: tuple[int, int]  # (num_layers, num_experts)

    def __init__(self, *, num_layers: int, num_experts: int) -> None:
        arrays = {a.name: np.full(a.dims(num_layers, num_experts), a.fill, a.dtype) for a in ARRAYS}
        object.__setattr__(self, "arrays", MappingProxyType(arrays))
        object.__setattr__(self, "shape", (num_layers, num_experts))

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"the plan state's {name} is allocated once: write into it")

    def addresses(self) -> dict[str, int]:
        """Each array's data address (what `BIND`'s pointer fields hold)."""
        return {k: address(a) for k, a in self.arrays.items()}


class InState:
    """A policy attribute that is a view of one array of the policy's plan state (`state`):
    reading gives the array, assigning is an AttributeError (fill it in place instead)."""

    def __init__(self, array: str | None = None) -> None:
        self.array = array

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.array = self.array or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.state.arrays[self.array]

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(
            f"{type(obj).__name__}.{self.name} is a view of the plan state's {self.array}: "
            "write into it, never replace it"
        )


class Stateful:
    """A policy whose arrays are views of a plan state (`InState` attributes): the planner
    attaches its own (`attach`); a policy used alone gets one of its own at `reset`."""

    state: PlanState

    def attach(self, state: PlanState) -> None:
        """Use `state`'s arrays from now on (the planner's, before its reset)."""
        self.__dict__["state"] = state

    def own_state(self, *, num_layers: int, num_experts: int) -> None:
        """A state of the policy's own unless the attached one has this shape."""
        state = self.__dict__.get("state")
        if state is None or state.shape != (num_layers, num_experts):
            self.attach(PlanState(num_layers=num_layers, num_experts=num_experts))
