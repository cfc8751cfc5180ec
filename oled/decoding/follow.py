"""Recording one generation's commits so that another generation of the same prompt can follow
them: every runtime then runs the same forwards over the same tokens, whatever its own choices,
which is what a fair timing comparison of offloading policies needs (CPU experts agree with the
GPU only to a tolerance, and on near-tie confidences a different token changes all later work).
"""

from __future__ import annotations

import torch
from torch import Tensor

from oled.decoding.observers import DecodeObserver, IterationInfo


class Trajectory(DecodeObserver):
    """Per iteration of the observed generation: committed positions [L] bool and the block's
    tokens after the commits [L] int64 (the last generation observed)."""

    agreement = True  # its tokens are a generation's own: count how often a follower agrees

    def __init__(self) -> None:
        self.steps: list[tuple[Tensor, Tensor]] = []
        self.prompt: tuple[int, ...] = ()  # the prompt it was recorded for, if the recorder says

    def on_generation_start(self, prompt_length: int) -> None:
        self.steps = []

    def on_iteration(self, info: IterationInfo) -> None:
        self.steps.append((info.committed.clone(), info.tokens.clone()))

    def at(self, step: int, block_length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The commits [L] bool and tokens [L] of iteration `step` of the generation (counted
        over all blocks), on `device`."""
        if step >= len(self.steps):
            raise ValueError(
                f"the followed generation ended after {len(self.steps)} iterations; follow "
                "only a generation of the same prompt and decoding settings"
            )
        commit, tokens = self.steps[step]
        if commit.shape[0] != block_length:
            raise ValueError(
                f"the followed generation has blocks of {commit.shape[0]} tokens, not "
                f"{block_length}"
            )
        return commit.to(device), tokens.to(device)

    def confidence_at(self, step: int, device: torch.device) -> Tensor | None:
        """The confidences [L] that iteration `step` reports instead of its own (a routing
        replay's: oled.decoding.replay), or None: its own."""
        return None
