"""`oled bench --streams`: many users at once, decoded together (oled.decoding.batch).

A row of N streams decodes the same pool of requests (seeded random prompts, a prompt
file's, or a routing trace's prompts replayed: oled.trace.replay), N at a time: the requests
of a group arrive one forward apart, so each one after the first joins a batch that is
already decoding, and the group's batch runs until all of them end. The one-stream row is
the single-request path (`Runtime.stream`, or `Runtime.replay_stream`), one request after
another; its tokens are every request's reference, and each batched request's tokens are
compared with them. Every row runs `runs` timed passes over the pool after its warm-up passes
(`warmup_runs`; a batched row's over the whole pool, so that every shape's graphs are captured
there).

Per row: aggregate tokens/s (all tokens over the time the groups took; the median pass and
the range of the passes), per-request tokens/s (its tokens over its own time from arrival),
time to first token (from its arrival to the first streamed block with answer tokens), p50 and
p90, the running streams' slowdown while prompts join (each forward that carried a joining
prompt's rows beside running streams over the median forward of as many streams that carried
none, averaged) and their stall (what those forwards took beyond that median, per joining
prompt), and expert copies and CPU experts per generated token. With `profile`: device time per
forward stage (CUDA) and host time per stage and per forward, from a few steady forwards of N
streams (oled.bench.profile).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from oled.bench.profile import profile_figures
from oled.bench.runs import (
    BenchConfig,
    Job,
    TraceWorkload,
    add_job,
    batch_session,
    bench_decode,
    random_prompt,
)
from oled.bench.tables import fmt, with_spread
from oled.decoding import DecodeConfig
from oled.decoding.batch import BatchDecoder, ForwardFigures
from oled.decoding.decoder import median_p90
from oled.progress import track
from oled.runtime import Runtime
from oled.trace.batched import whole_groups
from oled.trace.replay import BatchReplay

if TYPE_CHECKING:
    from rich.table import Table

Messages = list[dict[str, str]]  # a chat prompt


@dataclass
class Request:
    """One request's timings and tokens."""

    job: Job
    arrived: float = 0.0
    first: float | None = None  # the first block with answer tokens
    done: float = 0.0
    tokens: list[int] | None = None

    def add(self, new: list[int], now: float) -> None:
        self.tokens = (self.tokens or []) + new
        if new and self.first is None:
            self.first = now


@dataclass
class Pass:
    """One timed pass over the pool: its requests, copies, CPU experts, seconds and batched
    forwards."""

    requests: list[Request] = field(default_factory=list)
    copies: float = 0.0
    cpu_experts: float = 0.0
    seconds: float = 0.0
    forwards: list[ForwardFigures] = field(default_factory=list)
    joins: int = 0  # requests that joined a batch with streams decoding

    def add_misses(self, rt: Runtime) -> None:
        """Count the last generation's (or batch's) expert copies and CPU experts."""
        summary = rt.offload_summary() or {}
        self.copies += float(summary.get("copies", 0))
        self.cpu_experts += float(summary.get("cpu_experts", 0))

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens or []) for r in self.requests)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def bench_streams(
    rt: Runtime,
    cfg: BenchConfig,
    label: str,
    counts: list[int],
    requests: int | None = None,
    prompts: list[Messages] | None = None,
    work: TraceWorkload | None = None,
) -> list[dict[str, Any]]:
    """A row per stream count over one pool of `requests` (default: the largest count) of
    seeded random prompts, of `prompts` (chat messages, in turn) or, with `work`, of its
    trace's selected prompts replayed (in turn; by default every one at least once, in whole
    groups of the largest count)."""
    if work is not None:
        requests = requests or whole_groups(max(counts), len(work.prompts))
    pool = _pool(rt, cfg, requests or max(counts), prompts, work)
    decode = bench_decode(rt, cfg)
    for _ in range(cfg.warmup_runs):
        _single(rt, pool[:1] if work is None else pool, decode, work)
    singles = [_single(rt, pool, decode, work) for _ in range(cfg.runs)]
    reference = [r.tokens for r in singles[0].requests]
    rows = []
    for n in counts:
        if n == 1:
            passes, extra = singles, {}
        else:
            trace = work.trace if work is not None else None
            with batch_session(rt, n, decode, trace) as (dec, source):  # one for all passes
                for _ in range(cfg.warmup_runs):  # its graphs are captured here (every shape)
                    _batched(rt, dec, pool, decode, source)
                before = _captures(rt)
                passes = [_batched(rt, dec, pool, decode, source) for _ in range(cfg.runs)]
            extra = {"graph_captures": _captures(rt) - before}
        row = _row(label, n, passes, reference) | extra
        if work is not None:
            row["routing"] = {"trace": work.name, "prompts": [j.traced for j in pool]}
        rows.append(row | _profile(rt, cfg, pool[:n], decode, work))
    return rows


def _pool(
    rt: Runtime,
    cfg: BenchConfig,
    requests: int,
    prompts: list[Messages] | None,
    work: TraceWorkload | None,
) -> list[Job]:
    """The requests: seeded random prompts of the configured length, the chat prompts given,
    or the trace's selected prompts (each with its replay's seeded ids), in turn."""
    if work is not None:
        source = rt.routing_replay(work.trace)
        chosen = [work.prompts[i % len(work.prompts)] for i in range(requests)]
        return [Job(rt.replay_request(source, i)[0], i) for i in chosen]
    if prompts is None:
        return [Job(random_prompt(rt, cfg.prompt_length, cfg.seed + i)) for i in range(requests)]
    if not prompts:
        raise ValueError("no prompts to decode")
    return [Job(rt.prompt_ids(prompts[i % len(prompts)], chat=True)) for i in range(requests)]


def _single(rt: Runtime, pool: list[Job], decode: DecodeConfig, work: TraceWorkload | None) -> Pass:
    """Every request alone, in turn."""
    out = Pass()
    for job in track(pool, "1 stream"):
        r = Request(job, arrived=time.perf_counter())
        if job.traced is None:
            blocks = rt.stream(job.prompt, decode=decode)
        else:
            assert work is not None  # a traced job comes from a workload
            blocks = rt.replay_stream(work.trace, job.traced)
        for block in blocks:
            _sync(rt)
            r.add(block.new_tokens, time.perf_counter())
        r.done = time.perf_counter()
        out.seconds += r.done - r.arrived
        out.add_misses(rt)
        out.requests.append(r)
    return out


def _batched(
    rt: Runtime,
    dec: BatchDecoder,
    pool: list[Job],
    decode: DecodeConfig,
    source: BatchReplay | None = None,
) -> Pass:
    """The pool in groups of `dec.max_batch`, each decoded as one batch that its requests join
    one forward apart (a traced job replays its prompt through `source`)."""
    out, n = Pass(), dec.max_batch
    for g in track(range(0, len(pool), n), f"{n} streams"):
        t0 = time.perf_counter()
        arriving = deque(Request(job) for job in pool[g : g + n])
        out.joins += len(arriving) - 1  # the first finds the batch idle
        while arriving or dec.busy:
            if arriving:  # the next request arrives before this forward
                r = arriving.popleft()
                r.arrived = time.perf_counter()
                add_job(rt, dec, r.job, decode, source, tag=r)
                out.requests.append(r)
            _step(dec)
            out.forwards.append(dec.last)
        _sync(rt)
        out.seconds += time.perf_counter() - t0
        out.add_misses(rt)
    return out


def _step(dec: BatchDecoder) -> None:
    """One forward of the batch, its finished blocks and requests timed."""
    events = dec.step()
    now = time.perf_counter()
    for ev in events:
        if ev.block is not None:
            ev.stream.tag.add(ev.block.new_tokens, now)
        if ev.finished:
            ev.stream.tag.done = now


def _profile(
    rt: Runtime,
    cfg: BenchConfig,
    jobs: list[Job],
    decode: DecodeConfig,
    work: TraceWorkload | None = None,
) -> dict[str, Any]:
    """With `cfg.profile`: device ms per forward stage (CUDA only) and host ms per stage and
    per forward, over a few steady forwards of these requests decoded together (one stream:
    the single-request path; traced ones replay `work`'s prompts)."""
    if not cfg.profile:
        return {}
    trace = work.trace if work is not None else None
    where: dict[str, Any] = {"batch": jobs, "batch_trace": trace}
    if len(jobs) == 1:
        traced = jobs[0].traced
        where = {"replay": (trace, traced)} if trace is not None and traced is not None else {}
    return profile_figures(rt, jobs[0].prompt, decode, **where)


def _captures(rt: Runtime) -> int:
    """CUDA graphs captured so far by the runtime's forwards (0 without graphs)."""
    graphs = getattr(rt.forward, "graphs", None)
    return getattr(graphs, "captures", 0)


def _sync(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize()


def _row(
    label: str, n: int, passes: list[Pass], reference: list[list[int] | None]
) -> dict[str, Any]:
    """One row's figures over its passes."""
    done = [r for p in passes for r in p.requests]
    tokens = sum(p.tokens for p in passes)
    seconds = sum(p.seconds for p in passes)
    ttft = [1000 * ((r.first or r.done) - r.arrived) for r in done]
    per_request = [len(r.tokens or []) / (r.done - r.arrived) for r in done if r.done > r.arrived]
    p50, p90 = median_p90(ttft)
    equal = sum(r.tokens == reference[i % len(reference)] for i, r in enumerate(done))
    rates = [p.tokens_per_second for p in passes]
    return {
        "config": label,
        "label": f"{label}, {n} stream{'s' * (n > 1)}",
        "streams": n,
        "passes": len(passes),
        "requests": len(done),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": statistics.median(rates),
        "tokens_per_second_passes": rates,
        "request_tokens_per_second": sum(per_request) / len(per_request) if per_request else 0.0,
        "ttft_ms_p50": p50,
        "ttft_ms_p90": p90,
        **_joins([f for p in passes for f in p.forwards], sum(p.joins for p in passes)),
        "copies": sum(p.copies for p in passes),
        "copies_per_token": sum(p.copies for p in passes) / tokens if tokens else 0.0,
        "cpu_experts_per_token": sum(p.cpu_experts for p in passes) / tokens if tokens else 0.0,
        "equal": equal,
    }


def _joins(forwards: list[ForwardFigures], joins: int) -> dict[str, Any]:
    """How `joins` prompts joining running streams slowed them: each forward that carried a
    joining prompt's rows beside running streams, against the median forward of as many
    streams that carried no prompt rows (the running streams' slowdown: the mean of those
    ratios; the stall: the milliseconds those forwards took beyond it, per joining prompt)."""
    carried = [f for f in forwards if f.prefill and f.running]
    plain: dict[int, list[float]] = {}
    for f in forwards:
        if not f.prefill:
            plain.setdefault(f.streams, []).append(f.ms)
    base = {n: statistics.median(ms) for n, ms in plain.items()}
    judged = [(f.ms, base[f.running]) for f in carried if base.get(f.running)]
    every = [t for ms in plain.values() for t in ms]
    return {
        "join_forwards": len(carried),
        "join_forward_ms_mean": statistics.fmean(f.ms for f in carried) if carried else None,
        "join_forward_ms_max": max(f.ms for f in carried) if carried else None,
        "plain_forward_ms_p50": statistics.median(every) if every else None,
        "running_slowdown": statistics.fmean(ms / b for ms, b in judged) if judged else None,
        "stall_ms_per_join": sum(ms - b for ms, b in judged) / joins if judged and joins else None,
    }


def streams_table(rows: list[dict[str, Any]]) -> Table:
    """A rich table of stream rows, with each row's throughput against its config's first."""
    from rich.table import Table

    out = Table(show_edge=False, header_style="bold")
    cols = [
        "config",
        "streams",
        "tokens/s (passes)",
        "x 1 stream",
        "per request tok/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "fwd ms p50",
        "join fwd ms",
        "running slowdown",
        "stall ms/join",
        "copies/token",
        "CPU experts/token",
        "= 1 stream",
    ]
    for col in cols:
        out.add_column(col, justify="left" if col == "config" else "right")
    first: dict[str, float] = {}
    for r in rows:
        base = first.setdefault(r["config"], r["tokens_per_second"])
        out.add_row(
            r["config"],
            str(r["streams"]),
            with_spread(r["tokens_per_second"], r.get("tokens_per_second_passes")),
            _ratio(r, base),
            f"{r['request_tokens_per_second']:.1f}",
            f"{r['ttft_ms_p50']:.0f}",
            f"{r['ttft_ms_p90']:.0f}",
            fmt(r.get("plain_forward_ms_p50"), "{:.2f}"),
            fmt(r.get("join_forward_ms_mean"), "{:.2f}"),
            fmt(r.get("running_slowdown"), "{:.2f}x"),
            fmt(r.get("stall_ms_per_join"), "{:.1f}"),
            f"{r['copies_per_token']:.1f}",
            f"{r.get('cpu_experts_per_token', 0.0):.1f}",
            f"{r['equal']}/{r['requests']}",
        )
    return out


def _ratio(row: dict[str, Any], base: float) -> str:
    """A row's tokens/s against its config's first row (median passes), with its passes'."""
    if not base:
        return "-"
    passes = [rate / base for rate in row.get("tokens_per_second_passes") or []]
    return with_spread(row["tokens_per_second"] / base, passes, "{:.2f}")
