"""`oled bench --streams`: many users at once, decoded together (oled.decoding.batch).

A row of N streams decodes the same pool of requests (seeded random prompts), N at a time:
groups of N arrive together and decode in one batch. The one-stream row is the single-request
path (`Runtime.stream`), one request after another; its tokens are every request's reference,
and each batched request's tokens are compared with them. Per row: aggregate tokens/s (all
tokens over the time the groups took), per-request tokens/s (its tokens over its own time from
arrival), time to first token (the first streamed block with answer tokens), p50 and p90, and
expert copies per generated token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from oled.bench.runs import BenchConfig, bench_decode, random_prompt
from oled.decoding import DecodeConfig
from oled.decoding.decoder import median_p90
from oled.progress import track
from oled.runtime import Runtime

if TYPE_CHECKING:
    from rich.table import Table


@dataclass
class Request:
    """One request's timings and tokens."""

    prompt: list[int]
    arrived: float = 0.0
    first: float | None = None  # the first block with answer tokens
    done: float = 0.0
    tokens: list[int] | None = None

    def add(self, new: list[int], now: float) -> None:
        self.tokens = (self.tokens or []) + new
        if new and self.first is None:
            self.first = now


def bench_streams(
    rt: Runtime, cfg: BenchConfig, label: str, counts: list[int], requests: int | None = None
) -> list[dict[str, Any]]:
    """A row per stream count over one pool of `requests` (default: the largest count)."""
    pool = [
        random_prompt(rt, cfg.prompt_length, cfg.seed + i) for i in range(requests or max(counts))
    ]
    decode = bench_decode(rt, cfg)
    for _ in range(cfg.warmup_runs):
        _single(rt, pool[:1], decode)
    single, copies, seconds = _single(rt, pool, decode)
    reference = [r.tokens for r in single]
    rows = []
    for n in counts:
        if n == 1:
            rows.append(_row(label, 1, single, copies, seconds, reference))
            continue
        for _ in range(cfg.warmup_runs):  # its graphs are captured here
            _batched(rt, pool[:n], decode, n)
        before = _captures(rt)
        done, copies_n, seconds_n = _batched(rt, pool, decode, n)
        row = _row(label, n, done, copies_n, seconds_n, reference)
        rows.append(row | {"graph_captures": _captures(rt) - before})
    return rows


def _single(
    rt: Runtime, pool: list[list[int]], decode: DecodeConfig
) -> tuple[list[Request], float, float]:
    """Every request alone, in turn: the requests, the copies, the seconds in all."""
    out, copies, seconds = [], 0.0, 0.0
    for prompt in track(pool, "1 stream"):
        r = Request(prompt, arrived=time.perf_counter())
        for block in rt.stream(prompt, decode=decode):
            _sync(rt)
            r.add(block.new_tokens, time.perf_counter())
        r.done = time.perf_counter()
        seconds += r.done - r.arrived
        copies += _copies(rt)
        out.append(r)
    return out, copies, seconds


def _batched(
    rt: Runtime, pool: list[list[int]], decode: DecodeConfig, n: int
) -> tuple[list[Request], float, float]:
    """The pool in groups of n that arrive together, each group decoded as one batch."""
    dec = rt.batch_decoder(n, block_length=decode.block_length)
    out, copies, seconds = [], 0.0, 0.0
    for g in track(range(0, len(pool), n), f"{n} streams"):
        t0 = time.perf_counter()
        group = [Request(p, arrived=t0) for p in pool[g : g + n]]
        for r in group:
            dec.add(r.prompt, decode, tag=r)
        while dec.busy:
            events = dec.step()
            now = time.perf_counter()
            for ev in events:
                if ev.block is not None:
                    ev.stream.tag.add(ev.block.new_tokens, now)
                if ev.finished:
                    ev.stream.tag.done = now
        _sync(rt)
        seconds += time.perf_counter() - t0
        copies += _copies(rt)
        out += group
    return out, copies, seconds


def _copies(rt: Runtime) -> float:
    """The expert copies of the last generation (or batch), 0 when every expert is resident."""
    summary = rt.offload_summary()
    return 0.0 if summary is None else float(summary["copies"])


def _captures(rt: Runtime) -> int:
    """CUDA graphs captured so far by the runtime's forwards (0 without graphs)."""
    graphs = getattr(rt.forward, "graphs", None)
    return getattr(graphs, "captures", 0)


def _sync(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize()


def _row(
    label: str,
    n: int,
    done: list[Request],
    copies: float,
    seconds: float,
    reference: list[list[int] | None],
) -> dict[str, Any]:
    """One row's figures."""
    tokens = sum(len(r.tokens or []) for r in done)
    ttft = [1000 * ((r.first or r.done) - r.arrived) for r in done]
    per_request = [len(r.tokens or []) / (r.done - r.arrived) for r in done if r.done > r.arrived]
    p50, p90 = median_p90(ttft)
    equal = sum(r.tokens == ref for r, ref in zip(done, reference, strict=True))
    return {
        "config": label,
        "streams": n,
        "requests": len(done),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "request_tokens_per_second": sum(per_request) / len(per_request) if per_request else 0.0,
        "ttft_ms_p50": p50,
        "ttft_ms_p90": p90,
        "copies": copies,
        "copies_per_token": copies / tokens if tokens else 0.0,
        "equal": equal,
    }


def streams_table(rows: list[dict[str, Any]]) -> Table:
    """A rich table of stream rows, with each row's throughput against its config's first."""
    from rich.table import Table

    out = Table(show_edge=False, header_style="bold")
    cols = [
        "config",
        "streams",
        "tokens/s",
        "x 1 stream",
        "per request tok/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "copies/token",
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
            f"{r['tokens_per_second']:.1f}",
            f"{r['tokens_per_second'] / base:.2f}" if base else "-",
            f"{r['request_tokens_per_second']:.1f}",
            f"{r['ttft_ms_p50']:.0f}",
            f"{r['ttft_ms_p90']:.0f}",
            f"{r['copies_per_token']:.1f}",
            f"{r['equal']}/{r['requests']}",
        )
    return out
