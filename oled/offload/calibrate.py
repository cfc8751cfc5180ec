"""A micro-benchmark that fits the cost model to this machine, stored per machine key.

Measured in `ROUNDS` interleaved rounds, each timing the fastest of `REPEATS` calls (a preempted
call only ever takes longer); each figure is the median of its rounds that lie inside physical
bounds (`bounds`). A calibration is stored only when it was measured with every configured
thread on a core of its own (oled.threads.contended, from /proc/stat before and after) and each
figure had `QUORUM` rounds inside its bounds. Otherwise this process uses it, marked "not
stored", and says so in one line: a stored calibration drives every later run's decisions, so
one taken beside a busy neighbour would mislead them all, silently. A stored one is read back
after its figures pass the bounds, then re-checked in a few milliseconds (`recheck`); a
disagreement is reported, in one line and in every report that uses it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import platform
import re
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from oled import kernels
from oled.kernels import cpu
from oled.model.experts import ExpertStore, expert_pairs
from oled.offload.copies import Rows, launch
from oled.offload.host_experts import HostExperts
from oled.policies.base import CostModel
from oled.threads import contended, loadavg, others_busy, read_sample, visible_cpus

_PATHS = "rows-6"  # the engine's copy and CPU-expert paths: a new one measures again
_METHOD = "rounds-3"  # how the figures are measured and checked: a new method measures again

ROUNDS = 5  # interleaved rounds, each timing every figure once
REPEATS = 3  # calls per timing in a round; the fastest counts
QUORUM = 3  # rounds inside its bounds that a figure needs for the calibration to be stored

RECHECK_FACTOR = 3.0  # a stored figure and the start-up re-check disagree beyond this ratio
RECHECK_SLACK_MS = 0.02  # ... and by more than this (timer and call overhead on tiny experts)
RECHECK_BUDGET_MS = 10.0  # time per re-check probe after its warm-up call

# Physical bounds on the figures. They hold on an H200 host (pinned copies 46-53 GB/s, a grouped
# GEMM's fixed cost about 0.1 ms, a CPU expert 0.2-1.2 ms: DESIGN.md section 5) and on a 2-core
# CPU-only machine (copies are memcpy of 10-40 GB/s, fixed costs below 2 ms), with room for any
# host between; a figure outside them was timed through a preemption, or its fit was noise.
MAX_HOST_GBPS = 1000.0  # no copy of an expert's rows, and no CPU expert reading its weights,
# beats 1 TB/s: PCIe Gen5 x16 carries 64 GB/s, NVLink-C2C 450 GB/s, a 16-core host streams its
# memory at 86 GB/s and one core copies cache-resident rows below 200 GB/s
MIN_COPY_GBPS = 0.1  # nor is a copy slower than 0.1 GB/s (a pageable PCIe copy runs at 7 GB/s)
MAX_DEVICE_GBPS = 10_000.0  # device compute reads each expert once: H200's HBM3e is 4.8 TB/s
MAX_FIXED_MS = 10.0  # a fixed cost (launches, a hand-off, a sync) is about 0.1 ms on an H200
MAX_EXPERT_MS = 1000.0  # one expert's compute, on the CPU or the device, takes less than 1 s
MIN_TOKEN_MS = 1e-6  # a token's share of an expert is never free (a nanosecond)
MAX_TOKEN_MS = 100.0
MANY_LINE = ("cpu_many_fixed_ms", "cpu_many_ms_per_token")  # experts above cpu.MAX_TOKENS


class CalibrationWarning(UserWarning):
    """A calibration not stored, a stored one rejected, or a re-check that disagrees."""


@dataclass(frozen=True)
class Bound:
    """The physically possible range of one figure of a cost model, in milliseconds."""

    figure: str
    low: float
    high: float
    why: str

    def violation(self, value: float) -> str | None:
        """One line naming the figure and the bound it breaks; None inside the bound."""
        if self.low <= value <= self.high:
            return None
        side, limit = ("below", self.low) if value < self.low else ("above", self.high)
        return f"{self.figure} = {value:.3g} ms is {side} its bound {limit:.3g} ms ({self.why})"

    def clamp(self, value: float) -> float:
        return min(max(value, self.low), self.high)


def bounds(expert_bytes: int) -> dict[str, Bound]:
    """The bound of every measured figure of a cost model for experts of `expert_bytes`."""
    mb = expert_bytes / 1e6  # MB; 1 MB at 1 GB/s takes 1 ms
    fixed = "a fixed cost: launches, a hand-off, a sync"
    return {
        b.figure: b
        for b in (
            Bound(
                "copy_ms_per_expert",
                mb / MAX_HOST_GBPS,
                mb / MIN_COPY_GBPS,
                f"{expert_bytes} bytes at {MAX_HOST_GBPS:g} to {MIN_COPY_GBPS:g} GB/s",
            ),
            Bound("copy_fixed_ms", 0.0, MAX_FIXED_MS, fixed),
            Bound(
                "cpu_fixed_ms",
                mb / MAX_HOST_GBPS,
                MAX_EXPERT_MS,
                f"reading {expert_bytes} bytes of weights at {MAX_HOST_GBPS:g} GB/s at most",
            ),
            Bound("cpu_ms_per_token", MIN_TOKEN_MS, MAX_TOKEN_MS, "a token's share of an expert"),
            Bound("cpu_call_ms", 0.0, MAX_FIXED_MS, fixed),
            Bound("cpu_many_fixed_ms", 0.0, MAX_EXPERT_MS, "one expert's compute"),
            Bound(
                "cpu_many_ms_per_token", MIN_TOKEN_MS, MAX_TOKEN_MS, "a token's share of an expert"
            ),
            Bound("gpu_fixed_ms", 0.0, MAX_FIXED_MS, fixed),
            Bound(
                "gpu_ms_per_expert",
                mb / MAX_DEVICE_GBPS,
                MAX_EXPERT_MS,
                f"reading {expert_bytes} bytes of weights at {MAX_DEVICE_GBPS:g} GB/s at most",
            ),
        )
    }


def violation(cost: CostModel) -> str | None:
    """The first figure of `cost` outside its bound, as one line; None when all are inside
    (a many-token line of per-token cost 0 is not measured: the few-token line holds)."""
    unset = MANY_LINE if math.isinf(cost.many_from) else ()
    for name, bound in bounds(cost.expert_bytes).items():
        if name in unset:
            continue
        line = bound.violation(getattr(cost, name))
        if line is not None:
            return line
    return None


def machine_parts(store: ExpertStore, device: torch.device, threads: int) -> dict[str, str]:
    """What the measured costs depend on: the machine, the configured intra-op threads (not the
    count of the moment, which follows the load: oled.threads), torch, the expert shape and
    dtype, where the experts live, the kernels, the engine's paths and the method (a change in
    any measures again)."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": str(threads),
        "torch": torch.__version__,
        "expert shape": str(tuple(store.w13[0].shape[1:])),
        "dtype": str(store.w13[0].dtype).removeprefix("torch."),
        "pinned": str(store.pinned),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "kernels": kernels.describe(device),
        "cpu experts": cpu.describe(store.w13[0], store.w2[0])
        if device.type == "cuda"
        else "torch",
        "paths": _PATHS,
        "method": _METHOD,
    }


def machine_key(parts: dict[str, str]) -> str:
    """A short digest of `machine_parts` (the file name of its calibration)."""
    return hashlib.sha1("|".join(parts.values()).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Calibration:
    """A cost model measured on this machine, the key it is stored under, when, and under what
    load; `stored` says whether it was kept (False: measured under load or outside its bounds,
    used by this process only), `state` and `recheck` how this process came to use it."""

    cost: CostModel
    parts: dict[str, str]
    measured: str  # UTC, ISO 8601
    file: Path
    load: dict[str, Any] | None = None  # the load while it was measured (None: not recorded)
    experts: int | None = None  # experts per layer of the store it was measured on
    stored: bool = True
    rounds: dict[str, list[float]] | None = field(default=None, compare=False)
    state: str = field(default="", compare=False)  # e.g. "stored clean, re-check agrees"
    recheck: dict[str, Any] | None = field(default=None, compare=False)

    def describe(self) -> dict[str, Any]:
        """For reports: where the decisions' costs come from, the costs, whether they were
        stored, the load while they were measured and the start-up re-check."""
        return {
            "source": "calibrated",
            "file": str(self.file),
            "measured": self.measured,
            "key": machine_key(self.parts),
            **self.parts,
            **asdict(self.cost),
            "stored": self.stored,
            "state": self.state,
            "load": self.load,
            "recheck": self.recheck,
        }

    def to_json(self) -> str:
        data = {
            "key": self.parts,
            "measured": self.measured,
            "cost": asdict(self.cost),
            "load": self.load,
            "experts": self.experts,
            "rounds": self.rounds,
        }
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def read(cls, file: Path) -> Calibration:
        """A stored calibration (ValueError, KeyError, TypeError when not one)."""
        data = json.loads(file.read_text())
        cost = CostModel.from_json(json.dumps(data["cost"]))
        return cls(
            cost=cost,
            parts=dict(data["key"]),
            measured=data["measured"],
            file=file,
            load=data.get("load"),
            experts=data.get("experts"),
            rounds=data.get("rounds"),
        )

    @property
    def current(self) -> bool:
        """Whether this torch and this method would read it (the others are never used)."""
        return self.parts.get("method") == _METHOD

    def write(self) -> None:
        """Store it: whole or not at all (a process killed mid-write leaves no half file)."""
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(self.file)


def describe_load(load: dict[str, Any] | None) -> str:
    """The load while a calibration was measured, in words."""
    if not load:
        return "load not recorded"
    others, threads = load.get("others_cores"), load.get("threads")
    busy = "unknown" if others is None else f"{others:.1f}"
    return (
        f"{threads} thread{'s' if threads != 1 else ''}, other processes keeping {busy} of "
        f"{load.get('cores')} cores busy, load average {load.get('loadavg') or 'unknown'}"
    )


def stored_calibrations(cache_dir: Path) -> list[Calibration]:
    """The calibrations stored under `cache_dir`, newest first (unreadable files skipped), and
    the ones this process measured there and did not store."""
    out = [c for c in _THIS_PROCESS.values() if not c.stored and c.file.parent == cache_dir]
    for file in sorted(cache_dir.glob("cost-*.json")):
        try:
            out.append(Calibration.read(file))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda c: c.measured, reverse=True)


_THIS_PROCESS: dict[Path, Calibration] = {}  # what this process used, per file


def calibrated_cost(
    store: ExpertStore,
    device: torch.device,
    cache_dir: Path,
    *,
    threads: int | None = None,
    others: float | None = None,
    recheck: bool = True,
) -> Calibration:
    """The cost model for this machine and expert shape: the stored one (checked against the
    bounds, then re-checked quickly: `recheck`), else measured now and stored when the machine
    was quiet, so that the decisions it drives are the same on every run here. `threads` is
    the configured intra-op thread count (the key's; torch's current count by default),
    `others` the cores' worth that other processes kept busy lately (oled.threads). One not
    stored is reused by this process (its runtimes decide alike) and measured again by the
    next."""
    configured = threads or torch.get_num_threads()
    parts = machine_parts(store, device, configured)
    file = cache_dir / f"cost-{machine_key(parts)}.json"
    used = _THIS_PROCESS.get(file)
    if used is not None and used.stored == file.exists() and _same_file(used, file):
        return used
    if file.exists():
        try:
            stored = Calibration.read(file)
        except (ValueError, KeyError, TypeError):
            stored = None  # stale format: measure again
        line = violation(stored.cost) if stored is not None else None
        if stored is not None and line is None:
            checked = with_recheck(stored, store, device, configured, others) if recheck else stored
            _THIS_PROCESS[file] = checked
            return checked
        if line is not None:  # kept aside (never read again), for whoever wonders why
            file.replace(file.with_suffix(".rejected"))
            _warn(f"stored cost calibration {file.name} rejected: {line}; measuring again")
    calibration = measure_calibration(store, device, parts, file, configured)
    if calibration.stored:
        calibration.write()
    else:
        _warn(f"cost calibration {calibration.state}; this run uses it, the next one measures")
    _THIS_PROCESS[file] = calibration
    return calibration


def _same_file(used: Calibration, file: Path) -> bool:
    """Whether the stored file is still the one this process read or wrote."""
    if not used.stored:
        return True
    try:
        return Calibration.read(file) == used
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _warn(line: str) -> None:
    warnings.warn(line, CalibrationWarning, stacklevel=3)


# /proc/stat counts in 10 ms ticks: a window shorter than this says little about the load
LOAD_WINDOW_S = 0.1


def measure_calibration(
    store: ExpertStore, device: torch.device, parts: dict[str, str], file: Path, configured: int
) -> Calibration:
    """Measure now (`measure_rounds`) under /proc/stat's eye: stored (`stored` True) only when
    every configured thread ran on a core of its own and every figure had a quorum of rounds
    inside its bounds; `state` says which."""
    threads_now = torch.get_num_threads()
    cores = len(visible_cpus())
    before, start = read_sample(), time.perf_counter()
    cost, rounds, guard = measure_rounds(store, device)
    seconds = time.perf_counter() - start
    if seconds < LOAD_WINDOW_S:  # a quick measurement: watch the others for long enough
        time.sleep(LOAD_WINDOW_S - seconds)
    others = others_busy(before, read_sample())
    load = {
        "threads": threads_now,
        "cores": cores,
        "others_cores": None if others is None else round(others, 3),
        "loadavg": loadavg(),
        "seconds": round(seconds, 3),
    }
    clean = False
    if contended(threads_now, cores, others) or threads_now != configured:
        state = f"not stored: measured under load: {describe_load(load)}"
        if threads_now != configured:
            state += f" (of {configured} configured threads, the load left {threads_now})"
    elif guard is not None:
        state = f"not stored: {guard}"
    else:
        state, clean = "measured now, stored clean", True
    measured = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return Calibration(
        cost,
        parts,
        measured,
        file,
        load=load,
        experts=store.num_experts,
        stored=clean,
        rounds=rounds,
        state=state,
    )


def with_recheck(
    calibration: Calibration,
    store: ExpertStore,
    device: torch.device,
    configured: int,
    others: float | None = None,
) -> Calibration:
    """A stored calibration with its start-up re-check (`recheck`; `others`: other processes'
    busy cores seen lately): one line on stderr when they disagree, and the state that
    reports show."""
    check = recheck(calibration.cost, store, device, configured=configured, others=others)
    if check["disagrees"]:
        line = f"re-check disagrees: {check['disagrees']} (oled env --recalibrate measures again)"
        state = f"stored clean; {line}"
        _warn(f"cost calibration {calibration.file.name}: {line}")
    elif check["under_load"]:
        state = "stored clean, re-checked under load (only a faster machine would disagree)"
    else:
        state = "stored clean, re-check agrees"
    return replace(calibration, state=state, recheck=check)


def measure(store: ExpertStore, device: torch.device) -> CostModel:
    """Copy time per expert, CPU expert time against tokens, grouped GEMM against experts
    (`measure_rounds`' medians)."""
    return measure_rounds(store, device)[0]


def measure_rounds(
    store: ExpertStore, device: torch.device, rounds: int = ROUNDS
) -> tuple[CostModel, dict[str, list[float]], str | None]:
    """The cost model as the medians of each figure's rounds inside its bounds, every round's
    figures, and a guard line when a figure had fewer than QUORUM rounds inside (its median
    over all rounds, clamped into the bound, stands in for it)."""
    probes = _Probes(store, device)
    per_round: dict[str, list[float]] = {}
    timings = probes.timings()
    for fn in timings.values():  # warm-up: allocations, first calls
        fn()
    for _ in range(rounds):
        ms = {name: _fastest(fn, device, REPEATS) for name, fn in timings.items()}
        for name, value in probes.figures(ms).items():
            per_round.setdefault(name, []).append(value)
    limits = bounds(store.expert_bytes)
    figures: dict[str, float] = {}
    guard = None
    for name, values in per_round.items():
        inside = [v for v in values if limits[name].violation(v) is None]
        if len(inside) >= min(QUORUM, rounds):
            figures[name] = statistics.median(inside)
            continue
        figures[name] = limits[name].clamp(statistics.median(values))
        if guard is None:
            first = next(line for v in values if (line := limits[name].violation(v)) is not None)
            guard = f"{len(inside)} of {rounds} rounds inside the bounds: {first}"
    cost = CostModel(**figures, expert_bytes=store.expert_bytes, cpu_few_tokens=cpu.MAX_TOKENS)
    return cost, {k: [round(v, 6) for v in vs] for k, vs in per_round.items()}, guard


def recheck(
    cost: CostModel,
    store: ExpertStore,
    device: torch.device,
    *,
    configured: int,
    others: float | None = None,
) -> dict[str, Any]:
    """A quick look (tens of ms: `RECHECK_BUDGET_MS` per probe after a warm-up call) at
    whether `cost` still holds: n expert copies, four CPU experts of four tokens and a grouped
    call over n experts, each timed against the model. `disagrees` names the probes off by
    more than RECHECK_FACTOR (and RECHECK_SLACK_MS); under load (fewer threads than
    `configured`, or threads without a core of their own during the probes or, by `others`,
    lately) only a probe faster than the model counts, since load only slows."""
    probes = _Probes(store, device)
    n = probes.n
    modelled = {
        "copy": cost.copy_ms(n),
        "CPU expert": cost.cpu_layer_ms(np.full(4, 4)),
        "device expert": cost.gpu_ms(n),
    }
    fns = {
        "copy": probes.copy(n),
        "CPU expert": probes.cpu_layer(4, 4),
        "device expert": probes.device_experts(probes.slot13, probes.slot2, n),
    }
    threads_now, cores = torch.get_num_threads(), len(visible_cpus())
    before, start = read_sample(), time.perf_counter()
    now = {name: _quick(fn, device) for name, fn in fns.items()}
    seconds = time.perf_counter() - start
    during = others_busy(before, read_sample()) if seconds >= LOAD_WINDOW_S else None
    loaded = (
        threads_now < configured
        or contended(threads_now, cores, during)
        or contended(threads_now, cores, others)
    )
    off = []
    for name, ms in now.items():
        model = float(modelled[name])
        if abs(ms - model) <= RECHECK_SLACK_MS or model <= 0:
            continue
        if ms >= RECHECK_FACTOR * model and not loaded:
            off.append(f"{name} {ms:.3g} ms, {ms / model:.1f}x the stored {model:.3g} ms")
        elif ms * RECHECK_FACTOR <= model:
            off.append(f"{name} {ms:.3g} ms, {model / ms:.1f}x faster than the stored {model:.3g}")
    return {
        "ms": round(1000 * seconds, 1),
        "factor": RECHECK_FACTOR,
        "probes": {
            k: {"now_ms": round(now[k], 4), "stored_ms": round(float(modelled[k]), 4)} for k in now
        },
        "others_cores": None if during is None else round(during, 3),
        "under_load": loaded,
        "disagrees": "; ".join(off) or None,
    }


class _Probes:
    """The engine's paths over layer 0 of a store, ready to time: copies of expert rows into
    n device slots, the CPU expert path, grouped expert compute on the device."""

    def __init__(self, store: ExpertStore, device: torch.device) -> None:
        self.w13, self.w2 = store.w13[0], store.w2[0]  # [E, 2I, H], [E, H, I]
        self.device = device
        self.e = self.w13.shape[0]
        self.n = min(8, self.e)
        shape13, shape2 = self.w13.shape[1:], self.w2.shape[1:]
        self.slot13 = torch.empty((self.n, *shape13), dtype=self.w13.dtype, device=device)
        self.slot2 = torch.empty((self.n, *shape2), dtype=self.w2.dtype, device=device)
        self.src, self.dst = Rows.of(self.w13, self.w2), Rows.of(self.slot13, self.slot2)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._table: tuple[Tensor, Tensor] | None = None

    def copy(self, count: int) -> Callable[[], None]:
        """Copy experts 0..count-1 into the first `count` slots."""
        rows = list(range(count))
        return lambda: launch(self.src, self.dst, rows, rows, self.stream)

    def cpu_layer(self, n_experts: int, tokens_each: int) -> Callable[[], Tensor]:
        """The CPU expert path as the engine pays it: 32 tokens' activations to the host, the
        CPU experts' GEMMs over the host table (expert e gets `tokens_each` (token, expert)
        pairs) and their rows back to the device. Each call takes the next `n_experts` of the
        layer's experts, so that their weights come from memory, not from the CPU's caches,
        as a missed expert's do in the engine."""
        h = self.w2.shape[1]
        t, k = 32, min(8, self.e)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(t, h, generator=gen).to(device=self.device, dtype=self.w13.dtype)
        weights = torch.rand(t, k, generator=gen)  # [T, K]
        n_experts = min(n_experts, self.e)
        pairs = torch.arange(n_experts).repeat_interleave(tokens_each)  # [n * tokens_each]
        turns = []  # each [T, K]: experts first..first+n on their tokens, -1 elsewhere
        for first in range(0, self.e - n_experts + 1, n_experts):
            ids = torch.full((t * k,), -1, dtype=torch.long)
            ids[: len(pairs)] = first + pairs
            turns.append(ids.view(t, k))
        calls = itertools.cycle(turns)

        host = HostExperts(self.device)  # as the engine computes them and sends them back
        pairs = torch.zeros(t, k, h, dtype=torch.float32, device=self.device)  # [T, K, H]
        # the activations' host buffer, pinned beside a GPU as the engine's is
        x_host = torch.empty(t, h, dtype=x.dtype, pin_memory=host.cuda)  # [T, H]

        def run() -> Tensor:
            x_host.copy_(x)  # waits for the copy, as the engine waits for its event
            index, rows = host.rows(x_host, next(calls), weights, self.w13, self.w2)
            host.add(pairs, index, rows)
            return pairs

        return run

    def device_experts(self, w13: Tensor, w2: Tensor, experts: int) -> Callable[[], Tensor]:
        """expert_pairs over a device table: 32 tokens spread over `experts` experts, top-k."""
        h = w2.shape[1]
        tokens, k = 32, min(8, self.e)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, h, generator=gen).to(device=self.device, dtype=w13.dtype)
        ids = torch.randint(0, experts, (tokens, k), generator=gen).to(self.device)  # [T, K]
        weights = torch.rand(tokens, k, generator=gen).to(self.device)  # [T, K]
        return lambda: expert_pairs(x, ids, weights, w13, w2)

    def table(self) -> tuple[Tensor, Tensor]:
        """Layer 0's every expert on the device (the grouped call over E experts)."""
        if self._table is None:
            self._table = (self.w13.to(self.device), self.w2.to(self.device))
        return self._table

    def gpu_counts(self) -> list[int]:
        return [1, self.n, self.e]

    def timings(self) -> dict[str, Callable[[], object]]:
        """Every call a round times, by name."""
        table13, table2 = self.table()
        out: dict[str, Callable[[], object]] = {
            "copy 1": self.copy(1),
            f"copy {self.n}": self.copy(self.n),
            "cpu 1x1": self.cpu_layer(1, 1),
            "cpu 4x1": self.cpu_layer(4, 1),
            "cpu 4x8": self.cpu_layer(4, 8),
            "cpu 4x16": self.cpu_layer(4, 16),  # above cpu.MAX_TOKENS: torch's products
            "cpu 4x32": self.cpu_layer(4, 32),
        }
        for k in self.gpu_counts():
            out[f"gpu {k}"] = self.device_experts(table13, table2, k)
        return out

    def figures(self, ms: dict[str, float]) -> dict[str, float]:
        """One round's figures from its timings (the bounds judge them)."""
        n = self.n
        copy_one, many = ms["copy 1"], ms[f"copy {n}"]
        copy_per = (many - copy_one) / (n - 1) if n > 1 else copy_one
        # a layer's CPU experts in decoding: a call of 1-4 experts of 1-8 tokens each
        m = min(4, self.e)  # experts per CPU probe
        # bound by reading the weights, 8 tokens may cost what 1 does: the slope is then ~0
        per_token = max((ms["cpu 4x8"] - ms["cpu 4x1"]) / m / 7, MIN_TOKEN_MS)
        cpu_one = (ms["cpu 4x1"] - ms["cpu 1x1"]) / (m - 1) if m > 1 else ms["cpu 1x1"]
        call = max(ms["cpu 1x1"] - cpu_one, 0.0)  # what a call costs beside its experts
        # a prompt's or a batch's experts of more tokens than the C kernel takes: their own line
        many_per = max((ms["cpu 4x32"] - ms["cpu 4x16"]) / m / 16, MIN_TOKEN_MS)
        many_fixed = max((ms["cpu 4x16"] - call) / m - 16 * many_per, 0.0)
        counts = self.gpu_counts()
        gpu_fixed, gpu_per = _line(counts, [ms[f"gpu {k}"] for k in counts])
        return {  # a fixed cost a little below 0 is the fit's noise around a small one
            "copy_ms_per_expert": copy_per,
            "copy_fixed_ms": max(copy_one - copy_per, 0.0),
            "cpu_fixed_ms": cpu_one - per_token,
            "cpu_call_ms": call,
            "cpu_ms_per_token": per_token,
            "cpu_many_fixed_ms": many_fixed,
            "cpu_many_ms_per_token": many_per,
            "gpu_fixed_ms": max(gpu_fixed, 0.0),
            "gpu_ms_per_expert": gpu_per,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fastest(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """The fastest of `repeat` calls of fn(), in milliseconds (synchronised)."""
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, 1000 * (time.perf_counter() - t0))
    return best


def _quick(fn: Callable[[], object], device: torch.device) -> float:
    """The fastest of a few calls of fn() after one warm-up: at least 2, at most 5, stopping
    once RECHECK_BUDGET_MS is spent."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 2 or (calls < 5 and spent < RECHECK_BUDGET_MS):
        ms = _fastest(fn, device, 1)
        best, spent, calls = min(best, ms), spent + ms, calls + 1
    return best


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys over xs (slope = y / x with one distinct x)."""
    if len(set(xs)) < 2:
        return 0.0, float(np.mean(ys)) / xs[0]
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def recalibrate(cache_dir: Path) -> list[str]:
    """Measure every calibration stored under `cache_dir` again, on a store of its shape with
    its threads and kernels, and replace the file when the new one is clean (measured quiet,
    inside its bounds); one line per file saying what happened."""
    lines = []
    for old in stored_calibrations(cache_dir):
        if not old.stored:
            continue
        why = _cannot_measure(old)
        if why is not None:
            lines.append(f"{old.file.name}: kept ({why})")
            continue
        lines.append(f"{old.file.name}: {_measure_again(old)}")
    return lines or [f"no calibration stored in {cache_dir} (the first offloaded run measures)"]


def _cannot_measure(c: Calibration) -> str | None:
    """Why this process cannot measure `c`'s key again, or None."""
    if not c.current:
        return "measured by an earlier method, never read now: delete it"
    if c.parts.get("torch") != torch.__version__:
        return f"measured with torch {c.parts.get('torch')}, this is {torch.__version__}"
    if c.experts is None or _shape(c.parts.get("expert shape", "")) is None:
        return "the file does not name its experts' shape"
    if c.parts.get("device") != "cpu" and _cuda_index(c.parts.get("device", "")) is None:
        return f"no {c.parts.get('device')} in this process"
    return None


def _shape(text: str) -> tuple[int, int] | None:
    """(2I, H) of an "expert shape" part such as "(256, 256)"."""
    m = re.fullmatch(r"\((\d+), (\d+)\)", text)
    return (int(m[1]), int(m[2])) if m else None


def _cuda_index(name: str) -> int | None:
    if not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if torch.cuda.get_device_name(i) == name:
            return i
    return None


def _measure_again(old: Calibration) -> str:
    """Measure `old`'s key again; replace its file when clean."""
    parts = old.parts
    shape = _shape(parts["expert shape"])
    assert shape is not None and old.experts is not None  # _cannot_measure
    index = _cuda_index(parts["device"])
    device = torch.device("cpu") if index is None else torch.device("cuda", index)
    dtype = getattr(torch, parts["dtype"])
    threads, mode = torch.get_num_threads(), kernels.mode()
    gen = torch.Generator().manual_seed(0)
    try:
        torch.set_num_threads(int(parts["threads"]))
        kernels.use(parts["kernels"] if device.type == "cuda" else "auto")
        store = ExpertStore.empty(
            layers=1,
            experts=old.experts,
            hidden=shape[1],
            inter=shape[0] // 2,
            dtype=dtype,
            pin=parts["pinned"] == "True",
        )
        for w in (*store.w13, *store.w2):
            w.copy_(0.02 * torch.randn(w.shape, generator=gen))
        if machine_parts(store, device, int(parts["threads"])) != parts:
            return "kept (this process does not reproduce its key)"
        new = measure_calibration(store, device, parts, old.file, int(parts["threads"]))
    finally:
        torch.set_num_threads(threads)
        kernels.use(mode)
    _THIS_PROCESS.pop(old.file, None)
    if not new.stored:
        return f"kept the stored one; the new one is {new.state}"
    new.write()
    return f"replaced ({new.measured}, {describe_load(new.load)})"
