"""What the block decoder publishes while it runs: the hook for offload policies and traces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from oled.decoding.follow import Trajectory


@dataclass(frozen=True)
class IterationInfo:
    """One denoising iteration (one model forward) of one block, batch row 0.

    Positions are the block's `block_length` positions, in order.
    """

    block: int  # index of the block being decoded (0 = first decoded block)
    iteration: int  # iteration within the block (0 = first forward of the block)
    step: int  # iteration counted over the whole generation
    block_start: int  # absolute position of the block's first token
    tokens: (
        torch.Tensor
    )  # [L] int64: block tokens after this iteration's commits (mask id where open)
    masked: torch.Tensor  # [L] bool: position was masked when the forward ran
    confidence: torch.Tensor  # [L] float32: confidence of masked positions; 1.0 where fixed
    committed: torch.Tensor  # [L] bool: committed by this iteration
    forward_tokens: int  # tokens the forward ran over (pending prefix + block)
    seconds: float  # wall time of the iteration (forward + decision)
    logits: torch.Tensor | None = None  # [L, V] fp32: the forward's (valid during the hook)


@dataclass(frozen=True)
class BatchIterationInfo:
    """One batched forward (oled.decoding.batch): each sequence's iteration, in row order."""

    step: int  # forwards of the batch so far, this one included, minus one
    block: int  # blocks begun over the batch (a new value: some sequence began a block)
    rows: list[IterationInfo]  # per sequence; its forward_tokens rows, pending prefix first


@dataclass(frozen=True)
class BatchPart:
    """One sequence's rows in a batched forward about to run."""

    tag: object  # the caller's handle of the sequence
    step: int  # its forwards before this one (the index of this one over its generation)
    rows: int  # rows it runs, pending prefix first
    follow: Trajectory | None  # the generation whose commits it takes, if any


@dataclass(frozen=True)
class BlockInfo:
    """A finished block."""

    block: int
    block_start: int
    tokens: torch.Tensor  # [L] int64: the final tokens of the block
    new_tokens: list[int]  # generated token ids of this block (prompt positions excluded)
    iterations: int


class DecodeObserver:
    """Base class for anything that watches decoding; every hook is optional."""

    def on_generation_start(self, prompt_length: int) -> None:
        """A generation begins."""

    def on_iteration_start(self, block: int, iteration: int, step: int) -> None:
        """A forward is about to run."""

    def on_iteration(self, info: IterationInfo) -> None:
        """A forward ran and the decoder committed tokens."""

    def on_batch_start(self, step: int, parts: list[BatchPart]) -> None:
        """A batched forward (the batch's `step`-th) is about to run these sequences' rows, in
        row order (after `on_iteration_start`)."""

    def on_batch_iteration(self, info: BatchIterationInfo) -> None:
        """A batched forward ran and each of its sequences committed tokens (in place of
        `on_iteration`, which batched decoding does not call)."""

    def on_block_end(self, info: BlockInfo) -> None:
        """A block has no mask left."""

    def on_generation_end(self) -> None:
        """The generation finished (also when it stopped early or failed)."""
