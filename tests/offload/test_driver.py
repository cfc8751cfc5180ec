"""drive.c's layer launches (oled.offload.driver) against a recording stand-in for the CUDA
runtime: after the compiled plan it issues the calls that the engine's Python path
(oled.offload.launches, run here against a recording Launcher) issues for the same plan, in its
order, with the plan's rows, slots and events, or none at all when it declines; its ctypes
mirrors are checked against drive.c's contract on load."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from oled import clib
from oled.offload import driver
from oled.offload.drive_state import COUNTS, DRIVE_PART
from oled.offload.driver import Call, Drive
from oled.offload.encoded import PARTS
from oled.offload.launches import launch_layer
from oled.offload.metrics import FIELDS
from oled.policies import compensation as C
from oled.policies import native
from oled.policies import retention as R
from oled.policies.allocation import UniformAllocation
from oled.policies.base import CostModel
from oled.policies.planner import COPIED, STAGE_ROUNDS, STAGED, Planner

L, E, K, T = 3, 24, 4, 6
SRC13, SRC2, CACHE13, CACHE2 = 10**9, 2 * 10**9, 3 * 10**9, 4 * 10**9  # [L] bases + 10**7 l
STAGE13, STAGE2, Z13, Z2 = 5 * 10**9, 6 * 10**9, 1000, 500
MAPS_DEV, COMPUTE, COPY = 7 * 10**9, 71, 72
X_DEV, X_HOST, X_BYTES = 8 * 10**9, 9 * 10**9, 4096
STAGE_CAPACITY = 2

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
            )(self.batch),
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
    p = Planner.for_model(
        L,
        E,
        K,
        3 * 5,
        stage_capacity=STAGE_CAPACITY,
        cost=CostModel.profile("h200"),
        allocation=UniformAllocation(),
        retention=R.LRURetention(),
        compensation=compensation,
        compiled=True,
    )
    maps = np.full((L, p.slot_map_rows, E), -1, np.int64)
    p.attach_maps(maps)
    rt = Runtime()
    counts = np.zeros((L, len(COUNTS.entries)))
    keep = dict(
        counts=counts,
        log=np.zeros((256, 4), np.int64),
        events=(_p * 512)(),
        tables=[
            np.array([b + 10**7 * layer for layer in range(L)], np.int64)
            for b in (SRC13, SRC2, CACHE13, CACHE2)
        ],
        args=[(_p * (2 * E + 2))() for _ in range(2)],
        sizes=(_s * (2 * E + 2))(),
    )
    fn = {k: ctypes.cast(f, _p).value for k, f in rt.fns.items()}
    d = Drive(
        **{k: v for k, v in fn.items() if k != "memcpy_batch"},
        memcpy_batch=fn["memcpy_batch"],
        batch_abi=13,
        batch_min=batch_min,
        compute=COMPUTE,
        copy=COPY,
        stage13=STAGE13,
        stage2=STAGE2,
        size13=Z13,
        size2=Z2,
        stage_capacity=p.stage_capacity,
        bind=ctypes.addressof(p.native.bind),
        out=p.native.out.ctypes.data,
        maps_host=maps.ctypes.data,
        maps_dev=MAPS_DEV,
        map_rows=maps.shape[1],
        num_experts=E,
        events=ctypes.addressof(keep["events"]),
        n_events=512,
        log=keep["log"].ctypes.data,
        log_cap=256,
        counts=counts.ctypes.data,
        srcs=ctypes.addressof(keep["args"][0]),
        dsts=ctypes.addressof(keep["args"][1]),
        sizes=ctypes.addressof(keep["sizes"]),
    )
    d.src13, d.src2, d.cache13, d.cache2 = (t.ctypes.data for t in keep["tables"])
    execs = np.arange(1, p.slot_map_rows + 1, dtype=np.int64) * 100  # graph of row r: 100 (r+1)
    routing = (np.zeros((T, K), np.int64), np.zeros((T, K), np.float32))
    call = Call(
        execs=execs.ctypes.data,
        n_execs=len(execs),
        ids_host=routing[0].ctypes.data,
        w_host=routing[1].ctypes.data,
        pairs=T * K,
        x_dev=X_DEV,
        x_host=X_HOST,
        x_bytes=X_BYTES,
    )
    p.native.reserve(T * K)
    return p, d, call, rt, (keep, execs, maps, routing)


def run(p, d, call, routing, layer, ids, weights) -> int:
    """One layer call through drive.c, its routing in the call's host buffers."""
    routing[0][:], routing[1][:] = ids, weights
    rc = driver.library().oled_layer(
        ctypes.byref(d), ctypes.byref(call), layer, p.step, p.clock, p.block, 1.0, 0
    )
    p.native.finish(layer, rc, ids)
    return rc


class Recorder:
    """A launches.Launcher over the test's tables: the Python path's runtime calls as
    Runtime's tuples (events numbered from 1), its timed event pairs as drive.c logs them."""

    compute, copy, finish, stage_capacity, ahead = COMPUTE, COPY, COPY, STAGE_CAPACITY, None

    def __init__(self, maps: np.ndarray) -> None:
        self.maps = maps
        self.calls: list[tuple] = []
        self.log: list[tuple] = []  # (layer, kind, start, end): kind 0 copies, 1 a stall
        self.events = itertools.count(1)
        self.stage_free = None

    def record(self, stream) -> int:
        event = next(self.events)
        self.calls.append(("record", event, stream))
        return event

    def wait(self, stream, event) -> None:
        self.calls.append(("wait", stream, event))

    def timed(self, layer, start, end, copy) -> None:
        self.log.append((layer, 0 if copy else 1, start, end))

    def copy_rows(self, layer, experts, slots, stage) -> None:
        """Every w13 row, then every w2 row, one cudaMemcpyAsync each (copies.launch)."""
        src = (SRC13 + 10**7 * layer, SRC2 + 10**7 * layer)
        dst = (STAGE13, STAGE2) if stage else (CACHE13 + 10**7 * layer, CACHE2 + 10**7 * layer)
        for s_base, d_base, z in zip(src, dst, (Z13, Z2), strict=True):
            self.calls.extend(
                ("copy", d_base + s * z, s_base + e * z, z, 1, COPY)
                for e, s in zip(experts, slots, strict=True)
            )

    def copies_issued(self, layer) -> None:
        pass

    def activations(self) -> None:
        self.calls.append(("copy", X_HOST, X_DEV, X_BYTES, 2, COMPUTE))

    def send_maps(self, layer, rows) -> None:
        at = layer * self.maps.shape[1] * E * 8
        self.calls.append(
            ("copy", MAPS_DEV + at, self.maps.ctypes.data + at, rows * E * 8, 1, COMPUTE)
        )

    def run_pass(self, row) -> None:
        self.calls.append(("graph", 100 * (row + 1), COMPUTE))  # setup's graph of row r


def numbered(calls: list[tuple], log: list) -> tuple[list[tuple], list[tuple]]:
    """Calls and logged pairs with each event named by the order it first appears in."""
    names: dict[int, int] = {}

    def name(event: int) -> int:
        return names.setdefault(event, len(names))

    out = []
    for c in calls:
        if c[0] == "record":
            c = ("record", name(c[1]), c[2])
        elif c[0] == "wait":
            c = ("wait", c[1], name(c[2]))
        out.append(c)
    return out, [(int(a), int(k), name(int(s)), name(int(e))) for a, k, s, e in log]


@pytest.fixture(autouse=True)
def needs_compiler():
    try:
        native.library()
    except native.NativeUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("comp", ["transfer", "cpu"])
def test_launches_follow_the_python_path(comp):
    """Every layer call: drive.c's runtime calls and timed event pairs are the Python path's
    for the same plan (launches.launch_layer): the copies into the plan's slots, the
    activations when CPU experts are planned, the slot maps, the passes' graphs, each wait on
    the event its copies completed."""
    compensation = C.TransferOnly() if comp == "transfer" else C.CpuOnly()
    p, d, call, rt, (keep, _, maps, routing) = setup(compensation)
    python = Recorder(maps)
    ref = ctypes.byref(d)
    rng = np.random.default_rng(0)
    staged = cpu = 0
    for step, layer in itertools.product(range(6), range(L)):
        p.begin_step(step=step, block=0)
        ids = rng.integers(0, E, (T, K))
        rt.calls.clear()
        python.calls.clear()
        python.log.clear()
        logged = d.logged
        rc = run(p, d, call, routing, layer, ids, rng.random((T, K)).astype(np.float32))
        assert rc == 1
        plan = p.native.unpack(layer)
        p.caches[layer].check()  # drive.c counted the free slots as the cache does
        cpu_ready = launch_layer(python, layer, plan)
        assert numbered(rt.calls, keep["log"][logged : d.logged]) == numbered(
            python.calls, python.log
        )
        assert (cpu_ready is not None) == bool(d.cpu_ready) == (len(plan.cpu_experts) > 0)
        for i, c in enumerate(rt.calls):  # each wait is on an event recorded before it
            if c[0] == "wait" and c[1] == COMPUTE:
                copy_done = [x[1] for x in rt.calls[:i] if x[0] == "record" and x[2] == COPY]
                assert c[2] == copy_done[-1]
        recorded = [c[1] for c in rt.calls if c[0] == "record"]
        assert len(set(recorded)) == len(recorded), "an event recorded twice in one call"
        staged += plan.map_rows > STAGED
        cpu += len(plan.cpu_experts) > 0
        if d.used > 400:
            assert driver.library().oled_collect(ref) == 0
            python.stage_free = None  # both streams idle: the stage is free
    assert cpu if comp == "cpu" else staged, "the routing never needed the case under test"


def test_staged_rounds_wait_only_for_their_part_of_the_stage():
    """A round's copies wait for the pass STAGE_ROUNDS rounds before it (the last users of its
    part of the stage), not for the previous round's, so they run while that pass computes;
    the next call's first rounds wait for the last pass of this one."""
    p, d, call, rt, (keep, _, _, routing) = setup(C.TransferOnly())  # keep: what d points to
    ids = np.arange(T * K).reshape(T, K) % E  # every expert: rounds through the stage
    before = []  # the stage's users before the first call: none
    for step in range(2):
        p.begin_step(step=step, block=0)
        rt.calls.clear()
        assert run(p, d, call, routing, 0, ids, np.ones((T, K), np.float32)) == 1
        rounds = p.native.unpack(0).map_rows - STAGED
        assert rounds > STAGE_ROUNDS
        after = {}  # round -> the event recorded after its pass
        waits = []  # the copy stream's waits, in order
        for i, c in enumerate(rt.calls):
            if c[0] == "graph" and c[1] >= 100 * (STAGED + 1):
                after[c[1] // 100 - 1 - STAGED] = rt.calls[i + 1][1]
            if c[0] == "wait" and c[1] == COPY:
                waits.append(c[2])
        later = [after[n - STAGE_ROUNDS] for n in range(STAGE_ROUNDS, rounds)]
        assert waits == before * STAGE_ROUNDS + later
        before = [after[rounds - 1]]  # both parts' users for the next call: this last pass
        assert d.stage_free == before[0]


def test_counts_and_collected_times_match_the_plans():
    p, d, call, rt, (keep, _, _, routing) = setup(C.TransferOnly())
    ref, rng = ctypes.byref(d), np.random.default_rng(1)
    want = np.zeros((L, len(COUNTS.entries)))
    col = COUNTS.index
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
    assert driver.library().oled_collect(ref) == 0
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
    lib = driver.library()
    assert lib.oled_layer(ctypes.byref(d), ctypes.byref(call), 0, 0, 0, 0, 1.0, 0) == -3
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
    want = [
        (CACHE13 + s * Z13, SRC13 + e * Z13)
        for e, s in zip(plan.copy_experts, plan.copy_slots, strict=True)
    ]
    assert [(c[1], c[2]) for c in copies[:n]] == want


LAND13, LAND2, LAND_ROWS, DESC_DEV, DECODER = 11 * 10**9, 12 * 10**9, 2, 13 * 10**9, 73
EXECS = (901, 902)  # the decoder graph of each landing part
LANDED, DECODED = (
    (9001, 9002),
    (9003, 9004),
)  # each part's events: after its landing, after its decode
P13, P2 = 1600, 800  # bf16 bytes of a row; the encoded rows are Z13, Z2


def with_decoder(d: Drive, ring_rows: int, used: int = 0) -> tuple[np.ndarray, np.ndarray, list]:
    """Point d at a decoder (oled.offload.encoded): its ring [ring_rows, stride] and count of
    taken descriptors, and the arrays d reads (keep them alive)."""
    ring = np.zeros((ring_rows, 1 + 4 * LAND_ROWS), np.int64)
    taken = np.full(1, used, np.int64)
    execs = np.array(EXECS, np.int64)
    events = (_p * (2 * PARTS))(*LANDED, *DECODED)
    d.decoder, d.decode_execs, d.land_events = DECODER, execs.ctypes.data, ctypes.addressof(events)
    d.land13, d.land2, d.land_rows, d.plain13, d.plain2 = LAND13, LAND2, LAND_ROWS, P13, P2
    d.desc_host, d.desc_dev, d.desc_stride = ring.ctypes.data, DESC_DEV, ring.shape[1]
    d.desc_cap, d.desc_used = ring_rows, taken.ctypes.data
    return ring, taken, [execs, events]


def test_encoded_copies_land_in_turns_and_decode_on_their_own_stream():
    """With a decoder: each round of LAND_ROWS experts waits on the copy stream for the last
    decode of its landing part (the parts taken in turn by ring index, across calls), sends
    its descriptor to the part's row, lands in the part's rows and records the part's landing;
    the decoder's stream waits for it, replays the part's graph and records the decode. The
    descriptor maps every landed row to its slot; the copies are timed to the decoder's stream
    and the compute stream waits there."""
    p, d, call, rt, (*_, routing) = setup(C.TransferOnly())
    ring, used, _keep = with_decoder(d, 64)
    ids = np.arange(T * K).reshape(T, K) % E  # misses everywhere: copies needed
    taken = 0
    for step in range(2):
        p.begin_step(step=step, block=0)
        rt.calls.clear()
        assert run(p, d, call, routing, 0, ids, np.ones((T, K), np.float32)) == 1
        plan = p.native.unpack(0)
        experts, slots = plan.copy_experts, plan.copy_slots
        staged = [
            len(plan.stage_experts[lo : lo + STAGE_CAPACITY])
            for lo in range(0, len(plan.stage_experts), STAGE_CAPACITY)
        ]
        rounds = -(-len(experts) // LAND_ROWS)
        assert used[0] - taken == rounds + sum(-(-n // LAND_ROWS) for n in staged) > PARTS
        assert rounds > 1 or step > 0  # the second call: hits and staged rounds
        graphs = [c for c in rt.calls if c[0] == "graph" and c[2] == DECODER]
        assert [c[1] for c in graphs] == [EXECS[(taken + i) % PARTS] for i in range(len(graphs))]
        for r in range(rounds):  # the cache's copies
            i = taken + r
            part, into = i % PARTS, slots[LAND_ROWS * r : LAND_ROWS * (r + 1)]
            k = len(into)
            q, row = ring[i], part * LAND_ROWS + np.arange(k)
            assert q[0] == 2 * k
            landed = [*(row * Z13), *(LAND2 - LAND13 + row * Z2)]
            dest = [*(CACHE13 + into * P13 - LAND13), *(CACHE2 + into * P2 - LAND13)]
            assert q[1 : 1 + 4 * k : 2].tolist() == landed and q[2 : 2 + 4 * k : 2].tolist() == dest
            desc = DESC_DEV + 8 * part * ring.shape[1]
            at = rt.calls.index(("copy", desc, ring[i].ctypes.data, 8 * (1 + 4 * k), 1, COPY))
            assert rt.calls[at - 1] == ("wait", COPY, DECODED[part])
            land = rt.calls[at + 1 : at + 1 + 2 * k]
            assert [c[1:3] for c in land[:k]] == [
                (LAND13 + (part * LAND_ROWS + j) * Z13, SRC13 + e * Z13)
                for j, e in enumerate(experts[LAND_ROWS * r : LAND_ROWS * (r + 1)])
            ]
            assert rt.calls[at + 1 + 2 * k : at + 5 + 2 * k] == [
                ("record", LANDED[part], COPY),
                ("wait", DECODER, LANDED[part]),
                ("graph", EXECS[part], DECODER),
                ("record", DECODED[part], DECODER),
            ]
        waits = [c for c in rt.calls if c[0] == "wait" and c[1] == COMPUTE]
        assert waits and all(rt.stream_of[c[2]] == DECODER for c in waits)
        taken = int(used[0])


def test_encoded_copies_decline_when_the_ring_is_full():
    p, d, call, rt, (*_, routing) = setup(C.TransferOnly())
    _, used, _keep = with_decoder(d, 1, used=1)
    ids = np.arange(T * K).reshape(T, K) % E
    assert run(p, d, call, routing, 0, ids, np.ones((T, K), np.float32)) == 0
    assert rt.calls == [] and used[0] == 1


def _swapped(struct: type[ctypes.Structure], i: int, j: int) -> type[ctypes.Structure]:
    """A ctypes mirror of `struct` with fields i and j swapped."""
    fields = list(struct._fields_)
    fields[i], fields[j] = fields[j], fields[i]
    return type("Swapped", (ctypes.Structure,), {"_fields_": fields})


def test_the_drive_contract_holds_and_names_every_field():
    reported = clib.contract(driver.library(), "drive")
    assert [f for f, *_ in reported["Drive"].rows] == [f for f, _ in Drive._fields_]
    assert reported["Call"].size == ctypes.sizeof(Call)
    assert [n for n, *_ in reported["counts"].rows] == list(FIELDS)  # the engine metrics'
    assert {t.name for t in DRIVE_PART.tables} == {"counts", "landing"}


def test_a_drive_mirror_with_two_fields_swapped_is_refused():
    structs = {"Drive": _swapped(Drive, 2, 3), "Call": Call}
    with pytest.raises(
        clib.ContractError,
        match=r"drive.c and its ctypes mirror disagree "
        r"on Drive field 2: C has 'record' at offset 16 \(8 bytes\), the "
        r"mirror 'wait' at offset 16 \(8 bytes\)",
    ):
        clib.check(driver.library(), "drive", structs, {t.name: t.index for t in DRIVE_PART.tables})


def test_a_counts_table_out_of_order_is_refused():
    wrong = COUNTS.index | {"hits": 1, "misses": 0}
    with pytest.raises(clib.ContractError, match="on the counts: 'hits' is 0 in C, 1 in Python"):
        clib.check(
            driver.library(),
            "drive",
            {"Drive": Drive, "Call": Call},
            {"counts": wrong, "landing": {"parts": PARTS}},
        )
