"""The compiled planner (oled.policies.native) decides exactly as the Python planner, and its
contract with plan.c is checked on load."""

from __future__ import annotations

import ctypes
import dataclasses
import os

import numpy as np
import pytest

from oled import clib
from oled.policies import compensation as C
from oled.policies import native
from oled.policies import retention as R
from oled.policies.allocation import AdaptiveAllocation, UniformAllocation
from oled.policies.base import CostModel, Load, RetentionPolicy, StepContext
from oled.policies.native import BIND, PLAN
from oled.policies.planner import Planner

L, E, K = 4, 32, 4
RETENTIONS = {
    "lru": R.LRURetention,
    "lfu": R.LFURetention,
    "lfu-decay-tokens": lambda: R.LFURetention(decay=0.9, per_token=True),
    "score-ema": R.ScoreEMARetention,
    "confidence": R.ConfidenceRetention,
}
COMPENSATIONS = {
    "cooperative": C.CooperativeCompensation,
    "cooperative-h2": lambda: C.CooperativeCompensation(future_weight=2.0, horizon=2),
    "makespan": C.MakespanCompensation,
    "batch": lambda: C.BatchThreshold(min_tokens=3),
    "transfer": C.TransferOnly,
    "cpu": C.CpuOnly,
    "interval": lambda: C.IntervalRefresh(interval=3, min_tokens=2),
    "static-hot": lambda: C.StaticHot(learn_blocks=1),
    "static-profile": lambda: C.StaticHot(counts=np.arange(L * E).reshape(L, E) % 7),
    "resident": C.Resident,
}
SETUPS = [  # total slots, stage capacity, adaptive allocation, copies ahead
    (8, 3, False, 0),
    (40, 0, True, 0),
    (64, 2, True, 6),
    (100, 4, False, 0),
]


def planner(ret: str, comp: str, setup: tuple, *, compiled: bool) -> Planner:
    slots, stage, adaptive, ahead = setup
    alloc = AdaptiveAllocation(min_shift=0.0) if adaptive else UniformAllocation()
    return Planner.for_model(
        L,
        E,
        K,
        slots,
        stage_capacity=stage,
        cost=dataclasses.replace(  # every cost term, a line for experts of many tokens too
            CostModel.profile("h200"),
            cpu_call_ms=0.3,
            cpu_many_fixed_ms=0.2,
            cpu_many_ms_per_token=0.02,
        ),
        allocation=alloc,
        retention=RETENTIONS[ret](),
        compensation=COMPENSATIONS[comp](),
        prefetch_limit=ahead,
        compiled=compiled,
    )


def routing(rng: np.random.Generator, hot: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [t, K] mostly from the layer's drifting hot set, weights [t, K] fp32."""
    ids = np.where(rng.random((t, K)) < 0.8, rng.choice(hot, (t, K)), rng.integers(0, E, (t, K)))
    return ids, rng.random((t, K)).astype(np.float32)


def drive(p: Planner, seed: int) -> list:
    """Forwards over 4 blocks: plans, copies ahead, observations; every decision and state."""
    rng = np.random.default_rng(seed)
    hot = [rng.choice(E, 10, replace=False) for _ in range(L)]
    maps = np.full((L, p.slot_map_rows, E), 7, np.int64)  # the plans write theirs in here
    p.attach_maps(maps)
    record = []
    for step in range(16):
        block = step // 4
        if step and step % 4 == 0:
            record.append(("resize", p.end_block()))
        p.begin_step(step=step, block=block)
        t = 32 + (8 if block else 0)  # prefix rows from the second block on
        on_device = step % 5 == 4
        for layer in range(L):
            hot[layer][rng.integers(0, 10)] = rng.integers(0, E)
            ids, w = routing(rng, hot[layer], t)
            load = Load(copy_queue_ms=float(rng.random()), cpu_queue_ms=float(rng.random()))
            if on_device:
                with p.all_on_device():
                    plan = p.plan(layer, ids, w, load)
            else:
                plan = p.plan(layer, ids, w, load if step % 2 else None)
            record.append(dataclasses.asdict(plan))
            record.append(maps[layer, : plan.map_rows].copy())
            if len(plan.cpu_experts):
                p.observe_cpu(layer, plan.cpu_tokens, float(rng.random() * 5))
            if p.prefetch_limit and layer + 1 < L:
                record.append(p.prefetch(layer + 1, routing(rng, hot[layer + 1], t)[0]))
            state = rng.integers(0, 3, t).astype(np.int8)
            ctx = StepContext(block, step % 4, step, state, rng.random(t).astype(np.float32))
            p.observe(layer, ids, w, ctx)
    for c in p.caches:
        c.check()
    record.append(p.stats.to_dict())
    record.append(dataclasses.asdict(p.layer_stats))
    record.append(_state(p.retention))
    return record


def _state(ret: RetentionPolicy) -> dict:
    return {k: v for k, v in vars(ret).items() if isinstance(v, np.ndarray | float | int)}


def same(a, b, path="") -> None:
    """Recursive exact equality, dtypes included, with the path of the first difference."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), (path, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        same(dataclasses.asdict(a), dataclasses.asdict(b), path)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("comp", COMPENSATIONS)
@pytest.mark.parametrize("ret", RETENTIONS)
def test_compiled_plans_equal_python_plans(ret: str, comp: str) -> None:
    for i, setup in enumerate(SETUPS):
        fast, slow = (planner(ret, comp, setup, compiled=c) for c in (True, False))
        assert fast.compiled and not slow.compiled
        same(drive(fast, seed=i), drive(slow, seed=i), f"setup {setup}")


def test_slot_maps_of_the_wrong_shape_are_refused() -> None:
    p = planner("lru", "transfer", SETUPS[0], compiled=True)
    with pytest.raises(ValueError, match=r"need \[4, >= 13, 32\]"):
        p.attach_maps(np.zeros((L, 2, E), np.int64))  # no rows for the stage's rounds
    with pytest.raises(ValueError, match="int64"):
        p.attach_maps(np.zeros((L, 13, E), np.int32))


def test_compiled_plan_rejects_expert_ids_out_of_range() -> None:
    p = planner("lru", "transfer", SETUPS[0], compiled=True)
    ids = np.array([[0, 1, 2, E]])
    with pytest.raises(ValueError, match=rf"expert ids \[{E}\] outside \[0, {E}\)"):
        p.plan(0, ids, np.ones((1, 4), np.float32))


class _Own(R.LRURetention):
    """A policy of the user's own: the compiled planner does not know it."""


def test_policies_of_ones_own_plan_in_python() -> None:
    def make(compiled):
        return Planner.for_model(
            L,
            E,
            K,
            16,
            stage_capacity=2,
            cost=CostModel.profile("h200"),
            allocation=UniformAllocation(),
            retention=_Own(),
            compensation=C.TransferOnly(),
            compiled=compiled,
        )

    assert not make(None).compiled
    with pytest.raises(native.NativeUnavailable, match="_Own has no compiled version"):
        make(True)


def test_without_a_compiler_the_planner_warns_and_plans_in_python(tmp_path, monkeypatch):
    monkeypatch.setenv("OLED_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.setenv("CC", "no-such-cc")
    native.LIBRARY.forget()
    try:
        with pytest.warns(UserWarning, match="no C compiler found"):
            assert not planner("lru", "transfer", SETUPS[0], compiled=None).compiled
        with pytest.raises(OSError) as info:  # what the machine lacks: one line for commands
            planner("lru", "transfer", SETUPS[0], compiled=True)
        assert isinstance(info.value, native.NativeUnavailable)
        message = str(info.value)
        assert "no C compiler found (tried $CC=no-such-cc, gcc on $PATH)" in message
        assert 'runtime.planner = "python"' in message and "\n" not in message
    finally:
        native.LIBRARY.forget()
    assert os.listdir(tmp_path) == []


def _swapped(struct: type[ctypes.Structure], i: int, j: int) -> type[ctypes.Structure]:
    """A ctypes mirror of `struct` with fields i and j swapped."""
    fields = list(struct._fields_)
    fields[i], fields[j] = fields[j], fields[i]
    return type("Swapped", (ctypes.Structure,), {"_fields_": fields})


def _mirrors(**structs: type[ctypes.Structure]) -> tuple[dict, dict]:
    """plan.c's mirrors (structs by name, tables), with `structs` in place of the described."""
    mine = {s.name: s.ctype for s in PLAN.structs}
    return {**mine, **structs}, {t.name: t.index for t in PLAN.tables}


def test_the_plan_contract_holds_and_names_every_field() -> None:
    lib = native.library()  # loading checked it
    clib.check(lib, "plan", *_mirrors())
    bind = clib.contract(lib, "plan")["Bind"]
    assert [f for f, *_ in bind.rows] == [f.name for f in BIND.fields]
    assert bind.size == ctypes.sizeof(BIND.ctype)


def test_the_plan_header_comes_from_the_state_description() -> None:
    header = PLAN.header()
    assert "typedef struct Bind {" in header and "    int32_t *slot_of; /* [L, E]" in header
    assert "ST_PREDICTED_HITS = 11" in header and "N_STATS = 12" in header
    assert "LfuParams lfu;" in header and "    double decay;" in header


def test_a_bind_mirror_with_two_fields_swapped_is_refused() -> None:
    with pytest.raises(
        clib.ContractError,
        match=r"plan.c and its ctypes mirror disagree on "
        r"Bind field 4: C has 'slot_of' at offset 32 \(8 bytes\), the mirror "
        r"'expert_in' at offset 32 \(8 bytes\)",
    ):
        clib.check(native.library(), "plan", *_mirrors(Bind=_swapped(BIND.ctype, 4, 5)))


def test_a_bind_mirror_with_a_narrower_field_is_refused() -> None:
    fields = [(f, ctypes.c_int32 if f == "ret_kind" else t) for f, t in BIND.ctype._fields_]
    narrow = type("Narrow", (ctypes.Structure,), {"_fields_": fields})
    i = [f for f, _ in fields].index("ret_kind")
    at = BIND.ctype.ret_kind.offset
    with pytest.raises(
        clib.ContractError,
        match=rf"Bind field {i}: C has 'ret_kind' at offset "
        rf"{at} \(8 bytes\), the mirror 'ret_kind' at offset {at} \(4 bytes\)",
    ):
        clib.check(native.library(), "plan", *_mirrors(Bind=narrow))


def _replace_table(name: str, **entries: int | None) -> clib.Part:
    """PLAN with table `name`'s entries changed (None: left out)."""
    table = next(t for t in PLAN.tables if t.name == name)
    changed = {k: v for k, v in {**table.entries, **entries}.items() if v is not None}
    new = dataclasses.replace(table, entries=changed)
    return dataclasses.replace(PLAN, tables=tuple(new if t is table else t for t in PLAN.tables))


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (
            _replace_table("retention kinds", LFURetention=3),
            "on the retention kinds: 'LFURetention' is 2 in C, 3 in Python",
        ),
        (
            _replace_table("compensation kinds", StaticHot=None),
            "on the compensation kinds: 'StaticHot' is 7 in C, missing in Python",
        ),
        (
            _replace_table("regions", hits=1, misses=0),
            "on the regions: 'hits' is 0 in C, 1 in Python",
        ),
    ],
)
def test_a_library_built_from_another_description_is_refused(monkeypatch, part, message) -> None:
    """A loaded library whose tables differ from the description (a stale build) is refused
    wherever it is asked for, and no planner mode hides that by planning in Python."""
    native.library()  # built and loaded from the description
    monkeypatch.setattr(native.LIBRARY, "parts", (part,))
    with pytest.raises(clib.ContractError, match=message):
        native.library()
    with pytest.raises(clib.ContractError, match=message):
        planner("lru", "transfer", SETUPS[0], compiled=None)
    monkeypatch.undo()
    assert planner("lru", "transfer", SETUPS[0], compiled=None).compiled


def test_structs_and_tables_left_unchecked_are_refused() -> None:
    with pytest.raises(
        clib.ContractError,
        match=r"name different structs and tables: "
        r"\['BatchParams', 'Bind'",
    ):
        tables = {k: v for k, v in _mirrors()[1].items() if k != "counters"}
        clib.check(native.library(), "plan", {}, tables)
