"""Planning one device's share of the experts, when several devices split every MoE layer's
experts in contiguous shares (runtime.devices > 1, oled.model.parallel).

Each device plans only its own experts, in its own ids (its store's rows, 0..E/N - 1): the
routing reaches its planner as `share_ids` maps it, and the pairs routed to the other shares'
experts (id E/N) are left out before the planner and its policies see them. They are neither
hits nor misses of this device, and its policies learn only from its own pairs, each with its
row's token state and confidence.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from oled.policies.base import Load, StepContext
from oled.policies.planner import LayerPlan, Planner


def share_ids(num_experts: int, devices: int, rank: int) -> np.ndarray:
    """[E] int64: each expert's id in share `rank` of `devices` contiguous shares (rank r
    holds experts [r E/N, (r + 1) E/N)), and E/N for the experts of the other shares."""
    per = num_experts // devices
    out = np.full(num_experts, per, np.int64)
    out[rank * per : (rank + 1) * per] = np.arange(per)
    return out


def own_pairs(ids: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray]:
    """(mask [T, K] of the pairs of this share's experts, their rows [N]) in routing `ids`
    [T, K] of share ids (`per`: another share's expert)."""
    mine = ids < per  # [T, K]
    return mine, mine.nonzero()[0]  # [N]: row of each kept pair, in row-major order


class SharePlanner(Planner):
    """A Planner over one share's experts (`num_experts` = E/N) whose routing is in share ids
    (`share_ids`): the pairs of the other shares (id `num_experts`) are left out, as [N, 1]
    routing of this share's pairs, before planning, observing and copying ahead."""

    def plan(
        self, layer: int, ids: np.ndarray, weights: np.ndarray, load: Load | None = None
    ) -> LayerPlan:
        mine, _ = own_pairs(ids, self.num_experts)
        return super().plan(layer, ids[mine][:, None], weights[mine][:, None], load)  # [N, 1]

    def observe(self, layer: int, ids: np.ndarray, weights: np.ndarray, ctx: StepContext) -> None:
        mine, rows = own_pairs(ids, self.num_experts)
        super().observe(layer, ids[mine][:, None], weights[mine][:, None], self._rows(ctx, rows))

    def prefetch(
        self, layer: int, ids: np.ndarray, after: LayerPlan | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        mine, _ = own_pairs(ids, self.num_experts)
        return super().prefetch(layer, ids[mine][:, None], after)

    def _rows(self, ctx: StepContext, rows: np.ndarray) -> StepContext:
        """The forward's context for the kept pairs' rows [N]; the pending prefix rows named
        (a policy that infers them from the row count, as all but its last block_length rows,
        would count the kept pairs instead)."""
        prefix = ctx.prefix
        if prefix is None:
            t = len(ctx.token_state)
            block = getattr(self.retention, "block_length", t)  # the policy's own inference
            prefix = np.arange(t) < t - block
        return replace(
            ctx,
            token_state=ctx.token_state[rows],
            confidence=ctx.confidence[rows],
            prefix=prefix[rows],
        )
