"""Several generations decoded together: one forward per iteration over every active sequence.

Each sequence keeps its own prompt, settings, block and iteration, its own slot of one shared
KV cache (its prefix) and its own position; the forward runs every sequence's rows side by side
(oled.model.model.BatchRows), so each MoE layer plans once for the union of the batch's routed
experts and one copy serves every sequence that routes to it. A sequence decodes exactly as
`BlockDecoder` decodes it alone (same blocks, commits and stops); sequences join at iteration
boundaries (`add`, taken by the next `step`) and leave as soon as they finish or are cancelled.

The commits of all streams are one batched step on the device (`select_commits` over [B, L]:
confidences, thresholds, the fewest commits, block ends), and the step's one host sync brings
back which blocks ended with every block's tokens. The host lays out a forward's rows only when
the batch changes (a stream joins, leaves, ends a block or has prefix rows pending); steady
iterations reuse the last layout.

With `prefill_chunk` > 0, a prompt joining a batch that is decoding enters its forwards in
chunks of whole blocks under that per-forward budget of prompt tokens, instead of in one
forward that every running stream waits for (a prompt that finds no stream decoding is taken
whole); a stream decodes once its prefix is cached.
Block-causal attention makes this the same function (a chunk ends on a block boundary), so the
answers are the unchunked ones.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from oled.decoding.config import DecodeConfig
from oled.decoding.decoder import (
    GenerationStats,
    _confidence,
    block_answer,
    layout,
    masked_sequence,
    open_positions,
    select_commits,
)
from oled.decoding.follow import Trajectory
from oled.decoding.observers import (
    BatchIterationInfo,
    BatchPart,
    BlockInfo,
    DecodeObserver,
    IterationInfo,
)
from oled.model.graphs import EagerForward
from oled.model.model import BatchRows, KVCache, LLaDA2Model
from oled.model.stages import stage


def _overrides(observer: DecodeObserver, hook: str) -> bool:
    """Whether `observer` implements `hook` (the base class's does nothing)."""
    return getattr(type(observer), hook, None) is not getattr(DecodeObserver, hook)


def padded_keys(needed: int) -> int:
    """The keys a batched forward attends per stream for `needed` of them: rounded up to a
    power of two, at least 64, so that forwards share graphs."""
    return max(64, 1 << (needed - 1).bit_length())


@dataclass(eq=False)
class Stream:
    """One sequence of a batch: its settings and where its decoding stands (its tokens live in
    the decoder's [slots, S] buffer, in row `slot`, while it is active)."""

    prompt: list[int]
    cfg: DecodeConfig
    cancelled: Callable[[], bool]
    tag: Any  # the caller's handle
    first: int  # the first block's start
    total: int  # positions in all: prompt, answer, the last block's rest
    stats: GenerationStats
    gen: torch.Generator | None
    follow: Trajectory | None = None  # the generation whose commits it takes, if any
    slot: int = -1  # its KV slot while active
    block: int = 0  # block index
    began: int = 0  # the batch's forward that ran its block first (iteration = forwards - began)
    cached: int = 0  # positions whose keys and values the slot holds
    decoding: bool = False  # its prefix is cached or runs with its block (no prefill left)
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


@dataclass(frozen=True, eq=False)
class Layout:
    """Where a forward's rows go, kept while the batch does not change: the streams that run
    (row order), their rows, and the decoding ones' commit rules on the device."""

    streams: list[Stream]  # every stream with rows in the forward, in row order
    lengths: list[int]  # rows per stream
    decoding: list[Stream]  # of them, those whose block runs (their logits, in row order)
    rows: BatchRows
    slots: Tensor  # [D, 1] int64: the decoding streams' slots
    positions: Tensor  # [D, L] int64: their blocks' positions
    began: Tensor  # [D, 1] int64: the forward each one's block began
    steps: Tensor | None  # [D, 1] int64: `cfg.steps` (0: none); None when no stream has steps
    strict: Tensor  # [D, 1] bool
    threshold: Tensor  # [D, 1] float32
    sampled: bool  # some decoding stream samples (temperature > 0)
    follows: bool  # some decoding stream takes a followed generation's commits
    cached: list[tuple[Stream, int]]  # streams with prefix rows: what they hold after it
    prefill: int  # rows of prompts not yet decoding
    running: int  # decoding streams that decoded in an earlier forward too

    def at_least(self, forwards: int, block_length: int) -> Tensor | int:
        """[D, 1]: the fewest commits of each decoding stream this forward (DecodeConfig.at_least,
        computed on the device)."""
        if self.steps is None:
            return 1
        it = forwards - self.began  # [D, 1] iteration within the block
        steps = self.steps.clamp(min=1)
        base, extra = block_length // steps, block_length % steps  # [D, 1]
        scheduled = (self.steps > 0) & (it < self.steps)  # [D, 1]
        return torch.where(scheduled, base + (it < extra).long(), 1)


@dataclass(frozen=True)
class ForwardFigures:
    """One batched forward, for benchmarks: its time and what it ran."""

    ms: float = 0.0  # the forward and the commits, to the step's host sync
    streams: int = 0  # streams with rows in it
    running: int = 0  # of them, those that decoded in an earlier forward too
    prefill: int = 0  # rows of prompts not yet decoding


@dataclass(frozen=True)
class Commits:
    """A batched commit step's tensors, decoding streams in row order (on the device; the
    step's one host copy brings what the host needs of them)."""

    masked: Tensor  # [D, L] bool: open when the forward ran
    committed: Tensor  # [D, L] bool
    confidence: Tensor  # [D, L] float32
    block: Tensor  # [D, L] int64: the blocks after the commits
    ended: Tensor  # [D] bool: no open position left


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
        prefill_chunk: int = 0,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, not {prefill_chunk}")
        self.model = model
        self.forward = forward or EagerForward(model)
        self.mask_id, self.stop_ids = mask_id, set(stop_ids)
        self.observers = list(observers)
        self.max_batch, self.block_length = max_batch, block_length
        # prompt rows per forward, whole blocks, at least one (None: a prompt in one forward)
        whole = max(block_length, prefill_chunk // block_length * block_length)
        self.prefill_chunk: int | None = whole if prefill_chunk else None
        self.device = model.lm_head.weight.device
        self.waiting: deque[Stream] = deque()
        self.active: list[Stream] = []
        self.cache: KVCache | None = None
        self.seqs = torch.empty(max_batch, 0, dtype=torch.long, device=self.device)  # [slots, S]
        self.open = torch.zeros(max_batch, block_length, dtype=torch.bool, device=self.device)
        self.forwards = 0  # batched forwards run
        self.blocks_begun = 0  # over every stream (a new value tells policies a block began)
        self.running = False  # between on_generation_start and on_generation_end
        self.last = ForwardFigures()  # the last forward's
        self._layout: Layout | None = None
        self._ms: list[float] = []  # forwards of the current layout, not yet in the stats

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
        follow: Trajectory | None = None,
    ) -> Stream:
        """Queue a generation; it joins at the next `step` with a free slot. With `follow`, it
        commits what that recorded generation committed, as `BlockDecoder` does (a routing
        replay's schedule: oled.trace.replay); its prompt then enters in one forward, as the
        recorded one did. ValueError for an empty prompt, a block length other than the
        batch's, too many positions, or a followed generation with prompt chunks."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if cfg.block_length != self.block_length:
            raise ValueError(
                f"block_length {cfg.block_length} differs from the batch's {self.block_length}"
            )
        if not cfg.use_cache:
            raise ValueError("batched decoding keeps each sequence's prefix: use_cache must be on")
        if follow is not None and self.prefill_chunk is not None:
            raise ValueError(
                "a followed generation's prompt runs in one forward: use prefill_chunk 0"
            )
        first, _, total = layout(len(prompt), cfg, self.model.config.max_position_embeddings)
        gen = None
        if cfg.temperature:
            gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        stream = Stream(
            prompt=list(prompt),
            cfg=cfg,
            cancelled=cancelled,
            tag=tag,
            first=first,
            total=total,
            stats=GenerationStats(prompt_tokens=len(prompt)),
            gen=gen,
            follow=follow,
        )
        self.waiting.append(stream)
        return stream

    @torch.inference_mode()
    def step(self) -> list[StreamEvent]:
        """Admit waiting streams into free slots, drop cancelled ones, run one forward over
        every active stream and commit the decoding ones' tokens in one batched step; what
        happened to each stream."""
        events = [self._leave(s, "cancelled") for s in self.active if s.cancelled()]
        events += self._admit()
        if not self.active:
            return events
        lay = self._layout or self._lay_out()
        self._layout = lay
        self._emit("on_iteration_start", self.blocks_begun, 0, self.forwards)
        if any(_overrides(obs, "on_batch_start") for obs in self.observers):
            parts = [
                BatchPart(s.tag, self._step_of(s), n, s.follow)
                for s, n in zip(lay.streams, lay.lengths, strict=True)
            ]
            self._emit("on_batch_start", self.forwards, parts)
        t0 = time.perf_counter()
        logits = self._forward(lay)  # [D * L, V]: each decoding stream's block rows, in order
        commits: Commits | None = None  # on the host
        if lay.decoding:
            with stage("decode step"):
                commits = self._fetch(self._commit(lay, logits))  # the step's one host sync
        seconds = time.perf_counter() - t0
        self.last = ForwardFigures(1000 * seconds, len(lay.streams), lay.running, lay.prefill)
        self._ms.append(1000 * seconds)
        if self.observers:  # what they see (nobody else needs it: a batch of copies saved)
            self._observed(lay, commits, logits, seconds)
        self.forwards += 1
        return events + self._advance(lay, commits)

    def _advance(self, lay: Layout, commits: Commits | None) -> list[StreamEvent]:
        """After a forward: the prefixes it cached (the next forward is laid out anew), then
        the blocks it ended (`commits` on the host)."""
        if lay.cached:
            self._relayout()
            for s, cached in lay.cached:
                s.cached = cached
        if commits is None:
            return []
        ended = commits.ended.nonzero().flatten().tolist()  # [] but at a block's end
        return [self._finish_block(lay.decoding[d], commits.block[d]) for d in ended]

    def _lay_out(self) -> Layout:
        """The next forward's rows: every decoding stream's pending prefix and block; while
        some stream decodes, the prompts not yet decoding take their prefix in whole blocks as
        long as the forward's prompt budget (`prefill_chunk`) lasts, with their block once the
        rest fits (with none decoding, nobody waits: every prompt is taken whole)."""
        left = self.prefill_chunk if any(s.decoding for s in self.active) else None
        streams, lengths, skips, cached, prefill, joined = [], [], [], [], 0, 0
        for s in self.active:
            pending = s.start - s.cached
            if s.decoding or left is None or pending <= left:
                if not s.decoding:  # the rest of its prompt, then it decodes
                    s.decoding, s.began, prefill = True, self.forwards, prefill + pending
                    left, joined = None if left is None else left - pending, joined + 1
                n, skip, after = pending + self.block_length, pending, s.start
            elif left >= self.block_length:  # a chunk of its prompt
                n = skip = left // self.block_length * self.block_length
                left, after, prefill = left - n, s.cached + n, prefill + n
            else:  # no budget left for it this forward
                continue
            streams.append(s)
            lengths.append(n)
            skips.append(skip)
            if after != s.cached:
                cached.append((s, after))
        return self._layout_of(streams, lengths, skips, cached, (prefill, joined))

    def _layout_of(
        self,
        streams: list[Stream],
        lengths: list[int],
        skips: list[int],
        cached: list[tuple[Stream, int]],
        joining: tuple[int, int],
    ) -> Layout:
        """A layout of these streams' rows (`skips[b]` rows of each before its logits);
        `joining`: the prompt rows in it and the streams that decode from it on."""
        rows = BatchRows.build(
            [s.slot for s in streams],
            [s.cached for s in streams],
            lengths,
            skips,
            keys=self._keys(max(s.cached + n for s, n in zip(streams, lengths, strict=True))),
            device=self.device,
            exact=self.forward.exact_batches,
        )
        dec = [s for s, n, k in zip(streams, lengths, skips, strict=True) if n > k]
        cfgs = [s.cfg for s in dec]
        ints = torch.tensor(
            [
                [s.slot for s in dec],
                [s.start for s in dec],
                [s.began for s in dec],
                [c.steps or 0 for c in cfgs],
                [c.strict_threshold for c in cfgs],
            ],
            dtype=torch.long,
        ).to(self.device)  # [5, D]: one copy
        thresholds = torch.tensor([c.threshold for c in cfgs], dtype=torch.float32)
        offsets = torch.arange(self.block_length, device=self.device)  # [L]
        return Layout(
            streams=streams,
            lengths=lengths,
            decoding=dec,
            rows=rows,
            slots=ints[0, :, None],
            positions=ints[1, :, None] + offsets,
            began=ints[2, :, None],
            steps=ints[3, :, None] if any(c.steps for c in cfgs) else None,
            strict=ints[4, :, None].bool(),
            threshold=thresholds.to(self.device)[:, None],
            sampled=any(c.temperature for c in cfgs),
            follows=any(s.follow is not None for s in dec),
            cached=cached,
            prefill=joining[0],
            running=len(dec) - joining[1],
        )

    def _relayout(self) -> None:
        """The batch changed: the forwards of the old layout go into its streams' stats, and
        the next forward is laid out anew."""
        if self._layout is not None and self._ms:
            ms, seconds = list(self._ms), sum(self._ms) / 1000
            for s in self._layout.streams:
                s.stats.iterations += len(ms)
                s.stats.seconds += seconds
                s.stats.iteration_ms += ms
        self._ms.clear()
        self._layout = None

    def _forward(self, lay: Layout) -> Tensor:
        """One forward over the layout's rows: the logits of each decoding stream's block
        rows [D * L, V]."""
        assert self.cache is not None  # reserved on admission
        tokens = self.seqs[lay.rows.row_slots, lay.rows.positions][None]  # [1, T]
        logits = self.forward.batch(
            tokens, rows=lay.rows, cache=self.cache, block_length=self.block_length
        )  # [1, D * L, V]
        return logits[0]

    def _commit(self, lay: Layout, logits: Tensor) -> Commits:
        """Every decoding stream's commits from its block's logits, as BlockDecoder commits
        them alone, in one batched step; the blocks' tokens and open positions updated."""
        d, bl = len(lay.decoding), self.block_length
        conf, tokens = self._choose(lay, logits.view(d, bl, -1))  # [D, L] each
        masked = self.open[lay.slots[:, 0]]  # [D, L]
        rule = lay.at_least(self.forwards, bl)
        commit = select_commits(conf, masked, lay.threshold, lay.strict, rule)  # [D, L]
        if lay.follows:
            conf, tokens, commit = self._followed(lay, conf, tokens, commit)
        block = torch.where(commit, tokens, self.seqs[lay.slots, lay.positions])  # [D, L]
        self.seqs[lay.slots, lay.positions] = block
        still = masked & ~commit  # [D, L]
        ended = ~still.any(dim=1)  # [D]
        self.open[lay.slots[:, 0]] = still | ended[:, None]  # a next block: all of it open
        return Commits(masked, commit, conf, block, ended)

    def _followed(
        self, lay: Layout, conf: Tensor, tokens: Tensor, commit: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(confidence, token, commit) [D, L] with each following stream's taken from its
        followed generation at its step (a replay's confidences too), as `BlockDecoder` takes
        them."""
        bl, rows = self.block_length, []
        for d, s in enumerate(lay.decoding):
            if s.follow is None:
                rows.append((conf[d], tokens[d], commit[d]))
                continue
            step = self._step_of(s)
            taken, forced = s.follow.at(step, bl, self.device)
            recorded = s.follow.confidence_at(step, self.device)
            rows.append((conf[d] if recorded is None else recorded, forced, taken))
        conf, tokens, commit = (torch.stack(parts) for parts in zip(*rows, strict=True))
        return conf, tokens, commit  # [D, L] each

    def _step_of(self, s: Stream) -> int:
        """Stream `s`'s forwards so far (before the one running): its step over its
        generation."""
        return s.stats.iterations + len(self._ms)

    def _choose(self, lay: Layout, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(confidence, token) [D, L] of each decoding stream from its logits [D, L, V]: one
        softmax for all when every one is greedy; a sampling stream draws from its own
        generator (its single-request draws)."""
        if not lay.sampled:
            return _confidence(logits, 0.0, None)
        pairs = [
            _confidence(lg, s.cfg.temperature, s.gen)
            for s, lg in zip(lay.decoding, logits, strict=True)
        ]
        return torch.stack([c for c, _ in pairs]), torch.stack([t for _, t in pairs])

    def _fetch(self, commits: Commits) -> Commits:
        """The commit step on the host, in one copy: which blocks ended and their tokens, and
        for the observers the open positions, commits and confidences."""
        parts = [commits.ended[:, None], commits.block]  # [D, 1], [D, L]
        if self.observers:
            parts += [commits.masked, commits.committed, commits.confidence]  # [D, L] each
        host = torch.cat([p.double() for p in parts], dim=1).cpu()  # [D, 1 + L (+ 3 L)]
        bl = self.block_length
        ended, block = host[:, 0].bool(), host[:, 1 : 1 + bl].long()  # [D], [D, L]
        if not self.observers:
            return replace(commits, ended=ended, block=block)
        masked, committed, confidence = host[:, 1 + bl :].split(bl, dim=1)  # [D, L] each
        return Commits(masked.bool(), committed.bool(), confidence.float(), block, ended)

    def _observed(
        self, lay: Layout, commits: Commits | None, logits: Tensor, seconds: float
    ) -> None:
        """Every stream's iteration to the observers, as one batched iteration (a stream still
        taking its prompt: no block rows)."""
        at = {id(s): d for d, s in enumerate(lay.decoding)}
        blocks = logits.view(len(lay.decoding), self.block_length, logits.shape[-1])
        infos = [
            self._info(s, n, at.get(id(s)), commits, blocks, seconds)
            for s, n in zip(lay.streams, lay.lengths, strict=True)
        ]
        self._emit(
            "on_batch_iteration", BatchIterationInfo(self.forwards, self.blocks_begun, infos)
        )

    def _info(
        self,
        s: Stream,
        rows: int,
        d: int | None,
        commits: Commits | None,
        logits: Tensor,
        seconds: float,
    ) -> IterationInfo:
        """Stream `s`'s part of a batched forward: `rows` rows, its block the `d`-th
        decoding one (None: prompt rows only)."""
        step = self._step_of(s) - 1
        if d is None or commits is None:
            none = torch.zeros(0, dtype=torch.bool, device=self.device)
            return IterationInfo(
                block=s.block,
                iteration=0,
                step=step,
                block_start=s.start,
                tokens=none.long(),
                masked=none,
                confidence=none.float(),
                committed=none,
                forward_tokens=rows,
                seconds=seconds,
            )
        masked = commits.masked[d]
        return IterationInfo(
            block=s.block,
            iteration=self.forwards - s.began,
            step=step,
            block_start=s.start,
            tokens=commits.block[d],
            masked=masked,
            confidence=torch.where(masked, commits.confidence[d], 1.0),
            committed=commits.committed[d],
            forward_tokens=rows,
            seconds=seconds,
            logits=logits[d],
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
            self._relayout()
            s.slot = min(set(range(self.max_batch)) - {a.slot for a in self.active})
            self._reserve(s.total)
            self.seqs[s.slot, : s.total] = masked_sequence(
                s.prompt, s.total, self.mask_id, self.device
            )[0]
            self.open[s.slot] = open_positions(s.start, s.end, len(s.prompt), self.device)
            self.active.append(s)
            self.blocks_begun += 1
        if self.running and not self.busy:
            self._end()
        return events

    def _reserve(self, positions: int) -> None:
        """A cache with a slot per stream and room for `positions`, and the token buffer as
        long; grown (the active streams' prefixes and tokens kept) when they have less."""
        old = self.cache
        if old is not None and old.max_len >= positions:
            return
        size = max(256, 1 << (positions - 1).bit_length())  # few growths, few key lengths
        size = min(size, self.model.config.max_position_embeddings)
        self.cache = self.forward.new_batch_cache(self.max_batch, size, self.device)
        seqs = torch.full((self.max_batch, size), self.mask_id, device=self.device)
        seqs[:, : self.seqs.shape[1]] = self.seqs
        self.seqs = seqs  # [slots, S]
        if old is not None:
            self.cache.k[..., : old.max_len, :] = old.k
            self.cache.v[..., : old.max_len, :] = old.v

    def _keys(self, needed: int) -> int:
        """The keys a forward attends per stream: `padded_keys`, at most the cache's length."""
        assert self.cache is not None  # reserved on admission
        return min(padded_keys(needed), self.cache.max_len)

    def _finish_block(self, s: Stream, block: Tensor) -> StreamEvent:
        """Stream `s`'s block has no open position left (`block` [L], its tokens on the host):
        its answer tokens, then its next block or its end."""
        self._relayout()
        cfg = s.cfg
        room = cfg.max_new_tokens - len(s.generated)
        new, stop_at = block_answer(block.tolist(), len(s.prompt) - s.start, room, self.stop_ids)
        s.generated += new
        s.stats.new_tokens, s.stats.blocks = len(s.generated), s.block + 1
        info = BlockInfo(
            block=s.block,
            block_start=s.start,
            tokens=block,
            new_tokens=new,
            iterations=self.forwards - s.began,
        )
        self._emit("on_block_end", info)
        if stop_at is not None or len(s.generated) >= cfg.max_new_tokens:
            return self._leave(s, "stop" if stop_at is not None else "length", info)
        s.block, s.began = s.block + 1, self.forwards
        self.blocks_begun += 1
        return StreamEvent(s, info, False)

    def _leave(self, s: Stream, why: str, block: BlockInfo | None = None) -> StreamEvent:
        """Stream `s` leaves the batch (its slot is free for the next `step`)."""
        self._relayout()
        s.stats.stopped, s.done = why, True
        self.active.remove(s)
        if self.running and not self.busy:
            self._end()
        return StreamEvent(s, block, True)

    def _end(self) -> None:
        """The busy period is over: every stream has left."""
        self.running = False
        self._emit("on_generation_end")
