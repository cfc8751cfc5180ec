"""drive.c's layer launches (oled.offload.driver) against a recording stand-in for the CUDA
runtime: after the compiled plan it issues the engine's Python path's calls in its order, with
the plan's rows, slots and events, or none at all when it declines."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from oled.offload import native
from oled.offload.driver import COUNTS, Call, Drive
from oled.offload.planner import COPIED, HIT, STAGED, Planner
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.policies.allocation import UniformAllocation
from oled.policies.base import CostModel

L, E, K, T = 3, 24, 4, 6
SRC13, SRC2, CACHE13, CACHE2 = 10**9, 2 * 10**9, 3 * 10**9, 4 * 10**9  # [L] bases + 10**7 l
STAGE13, STAGE2, Z13, Z2 = 5 * 10**9, 6 * 10**9, 1000, 500
MAPS_DEV, COMPUTE, COPY = 7 * 10**9, 71, 72
X_DEV, X_HOST, X_BYTES = 8 * 10**9, 9 * 10**9, 4096

_int = ctypes.c_int
_p, _s = ctypes.c_void_p, ctypes.c_size_t


class Runtime:
    """Records each runtime call as a tuple; events are numbered from 1."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.next_event = itertools.count(1)
        self.stream_of: dict[int, int] = {}  # event -> the stream it was last recorded on
        self.fns = {
            "memcpy_async": ctypes.CFUNCTYPE(_int, _p, _p, _s, _int, _p)(self.memcpy),
            "memcpy_batch": ctypes.CFUNCTYPE(
                _int,
                ctypes.POINTER(_p),
                ctypes.POINTER(_p),
                ctypes.POINTER(_s),
                _s,
                _p,
                _p,
                _s,
                _p,
            )(self.batch),  # fmt: skip
            "record": ctypes.CFUNCTYPE(_int, _p, _p)(self.record),
            "wait": ctypes.CFUNCTYPE(_int, _p, _p, ctypes.c_uint)(
                lambda s, e, f: self.log("wait", s, e)
            ),
            "launch": ctypes.CFUNCTYPE(_int, _p, _p)(lambda g, s: self.log("graph", g, s)),
            "create": ctypes.CFUNCTYPE(_int, ctypes.POINTER(_p))(self.create),
            "elapsed": ctypes.CFUNCTYPE(_int, ctypes.POINTER(ctypes.c_float), _p, _p)(self.elapsed),
        }

    def log(self, *call) -> int:
        self.calls.append(call)
        return 0

    def record(self, event, stream) -> int:
        self.stream_of[event] = stream
        return self.log("record", event, stream)

    def memcpy(self, dst, src, size, kind, stream) -> int:
        return self.log("copy", dst, src, size, kind, stream)

    def batch(self, dsts, srcs, sizes, count, attrs, index, n_attrs, stream) -> int:
        self.log("batch", count, stream)
        for i in range(count):
            self.log("copy", dsts[i], srcs[i], sizes[i], 1, stream)
        return 0

    def create(self, out) -> int:
        out[0] = next(self.next_event)
        return 0

    def elapsed(self, ms, start, end) -> int:
        ms[0] = 0.5 if self.stream_of[end] == COPY else 0.25  # copy and stall times apart
        return 0


def setup(compensation, *, batch_min: int = 0):
    p = Planner(
        num_layers=L, num_experts=E, top_k=K, total_slots=3 * 5, stage_capacity=2,
        allocation=UniformAllocation(), retention=R.LRURetention(), compensation=compensation,
        cost=CostModel.profile("h200"), compiled=True,
    )  # fmt: skip
    maps = np.full((L, p.slot_map_rows, E), -1, np.int64)
    p.attach_maps(maps)
    rt = Runtime()
    counts = np.zeros((L, len(COUNTS)))
    keep = dict(
        counts=counts, log=np.zeros((256, 4), np.int64), events=(_p * 512)(),
        tables=[np.array([b + 10**7 * layer for layer in range(L)], np.int64)
                for b in (SRC13, SRC2, CACHE13, CACHE2)],
        args=[(_p * (2 * E + 2))() for _ in range(2)], sizes=(_s * (2 * E + 2))(),
    )  # fmt: skip
    fn = {k: ctypes.cast(f, _p).value for k, f in rt.fns.items()}
    d = Drive(
        **{k: v for k, v in fn.items() if k != "memcpy_batch"},
        memcpy_batch=fn["memcpy_batch"], batch_abi=13, batch_min=batch_min, compute=COMPUTE,
        copy=COPY, stage13=STAGE13, stage2=STAGE2, size13=Z13, size2=Z2,
        stage_capacity=p.stage_capacity, bind=ctypes.addressof(p.native.bind),
        out=p.native.out.ctypes.data, maps_host=maps.ctypes.data, maps_dev=MAPS_DEV,
        map_rows=maps.shape[1], num_experts=E, events=ctypes.addressof(keep["events"]),
        n_events=512, log=keep["log"].ctypes.data, log_cap=256, counts=counts.ctypes.data,
        srcs=ctypes.addressof(keep["args"][0]), dsts=ctypes.addressof(keep["args"][1]),
        sizes=ctypes.addressof(keep["sizes"]),
    )  # fmt: skip
    d.src13, d.src2, d.cache13, d.cache2 = (t.ctypes.data for t in keep["tables"])
    execs = np.arange(1, p.slot_map_rows + 1, dtype=np.int64) * 100  # graph of row r: 100 (r+1)
    routing = (np.zeros((T, K), np.int64), np.zeros((T, K), np.float32))
    call = Call(execs=execs.ctypes.data, n_execs=len(execs), ids_host=routing[0].ctypes.data,
                w_host=routing[1].ctypes.data, pairs=T * K, x_dev=X_DEV, x_host=X_HOST,
                x_bytes=X_BYTES)  # fmt: skip
    p.native.reserve(T * K)
    return p, d, call, rt, (keep, execs, maps, routing)


def run(p, d, call, routing, layer, ids, weights) -> int:
    """One layer call through drive.c, its routing in the call's host buffers."""
    routing[0][:], routing[1][:] = ids, weights
    rc = native.library().oled_layer(
        ctypes.byref(d), ctypes.byref(call), layer, p.step, p.block, 1.0, 0
    )
    p.native.finish(layer, rc, ids)
    return rc


def expected(layer: int, plan, map_rows: int, stage_free: int | None) -> list[tuple]:
    """The engine's Python path's runtime calls for a plan (events as '?', checked apart)."""
    calls = []

    def copies(experts, slots, d13, d2):
        calls.append(("record", "?", COPY))
        for src, dst, z in ((SRC13, d13, Z13), (SRC2, d2, Z2)):
            base = src + 10**7 * layer
            calls.extend(("copy", dst + s * z, base + e * z, z, 1, COPY)
                         for e, s in zip(experts, slots, strict=True))  # fmt: skip
        calls.append(("record", "?", COPY))

    def wait():
        calls.extend([("record", "?", COMPUTE), ("wait", COMPUTE, "?"), ("record", "?", COMPUTE)])

    cache13, cache2 = CACHE13 + 10**7 * layer, CACHE2 + 10**7 * layer
    if len(plan.copy_experts):
        copies(plan.copy_experts, plan.copy_slots, cache13, cache2)
    if len(plan.cpu_experts):
        calls += [("copy", X_HOST, X_DEV, X_BYTES, 2, COMPUTE), ("record", "?", COMPUTE)]
    at = layer * map_rows * E * 8
    calls.append(("copy", MAPS_DEV + at, "maps", plan.map_rows * E * 8, 1, COMPUTE))
    calls.append(("graph", 100 * (HIT + 1), COMPUTE))
    if len(plan.copy_experts):
        wait()
        calls.append(("graph", 100 * (COPIED + 1), COMPUTE))
    for r in range(plan.map_rows - STAGED):
        if stage_free or r:
            calls.append(("wait", COPY, "?"))
        lo = 2 * r
        copies(plan.stage_experts[lo : lo + 2], plan.stage_slots[lo : lo + 2], STAGE13, STAGE2)
        wait()
        calls += [("graph", 100 * (STAGED + r + 1), COMPUTE), ("record", "?", COMPUTE)]
    return calls


@pytest.fixture(autouse=True)
def needs_compiler():
    try:
        native.library()
    except native.NativeUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("comp", ["transfer", "cpu"])
def test_launches_follow_the_python_path(comp):
    """Every layer call: the copies into the plan's slots, the activations when CPU experts are
    planned, the slot maps, the passes' graphs, each wait on the event its copies completed."""
    compensation = C.TransferOnly() if comp == "transfer" else C.CpuOnly()
    p, d, call, rt, (keep, _, maps, routing) = setup(compensation)
    ref = ctypes.byref(d)
    rng = np.random.default_rng(0)
    staged = cpu = 0
    for step, layer in itertools.product(range(6), range(L)):
        p.begin_step(step=step, block=0)
        ids = rng.integers(0, E, (T, K))
        stage_free = d.stage_free
        rt.calls.clear()
        rc = run(p, d, call, routing, layer, ids, rng.random((T, K)).astype(np.float32))
        assert rc == 1
        plan = p.native.unpack(layer)
        p.caches[layer].check()  # drive.c counted the free slots as the cache does
        want = expected(layer, plan, maps.shape[1], stage_free)
        got = [c if c[0] != "copy" or c[2] != maps.ctypes.data + c[1] - MAPS_DEV else
               (*c[:2], "maps", *c[3:]) for c in rt.calls]  # fmt: skip
        assert [tuple("?" if w == "?" else g for g, w in zip(c, e, strict=True))
                for c, e in zip(got, want, strict=True)] == want  # fmt: skip
        assert len(got) == len(want)
        recorded = [c[1] for c in rt.calls if c[0] == "record"]
        for i, c in enumerate(rt.calls):  # each wait is on an event recorded before it
            if c[0] == "wait" and c[1] == COMPUTE:
                copy_done = [x[1] for x in rt.calls[:i] if x[0] == "record" and x[2] == COPY]
                assert c[2] == copy_done[-1]
        assert len(set(recorded)) == len(recorded), "an event recorded twice in one call"
        staged += plan.map_rows > STAGED
        cpu += len(plan.cpu_experts) > 0
        if d.used > 400:
            assert native.library().oled_collect(ref) == 0
    assert cpu if comp == "cpu" else staged, "the routing never needed the case under test"


def test_counts_and_collected_times_match_the_plans():
    p, d, call, rt, (keep, _, _, routing) = setup(C.TransferOnly())
    ref, rng = ctypes.byref(d), np.random.default_rng(1)
    want = np.zeros((L, len(COUNTS)))
    col = {name: i for i, name in enumerate(COUNTS)}
    copy_launches = 0  # the cache's copies and each staged round: each timed and waited for
    for layer in range(L):
        p.begin_step(step=0, block=0)
        ids = rng.integers(0, E, (T, K))
        assert run(p, d, call, routing, layer, ids, np.ones((T, K), np.float32)) == 1
        plan = p.native.unpack(layer)
        row = want[layer]
        row[col["hits"]], row[col["misses"]] = len(plan.hits), len(plan.misses)
        row[col["copies"]] = len(plan.copy_experts) + len(plan.stage_experts)
        row[col["staged"]] = len(plan.stage_experts)
        row[col["gpu_experts"]] = len(plan.gpu_experts) + len(plan.stage_experts)
        row[col["calls"]] = 1
        copy_launches += (len(plan.copy_experts) > 0) + plan.map_rows - STAGED
    counts = keep["counts"]
    names = ["hits", "misses", "copies", "staged", "gpu_experts", "calls"]
    assert (counts[:, [col[n] for n in names]] == want[:, [col[n] for n in names]]).all()
    assert (counts[:, col["plan_ms"]] > 0).all()
    kinds = keep["log"][: d.logged, 1].tolist()
    assert copy_launches > 0 and kinds.count(0) == kinds.count(1) == copy_launches
    assert native.library().oled_collect(ref) == 0
    assert d.used == d.logged == 0 and not d.stage_free
    assert counts[:, col["copy_ms"]].sum() == pytest.approx(0.5 * copy_launches)
    assert counts[:, col["stall_ms"]].sum() == pytest.approx(0.25 * copy_launches)


def test_declines_before_any_launch_without_a_graph():
    """A pass without a captured graph: planned, nothing launched, the plan in the buffer."""
    p, d, call, rt, (keep, execs, _, routing) = setup(C.TransferOnly())
    execs[COPIED] = 0
    ids = np.arange(T * K).reshape(T, K) % E  # misses everywhere: copies needed
    rc = run(p, d, call, routing, 0, ids, np.ones((T, K), np.float32))
    assert rc == 0 and rt.calls == []
    plan = p.native.unpack(0)
    assert len(plan.copy_experts) > 0
    assert keep["counts"].sum() == 0


def test_a_routing_larger_than_the_planners_buffers_is_refused():
    p, d, call, rt, _ = setup(C.TransferOnly())
    call.pairs = len(p.native.ids) + 1
    lib = native.library()
    assert lib.oled_layer(ctypes.byref(d), ctypes.byref(call), 0, 0, 0, 1.0, 0) == -3
    assert rt.calls == [] and p.stats.plans.sum() == 0


def test_batched_copies_carry_the_same_rows():
    p, d, call, rt, (*_, routing) = setup(C.TransferOnly(), batch_min=2)
    ids = np.arange(T * K).reshape(T, K) % E
    assert run(p, d, call, routing, 0, ids, np.ones((T, K), np.float32)) == 1
    plan = p.native.unpack(0)
    n = len(plan.copy_experts)
    batch = [c for c in rt.calls if c[0] == "batch"]
    assert batch and batch[0][1] == 2 * n
    first = rt.calls.index(batch[0])
    copies = rt.calls[first + 1 : first + 1 + 2 * n]
    want = [(CACHE13 + s * Z13, SRC13 + e * Z13) for e, s in zip(plan.copy_experts,
            plan.copy_slots, strict=True)]  # fmt: skip
    assert [(c[1], c[2]) for c in copies[:n]] == want
