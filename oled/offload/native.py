"""The compiled planner: `Planner.plan` in C (plan.c) for the built-in policies, and the engine's
layer launches (drive.c, used through oled.offload.driver).

The C code is built on first use with the system's C compiler (`$CC`, else `cc`) into the cache
directory ($OLED_HOME/native) and loaded with ctypes. It decides exactly as the Python planner:
the same floating-point operations in the same order, the same tie rules (tests check every
field of every plan). Policies it does not know, and machines without a compiler, keep the
Python planner. It holds the addresses of the caches', the policies' and the planner's arrays:
those are updated in place, never replaced, except the caches that a resize rebuilds
(`bind_caches`).
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
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from oled.env import cache_home
from oled.offload.planner import LayerPlan
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.policies.base import CompensationPolicy, Load, RetentionPolicy

if TYPE_CHECKING:
    from oled.offload.planner import Planner

SOURCES = tuple(Path(__file__).with_name(name) for name in ("plan.c", "drive.c"))
HEADERS = (Path(__file__).with_name("plan.h"),)  # in the build's tag, found beside the sources
FLAGS = ("-O2", "-std=c11", "-shared", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off",
         "-fno-fast-math")  # fmt: skip  # no FMA contraction: the same rounding as numpy
REGIONS = ("hits", "misses", "gpu_experts", "copy_experts", "copy_slots", "stage_experts",
           "stage_slots", "cpu_experts", "cpu_tokens", "evicted", "counts")  # fmt: skip
# plan.c's header after the regions' starts: where the slot map copy starts and the output
# ends, the cache's free slots after the plan, the slot-map rows written
SLOT_MAP, END, FREE, MAP_ROWS = range(len(REGIONS), len(REGIONS) + 4)

RETENTION = {R.LRURetention: 1, R.LFURetention: 2, R.ScoreEMARetention: 3,
             R.ConfidenceRetention: 4}  # fmt: skip
COMPENSATION = {C.TransferOnly: 1, C.Resident: 1, C.CpuOnly: 2, C.BatchThreshold: 3,
                C.MakespanCompensation: 4, C.CooperativeCompensation: 5,
                C.IntervalRefresh: 6, C.StaticHot: 7}  # fmt: skip


class NativeUnavailable(RuntimeError):
    """The compiled planner cannot be built or loaded here."""


_p = ctypes.c_void_p
_i = ctypes.c_int64
_d = ctypes.c_double


class Bind(ctypes.Structure):
    """Mirrors `Bind` in plan.c: the planner's arrays and its policies' parameters."""

    _fields_ = [
        ("num_layers", _i), ("num_experts", _i), ("stage_capacity", _i), ("stats_alpha", _d),
        ("slot_of", _p), ("expert_in", _p), ("capacity", _p),
        ("ws", _p), ("reuse", _p), ("samples", _p), ("prev_used", _p), ("stats", _p),
        ("ret_kind", _i), ("ret_flag", _i), ("priority", _p), ("masked", _p), ("stable", _p),
        ("current", _p), ("ret_a", _d), ("ret_b", _d),
        ("comp_kind", _i), ("comp_int", _i), ("comp_a", _d),
        ("learned", _p), ("loaded", _p), ("seen", _p),
        ("copy_per", _d), ("copy_fixed", _d), ("cpu_fixed", _d), ("cpu_tok", _d),
        ("scratch", _p), ("ids", _p), ("weights", _p), ("routing_cap", _i), ("out", _p),
        ("maps", _p),
        ("map_rows", _i),
    ]  # fmt: skip


def unsupported(retention: RetentionPolicy, compensation: CompensationPolicy) -> str | None:
    """Why the compiled planner cannot run these policies (None when it can)."""
    for policy, known in ((retention, RETENTION), (compensation, COMPENSATION)):
        if type(policy) not in known:
            return f"{type(policy).__name__} has no compiled version"
    if isinstance(compensation, C.IntervalRefresh) and compensation.interval < 1:
        return f"IntervalRefresh.interval must be >= 1, got {compensation.interval}"
    return None


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    found = shutil.which(cc) or shutil.which("gcc")
    if not found:
        raise NativeUnavailable(f"no C compiler found (tried $CC, {cc!r} and 'gcc')")
    return found


def library() -> ctypes.CDLL:
    """plan.c built (once per source and machine) and loaded; NativeUnavailable when that
    fails (remembered: a failed build is not retried in this process)."""
    lib = _load()
    if isinstance(lib, NativeUnavailable):
        raise lib
    return lib


@cache
def _load() -> ctypes.CDLL | NativeUnavailable:
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for source in (*SOURCES, *HEADERS):
        try:
            digest.update(source.read_bytes())
        except OSError as e:
            return NativeUnavailable(f"cannot read {source}: {e}")
    tag = digest.hexdigest()[:16]
    machine = f"{sys.platform}-{platform.machine()}"
    target = cache_home() / "native" / f"plan-{machine}-{tag}.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except NativeUnavailable as e:
        return e
    except OSError as e:
        return NativeUnavailable(f"cannot build or load {target}: {e}")
    lib.oled_plan.restype = _i
    lib.oled_plan.argtypes = [_p, _i, _i, _i, _i, _d, _d, _d, _i]
    lib.oled_layout.restype = None
    lib.oled_layout.argtypes = [_i, _p]
    lib.oled_layer.restype = _i
    lib.oled_layer.argtypes = [_p, _p, _i, _i, _i, _d, _i]
    lib.oled_collect.restype = _i
    lib.oled_collect.argtypes = [_p]
    lib.oled_drive_counts.restype = _i
    return lib


def _build(target: Path) -> None:
    cc = _compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)  # then renamed: no torn file
    os.close(fd)
    cmd = [cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"]
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
        lens = np.zeros(5, np.int64)  # scratch, out, header, counters, regions (plan.c)
        self.lib.oled_layout(E, _addr(lens))
        scratch, out, self.header, counters, regions = lens.tolist()
        self.stats = p.stats.compiled  # [L, counters]
        if self.stats.shape != (L, counters) or regions != len(REGIONS):
            raise NativeUnavailable("plan.c and oled/offload/native.py disagree on the layout")
        self.scratch = np.zeros(scratch, np.int64)
        self.out = np.zeros(out, np.int64)
        b = self.bind = Bind(num_layers=L, num_experts=E, stage_capacity=p.stage_capacity,
                             stats_alpha=p.stats_alpha, scratch=_addr(self.scratch),
                             out=_addr(self.out))  # fmt: skip
        self._routing(64 * p.top_k)
        self._tables = [np.zeros(L, np.int64) for _ in range(3)]  # slot_of, expert_in, capacity
        b.slot_of, b.expert_in, b.capacity = (_addr(t) for t in self._tables)
        b.ws, b.reuse, b.samples = _addr(p._ws), _addr(p._reuse), _addr(p._samples)
        b.prev_used, b.stats = _addr(p._prev_used), _addr(self.stats)
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
        p.stats.rows[layer][11] += predicted_hits
        slot_of = out[h[SLOT_MAP] :].view(np.int32)[: self.E]
        return LayerPlan(
            layer=layer,
            slot_of=slot_of,
            predicted_hits=predicted_hits,
            map_rows=h[MAP_ROWS],
            **parts,
        )
