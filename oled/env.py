"""`oled env`: what this machine offers OLED-MoE (Python, torch, CUDA, GPU, CPU, packages)."""

from __future__ import annotations

import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from oled.threads import wait_policy

if TYPE_CHECKING:
    from oled.policies.base import CostModel

PACKAGES = (
    "oled-moe",
    "safetensors",
    "tokenizers",
    "numpy",
    "pydantic",
    "typer",
    "rich",
    "fastapi",
    "uvicorn",
    "mlflow-skinny",
    "mlflow",
    "optuna",
    "matplotlib",
    "triton",
)


@dataclass
class Report:
    """Rows of (key, value) plus the requirements that failed."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, key: str, value: object) -> None:
        self.rows.append((key, str(value)))

    def as_dict(self) -> dict:
        return {"rows": dict(self.rows), "failures": list(self.failures)}


def cpuinfo_field(name: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first `name : value` of /proc/cpuinfo (Linux), None when unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU feature flags (Linux), empty when unknown."""
    return set((cpuinfo_field("flags", cpuinfo) or "").split())


def cpu_rows(report: Report) -> None:
    import torch

    flags = cpu_flags()
    amx = [f for f in ("amx_bf16", "amx_tile", "amx_int8") if f in flags]
    report.add("CPU", cpuinfo_field("model name") or platform.machine())
    report.add(
        "CPU cores (visible)",
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    )
    report.add("torch threads", torch.get_num_threads())
    report.add("threads now", threads_row())
    report.add("OpenMP wait", wait_policy())
    report.add("AMX", ", ".join(amx) if amx else ("no" if flags else "unknown"))
    report.add("AVX-512", "yes" if "avx512f" in flags else ("no" if flags else "unknown"))
    report.add("host planner", planner_row(report))


def threads_row() -> str:
    """The intra-op threads a runtime would choose now (oled.threads.choose), and why."""
    import torch

    from oled.threads import MONITOR, choose, visible_cpus

    default, cores = torch.get_num_threads(), len(visible_cpus())
    choice = choose(cpu_threads=None, default=default, others=MONITOR.others(), cores=cores)
    if choice.fixed:
        return f"{choice.describe()}: fixed, whatever the load"
    return f"{choice.describe()}: runtime.cpu_threads or OMP_NUM_THREADS would fix the count"


def planner_row(report: Report) -> str:
    """Whether the offload engine plans compiled (oled.policies.native) or in Python; a
    compiled library that disagrees with its Python mirrors is a failure of the report."""
    from oled.policies import native

    try:
        native.library()
    except native.NativeUnavailable as e:
        return f"Python (compiled planner unavailable: {e})"
    except native.ContractError as e:
        report.failures.append(str(e))
        return "refused (the compiled code and its Python mirrors disagree)"
    return "compiled (built-in policies; policies of one's own in Python)"


def launches_row() -> str:
    """Whether the offload engine launches graphed layer calls from C (oled.offload.driver)."""
    from oled.offload.driver import unsupported

    why = unsupported()
    if why is not None:
        return f"Python ({why})"
    return "compiled (graphed layer calls, without copies ahead)"


def cuda_rows(report: Report, *, bandwidth: bool) -> None:
    import torch

    if not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        report.add("CUDA", f"not available (this torch is {build})")
        return
    report.add("CUDA (torch build)", torch.version.cuda)
    report.add("driver", driver_version())
    for i in range(torch.cuda.device_count()):
        prop = torch.cuda.get_device_properties(i)
        report.add(
            f"GPU {i}",
            f"{prop.name}, {prop.total_memory / 2**30:.1f} GiB, compute {prop.major}.{prop.minor}",
        )
    if torch.cuda.device_count() > 1:
        report.add("GPU links", links_row())
    report.add("fused kernels", kernel_row())
    report.add("expert copies", copies_row())
    report.add("layer launches", launches_row())
    if bandwidth:
        gbps = pinned_copy_bandwidth()
        report.add("host->GPU copy, pinned, 64 MiB", f"{gbps:.1f} GB/s")


def links_row() -> str:
    """How each pair of GPUs reaches the other: peer to peer (NVLink or PCIe) or through host
    memory; what runtime.devices > 1 sends its all-reduces over (NCCL)."""
    import torch

    n = torch.cuda.device_count()
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    peer = [torch.cuda.can_device_access_peer(i, j) for i, j in pairs]
    if all(peer):
        return f"every pair of the {n} GPUs peer to peer"
    return ", ".join(
        f"{i}-{j} {'peer to peer' if p else 'through the host'}"
        for (i, j), p in zip(pairs, peer, strict=True)
    )


def kernel_row() -> str:
    """Which kernels CUDA runs by default (`--kernels auto`)."""
    from oled import kernels

    if kernels.triton_available():
        return "Triton (the default; --kernels torch for torch's own)"
    return "torch's own: triton is not installed, so --kernels auto falls back to them"


def copies_row() -> str:
    """How the offload engine launches its host -> GPU copies (oled.offload.copies)."""
    from oled.offload import copies

    path = copies.runtime_library()
    if path:
        call = "cudaMemcpyBatchAsync" if copies.runtime_memcpy_batch() else "cudaMemcpyAsync"
        return f"{call} through {path}"
    return "torch's copy_ (no CUDA runtime library found in this process)"


def driver_version() -> str:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        v = version.value
        return f"CUDA {v // 1000}.{v % 1000 // 10} (driver API)"
    except OSError:
        return "unknown"


def pinned_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """GB/s of a pinned host -> GPU copy (best of `repeats`)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def calibration_rows(report: Report) -> None:
    """The cost models measured on this machine and stored (oled.offload.calibrate): the
    decisions of `runtime.cost = "calibrate"` read them back, so they repeat from run to run;
    and those this process measured under load and did not store."""
    from oled.offload.calibrate import describe_load, stored_calibrations, violation
    from oled.paths import cache_home

    folder = cache_home() / "cost"
    stored = stored_calibrations(folder)
    if not stored:
        report.add(
            "cost calibrations",
            f"none yet in {folder} (the first offloaded run on a quiet machine measures and "
            "stores one)",
        )
    for c in stored:
        k, cost = c.parts, c.cost
        if not c.stored:
            how = c.state
        elif not c.current:
            how = "an earlier method's, never read now: delete it"
        else:
            line = violation(cost)
            how = f"stored, {describe_load(c.load)}" + (f"; rejected: {line}" if line else "")
        report.add(
            f"cost {c.file.stem.removeprefix('cost-')}",
            f"{c.measured}, {k['device']}, experts {k['expert shape']} {k['dtype']}, "
            f"{k['threads']} threads: copy {cost.copy_ms_per_expert:.3g} ms/expert"
            f"{rate(k, cost.copy_ms_per_expert)}, CPU expert {cost.cpu_fixed_ms:.3g} + "
            f"{cost.cpu_ms_per_token:.3g} ms/token{rate(k, cost.cpu_ms(1))} at 1 token"
            f"{many_line(cost)} + {cost.cpu_call_ms:.3g} ms a layer, GPU "
            f"{cost.gpu_fixed_ms:.3g} + {cost.gpu_ms_per_expert:.3g} ms/expert ({how})",
        )


def many_line(cost: CostModel) -> str:
    """ ", above N tokens F + T ms/token" where the calibration measured that line."""
    if math.isinf(cost.many_from):
        return ""
    return (
        f", above {cost.many_from} tokens {cost.cpu_many_fixed_ms:.3g} + "
        f"{cost.cpu_many_ms_per_token:.3g} ms/token"
    )


def rate(parts: dict[str, str], ms: float) -> str:
    """ " (N GB/s)": one expert of a calibration's shape and dtype moved or computed in `ms`."""
    shape = [int(v) for v in re.findall(r"\d+", parts.get("expert shape", ""))]
    size = {"bfloat16": 2, "float16": 2, "float32": 4}.get(parts.get("dtype", ""))
    if len(shape) != 2 or not size or ms <= 0:
        return ""
    return f" ({1.5 * shape[0] * shape[1] * size / ms / 1e6:.3g} GB/s)"  # w13 [2I, H] + w2


def recalibrate() -> list[str]:
    """`oled env --recalibrate`: measure every stored calibration again, replacing a file only
    with a clean measurement (oled.offload.calibrate.recalibrate); a line per file."""
    from oled.offload.calibrate import recalibrate as again
    from oled.paths import cache_home

    return again(cache_home() / "cost")


def package_rows(report: Report) -> None:
    for name in PACKAGES:
        try:
            report.add(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            report.add(name, "not installed")


def collect(*, require_cuda: bool = False, bandwidth: bool = True) -> Report:
    """The environment report; `failures` lists the requirements that are not met."""
    import torch

    report = Report()
    report.add("Python", f"{sys.version.split()[0]} ({sys.executable})")
    report.add("platform", platform.platform())
    report.add("torch", torch.__version__)
    cuda_rows(report, bandwidth=bandwidth)
    cpu_rows(report)
    calibration_rows(report)
    package_rows(report)
    if require_cuda and not torch.cuda.is_available():
        build = torch.version.cuda
        why = (
            f"this torch ({torch.__version__}) is a CPU-only build"
            if build is None
            else (
                f"torch is built for CUDA {build} but sees no GPU (driver, CUDA_VISIBLE_DEVICES?)"
            )
        )
        report.failures.append(f"CUDA is required but not available: {why}")
    return report
