"""The benchmark's configuration, its workloads and one generation of a row."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from oled.decoding import DecodeConfig, DecodeObserver, GenerationStats
from oled.decoding.batch import BatchDecoder, Stream
from oled.decoding.follow import Trajectory
from oled.runtime import Runtime
from oled.trace.replay import BatchReplay, RoutingTrace

Generation = tuple[GenerationStats, dict | None, list[int]]  # stats, offload figures, tokens


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """The workload of a row: a seeded random prompt, the tokens generated, the passes. The
    decoding settings are each row's runtime's (its recipe's, with the command's flags)."""

    gen_length: int = 256
    prompt_length: int = 512
    warmup_runs: int = 1
    runs: int = 3
    seed: int = 0
    profile: bool = False

    def __post_init__(self) -> None:
        if min(self.gen_length, self.prompt_length, self.runs) < 1:
            raise ValueError("gen and prompt length and runs must be at least 1")
        if self.warmup_runs < 0:
            raise ValueError("warmup runs must be >= 0")


@dataclass(frozen=True)
class TraceWorkload:
    """A routing trace whose prompts (by index) a benchmark row replays instead of a random
    prompt (oled.trace.replay)."""

    trace: RoutingTrace
    prompts: tuple[int, ...]
    name: str = "trace"


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


def bench_decode(rt: Runtime, cfg: BenchConfig) -> DecodeConfig:
    """The runtime's decoding settings with the benchmark's length and the prefix cache."""
    return replace(rt.decode, max_new_tokens=cfg.gen_length, use_cache=True)


def run_once(
    rt: Runtime,
    prompt: list[int],
    decode: DecodeConfig | None,
    observers: Sequence[DecodeObserver] = (),
    follow: Trajectory | None = None,
) -> Generation:
    """One generation (committing what `follow` committed, if given): its decoding statistics,
    the offload engine's figures, its tokens."""
    tokens: list[int] = []
    for block in rt.stream(prompt, decode=decode, observers=observers, follow=follow):
        tokens += block.new_tokens
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    return rt.last_stats, rt.offload_summary(), tokens


def run_replay(
    rt: Runtime, trace: RoutingTrace, index: int, observers: Sequence[DecodeObserver] = ()
) -> Generation:
    """One replay of traced prompt `index` (Runtime.replay_stream): its decoding statistics,
    the offload engine's figures, its tokens."""
    tokens: list[int] = []
    for block in rt.replay_stream(trace, index, observers=observers):
        tokens += block.new_tokens
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    return rt.last_stats, rt.offload_summary(), tokens


@dataclass(frozen=True)
class Job:
    """A request of a batch: its prompt ids, and the trace prompt it replays (None: it
    decodes freely)."""

    prompt: list[int]
    traced: int | None = None


@contextlib.contextmanager
def batch_session(
    rt: Runtime,
    n: int,
    decode: DecodeConfig,
    trace: RoutingTrace | None = None,
    prefill_chunk: int | None = None,
) -> Iterator[tuple[BatchDecoder, BatchReplay | None]]:
    """A batch decoder of `n` streams (Runtime.batch_decoder, prompts in chunks of
    `prefill_chunk`: the runtime's by default), replaying `trace` when given
    (Runtime.replay_batch: every prompt in one forward), and its replay source (None without
    a trace)."""
    if trace is None:
        bl = decode.block_length
        yield rt.batch_decoder(n, block_length=bl, prefill_chunk=prefill_chunk), None
        return
    with rt.replay_batch(trace, n) as (dec, source):
        yield dec, source


def add_job(
    rt: Runtime,
    dec: BatchDecoder,
    job: Job,
    decode: DecodeConfig,
    source: BatchReplay | None = None,
    tag: object = None,
) -> Stream:
    """Queue `job` in `dec`: freely with `decode`, or its traced prompt's replay through
    `source` (a `batch_session` with the trace)."""
    if job.traced is None:
        return dec.add(job.prompt, decode, tag=tag)
    if source is None:
        raise ValueError(f"trace prompt {job.traced} replays only in a batch with its trace")
    ids, traced, follow = rt.replay_request(source, job.traced)
    return dec.add(ids, traced, tag=tag, follow=follow)


def run_batch(
    rt: Runtime,
    dec: BatchDecoder,
    jobs: Sequence[Job],
    decode: DecodeConfig,
    observers: Sequence[DecodeObserver] = (),
    source: BatchReplay | None = None,
) -> Generation:
    """The jobs decoded together by `dec` (a `batch_session`'s, with its `source`), with
    `observers` watching: the first stream's statistics and tokens, the offload engine's
    figures."""
    dec.observers += observers
    try:
        streams = [add_job(rt, dec, job, decode, source) for job in jobs]
        while dec.busy:
            dec.step()
    finally:
        del dec.observers[len(dec.observers) - len(observers) :]
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    return streams[0].stats, rt.offload_summary(), streams[0].generated
