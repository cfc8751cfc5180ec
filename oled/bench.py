"""`oled bench`: milliseconds per iteration, tokens/s and offload figures, side by side.

Workload (DESIGN.md section 7): a seeded random prompt (512 tokens by default), `gen_length`
generated tokens in blocks of `block_length`, batch 1; warm-up runs, then timed runs; median and
p90 over every timed iteration. With several recipes every configuration runs in this one
process and the table gives each one's ratio to the first.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from oled import kernels
from oled.decoding import DecodeObserver
from oled.decoding.decoder import median_p90
from oled.decoding.follow import Trajectory
from oled.model.stages import STAGES, annotate
from oled.offload.metrics import FIELDS, with_rates
from oled.runtime import Runtime


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    gen_length: int = 256
    block_length: int = 32
    threshold: float = 0.95
    prompt_length: int = 512
    warmup_runs: int = 1
    runs: int = 3
    seed: int = 0
    profile: bool = False

    def __post_init__(self) -> None:
        if min(self.gen_length, self.block_length, self.prompt_length, self.runs) < 1:
            raise ValueError("gen/block/prompt length and runs must be at least 1")
        if self.warmup_runs < 0:
            raise ValueError("warmup runs must be >= 0")


def random_prompt(rt: Runtime, length: int, seed: int) -> list[int]:
    """Seeded random token ids, special tokens excluded."""
    tok = rt.tokenizer
    specials = {tok.mask_id, tok.eos_id, *tok.stop_ids}
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rt.config.vocab_size, (length * 2,), generator=gen).tolist()
    ids = [i for i in ids if i not in specials][:length]
    if len(ids) < length:
        raise ValueError("could not draw a random prompt of that length")
    return ids


def stage_breakdown(rt: Runtime, prompt: list[int], decode, iterations: int = 3, follow=None,
                    replay: tuple[Any, int] | None = None):  # fmt: skip
    """Device milliseconds per iteration of each forward stage (oled.model.stages), from a few
    iterations (after the prompt's) of one extra eager generation under the profiler: every
    kernel and copy counts for the innermost stage that launched it. The graphs replay the same
    kernels, so these are their times too. CPU experts count the host's milliseconds (engine
    metrics), not device time."""
    from oled.model.graphs import EagerForward

    graphed, rt.forward = rt.forward, EagerForward(rt.model)
    try:
        window, off = _profiled(rt, prompt, decode, iterations, follow, device=True,
                                replay=replay)  # fmt: skip
    finally:
        rt.forward = graphed
    totals = _stage_device_us(window.profiler.events())
    out = {name: us / 1000 / window.seen for name, us in totals.items()}
    decode = off["decode"] if off is not None else {}
    if decode.get("cpu_ms"):
        out["CPU experts"] = decode["cpu_ms"] / max(1, decode["iterations"])
    return out


def host_breakdown(rt: Runtime, prompt: list[int], decode, iterations: int = 3, follow=None,
                   replay: tuple[Any, int] | None = None):  # fmt: skip
    """Host milliseconds per iteration of each stage range (inclusive: `copies` lies inside
    `host decision`) and of each CUDA API call (cudaGraphLaunch, cudaMemcpyAsync, ...), from a
    few iterations of one more generation run as the runtime runs it (graphs kept) under a
    CPU-only profiler: where the host path spends its time."""
    window, _ = _profiled(rt, prompt, decode, iterations, follow, device=False, replay=replay)
    totals: dict[str, float] = {}
    for e in window.profiler.events():
        if e.name in STAGES or _is_api_call(e.name):
            totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
    return {name: us / 1000 / max(1, window.seen) for name, us in totals.items()}


def _profiled(rt: Runtime, prompt: list[int], decode, iterations: int, follow, *, device: bool,
              replay: tuple[Any, int] | None = None):  # fmt: skip
    """One generation (following `follow` if given; the replay of (trace, prompt index) if
    `replay`) with iterations 1 .. `iterations` under the profiler: (the window, the engine's
    figures)."""
    window = _ProfileWindow(first=1, count=iterations, device=device)
    try:
        if replay is not None:
            _, off, _ = run_replay(rt, *replay, [window])
        else:
            _, off, _ = run_once(rt, prompt, decode, [window], follow)
    finally:
        window.stop()
    return window, off


class _ProfileWindow(DecodeObserver):
    """Profiles iterations first .. first + count - 1 of a generation, stages annotated; the
    device timeline too unless `device` is False."""

    def __init__(self, *, first: int, count: int, device: bool = True) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.first, self.count, self.seen, self.running = first, count, 0, False
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * device
        self.profiler = profile(activities=activities)

    def on_iteration_start(self, block: int, iteration: int, step: int) -> None:
        if step == self.first:
            annotate(True)
            self.profiler.start()
            self.running = True

    def on_iteration(self, info) -> None:
        if self.running:
            self.seen += 1
            if self.seen == self.count:
                self.stop()

    def stop(self) -> None:
        if self.running:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.stop()
            annotate(False)
            self.running = False


def _stage_device_us(events) -> dict[str, float]:
    """Microseconds of kernels and copies per innermost enclosing stage ('other' outside).

    Each device event is found through its host API call (cudaLaunchKernel, cuLaunchKernelEx,
    cudaMemcpyAsync, ...: the same correlation id), whose place in the host call tree names the
    stage; this also places Triton's kernels, which no torch op launches. A device event whose
    call the profiler did not record counts for the torch op it is linked to, if any.
    """
    totals: dict[str, float] = {}
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    calls = {e.id: e for e in events if e.device_type == cpu and _is_api_call(e.name)}
    ops = {e.id: e for e in events if e.device_type == cpu and not _is_api_call(e.name)}
    for event in events:
        if event.device_type != cuda or not _device_work(event):
            continue
        call = calls.get(event.id)
        if call is None:
            call = ops.get(getattr(event, "linked_correlation_id", 0) or -1)
        stage = _stage_of(call)
        totals[stage] = totals.get(stage, 0.0) + event.time_range.elapsed_us()
    return totals


def _device_work(event) -> bool:
    """A kernel, copy or memset: not a mirror of a stage range on the device timeline, nor a
    synchronisation (both span other work)."""
    kind = getattr(event, "activity_type", None)
    if kind is not None:
        return kind in ("kernel", "gpu_memcpy", "gpu_memset")
    return not (getattr(event, "is_user_annotation", False) or event.name in STAGES
                or "Sync" in event.name)  # fmt: skip


def _is_api_call(name: str) -> bool:
    """A CUDA runtime or driver call (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync...)."""
    return name.startswith("cuda") or (name.startswith("cu") and name[2:3].isupper())


def _stage_of(event) -> str:
    """The innermost stage range enclosing a host event; 'other' without one."""
    while event is not None:
        if event.name in STAGES:
            return event.name
        event = event.cpu_parent
    return "other"


def run_once(
    rt: Runtime, prompt: list[int], decode, observers=(), follow: Trajectory | None = None
) -> tuple[Any, dict | None, list[int]]:
    """One generation (committing what `follow` committed, if given): its decoding statistics,
    the offload engine's figures, its tokens."""
    tokens: list[int] = []
    for block in rt.stream(prompt, decode=decode, observers=observers, follow=follow):
        tokens += block.new_tokens
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    return rt.last_stats, rt.offload_summary(), tokens


def run_replay(rt: Runtime, trace, index: int, observers=()) -> tuple[Any, dict | None, list[int]]:
    """One replay of traced prompt `index` (Runtime.replay_stream): its decoding statistics,
    the offload engine's figures, its tokens."""
    tokens: list[int] = []
    for block in rt.replay_stream(trace, index, observers=observers):
        tokens += block.new_tokens
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    return rt.last_stats, rt.offload_summary(), tokens


@dataclass(frozen=True)
class TraceWorkload:
    """A routing trace whose prompts (by index) a benchmark row replays instead of a random
    prompt (oled.decoding.replay)."""

    trace: Any
    prompts: tuple[int, ...]
    name: str = "trace"


def bench_replay(rt: Runtime, cfg: BenchConfig, label: str, work: TraceWorkload) -> dict:
    """One configuration on a trace's routing: warm-up replays, then `runs` timed passes over
    the selected prompts (each prompt's replay one run), one row of figures. Every row replays
    the same schedule, so no trajectory is followed; the prompt and generation lengths, block
    length and threshold come from the trace."""
    n = len(work.prompts)
    for i in range(cfg.warmup_runs):
        run_replay(rt, work.trace, work.prompts[i % n])
    runs, offload, outputs, passes = [], [], [], []
    for _ in range(cfg.runs):
        for index in work.prompts:
            stats, off, tokens = run_replay(rt, work.trace, index)
            runs.append(stats)
            outputs.append(tokens)
            offload += [off] if off is not None else []
        done = runs[-n:]  # this pass: every selected prompt once
        passes.append(sum(s.new_tokens for s in done) / max(1e-9, sum(s.seconds for s in done)))
    row = summarise(label, runs, offload)
    row["tokens_per_second_passes"] = passes  # end to end, one figure per pass: the spread
    first = (work.trace, work.prompts[0])
    if cfg.profile and rt.device.type == "cuda":
        row["stages_ms_per_iteration"] = stage_breakdown(rt, [], None, replay=first)
    if cfg.profile:
        row["host_ms_per_iteration"] = host_breakdown(rt, [], None, replay=first)
    row["output"] = hashlib.sha1(repr(outputs[0]).encode()).hexdigest()[:12]
    row["routing"] = {"trace": work.name, "prompts": list(work.prompts)}
    row["kernels"] = kernels.describe(rt.device)
    row["graphs"] = bool(getattr(rt.forward, "graphed", False)) and rt.device.type == "cuda"
    return row


def bench_decode(rt: Runtime, cfg: BenchConfig):
    """The runtime's decoding settings with the benchmark's block, threshold and length."""
    return replace(rt.decode, block_length=cfg.block_length, threshold=cfg.threshold,
                   max_new_tokens=cfg.gen_length, use_cache=True)  # fmt: skip


def bench_runtime(
    rt: Runtime, cfg: BenchConfig, label: str, trajectory: Trajectory | None = None
) -> dict[str, Any]:
    """One configuration: warm-up, timed runs, one row of figures.

    With a `trajectory` the rows do the same work: an empty one records this row's first timed
    run; a recorded one is followed by every run of this row, whose `agreement` is the share of
    the followed commits where its own choice was the same token. A row whose prompt differs
    (another tokenizer) decodes freely.
    """
    decode = bench_decode(rt, cfg)
    prompt = random_prompt(rt, cfg.prompt_length, cfg.seed)
    recorded = trajectory is not None and bool(trajectory.steps)
    follow = trajectory if recorded and trajectory.prompt == tuple(prompt) else None
    record = [trajectory] if trajectory is not None and not recorded else []
    if record:
        trajectory.prompt = tuple(prompt)
    for _ in range(cfg.warmup_runs):
        run_once(rt, prompt, decode, follow=follow)
    runs, offload, outputs = [], [], []
    for i in range(cfg.runs):
        stats, off, tokens = run_once(rt, prompt, decode, record * (i == 0), follow)
        runs.append(stats)
        outputs.append(tokens)
        offload += [off] if off is not None else []
    row = summarise(label, runs, offload)
    if cfg.profile and rt.device.type == "cuda":
        row["stages_ms_per_iteration"] = stage_breakdown(rt, prompt, decode, follow=follow)
    if cfg.profile:
        row["host_ms_per_iteration"] = host_breakdown(rt, prompt, decode, follow=follow)
    row["output"] = hashlib.sha1(repr(outputs[0]).encode()).hexdigest()[:12]  # the tokens, short
    if follow is not None:
        row["agreement"] = sum(s.agreed for s in runs) / max(1, sum(s.followed for s in runs))
    row["kernels"] = kernels.describe(rt.device)
    row["graphs"] = bool(getattr(rt.forward, "graphed", False)) and rt.device.type == "cuda"
    return row


def summarise(label: str, runs: Sequence[Any], offload: Sequence[dict] = ()) -> dict[str, Any]:
    """A row: iteration times over the decode iterations (a run's first forward runs the
    prompt and is reported apart as `prompt_ms`), throughput over whole generations."""
    ms = [m for s in runs for m in s.decode_ms]
    median, p90 = median_p90(ms)
    prompt = [s.prompt_ms for s in runs if s.prompt_ms is not None]
    iterations = sum(s.iterations for s in runs)
    tokens = sum(s.new_tokens for s in runs)
    seconds = sum(s.seconds for s in runs)
    row: dict[str, Any] = {
        "label": label,
        "ms_per_iteration_median": median,
        "ms_per_iteration_p90": p90,
        "ms_per_iteration_mean": statistics.fmean(ms),
        "prompt_ms": statistics.median(prompt) if prompt else None,
        "ms_per_forward_mean": 1000 * seconds / iterations if iterations else 0.0,  # all forwards
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "tokens_per_forward": tokens / iterations if iterations else 0.0,
        "iterations": iterations,
        "tokens": tokens,
        "runs": len(runs),
    }
    if offload:
        row["offload"] = _offload_summary(list(offload))
    return row


def _offload_summary(per_run: list[dict]) -> dict[str, float]:
    """The engine's figures over the runs' decode iterations: rates, totals per iteration; and
    the copies of the prompt forward."""
    decode = with_rates(_sum(per_run, "decode"))
    n = max(1, sum(o["decode"]["iterations"] for o in per_run))
    out = {key: decode[key] for key in (
        "hit_rate", "cpu_share", "host_us_per_layer", "plan_us_per_layer", "launch_us_per_layer",
        "pass_us_per_layer", "sync_us_per_layer",
    )}  # fmt: skip
    for key in ("copies", "copy_bytes", "cpu_experts", "stall_ms", "copy_ms", "predicted"):
        out[f"{key}_per_iteration"] = decode[key] / n
    if decode["cpu_experts"]:  # the host's compute time per CPU expert
        out["cpu_ms_per_expert"] = decode["cpu_ms"] / decode["cpu_experts"]
    if decode["predicted"]:  # copied a layer ahead: the share that the layer then needed
        out["predicted_used"] = decode["predicted_hits"] / decode["predicted"]
    if out["copy_ms_per_iteration"]:  # bytes over the copy stream's busy time
        out["copy_gb_per_s"] = out["copy_bytes_per_iteration"] / out["copy_ms_per_iteration"] / 1e6
    out["prompt_copies"] = _sum(per_run, "prompt")["copies"] / len(per_run)
    return out


def _sum(per_run: list[dict], part: str) -> dict[str, float]:
    """One part ("prompt" or "decode") of the engine's summaries, summed over runs."""
    return {name: sum(o[part][name] for o in per_run) for name in FIELDS}


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = rows[0]["ms_per_iteration_median"] if rows else 0.0
    for row in rows:
        row["ms_ratio_to_first"] = row["ms_per_iteration_median"] / base if base else 0.0
    return rows


def machine() -> dict[str, str]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"python": sys.version.split()[0], "torch": torch.__version__, "gpu": gpu,
            "platform": platform.platform()}  # fmt: skip


def write_report(
    report_dir: Path, cfg: BenchConfig, rows: list[dict], device: str, path: Path | None = None
) -> Path:
    """The rows as bench-<time>.json in `report_dir`, or over `path` (the same report written
    again after each row, so that the rows done survive a later failure)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    path = path or report_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    body = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": sys.argv,
            "machine": machine(), "device": device, "config": asdict(cfg), "rows": rows}  # fmt: skip
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def table(rows: list[dict[str, Any]]):
    """A rich table: latency first, then throughput, ratios and offload columns when present."""
    from rich.table import Table

    m = machine()
    caption = f"{m['gpu'] if m['gpu'] != 'none' else platform.processor() or 'cpu'}, torch {m['torch']}, {time.strftime('%Y-%m-%d')}"
    used = sorted({row["kernels"] for row in rows if "kernels" in row})
    caption += f", kernels: {' / '.join(used)}" if used else ""
    out = Table(show_edge=False, header_style="bold", caption=caption)
    cols = ["config", "ms/iter p50", "ms/iter p90", "prompt ms", "tokens/s", "tokens/fwd"]
    ratios = len(rows) > 1
    offload = any("offload" in r for r in rows)
    ahead = any(r.get("offload", {}).get("predicted_per_iteration") for r in rows)
    cols += ["ms vs 1st", "same tokens"] * ratios
    cols += [
        "hit rate",
        "copies/it",
        "copy MB/it",
        "CPU share",
        "stall ms/it",
        "copy ms/it",
        "copy GB/s",
        "host µs/layer",
        "plan/launch/pass µs",
        "sync µs/layer",
    ] * offload
    cols += ["ahead/it (used)"] * ahead
    for col in cols:
        out.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        cells = [r["label"], f"{r['ms_per_iteration_median']:.2f}",
                 f"{r['ms_per_iteration_p90']:.2f}", _fmt(r.get("prompt_ms"), "{:.1f}"),
                 f"{r['tokens_per_second']:.1f}",
                 f"{r['tokens_per_forward']:.2f}"]  # fmt: skip
        same = "yes" if r.get("output") == rows[0].get("output") else "no"
        if r.get("agreement", 1.0) < 1.0:  # followed the first row; its own choices differed
            same = f"own {r['agreement']:.1%}"
        cells += [f"{r['ms_ratio_to_first']:.2f}x", same] * ratios
        if offload:
            o = r.get("offload", {})
            cells += [_fmt(o.get("hit_rate"), "{:.1%}"), _fmt(o.get("copies_per_iteration")),
                      _fmt(o.get("copy_bytes_per_iteration"), "{:.1f}", 1e-6),
                      _fmt(o.get("cpu_share"), "{:.1%}"),
                      _fmt(o.get("stall_ms_per_iteration"), "{:.2f}"),
                      _fmt(o.get("copy_ms_per_iteration"), "{:.2f}"),
                      _fmt(o.get("copy_gb_per_s"), "{:.1f}"),
                      _fmt(o.get("host_us_per_layer"), "{:.0f}"),
                      _host_split(o),
                      _fmt(o.get("sync_us_per_layer"), "{:.0f}")]  # fmt: skip
        if ahead:
            used = o.get("predicted_used")
            cells.append(
                _fmt(o.get("predicted_per_iteration"))
                + (f" ({used:.0%})" if used is not None else "")
            )
        out.add_row(*cells)
    return out


def stage_table(rows: list[dict[str, Any]]):
    from rich.table import Table

    seen = {k for r in rows for k in r.get("stages_ms_per_iteration", {})}
    names = [n for n in (*STAGES, "other") if n in seen]
    title = "device ms per iteration by stage (kernels and copies; CPU experts: host ms)"
    out = Table(show_edge=False, header_style="bold", title=title)
    for col in ["config", *names, "sum"]:
        out.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        stages = r.get("stages_ms_per_iteration", {})
        total = sum(v for k, v in stages.items() if k != "CPU experts") if stages else None
        out.add_row(r["label"], *(_fmt(stages.get(n), "{:.3f}") for n in names),
                    _fmt(total, "{:.3f}"))  # fmt: skip
    return out


def host_table(rows: list[dict[str, Any]], columns: int = 12):
    """The host milliseconds per iteration of the stages and API calls that take the most."""
    from rich.table import Table

    peak: dict[str, float] = {}
    for r in rows:
        for name, ms in r.get("host_ms_per_iteration", {}).items():
            peak[name] = max(peak.get(name, 0.0), ms)
    names = sorted(peak, key=peak.get, reverse=True)[:columns]
    title = "host ms per iteration by stage (inclusive) and CUDA API call (graphs as run)"
    out = Table(show_edge=False, header_style="bold", title=title)
    for col in ["config", *names]:
        out.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        host = r.get("host_ms_per_iteration", {})
        out.add_row(r["label"], *(_fmt(host.get(n), "{:.3f}") for n in names))
    return out


def _host_split(offload: dict) -> str:
    """The planner's, the copy launches' and the passes' parts of the host path, µs per layer."""
    parts = [offload.get(f"{k}_us_per_layer") for k in ("plan", "launch", "pass")]
    return "n/a" if None in parts else "/".join(f"{v:.0f}" for v in parts)


def _fmt(value: float | None, pattern: str = "{:.1f}", scale: float = 1.0) -> str:
    return "n/a" if value is None else pattern.format(value * scale)
