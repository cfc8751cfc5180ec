"""Recording one generation's commits so that another generation of the same prompt can follow
them: every runtime then runs the same forwards over the same tokens, whatever its own choices,
which is what a fair timing comparison of offloading policies needs (CPU experts agree with the
GPU only to a tolerance, and on near-tie confidences a different token changes all later work).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from oled.decoding.observers import BlockInfo, DecodeObserver, IterationInfo


class Trajectory(DecodeObserver):
    """Per iteration of the observed generation: committed positions [L] bool and the block's
    tokens after the commits [L] int64 (the last generation observed); its answer's tokens;
    and with `top_logits` > 0, each forward's largest logits per position and their token ids
    (each [L, top_logits]), against which `Agreement` compares another generation's."""

    agreement = True  # its tokens are a generation's own: count how often a follower agrees

    def __init__(self, top_logits: int = 0) -> None:
        self.top_logits = top_logits
        self.steps: list[tuple[Tensor, Tensor]] = []
        self.logits: list[tuple[Tensor, Tensor]] = []  # per step: values, ids [L, top_logits]
        self.tokens: list[int] = []  # the generated answer
        self.prompt: tuple[int, ...] = ()  # the prompt it was recorded for, if the recorder says

    def on_generation_start(self, prompt_length: int) -> None:
        self.steps, self.logits, self.tokens = [], [], []

    def on_iteration(self, info: IterationInfo) -> None:
        self.steps.append((info.committed.clone(), info.tokens.clone()))
        if self.top_logits and info.logits is not None:
            top = info.logits.topk(min(self.top_logits, info.logits.shape[-1]), dim=-1)
            self.logits.append((top.values, top.indices))

    def on_block_end(self, info: BlockInfo) -> None:
        self.tokens += info.new_tokens

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
        replay's: oled.trace.replay), or None: its own."""
        return None


class Agreement(DecodeObserver):
    """How a free-running generation compares with a recorded one (`reference`, recorded with
    `top_logits`: the all-resident model's, Runtime.reference). `result()` after the
    generation: whether the answers' tokens are equal, the first answer position where they
    differ, the first forward whose commits differ, and the largest logit difference, at the
    reference's top logits and in each position's largest logit, over the forwards up to that
    one (after it the inputs differ, so the logits no longer compare). Device work per
    forward: a gather and a max, no host sync."""

    def __init__(self, reference: Trajectory) -> None:
        self.reference = reference
        self.on_generation_start(0)

    def on_generation_start(self, prompt_length: int) -> None:
        self.steps: list[tuple[Tensor, Tensor]] = []
        self.picked: list[Tensor] = []  # per step [L, top]: this run's logits at the ref's ids
        self.tokens: list[int] = []

    def on_iteration(self, info: IterationInfo) -> None:
        self.steps.append((info.committed, info.tokens))
        step = len(self.steps) - 1
        if info.logits is not None and step < len(self.reference.logits):
            ids = self.reference.logits[step][1]  # [L, top]
            self.picked.append(
                torch.cat(  # [L, top + 1]: at the reference's ids, then the max
                    (info.logits.gather(-1, ids), info.logits.amax(-1, keepdim=True)), dim=-1
                )
            )

    def on_block_end(self, info: BlockInfo) -> None:
        self.tokens += info.new_tokens

    def result(self) -> dict[str, Any]:
        """tokens_equal, first_divergence (answer position, None when equal),
        diverged_step (first forward whose commits differ, None when none) and
        max_logit_diff (None without recorded logits)."""
        ref = self.reference
        first = _first_difference(self.tokens, ref.tokens)
        diverged = _first_differing_step(self.steps, ref.steps)
        upto = len(self.picked) if diverged is None else min(diverged + 1, len(self.picked))
        diff = None
        if upto:
            gaps = [
                (mine - torch.cat((vals, vals[:, :1]), dim=-1)).abs().amax()
                for mine, (vals, _) in zip(self.picked[:upto], ref.logits, strict=False)
            ]
            diff = float(torch.stack(gaps).amax())
        return {
            "tokens_equal": first is None,
            "first_divergence": first,
            "diverged_step": diverged,
            "max_logit_diff": diff,
        }


def _first_difference(mine: list[int], theirs: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter's length when one is a
    prefix of the other), None when they are equal."""
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return i
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))


def _first_differing_step(
    mine: list[tuple[Tensor, Tensor]], theirs: list[tuple[Tensor, Tensor]]
) -> int | None:
    """The first step whose commits or tokens differ (a step past the shorter), None: none."""
    n = min(len(mine), len(theirs))
    if n:
        same = torch.stack(
            [
                (a[0] == b[0]).all() & (a[1] == b[1]).all()
                for a, b in zip(mine[:n], theirs[:n], strict=True)
            ]
        )
        bad = (~same).nonzero()  # the one host sync
        if len(bad):
            return int(bad[0])
    return None if len(mine) == len(theirs) else n


def agreement_summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Free-running agreement with the resident model over generations (Agreement.result):
    the share whose tokens are equal, the earliest answer position that differs and the
    largest logit difference (None when nothing was compared)."""
    if not results:
        return {"tokens_equal": None, "first_divergence": None, "max_logit_diff": None}
    firsts = [r["first_divergence"] for r in results if r["first_divergence"] is not None]
    diffs = [r["max_logit_diff"] for r in results if r["max_logit_diff"] is not None]
    return {
        "tokens_equal": sum(r["tokens_equal"] for r in results) / len(results),
        "first_divergence": min(firsts) if firsts else None,
        "max_logit_diff": max(diffs) if diffs else None,
    }
