"""Collects routing and step contexts during generation and builds a Trace (model-independent)."""

from __future__ import annotations

import numpy as np

from oled.policies.base import StepContext
from oled.trace.format import Trace, TraceMeta


class TraceRecorder:
    """Call `record_routing` for each MoE layer of a forward, then `record_step` once."""

    def __init__(
        self,
        *,
        num_moe_layers: int,
        num_experts: int,
        top_k: int,
        expert_bytes: int = 0,
        hidden_size: int = 0,
        model_path: str = "",
        first_moe_layer: int = 0,
        weight_dtype: str = "float16",
    ) -> None:
        self.meta = TraceMeta(
            num_moe_layers=num_moe_layers,
            num_experts=num_experts,
            top_k=top_k,
            expert_bytes=expert_bytes,
            hidden_size=hidden_size,
            model_path=model_path,
        )
        self.first_moe_layer = first_moe_layer  # subtracted from `layer` in record_routing
        self.weight_dtype = np.dtype(weight_dtype)
        self.prompt_count = 0
        self._pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._pending_ranked: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._ids: list[np.ndarray] = []  # per step [L, T, K]
        self._weights: list[np.ndarray] = []
        self._ranked: list[tuple[np.ndarray, np.ndarray]] = []  # per step ([L, T, C], [L, T, C])
        self._pending_ahead: dict[int, np.ndarray] = {}
        self._ahead: list[np.ndarray] = []  # per step [L - 1, T, K]
        self._ctx: list[StepContext] = []

    def new_prompt(self) -> None:
        """A new prompt starts (counted in the metadata)."""
        self.prompt_count += 1

    def record_routing(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Routing [T, K] of one MoE layer in the current forward (host arrays)."""
        moe = layer - self.first_moe_layer
        if not 0 <= moe < self.meta.num_moe_layers:
            raise ValueError(f"layer {layer} is not a MoE layer of this recorder")
        self._pending[moe] = (
            np.asarray(ids).astype(np.int16),
            np.asarray(weights).astype(self.weight_dtype),
        )

    def record_ranking(self, layer: int, ids: np.ndarray, scores: np.ndarray) -> None:
        """The router's best experts [T, C] and their scores [T, C] of one MoE layer in the
        current forward (optional; recorded for every layer and forward or for none)."""
        moe = layer - self.first_moe_layer
        if not 0 <= moe < self.meta.num_moe_layers:
            raise ValueError(f"layer {layer} is not a MoE layer of this recorder")
        self._pending_ranked[moe] = (np.asarray(ids, np.int16), np.asarray(scores, np.float32))

    def record_ahead(self, layer: int, ids: np.ndarray) -> None:
        """The top-k ids [T, K] that MoE layer `layer` + 1's router gives `layer`'s router
        input in the current forward (optional; recorded for every layer but the last and every
        forward, or for none)."""
        moe = layer - self.first_moe_layer
        if not 0 <= moe < self.meta.num_moe_layers - 1:
            raise ValueError(f"layer {layer} has no next MoE layer in this recorder")
        self._pending_ahead[moe] = np.asarray(ids, np.int16)

    def record_step(self, ctx: StepContext) -> None:
        """Close the current forward with its context (all MoE layers must have been recorded)."""
        n = self.meta.num_moe_layers
        if len(self._pending) != n:
            missing = sorted(set(range(n)) - set(self._pending))
            raise ValueError(f"step {ctx.step}: no routing recorded for MoE layers {missing}")
        rows = len(ctx.token_state)
        shapes = {self._pending[i][0].shape for i in range(n)}
        if shapes != {(rows, self.meta.top_k)}:
            raise ValueError(
                f"step {ctx.step}: routing shapes {shapes} != {(rows, self.meta.top_k)}"
            )
        self._ids.append(np.stack([self._pending[i][0] for i in range(n)]))
        self._weights.append(np.stack([self._pending[i][1] for i in range(n)]))
        if self._pending_ranked or self._ranked:
            if len(self._pending_ranked) != n or len(self._ranked) != len(self._ctx):
                raise ValueError(f"step {ctx.step}: a ranking for some forwards or layers only")
            ranked = [self._pending_ranked[i] for i in range(n)]
            self._ranked.append(
                (np.stack([r[0] for r in ranked]), np.stack([r[1] for r in ranked]))
            )
        if self._pending_ahead or self._ahead:
            if len(self._pending_ahead) != n - 1 or len(self._ahead) != len(self._ctx):
                raise ValueError(f"step {ctx.step}: a prediction for some forwards or layers only")
            self._ahead.append(np.stack([self._pending_ahead[i] for i in range(n - 1)]))
        self._ctx.append(ctx)
        self._pending, self._pending_ranked, self._pending_ahead = {}, {}, {}

    def __len__(self) -> int:
        return len(self._ctx)

    def build(self) -> Trace:
        """The trace of every recorded step."""
        n, k = self.meta.num_moe_layers, self.meta.top_k
        meta = TraceMeta(**{**self.meta.__dict__, "prompt_count": self.prompt_count})
        lens = [len(c.token_state) for c in self._ctx]
        cat = np.concatenate
        return Trace(
            meta=meta,
            ids=cat(self._ids, axis=1) if self._ids else np.zeros((n, 0, k), np.int16),
            weights=(
                cat(self._weights, axis=1) if self._weights else np.zeros((n, 0, k), np.float16)
            ),
            token_state=cat([c.token_state for c in self._ctx] or [np.zeros(0)]).astype(np.int8),
            confidence=cat([c.confidence for c in self._ctx] or [np.zeros(0)]).astype(np.float32),
            row_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            block=np.array([c.block for c in self._ctx], np.int32),
            iteration=np.array([c.iteration for c in self._ctx], np.int32),
            step=np.array([c.step for c in self._ctx], np.int32),
            ranked_ids=cat([r[0] for r in self._ranked], axis=1) if self._ranked else None,
            ranked_scores=cat([r[1] for r in self._ranked], axis=1) if self._ranked else None,
            ahead_ids=cat(self._ahead, axis=1) if self._ahead else None,
        )
