"""Profiler attribution: device time per forward stage, host time per stage and CUDA API call.

A few iterations of one extra generation run under the torch profiler with the stage ranges of
oled.model.stages annotated; every kernel and copy counts for the innermost stage that launched
it. With `batch`, the generation is a batch of those prompts decoded together (one forward an
iteration for all of them, `oled bench --streams --profile`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent

from oled.bench.runs import Job, batch_session, run_batch, run_once, run_replay
from oled.decoding import DecodeConfig, DecodeObserver, IterationInfo, Trajectory
from oled.decoding.observers import BatchIterationInfo
from oled.model.graphs import EagerForward
from oled.model.stages import STAGES, annotate
from oled.runtime import Runtime
from oled.trace.replay import RoutingTrace

Replay = tuple[RoutingTrace, int]  # a trace and the index of the prompt to replay
Batch = Sequence[Job]  # requests decoded together (traced ones replay `batch_trace`'s prompts)


def profile_figures(
    rt: Runtime,
    prompt: list[int],
    decode: DecodeConfig | None,
    *,
    follow: Trajectory | None = None,
    replay: Replay | None = None,
    batch: Batch | None = None,
    batch_trace: RoutingTrace | None = None,
) -> dict[str, Any]:
    """A row's profile: on CUDA the device ms per stage (`stages_ms_per_iteration`), of the
    kernels that take the most in each stage (`stage_kernels_ms_per_iteration`) and outside
    every stage (`unstaged_kernels_ms_per_iteration`), and everywhere the host
    ms per stage and per iteration (`host_ms_per_iteration`), of one more generation run as
    `stage_breakdown` and `host_breakdown` say."""
    where: dict[str, Any] = {
        "follow": follow,
        "replay": replay,
        "batch": batch,
        "batch_trace": batch_trace,
    }
    out: dict[str, Any] = {}
    if rt.device.type == "cuda":
        stages, kernels = stage_breakdown(rt, prompt, decode, **where)
        out["stages_ms_per_iteration"] = stages
        out["stage_kernels_ms_per_iteration"] = kernels
        out["unstaged_kernels_ms_per_iteration"] = kernels.get("other", {})
    out["host_ms_per_iteration"] = host_breakdown(rt, prompt, decode, **where)
    return out


def stage_breakdown(
    rt: Runtime,
    prompt: list[int],
    decode: DecodeConfig | None,
    iterations: int = 3,
    follow: Trajectory | None = None,
    replay: Replay | None = None,
    batch: Batch | None = None,
    batch_trace: RoutingTrace | None = None,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Device milliseconds per iteration of each forward stage (oled.model.stages), from a few
    iterations (after the prompt's) of one extra eager generation under the profiler: every
    kernel and copy counts for the innermost stage that launched it. The graphs replay the same
    kernels (a batch's rows laid out as they lay them out), so these are their times too. CPU
    experts count the host's milliseconds (engine metrics), not device time. Second: per stage
    ('other' outside every stage) the kernels and copies that take the most, milliseconds per
    iteration by name (`TOP_KERNELS` of each)."""
    runs = rt.forward  # profiled eagerly, a batch's rows laid out as `runs` lays them out
    rt.forward = EagerForward(rt.model, exact_batches=runs.exact_batches)
    try:
        window, off = _profiled(
            rt,
            prompt,
            decode,
            iterations,
            follow,
            device=True,
            replay=replay,
            batch=batch,
            batch_trace=batch_trace,
        )
    finally:
        rt.forward = runs
    totals, kernels = _stage_device_us(window.profiler.events())
    out = {name: us / 1000 / window.seen for name, us in totals.items()}
    figures = off["decode"] if off is not None else {}
    if figures.get("cpu_ms"):
        out["CPU experts"] = figures["cpu_ms"] / max(1, figures["iterations"])
    top = {
        stage: sorted(named.items(), key=lambda kv: kv[1], reverse=True)[:TOP_KERNELS]
        for stage, named in kernels.items()
    }
    per_it = {stage: {name: us / 1000 / window.seen for name, us in top[stage]} for stage in top}
    return out, per_it


def host_breakdown(
    rt: Runtime,
    prompt: list[int],
    decode: DecodeConfig | None,
    iterations: int = 3,
    follow: Trajectory | None = None,
    replay: Replay | None = None,
    batch: Batch | None = None,
    batch_trace: RoutingTrace | None = None,
) -> dict[str, float]:
    """Host milliseconds per iteration of each stage range (inclusive: `copies` lies inside
    `host decision`) and of each CUDA API call (cudaGraphLaunch, cudaMemcpyAsync, ...), and
    the iteration's wall time ("iteration"), from a few iterations of one more generation run
    as the runtime runs it (graphs kept) under a CPU-only profiler: where the host path spends
    its time. On CUDA also the time the device is busy in an iteration ("device busy": the
    union of its kernels and copies, graphs' included), from one more such generation with the
    device traced (which slows the host, so apart): iteration minus it is the device idle,
    almost all of it waiting for the host between forwards (inside a forward's CUDA graph the
    kernels run back to back)."""
    where: dict[str, Any] = {"replay": replay, "batch": batch, "batch_trace": batch_trace}
    window, _ = _profiled(rt, prompt, decode, iterations, follow, device=False, **where)
    totals: dict[str, float] = {}
    for e in window.profiler.events():
        if e.name in STAGES or _is_api_call(e.name):
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
    totals["iteration"] = 1e6 * window.seconds
    out = {name: us / 1000 / max(1, window.seen) for name, us in totals.items()}
    if rt.device.type == "cuda":
        traced, _ = _profiled(rt, prompt, decode, iterations, follow, device=True, **where)
        busy = [
            (e.time_range.start, e.time_range.end)
            for e in traced.profiler.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and _device_work(e)
        ]
        out["device busy"] = union_us(busy) / 1000 / max(1, traced.seen)
    return out


def _profiled(
    rt: Runtime,
    prompt: list[int],
    decode: DecodeConfig | None,
    iterations: int,
    follow: Trajectory | None,
    *,
    device: bool,
    replay: Replay | None = None,
    batch: Batch | None = None,
    batch_trace: RoutingTrace | None = None,
) -> tuple[_ProfileWindow, dict | None]:
    """One generation (following `follow` if given; the replay of (trace, prompt index) if
    `replay`; the requests of `batch` decoded together if given, the traced ones replaying
    `batch_trace`'s prompts) with iterations 1 .. `iterations` under the profiler: (the
    window, the engine's figures)."""
    window = _ProfileWindow(first=1, count=iterations, device=device)
    try:
        if batch is not None:
            cfg = decode or rt.decode
            session = batch_session(rt, len(batch), cfg, batch_trace, prefill_chunk=0)
            with session as (dec, source):  # every prompt in the batch's first forward
                run_batch(rt, dec, batch, cfg, source=source)  # its graphs are captured here
                _, off, _ = run_batch(rt, dec, batch, cfg, [window], source)
        elif replay is not None:
            _, off, _ = run_replay(rt, *replay, [window])
        else:
            _, off, _ = run_once(rt, prompt, decode, [window], follow)
    finally:
        window.stop()
    return window, off


class _ProfileWindow(DecodeObserver):
    """Profiles iterations first .. first + count - 1 of a generation, stages annotated; the
    device timeline too unless `device` is False; a batch's forwards count as iterations."""

    def __init__(self, *, first: int, count: int, device: bool = True) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.first, self.count, self.seen, self.running = first, count, 0, False
        self.seconds, self._t0 = 0.0, 0.0  # wall time of the profiled iterations
        self.base: int | None = None  # the generation's first step (a batch counts on)
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * device
        self.profiler = profile(activities=activities)

    def on_generation_start(self, prompt_length: int) -> None:
        self.base = None

    def on_iteration_start(self, block: int, iteration: int, step: int) -> None:
        self.base = step if self.base is None else self.base
        if step - self.base == self.first and not self.seen:
            annotate(True)
            self.profiler.start()
            self.running, self._t0 = True, time.perf_counter()

    def on_iteration(self, info: IterationInfo) -> None:
        if self.running:
            self.seen += 1
            if self.seen == self.count:
                self.stop()

    def on_batch_iteration(self, info: BatchIterationInfo) -> None:
        self.on_iteration(info.rows[0])

    def stop(self) -> None:
        if self.running:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self._t0
            self.profiler.stop()
            annotate(False)
            self.running = False


TOP_KERNELS = 8  # kernels of each stage reported by name


def _stage_device_us(
    events: Sequence[FunctionEvent],
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Microseconds of kernels and copies per innermost enclosing stage ('other' outside), and
    per stage by kernel name.

    Each device event is found through its host API call (cudaLaunchKernel, cuLaunchKernelEx,
    cudaMemcpyAsync, ...: the same correlation id), whose place in the host call tree names the
    stage; this also places Triton's kernels, which no torch op launches. A device event whose
    call the profiler did not record counts for the torch op it is linked to, if any.
    """
    totals: dict[str, float] = {}
    kernels: dict[str, dict[str, float]] = {}
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    calls = {e.id: e for e in events if e.device_type == cpu and _is_api_call(e.name)}
    ops = {e.id: e for e in events if e.device_type == cpu and not _is_api_call(e.name)}
    for event in events:
        if event.device_type != cuda or not _device_work(event):
            continue
        call = calls.get(event.id)
        if call is None:
            call = ops.get(getattr(event, "linked_correlation_id", 0) or -1)
        stage, us = _stage_of(call), event.time_range.elapsed_us()
        totals[stage] = totals.get(stage, 0.0) + us
        named = kernels.setdefault(stage, {})
        named[event.name] = named.get(event.name, 0.0) + us
    return totals, kernels


def union_us(spans: list[tuple[float, float]]) -> float:
    """The length covered by (start, end) spans, overlaps counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _device_work(event: FunctionEvent) -> bool:
    """A kernel, copy or memset: not a mirror of a stage range on the device timeline, nor a
    synchronisation (both span other work)."""
    kind = getattr(event, "activity_type", None)
    if kind is not None:
        return kind in ("kernel", "gpu_memcpy", "gpu_memset")
    return not (
        getattr(event, "is_user_annotation", False) or event.name in STAGES or "Sync" in event.name
    )


def _is_api_call(name: str) -> bool:
    """A CUDA runtime or driver call (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync...)."""
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def _stage_of(event: FunctionEvent | None) -> str:
    """The innermost stage range enclosing a host event; 'other' without one."""
    while event is not None:
        if event.name in STAGES:
            return event.name
        event = event.cpu_parent
    return "other"
