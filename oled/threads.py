"""CPU threads on a machine that other processes share.

More intra-op threads than free cores make every parallel region wait at its barrier for a
thread that shares its core with a busy neighbour: on a 2-core machine beside one CPU-bound
process the quickstart ran 2.3-4.1x slower with two threads (docs/performance.md, "Busy
machines"). `choose` takes the count from the cores that other processes leave free
(/proc/stat, less this process's own CPU time), unless `runtime.cpu_threads` or
`OMP_NUM_THREADS` fixes it.

How OpenMP threads wait is left to libgomp (spin about 3 ms, then sleep) unless the user sets
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`: with the thread count taken from the free cores no
thread waits for a preempted one, and every shorter spin measured slower where cores are
plenty (CPU experts on a quiet 16-core H200 host: 10-30% at GOMP_SPINCOUNT=10000, 2-7x
passive); with more threads than free cores, 10000 was slower still than libgomp's default on
2 cores, and only `OMP_WAIT_POLICY=passive` helped (at about 12% when quiet).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


def wait_policy(environ: Mapping[str, str] = os.environ) -> str:
    """How OpenMP threads wait in this process, in words (for `oled env`)."""
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    shown = [f"{name}={environ[name]}" for name in names if name in environ]
    if not shown:
        return "libgomp's default (spin about 3 ms, then sleep)"
    return ", ".join(shown)


def visible_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuSample:
    """Busy CPU time of the visible CPUs, this process's own CPU time and the clock, at once."""

    busy_s: float  # summed over the visible CPUs (user, nice, system, irq, softirq, steal)
    own_s: float  # this process's CPU time, all its threads (time.process_time)
    wall_s: float  # time.monotonic


def read_sample(stat: Path = Path("/proc/stat"), cpus: set[int] | None = None) -> CpuSample | None:
    """A sample now; None where /proc/stat cannot be read (not Linux)."""
    cpus = visible_cpus() if cpus is None else cpus
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy, seen = 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in rest.split()]
        busy += v[0] + v[1] + v[2] + sum(v[5:8])  # user nice system . . irq softirq steal
        seen += 1
    if not seen:
        return None
    return CpuSample(busy / tick, time.process_time(), time.monotonic())


def others_busy(before: CpuSample | None, after: CpuSample | None) -> float | None:
    """Cores' worth of CPU time that other processes used between two samples (None without
    samples or over less than 20 ms: /proc/stat counts in ticks of 10 ms)."""
    if before is None or after is None or after.wall_s - before.wall_s < 0.02:
        return None
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / (after.wall_s - before.wall_s))


def loadavg(path: Path = Path("/proc/loadavg")) -> str | None:
    """The 1, 5 and 15 minute load averages as /proc/loadavg gives them; None where unknown."""
    try:
        return " ".join(path.read_text().split()[:3])
    except OSError:
        return None


class CpuMonitor:
    """Other processes' busy cores over the time since the last reading (at least `min_s`:
    a shorter window is completed by sleeping; a window longer than `max_s` is stale, and a
    fresh one of `min_s` is taken instead)."""

    def __init__(self, *, min_s: float = 0.1, max_s: float = 60.0) -> None:
        self.min_s, self.max_s = min_s, max_s
        self._last = read_sample()

    def others(self) -> float | None:
        """Cores' worth that other processes kept busy lately; None where unknown."""
        last, now = self._last, read_sample()
        if last is None or now is None:
            return None
        if now.wall_s - last.wall_s > self.max_s:
            last = now
        if now.wall_s - last.wall_s < self.min_s:
            time.sleep(self.min_s - (now.wall_s - last.wall_s))
            now = read_sample()
        self._last = now
        return others_busy(last, now)


MONITOR = CpuMonitor()  # from this module's first import: the window covers start-up


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op threads a runtime uses now, and the most it uses (the calibration's key)."""

    threads: int  # threads to use now
    configured: int  # runtime.cpu_threads, else OMP_NUM_THREADS, else torch's count as set
    source: str  # "runtime.cpu_threads", "OMP_NUM_THREADS" or "free cores"
    cores: int  # CPUs this process may run on
    others: float | None  # cores' worth that other processes kept busy (None: not measured)

    @property
    def fixed(self) -> bool:
        """Whether the user fixed the count (then the load never changes it)."""
        return self.source != "free cores"

    def describe(self) -> str:
        """One line for reports and `oled env`."""
        busy = (
            f"other processes keep {self.others:.1f} of {self.cores} cores busy"
            if self.others is not None
            else "other processes' load unknown"
        )
        if self.fixed:
            return f"{self.threads} ({self.source}; {busy})"
        return f"{self.threads} of {self.configured} ({busy})"


def env_threads(environ: Mapping[str, str] = os.environ) -> int | None:
    """The thread count `OMP_NUM_THREADS` sets (its first entry), None when unset or invalid."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def choose(
    *,
    cpu_threads: int | None,
    default: int,
    others: float | None,
    cores: int,
    environ: Mapping[str, str] = os.environ,
) -> ThreadChoice:
    """`cpu_threads` (the recipe's `runtime.cpu_threads`) when set, else `OMP_NUM_THREADS`
    when set; else `default` threads (torch's count as the process set it) less the cores that
    other processes keep busy, rounded to the nearest core (at least 1)."""
    if cpu_threads:
        return ThreadChoice(cpu_threads, cpu_threads, "runtime.cpu_threads", cores, others)
    omp = env_threads(environ)
    if omp is not None:
        return ThreadChoice(omp, omp, "OMP_NUM_THREADS", cores, others)
    threads = default if others is None else max(1, min(default, int(cores - others + 0.5)))
    return ThreadChoice(threads, default, "free cores", cores, others)


def contended(threads: int, cores: int, others: float | None) -> bool:
    """Whether `threads` threads lacked a core of their own while other processes kept `others`
    cores busy: the free cores fell a quarter of a core or more below the threads."""
    return others is not None and cores - others < threads - 0.25
