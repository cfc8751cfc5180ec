"""The compiled planner: `Planner.plan` in C (plan.c) for the built-in policies, built into one
library with the offload engine's layer launches (oled/offload/drive.c, used through
oled.offload.driver).

The C code is built on first use with the system's C compiler (`$CC`, else `cc`, else `gcc`)
into the cache directory ($OLED_HOME/native) and loaded with ctypes. It decides exactly as the
Python planner: the same floating-point operations in the same order, the same tie rules (tests
check every field of every plan). Policies it does not know, and machines without a compiler,
keep the Python planner. It holds the addresses of the caches', the policies' and the
planner's arrays: those are updated in place, never replaced, except the caches that a resize
rebuilds (`bind_caches`).

On load the C side's contract (each struct's size and fields, its tables of names) is checked
against the Python mirrors (`Bind`, the policy kinds, the counters, the output's layout): any
difference is a ContractError before anything runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from oled.paths import cache_home
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.policies.base import CompensationPolicy, Load, RetentionPolicy
from oled.policies.planner import COPIED, COUNTERS, HIT, STAGE_ROUNDS, STAGED, LayerPlan

if TYPE_CHECKING:
    from oled.policies.planner import Planner

_HERE = Path(__file__).parent
# drive.c: the offload engine's layer launches, built into the same library (including plan.h)
SOURCES = (_HERE / "plan.c", _HERE.parent / "offload" / "drive.c")
HEADERS = (_HERE / "plan.h",)  # in the build's tag; found through -I
FLAGS = (
    "-O2",
    "-std=c11",
    "-shared",
    "-fPIC",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fno-fast-math",
)  # no FMA contraction: the same rounding as numpy
REGIONS = (
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
)
# plan.c's header after the regions' starts: where the slot map copy starts and the output
# ends, the cache's free slots after the plan, the slot-map rows written
HEADER_FIELDS = ("slot_map", "end", "free", "map_rows")
SLOT_MAP, END, FREE, MAP_ROWS = range(len(REGIONS), len(REGIONS) + len(HEADER_FIELDS))

RETENTION = {R.LRURetention: 1, R.LFURetention: 2, R.ScoreEMARetention: 3, R.ConfidenceRetention: 4}
COMPENSATION = {
    C.TransferOnly: 1,
    C.Resident: 1,
    C.CpuOnly: 2,
    C.BatchThreshold: 3,
    C.MakespanCompensation: 4,
    C.CooperativeCompensation: 5,
    C.IntervalRefresh: 6,
    C.StaticHot: 7,
}
_PREDICTED_HITS = COUNTERS.index("predicted_hits")


class NativeUnavailable(OSError):
    """The compiled planner cannot be built or loaded here: what this machine lacks (a C
    compiler, a loadable library), so an OSError, which commands report as one line."""


class ContractError(RuntimeError):
    """The compiled code and its Python mirrors (ctypes structs, tables) disagree: a defect of
    the package, never a reason to plan in Python instead, so it is raised wherever the library
    is asked for (in every planner mode)."""


_p = ctypes.c_void_p
_i = ctypes.c_int64
_d = ctypes.c_double


class Bind(ctypes.Structure):
    """Mirrors `Bind` in plan.c: the planner's arrays and its policies' parameters."""

    _fields_ = [
        ("num_layers", _i),
        ("num_experts", _i),
        ("stage_capacity", _i),
        ("stats_alpha", _d),
        ("slot_of", _p),
        ("expert_in", _p),
        ("capacity", _p),
        ("ws", _p),
        ("reuse", _p),
        ("samples", _p),
        ("prev_used", _p),
        ("stats", _p),
        ("ret_kind", _i),
        ("ret_flag", _i),
        ("priority", _p),
        ("masked", _p),
        ("stable", _p),
        ("current", _p),
        ("ret_a", _d),
        ("ret_b", _d),
        ("comp_kind", _i),
        ("comp_int", _i),
        ("comp_a", _d),
        ("learned", _p),
        ("loaded", _p),
        ("seen", _p),
        ("copy_per", _d),
        ("copy_fixed", _d),
        ("cpu_fixed", _d),
        ("cpu_tok", _d),
        ("scratch", _p),
        ("ids", _p),
        ("weights", _p),
        ("routing_cap", _i),
        ("out", _p),
        ("maps", _p),
        ("map_rows", _i),
    ]


# -- the contract ---------------------------------------------------------------------------


class _Row(ctypes.Structure):
    """Mirrors `ContractRow` in plan.h (its size is checked first)."""

    _fields_ = [("name", ctypes.c_char_p), ("value", _i), ("size", _i)]


class _Table(ctypes.Structure):
    """Mirrors `Contract` in plan.h."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("size", _i),
        ("n_rows", _i),
        ("rows", ctypes.POINTER(_Row)),
    ]


@dataclass(frozen=True)
class Reported:
    """A struct's layout or a table of names as the C side reports it."""

    size: int  # the struct's sizeof; -1 for a table
    rows: tuple[tuple[str, int, int], ...]  # struct: (field, offset, size); table: (name, value, 0)


def contract(lib: ctypes.CDLL, part: str) -> dict[str, Reported]:
    """What `part`.c reports through oled_`part`_contract, by struct or table name."""
    sizes = np.zeros(2, np.int64)
    lib.oled_contract_sizes(_addr(sizes))
    mine = (ctypes.sizeof(_Row), ctypes.sizeof(_Table))
    if tuple(sizes.tolist()) != mine:
        raise ContractError(
            f"plan.h's contract rows are {sizes.tolist()} bytes, the mirrors {list(mine)}"
        )
    fn = getattr(lib, f"oled_{part}_contract")
    fn.restype, fn.argtypes = _i, [ctypes.POINTER(ctypes.POINTER(_Table))]
    tables = ctypes.POINTER(_Table)()
    n = fn(ctypes.byref(tables))
    return {
        t.name.decode(): Reported(
            t.size, tuple((r.name.decode(), r.value, r.size) for r in t.rows[: t.n_rows])
        )
        for t in tables[:n]
    }


def check(
    lib: ctypes.CDLL,
    part: str,
    structs: dict[str, type[ctypes.Structure]],
    tables: dict[str, dict[str, int]],
) -> None:
    """`part`.c's contract against the Python mirrors: ctypes `structs` and `tables` (name ->
    value) by the C side's names; ContractError at the first difference."""
    reported = contract(lib, part)
    unchecked = set(reported) ^ (set(structs) | set(tables))
    if unchecked:
        raise ContractError(
            f"{part}.c and its Python mirrors name different structs and "
            f"tables: {sorted(unchecked)}"
        )
    for name, struct in structs.items():
        check_struct(name, struct, reported[name], source=f"{part}.c")
    for name, table in tables.items():
        check_table(name, table, reported[name], source=f"{part}.c")


def check_struct(
    name: str, struct: type[ctypes.Structure], reported: Reported, *, source: str
) -> None:
    """The ctypes mirror `struct` of C's struct `name`: the same fields, in order, at the same
    offsets with the same sizes, and the same size; else ContractError."""
    fields = [f[0] for f in struct._fields_]
    mine = [(f, getattr(struct, f).offset, getattr(struct, f).size) for f in fields]
    for i, (theirs, ours) in enumerate(zip_longest(reported.rows, mine)):
        if theirs != ours:
            raise ContractError(
                f"{source} and its ctypes mirror disagree on {name} field {i}: "
                f"C has {_field(theirs)}, the mirror {_field(ours)}"
            )
    if ctypes.sizeof(struct) != reported.size:
        raise ContractError(
            f"{source} and its ctypes mirror disagree on sizeof({name}): "
            f"{reported.size} in C, {ctypes.sizeof(struct)} in the mirror"
        )


def check_table(name: str, table: dict[str, int], reported: Reported, *, source: str) -> None:
    """The Python side's `table` (name -> value) against C's table `name`; else ContractError."""
    theirs = {key: value for key, value, _ in reported.rows}
    for key in dict.fromkeys([*theirs, *table]):
        if theirs.get(key) != table.get(key):
            raise ContractError(
                f"{source} and its Python mirror disagree on the {name}: "
                f"{key!r} is {_value(theirs.get(key))} in C, "
                f"{_value(table.get(key))} in Python"
            )


def _field(row: tuple[str, int, int] | None) -> str:
    return "no field" if row is None else f"{row[0]!r} at offset {row[1]} ({row[2]} bytes)"


def _value(value: int | None) -> str:
    return "missing" if value is None else str(value)


def plan_tables() -> dict[str, dict[str, int]]:
    """The tables plan.c reports, as the Python side has them."""
    return {
        "retention kinds": {cls.__name__: kind for cls, kind in RETENTION.items()},
        "compensation kinds": {cls.__name__: kind for cls, kind in COMPENSATION.items()},
        "counters": {name: i for i, name in enumerate(COUNTERS)},
        "regions": {name: i for i, name in enumerate(REGIONS)},
        "header": {name: SLOT_MAP + i for i, name in enumerate(HEADER_FIELDS)},
        "slot-map rows": {
            "hit": HIT,
            "copied": COPIED,
            "staged": STAGED,
            "stage rounds": STAGE_ROUNDS,
        },
    }


# -- what runs compiled, building and loading ---------------------------------------------------


def unsupported(retention: RetentionPolicy, compensation: CompensationPolicy) -> str | None:
    """Why the compiled planner cannot run these policies (None when it can)."""
    for policy, known in ((retention, RETENTION), (compensation, COMPENSATION)):
        if type(policy) not in known:
            return f"{type(policy).__name__} has no compiled version"
    if isinstance(compensation, C.IntervalRefresh) and compensation.interval < 1:
        return f"IntervalRefresh.interval must be >= 1, got {compensation.interval}"
    return None


PYTHON_PLANNER = 'runtime.planner = "python" in the recipe, or --set runtime.planner=python'


def _compiler() -> str:
    """The C compiler to build with: $CC, else `cc`, else `gcc` (found on $PATH)."""
    tried = [f"$CC={os.environ['CC']}"] if os.environ.get("CC") else ["cc"]
    found = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if not found:
        raise NativeUnavailable(
            f"no C compiler found (tried {', '.join([*tried, 'gcc'])} on $PATH): the compiled "
            f"planner needs one; install one or set $CC, or plan in Python ({PYTHON_PLANNER})"
        )
    return found


def library() -> ctypes.CDLL:
    """plan.c and drive.c built (once per source and machine), loaded and plan.c's contract
    checked; NativeUnavailable when that fails (remembered: a failed build is not retried in
    this process), a ContractError whenever the contract does not hold."""
    lib = _load()
    if isinstance(lib, NativeUnavailable):
        raise lib
    return lib


@cache
def _load() -> ctypes.CDLL | NativeUnavailable:
    target = _target()
    if isinstance(target, NativeUnavailable):
        return target
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
        _declare(lib)
        check(lib, "plan", {"Bind": Bind}, plan_tables())
    except NativeUnavailable as e:
        return e
    except OSError as e:
        return NativeUnavailable(f"cannot build or load {target}: {e}")
    return lib


def _target() -> Path | NativeUnavailable:
    """The library's path in the cache, tagged by the flags and every source and header."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for source in (*SOURCES, *HEADERS):
        try:
            digest.update(source.read_bytes())
        except OSError as e:
            return NativeUnavailable(f"cannot read {source}: {e}")
    tag = digest.hexdigest()[:16]
    machine = f"{sys.platform}-{platform.machine()}"
    return cache_home() / "native" / f"plan-{machine}-{tag}.so"


def _declare(lib: ctypes.CDLL) -> None:
    """plan.c's entry points' signatures (drive.c's: oled.offload.driver)."""
    lib.oled_plan.restype = _i
    lib.oled_plan.argtypes = [_p, _i, _i, _i, _i, _d, _d, _d, _i]
    lib.oled_layout.restype = None
    lib.oled_layout.argtypes = [_i, _p]
    lib.oled_contract_sizes.restype = None
    lib.oled_contract_sizes.argtypes = [_p]


def _build(target: Path) -> None:
    cc = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # then renamed: no torn file
    os.close(fd)
    includes = [f"-I{d}" for d in dict.fromkeys(h.parent for h in HEADERS)]
    cmd = [cc, *FLAGS, *includes, "-o", tmp, *map(str, SOURCES), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise NativeUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class CompiledPlan:
    """`Planner.plan` through plan.c over the planner's own arrays (bound once; caches again
    after a resize)."""

    def __init__(self, planner: Planner) -> None:
        self.lib = library()
        self.planner = p = planner
        L, E = p.num_layers, p.num_experts
        self.E = E
        lens = np.zeros(3, np.int64)  # scratch, out, header (plan.c)
        self.lib.oled_layout(E, _addr(lens))
        scratch, out, self.header = lens.tolist()
        self.stats = p.stats.compiled  # [L, counters]
        self.scratch = np.zeros(scratch, np.int64)
        self.out = np.zeros(out, np.int64)
        b = self.bind = Bind(
            num_layers=L,
            num_experts=E,
            stage_capacity=p.stage_capacity,
            stats_alpha=p.stats_alpha,
            scratch=_addr(self.scratch),
            out=_addr(self.out),
        )
        self._routing(64 * p.top_k)
        self._tables = [np.zeros(L, np.int64) for _ in range(3)]  # slot_of, expert_in, capacity
        b.slot_of, b.expert_in, b.capacity = (_addr(t) for t in self._tables)
        b.ws, b.reuse, b.samples = _addr(p.working_set), _addr(p.reuse), _addr(p.samples)
        b.prev_used, b.stats = _addr(p.last_counts), _addr(self.stats)
        self._retention(p.retention)
        self._compensation(p.compensation)
        cost = p.cost
        b.copy_per, b.copy_fixed = cost.copy_ms_per_expert, cost.copy_fixed_ms
        b.cpu_fixed, b.cpu_tok = cost.cpu_fixed_ms, cost.cpu_ms_per_token
        self.ref = ctypes.byref(b)
        self.lru = type(p.retention) is R.LRURetention
        comp = p.compensation
        self.cooperative = comp if isinstance(comp, C.CooperativeCompensation) else None
        self.bind_caches()

    def _routing(self, pairs: int) -> None:
        """Room for the routing of `pairs` (token, expert) pairs."""
        self.ids = np.zeros(pairs, np.int64)  # flat [T * K]
        self.weights = np.zeros(pairs, np.float64)
        self.bind.ids, self.bind.weights = _addr(self.ids), _addr(self.weights)
        self.bind.routing_cap = pairs

    def attach_maps(self, maps: np.ndarray) -> None:
        """Write each plan's slot maps into `maps` [L, R, E] int64 (Planner.attach_maps)."""
        self._maps = maps
        self.bind.maps, self.bind.map_rows = _addr(maps), maps.shape[1]

    def _retention(self, ret: RetentionPolicy) -> None:
        b = self.bind
        b.ret_kind = RETENTION[type(ret)]
        if isinstance(ret, R.ConfidenceRetention):
            b.priority, b.masked = _addr(ret.score), _addr(ret.masked)
            b.stable, b.current = _addr(ret.stable), _addr(ret.current)
            b.ret_a, b.ret_b = ret.now_weight, ret.reuse_scale
            return
        b.priority = _addr(ret.priority)
        if isinstance(ret, R.LFURetention):
            b.ret_a, b.ret_flag = ret.decay, int(ret.per_token)
        elif isinstance(ret, R.ScoreEMARetention):
            b.ret_a = ret.alpha

    def _compensation(self, comp: CompensationPolicy) -> None:
        b = self.bind
        b.comp_kind = COMPENSATION[type(comp)]
        if isinstance(comp, C.CooperativeCompensation):
            b.comp_a = comp.future_weight * comp.horizon
        elif isinstance(comp, C.BatchThreshold):
            b.comp_a = comp.min_tokens
        elif isinstance(comp, C.IntervalRefresh):
            b.comp_int, b.comp_a = comp.interval, comp.min_tokens
        elif isinstance(comp, C.StaticHot):
            b.comp_int = comp.learn_blocks
            b.learned, b.loaded, b.seen = (_addr(a) for a in (comp.learned, comp.loaded, comp.seen))

    def bind_caches(self) -> None:
        """Point at the layers' current slot maps (after construction and after resizes)."""
        slot_of, expert_in, capacity = self._tables
        for layer, c in enumerate(self.planner.caches):
            slot_of[layer], expert_in[layer], capacity[layer] = (
                _addr(c.slot_of),
                _addr(c.expert_in),
                c.capacity,
            )

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
            self.ref, layer, n, p.step, p.block, copy_q, cpu_q, self.slowdown(), p.gpu_only
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
        self.planner.caches[layer].n_free = int(self.out[FREE])
        if self.lru:
            self.planner.retention.now = self.planner.step

    def unpack(self, layer: int) -> LayerPlan:
        """The LayerPlan that the last `run` left in the output buffer."""
        p = self.planner
        h = self.out[: self.header].tolist()  # where each array starts (plan.c's pack)
        out = self.out[: h[END]].copy()  # the plan's own
        parts = {k: out[h[i] : h[i + 1]] for i, k in enumerate(REGIONS)}
        counts = parts.pop("counts")  # [E] tokens per expert
        predicted_hits = p.ahead.score(layer, counts)  # of those copied at the layer before
        p.stats.rows[layer][_PREDICTED_HITS] += predicted_hits
        slot_of = out[h[SLOT_MAP] :].view(np.int32)[: self.E]
        return LayerPlan(
            layer=layer,
            slot_of=slot_of,
            predicted_hits=predicted_hits,
            map_rows=h[MAP_ROWS],
            **parts,
        )
