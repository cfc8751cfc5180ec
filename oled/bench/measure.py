"""Benchmark rows: warm-up and timed runs of one configuration, summarised into figures."""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Sequence
from typing import Any

from oled import kernels
from oled.bench.profile import Replay, profile_figures
from oled.bench.runs import (
    BenchConfig,
    TraceWorkload,
    bench_decode,
    random_prompt,
    run_once,
    run_replay,
)
from oled.decoding import DecodeConfig, Trajectory
from oled.decoding.decoder import median_p90
from oled.decoding.follow import Agreement, agreement_summary
from oled.offload.metrics import FIELDS, with_rates
from oled.progress import track
from oled.runtime import Runtime


def replay_warmups(cfg: BenchConfig, prompts: int) -> int:
    """Untimed replays before a replay row's timed passes: none when none are asked for, else
    at least one of each of the `prompts` selected (each prompt has its own shapes)."""
    return max(cfg.warmup_runs, prompts) if cfg.warmup_runs else 0


def bench_replay(rt: Runtime, cfg: BenchConfig, label: str, work: TraceWorkload) -> dict:
    """One configuration on a trace's routing: warm-up replays (unless none are asked for,
    every selected prompt at least once, so that each prompt's shapes are captured as graphs
    before any timed pass),
    then `runs` timed passes over the selected prompts (each prompt's replay one run), one row
    of figures. Every row replays the same schedule, so no trajectory is followed; the prompt
    and generation lengths, block length and threshold come from the trace."""
    n = len(work.prompts)
    for i in track(range(replay_warmups(cfg, n)), f"warming up {label}"):
        run_replay(rt, work.trace, work.prompts[i % n])
    runs, offload, outputs, passes = [], [], [], []
    for _ in track(range(cfg.runs), f"timing {label}"):
        for index in work.prompts:
            stats, off, tokens = run_replay(rt, work.trace, index)
            runs.append(stats)
            outputs.append(tokens)
            offload += [off] if off is not None else []
        done = runs[-n:]  # this pass: every selected prompt once
        passes.append(sum(s.new_tokens for s in done) / max(1e-9, sum(s.seconds for s in done)))
    row = summarise(label, runs, offload)
    row["tokens_per_second_passes"] = passes  # end to end, one figure per pass: the spread
    _profile_into(row, rt, cfg, [], None, replay=(work.trace, work.prompts[0]))
    row["output"] = _digest(outputs[0])
    row["routing"] = {"trace": work.name, "prompts": list(work.prompts)}
    return row | _execution(rt)


def bench_runtime(
    rt: Runtime, cfg: BenchConfig, label: str, follow: bool = False
) -> dict[str, Any]:
    """One configuration: the prompt's reference (every expert on the device: the resident
    model's tokens, untimed), warm-up, timed runs, one row of figures.

    Free running (the default), every timed run is compared with the reference as it runs
    (`agreement`: tokens equal, first divergence, largest logit difference). With `follow`,
    the runs commit the reference's tokens, so that every row does the same work
    (`followed_agreement`: the share of commits where the run's own choice was the same
    token), and one more free-running run, untimed, measures the agreement.
    """
    decode = bench_decode(rt, cfg)
    prompt = random_prompt(rt, cfg.prompt_length, cfg.seed)
    reference = rt.reference_ids(prompt, decode)
    followed = reference if follow else None
    for _ in track(range(cfg.warmup_runs), f"warming up {label}"):
        run_once(rt, prompt, decode, follow=followed)
    runs, offload, outputs, agreements = [], [], [], []
    for _ in track(range(cfg.runs), f"timing {label}"):
        agree = [] if follow else [Agreement(reference)]
        stats, off, tokens = run_once(rt, prompt, decode, agree, followed)
        runs.append(stats)
        outputs.append(tokens)
        offload += [off] if off is not None else []
        agreements += [a.result() for a in agree]
    if follow:
        agree = [Agreement(reference)]
        run_once(rt, prompt, decode, agree)
        agreements.append(agree[0].result())
    row = summarise(label, runs, offload)
    row["tokens_per_second_passes"] = [s.tokens_per_second for s in runs]  # each run a pass
    _profile_into(row, rt, cfg, prompt, decode, follow=followed)
    row["output"] = _digest(outputs[0])
    row["block_length"], row["threshold"] = decode.block_length, decode.threshold
    row["agreement"] = agreement_summary(agreements) | {"runs": len(agreements)}
    if follow:
        followed_commits = sum(s.followed for s in runs)
        row["followed_agreement"] = sum(s.agreed for s in runs) / max(1, followed_commits)
    return row | _execution(rt)


def _profile_into(
    row: dict,
    rt: Runtime,
    cfg: BenchConfig,
    prompt: list[int],
    decode: DecodeConfig | None,
    follow: Trajectory | None = None,
    replay: Replay | None = None,
) -> None:
    """With `cfg.profile`: the device stage times (CUDA only) and the host times, into `row`."""
    if cfg.profile:
        row.update(profile_figures(rt, prompt, decode, follow=follow, replay=replay))


def _digest(tokens: list[int]) -> str:
    """The tokens, short: equal digests, equal outputs."""
    return hashlib.sha1(repr(tokens).encode()).hexdigest()[:12]


def _execution(rt: Runtime) -> dict[str, Any]:
    """How the row ran: the kernels in use, whether the forwards were CUDA graphs, and how the
    offload decisions were made (the cost model's source and figures; None when resident)."""
    graphs = bool(getattr(rt.forward, "graphed", False)) and rt.device.type == "cuda"
    return {"kernels": kernels.describe(rt.device), "graphs": graphs, "decisions": rt.decisions()}


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
    out = {
        key: decode[key]
        for key in (
            "hit_rate",
            "cpu_share",
            "host_us_per_layer",
            "plan_us_per_layer",
            "launch_us_per_layer",
            "pass_us_per_layer",
            "sync_us_per_layer",
        )
    }
    for key in ("copies", "copy_bytes", "cpu_experts", "stall_ms", "copy_ms", "predicted"):
        out[f"{key}_per_iteration"] = decode[key] / n
    if decode["cpu_experts"]:  # the host's compute time per CPU expert
        out["cpu_ms_per_expert"] = decode["cpu_ms"] / decode["cpu_experts"]
        # the engine's CPU-expert time over the calibrated cost model's for the same experts
        out["cpu_time_over_model"] = decode["cpu_ms"] / max(decode["cpu_model_ms"], 1e-9)
    if decode["predicted"]:  # copied a layer ahead: the share that the layer then needed
        out["predicted_used"] = decode["predicted_hits"] / decode["predicted"]
    if out["copy_ms_per_iteration"]:  # bytes over the copy stream's busy time
        out["copy_gb_per_s"] = out["copy_bytes_per_iteration"] / out["copy_ms_per_iteration"] / 1e6
    prompt = with_rates(_sum(per_run, "prompt"))
    out["prompt_copies"] = prompt["copies"] / len(per_run)
    # the prompt forward's copies: bytes and busy time (its floor: bytes at the pinned rate)
    out["prompt_copy_bytes"] = prompt["copy_bytes"] / len(per_run)
    out["prompt_copy_ms"] = prompt["copy_ms"] / len(per_run)
    out["prompt_cpu_share"] = prompt["cpu_share"]  # CPU experts in the prompt forward
    return out


def _sum(per_run: list[dict], part: str) -> dict[str, float]:
    """One part ("prompt" or "decode") of the engine's summaries, summed over runs."""
    return {name: sum(o[part][name] for o in per_run) for name in FIELDS}


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's median ms per iteration as a ratio to the first row's."""
    base = rows[0]["ms_per_iteration_median"] if rows else 0.0
    for row in rows:
        row["ms_ratio_to_first"] = row["ms_per_iteration_median"] / base if base else 0.0
    return rows
