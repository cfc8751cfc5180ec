"""Block diffusion decoding with dInfer's semantics (DESIGN.md section 4).

The answer is decoded in blocks of `block_length` absolute positions. Each iteration runs the
whole block through the model over the cached prefix, takes the softmax max probability of every
masked position as its confidence and commits every masked position whose confidence reaches
the threshold (at least the most confident one; with `steps`, at least block_length / steps, as
LLaDA2's own generate; with `strict_threshold`, strictly above it); nothing is remasked. Open
positions are tracked apart from their tokens, so a committed mask id stays committed (as in
LLaDA2's generate) and a block ends within `block_length` forwards, or `steps`. A
finished block's keys and values enter the prefix cache during the next block's first forward
(which therefore runs over the finished block and the new one), so cached decoding computes the
same function as recomputing the whole sequence.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.types import Device

from oled.decoding.config import DecodeConfig
from oled.decoding.follow import Trajectory
from oled.decoding.observers import BlockInfo, DecodeObserver, IterationInfo
from oled.model.graphs import EagerForward
from oled.model.model import KVCache, LLaDA2Model
from oled.model.stages import stage


@dataclass
class GenerationStats:
    """What one generation cost."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    blocks: int = 0
    iterations: int = 0
    seconds: float = 0.0
    iteration_ms: list[float] = field(default_factory=list)
    followed: int = 0  # commits taken from a followed generation
    agreed: int = 0  # of them, where this generation chose the same token
    stopped: str = "length"  # "stop" (EOS / role end), "length", "cancelled"

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.iterations if self.iterations else 0.0

    @property
    def prompt_ms(self) -> float | None:
        """The first forward, which runs the prompt's tokens (None before any forward)."""
        return self.iteration_ms[0] if self.iteration_ms else None

    @property
    def decode_ms(self) -> list[float]:
        """The forwards after the first: the steady decoding iterations (the only forward
        when there is one)."""
        return self.iteration_ms[1:] or self.iteration_ms

    @property
    def ms_per_iteration(self) -> float:
        return 1000 * self.seconds / self.iterations if self.iterations else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.new_tokens,
            "blocks": self.blocks,
            "iterations": self.iterations,
            "seconds": self.seconds,
            "iteration_ms": list(self.iteration_ms),
            "tokens_per_forward": self.tokens_per_forward,
            "ms_per_iteration": self.ms_per_iteration,
            "tokens_per_second": self.tokens_per_second,
            "finish_reason": self.stopped,
            "followed": self.followed,
            "agreed": self.agreed,
        }


def median_p90(ms: Sequence[float]) -> tuple[float, float]:
    """Median and p90 (interpolated linearly between the samples) of some milliseconds (0 for
    none): the one definition that `oled bench`, `oled run`, `oled generate` and the chat use."""
    ms = list(ms) or [0.0]
    p90 = statistics.quantiles(ms, n=10, method="inclusive")[-1] if len(ms) > 1 else ms[0]
    return statistics.median(ms), p90


class BlockDecoder:
    """Decodes one prompt (batch size 1) block by block; `stream` yields finished blocks."""

    def __init__(
        self,
        model: LLaDA2Model,
        *,
        mask_id: int,
        stop_ids: Iterable[int] = (),
        observers: Sequence[DecodeObserver] = (),
        forward: EagerForward | None = None,
    ) -> None:
        self.model = model
        self.forward = forward or EagerForward(model)
        self.mask_id = mask_id
        self.stop_ids = set(stop_ids)
        self.observers = list(observers)
        self.stats = GenerationStats()
        self._follow: Trajectory | None = None  # the generation this one follows, if any

    def _emit(self, hook: str, *args: object) -> None:
        for obs in self.observers:
            getattr(obs, hook)(*args)

    @torch.inference_mode()
    def stream(
        self,
        prompt: Sequence[int],
        cfg: DecodeConfig,
        *,
        cancelled: Callable[[], bool] = lambda: False,
        follow: Trajectory | None = None,
    ) -> Iterator[BlockInfo]:
        """Yield each finished block; `self.stats` holds the running totals. With `follow`,
        commit what that recorded generation committed instead of this one's choices (the
        stats count how often they agreed)."""
        if not prompt:
            raise ValueError("the prompt is empty")
        device = self.model.lm_head.weight.device
        p = len(prompt)
        first, n_blocks, total = layout(p, cfg, self.model.config.max_position_embeddings)
        seq = masked_sequence(prompt, total, self.mask_id, device)  # [1, S]
        cache = self.forward.new_cache(total, device) if cfg.use_cache else None
        gen = torch.Generator(device=device).manual_seed(cfg.seed) if cfg.temperature else None
        self.stats = GenerationStats(prompt_tokens=p)
        self._follow = follow
        self._emit("on_generation_start", p)
        try:
            yield from self._blocks(seq, p, first, n_blocks, cfg, cache, gen, cancelled)
        finally:
            self._emit("on_generation_end")

    def _blocks(
        self,
        seq: Tensor,
        p: int,
        first: int,
        n_blocks: int,
        cfg: DecodeConfig,
        cache: KVCache | None,
        gen: torch.Generator | None,
        cancelled: Callable[[], bool],
    ) -> Iterator[BlockInfo]:
        bl = cfg.block_length
        generated: list[int] = []
        for b in range(n_blocks):
            start = first + b * bl
            iterations = self._decode_block(seq, b, start, cfg, cache, gen, cancelled)
            if iterations is None:
                self.stats.stopped = "cancelled"
                return
            block = seq[0, start : start + bl]
            new, stop_at = block_answer(
                block.tolist(), p - start, cfg.max_new_tokens - len(generated), self.stop_ids
            )
            generated += new
            self.stats.new_tokens = len(generated)
            self.stats.blocks = b + 1
            info = BlockInfo(
                block=b,
                block_start=start,
                tokens=block.clone(),
                new_tokens=new,
                iterations=iterations,
            )
            self._emit("on_block_end", info)
            yield info
            if stop_at is not None:
                self.stats.stopped = "stop"
                return
            if len(generated) >= cfg.max_new_tokens:
                self.stats.stopped = "length"
                return
            if cancelled():
                self.stats.stopped = "cancelled"
                return

    def _decode_block(
        self,
        seq: Tensor,
        b: int,
        start: int,
        cfg: DecodeConfig,
        cache: KVCache | None,
        gen: torch.Generator | None,
        cancelled: Callable[[], bool],
    ) -> int | None:
        """Iterate until the block at `start` has no mask; the iterations, None if cancelled.

        Each iteration's one host sync (is any mask left?) comes at its end, so its time
        covers the device work of the forward and the commit, not only their launch.
        """
        bl = cfg.block_length
        end = start + bl
        masked = open_positions(start, end, self.stats.prompt_tokens, seq.device)  # [L]
        open_ = bool(masked.any())
        it = 0
        follow = self._follow
        # device counts when following (read once, at the block's end)
        agreed: int | Tensor = 0
        followed: int | Tensor = 0
        while open_:
            if cancelled():
                return None
            self._emit("on_iteration_start", b, it, self.stats.iterations)
            t0 = time.perf_counter()
            logits, ran = self._forward(seq, start, end, cache, bl)  # [L, V], tokens run
            with stage("decode step"):
                conf, tokens = _confidence(logits, cfg.temperature, gen)  # [L], [L]
                if follow is None:
                    commit = _commit(conf, masked, cfg, it)  # [L] bool
                else:
                    commit, forced = follow.at(self.stats.iterations, bl, tokens.device)
                    recorded = follow.confidence_at(self.stats.iterations, tokens.device)
                    if recorded is not None:  # a replay: the observers see the trace's
                        conf = recorded
                    agreed += ((tokens == forced) & commit).sum()
                    followed += commit.sum()
                    tokens = forced
                seq[0, start:end] = torch.where(commit, tokens, seq[0, start:end])
                still = masked & ~commit  # [L]
            open_ = bool(still.any())  # the iteration's host sync
            seconds = time.perf_counter() - t0
            self.stats.iterations += 1
            self.stats.seconds += seconds
            self.stats.iteration_ms.append(1000 * seconds)
            self._emit(
                "on_iteration",
                IterationInfo(
                    block=b,
                    iteration=it,
                    step=self.stats.iterations - 1,
                    block_start=start,
                    tokens=seq[0, start:end].clone(),
                    masked=masked,
                    confidence=torch.where(masked, conf, 1.0),
                    committed=commit,
                    forward_tokens=ran,
                    seconds=seconds,
                    logits=logits,
                ),
            )
            masked = still
            it += 1
        if follow is not None and follow.agreement:
            self.stats.followed += int(followed)
            self.stats.agreed += int(agreed)
        return it

    def _forward(
        self, seq: Tensor, start: int, end: int, cache: KVCache | None, bl: int
    ) -> tuple[Tensor, int]:
        """Block logits [L, V]; with a cache, pending prefix tokens run in the same forward."""
        if cache is None:
            logits = self.forward(
                seq[:, :end], start=0, cache=None, block_length=bl, logits_from=start
            )
            return logits[0], end
        past = cache.length
        logits = self.forward(
            seq[:, past:end], start=past, cache=cache, block_length=bl, logits_from=start - past
        )
        cache.length = start  # keep the prefix (now including any pending tokens), drop the block
        return logits[0], end - past


def layout(prompt_length: int, cfg: DecodeConfig, limit: int) -> tuple[int, int, int]:
    """Where a generation lies: (first block's start, blocks, positions in all); ValueError
    when they pass the model's `limit` positions. Blocks are aligned to absolute positions, so
    the first one holds the prompt's last partial block."""
    bl = cfg.block_length
    first = (prompt_length // bl) * bl
    n_blocks = -(-(prompt_length + cfg.max_new_tokens - first) // bl)  # ceil
    total = first + n_blocks * bl
    if total > limit:
        raise ValueError(f"prompt + answer need {total} positions; the model allows {limit}")
    return first, n_blocks, total


def open_positions(start: int, end: int, prompt_length: int, device: Device) -> Tensor:
    """[end - start] bool: the positions of a new block that are still to decode (those past
    the prompt). From here on a block's open positions are tracked apart from their tokens:
    a position whose committed token is the mask id is not open again."""
    return torch.arange(start, end, device=device) >= prompt_length


def masked_sequence(prompt: Sequence[int], total: int, mask_id: int, device: Device) -> Tensor:
    """[1, total] int64: the prompt, then mask ids."""
    seq = torch.full((1, total), mask_id, dtype=torch.long, device=device)  # [1, S]
    seq[0, : len(prompt)] = torch.tensor(list(prompt), dtype=torch.long, device=device)
    return seq


def block_answer(
    block: Sequence[int], prompt_in_block: int, room: int, stop_ids: set[int]
) -> tuple[list[int], int | None]:
    """A finished block's answer tokens (past the prompt's, at most `room`, cut before a stop
    id) and where the stop id was (None: no stop)."""
    new = list(block[max(prompt_in_block, 0) :])[:room]
    stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
    return (new if stop_at is None else new[:stop_at]), stop_at


def _confidence(
    logits: Tensor, temperature: float, gen: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Per position: (probability of the chosen token, chosen token). logits [L, V] fp32."""
    if temperature == 0:
        probs = torch.softmax(logits, dim=-1)
        conf, tokens = probs.max(dim=-1)
        return conf, tokens
    probs = torch.softmax(logits / temperature, dim=-1)  # [L, V]
    tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1)  # [L]
    return probs.gather(-1, tokens[:, None]).squeeze(-1), tokens


def _commit(conf: Tensor, masked: Tensor, cfg: DecodeConfig, iteration: int) -> Tensor:
    """Masked positions at or above the threshold (strictly above with `strict_threshold`),
    and at least the `cfg.at_least(iteration)` most confident ones: `select_commits` for one
    sequence. conf, masked [L]."""
    return select_commits(
        conf[None], masked[None], cfg.threshold, cfg.strict_threshold, cfg.at_least(iteration)
    )[0]


def select_commits(
    conf: Tensor,
    masked: Tensor,
    threshold: Tensor | float,
    strict: Tensor | bool,
    at_least: Tensor | int,
) -> Tensor:
    """[B, L] bool: per sequence, the masked positions whose confidence reaches its threshold
    (strictly above where `strict`), and at least its `at_least` most confident masked ones;
    of equal confidences the earlier position ranks first. conf [B, L] fp32, masked [B, L]
    bool; threshold, strict and at_least a scalar or [B, 1] each. One set of kernels for the
    whole batch: a stable descending sort ranks the positions."""
    score = torch.where(masked, conf, -1.0)  # [B, L]; fixed positions rank below any open one
    if isinstance(strict, bool):
        above = score > threshold if strict else score >= threshold  # [B, L]
    else:
        above = torch.where(strict, score > threshold, score >= threshold)  # [B, L]
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices  # [B, L]
    ranks = torch.arange(score.shape[-1], device=score.device).expand_as(order)  # [B, L]
    rank = torch.empty_like(order).scatter_(-1, order, ranks)  # [B, L]: each position's rank
    return masked & (above | (rank < at_least))
