"""Several generations decoded together: one forward per iteration over every active sequence.

Each sequence keeps its own prompt, settings, block and iteration, its own slot of one shared
KV cache (its prefix) and its own position; the forward runs every sequence's rows side by side
(oled.model.model.BatchRows), so each MoE layer plans once for the union of the batch's routed
experts and one copy serves every sequence that routes to it. A sequence decodes exactly as
`BlockDecoder` decodes it alone (same blocks, commits and stops); sequences join at iteration
boundaries (`add`, taken by the next `step`) and leave as soon as they finish or are cancelled.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from oled.decoding.config import DecodeConfig
from oled.decoding.decoder import (
    GenerationStats,
    _commit,
    _confidence,
    block_answer,
    layout,
    masked_sequence,
    open_positions,
)
from oled.decoding.observers import BatchIterationInfo, BlockInfo, DecodeObserver, IterationInfo
from oled.model.graphs import EagerForward
from oled.model.model import BatchRows, KVCache, LLaDA2Model
from oled.model.stages import stage


@dataclass(eq=False)
class Stream:
    """One sequence of a batch: its settings, its tokens and where its decoding stands."""

    prompt: list[int]
    cfg: DecodeConfig
    cancelled: Callable[[], bool]
    tag: Any  # the caller's handle
    seq: Tensor  # [1, S] int64: prompt, answer so far, mask ids
    first: int  # the first block's start
    stats: GenerationStats
    gen: torch.Generator | None
    slot: int = -1  # its KV slot while active
    block: int = 0  # block index
    iteration: int = 0  # within the block
    cached: int = 0  # positions whose keys and values the slot holds
    # [L] bool: the block's open positions (set on admission)
    masked: Tensor = field(init=False, repr=False)
    generated: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def start(self) -> int:
        return self.first + self.block * self.cfg.block_length

    @property
    def end(self) -> int:
        return self.start + self.cfg.block_length


@dataclass(frozen=True)
class StreamEvent:
    """What a step did to one stream: a finished block, its end, or both."""

    stream: Stream
    block: BlockInfo | None  # the block it finished (None: it was cancelled)
    finished: bool  # it left the batch (stream.stats.stopped says why)


class BatchDecoder:
    """Decodes up to `max_batch` streams together; `add` queues one, `step` runs a forward."""

    def __init__(
        self,
        model: LLaDA2Model,
        *,
        mask_id: int,
        stop_ids: Iterable[int] = (),
        observers: Sequence[DecodeObserver] = (),
        forward: EagerForward | None = None,
        max_batch: int = 8,
        block_length: int = 32,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        self.model = model
        self.forward = forward or EagerForward(model)
        self.mask_id, self.stop_ids = mask_id, set(stop_ids)
        self.observers = list(observers)
        self.max_batch, self.block_length = max_batch, block_length
        self.device = model.lm_head.weight.device
        self.waiting: deque[Stream] = deque()
        self.active: list[Stream] = []
        self.cache: KVCache | None = None
        self.forwards = 0  # batched forwards run
        self.blocks_begun = 0  # over every stream (a new value tells policies a block began)
        self.running = False  # between on_generation_start and on_generation_end

    def _emit(self, hook: str, *args: object) -> None:
        for obs in self.observers:
            getattr(obs, hook)(*args)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def add(
        self,
        prompt: Sequence[int],
        cfg: DecodeConfig,
        *,
        cancelled: Callable[[], bool] = lambda: False,
        tag: Any = None,
    ) -> Stream:
        """Queue a generation; it joins at the next `step` with a free slot. ValueError for
        an empty prompt, a block length other than the batch's, or too many positions."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if cfg.block_length != self.block_length:
            raise ValueError(
                f"block_length {cfg.block_length} differs from the batch's {self.block_length}"
            )
        if not cfg.use_cache:
            raise ValueError("batched decoding keeps each sequence's prefix: use_cache must be on")
        first, _, total = layout(len(prompt), cfg, self.model.config.max_position_embeddings)
        gen = None
        if cfg.temperature:
            gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        stream = Stream(
            prompt=list(prompt),
            cfg=cfg,
            cancelled=cancelled,
            tag=tag,
            seq=masked_sequence(prompt, total, self.mask_id, self.device),
            first=first,
            stats=GenerationStats(prompt_tokens=len(prompt)),
            gen=gen,
        )
        self.waiting.append(stream)
        return stream

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """Admit waiting streams into free slots, drop cancelled ones, run one forward over
        every active stream and commit each one's tokens; what happened to each stream."""
        events = [self._leave(s, "cancelled") for s in self.active if s.cancelled()]
        events += self._admit()
        if not self.active:
            return events
        self._emit("on_iteration_start", self.blocks_begun, 0, self.forwards)
        t0 = time.perf_counter()
        ran = [s.end - s.cached for s in self.active]  # rows per stream: pending prefix + block
        logits = self._forward()  # [B * L, V]: each stream's block rows, in order
        bl = self.block_length
        with stage("decode step"):
            blocks = logits.split(bl)  # per stream [L, V]
            commits = [self._commit(s, lg) for s, lg in zip(self.active, blocks, strict=True)]
            still = torch.stack(
                [s.masked & ~c for s, (c, _) in zip(self.active, commits, strict=True)]
            )
            open_ = still.any(dim=1).tolist()  # the step's one host sync
        seconds = time.perf_counter() - t0
        for s in self.active:
            s.stats.iterations += 1
            s.stats.seconds += seconds
            s.stats.iteration_ms.append(1000 * seconds)
        if self.observers:  # what they see (nobody else needs it: a batch of copies saved)
            self._observed(commits, blocks, ran, seconds)
        self.forwards += 1
        for s, masked, more in zip(list(self.active), still, open_, strict=True):
            if more:
                s.masked, s.iteration = masked, s.iteration + 1
            else:
                events.append(self._finish_block(s))
        return events

    def _observed(self, commits: list, blocks: tuple, ran: list[int], seconds: float) -> None:
        """Every stream's iteration to the observers, as one batched iteration."""
        infos = [
            IterationInfo(
                block=s.block,
                iteration=s.iteration,
                step=s.stats.iterations,
                block_start=s.start,
                tokens=s.seq[0, s.start : s.end].clone(),
                masked=s.masked,
                confidence=torch.where(s.masked, conf, 1.0),
                committed=commit,
                forward_tokens=n,
                seconds=seconds,
                logits=lg,
            )
            for s, (commit, conf), lg, n in zip(self.active, commits, blocks, ran, strict=True)
        ]
        self._emit(
            "on_batch_iteration", BatchIterationInfo(self.forwards, self.blocks_begun, infos)
        )

    def _admit(self) -> list[StreamEvent]:
        """Waiting streams into free slots (cancelled ones end here: their events)."""
        events = []
        while self.waiting and len(self.active) < self.max_batch:
            s = self.waiting.popleft()
            if s.cancelled():
                s.stats.stopped, s.done = "cancelled", True
                events.append(StreamEvent(s, None, True))
                continue
            if not self.running:  # a busy period begins (observers reset their figures)
                self.running = True
                self._emit("on_generation_start", len(s.prompt))
            s.slot = min(set(range(self.max_batch)) - {a.slot for a in self.active})
            self._reserve(s.seq.shape[1])
            s.masked = self._open(s)
            self.active.append(s)
            self.blocks_begun += 1
        if self.running and not self.busy:
            self._end()
        return events

    def _open(self, s: Stream) -> Tensor:
        """[L] bool: the open positions of stream `s`'s new block."""
        return open_positions(s.start, s.end, len(s.prompt), self.device)

    def _reserve(self, positions: int) -> None:
        """A cache with a slot per stream and room for `positions`; grown (the active
        streams' prefixes kept) when it has less."""
        old = self.cache
        if old is not None and old.max_len >= positions:
            return
        size = max(256, 1 << (positions - 1).bit_length())  # few growths, few key lengths
        size = min(size, self.model.config.max_position_embeddings)
        self.cache = self.forward.new_batch_cache(self.max_batch, size, self.device)
        if old is not None:
            self.cache.k[..., : old.max_len, :] = old.k
            self.cache.v[..., : old.max_len, :] = old.v

    def _forward(self) -> Tensor:
        """One forward over every active stream's pending prefix and block: the logits of
        each stream's block rows [B * L, V]."""
        streams = self.active
        tokens = torch.cat([s.seq[0, s.cached : s.end] for s in streams])[None]  # [1, T]
        lengths = [s.end - s.cached for s in streams]
        rows = BatchRows.build(
            [s.slot for s in streams],
            [s.cached for s in streams],
            lengths,
            [s.start - s.cached for s in streams],
            keys=self._keys(max(s.end for s in streams)),
            device=self.device,
            exact=not self.forward.graphed,
        )
        assert self.cache is not None  # reserved on admission
        logits = self.forward.batch(
            tokens, rows=rows, cache=self.cache, block_length=self.block_length
        )  # [1, B * L, V]
        for s in streams:
            s.cached = s.start  # keep the prefix (with any pending block), drop the block's
        return logits[0]

    def _keys(self, needed: int) -> int:
        """The keys a forward attends per stream: `needed` rounded up to a power of two (at
        least 64, at most the cache's length), so that forwards share graphs."""
        keys = max(64, 1 << (needed - 1).bit_length())
        assert self.cache is not None  # reserved on admission
        return min(keys, self.cache.max_len)

    def _commit(self, s: Stream, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Commit stream `s`'s tokens from its block's logits [L, V] as BlockDecoder does:
        (committed [L] bool, confidence [L])."""
        conf, tokens = _confidence(logits, s.cfg.temperature, s.gen)  # [L], [L]
        commit = _commit(conf, s.masked, s.cfg, s.iteration)  # [L] bool
        block = s.seq[0, s.start : s.end]
        block.copy_(torch.where(commit, tokens, block))
        return commit, conf

    def _finish_block(self, s: Stream) -> StreamEvent:
        """Stream `s`'s block has no mask left: its answer tokens, then its next block or
        its end."""
        cfg = s.cfg
        block = s.seq[0, s.start : s.end]
        new, stop_at = block_answer(
            block, len(s.prompt) - s.start, cfg.max_new_tokens - len(s.generated), self.stop_ids
        )
        s.generated += new
        s.stats.new_tokens, s.stats.blocks = len(s.generated), s.block + 1
        info = BlockInfo(
            block=s.block,
            block_start=s.start,
            tokens=block.clone(),
            new_tokens=new,
            iterations=s.iteration + 1,
        )
        self._emit("on_block_end", info)
        if stop_at is not None or len(s.generated) >= cfg.max_new_tokens:
            return self._leave(s, "stop" if stop_at is not None else "length", info)
        s.block, s.iteration = s.block + 1, 0
        s.masked = self._open(s)
        self.blocks_begun += 1
        return StreamEvent(s, info, False)

    def _leave(self, s: Stream, why: str, block: BlockInfo | None = None) -> StreamEvent:
        """Stream `s` leaves the batch (its slot is free for the next `step`)."""
        s.stats.stopped, s.done = why, True
        self.active.remove(s)
        if self.running and not self.busy:
            self._end()
        return StreamEvent(s, block, True)

    def _end(self) -> None:
        """The busy period is over: every stream has left."""
        self.running = False
        self._emit("on_generation_end")
