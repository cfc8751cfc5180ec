"""Synthetic routing traces with block-diffusion structure (tests, simulator smoke runs).

Each block position has a preferred routing per layer (Gumbel top-k over skewed per-layer
logits). Masked positions keep their routing with a few routes redrawn per iteration (low
confidence = the same input next time); a position committed in an iteration gets a new routing
from the next forward on (its token changed); fixed positions keep theirs. Each iteration commits
the most confident masked positions. The next block's positions start from the previous block's
masked routings (partly redrawn); its first forward carries the previous block's last commits
as pending prefix rows.
"""

from __future__ import annotations

import numpy as np

from oled.token_states import TOKEN_COMMITTED, TOKEN_FIXED, TOKEN_MASKED
from oled.trace.format import Trace, TraceMeta


def _draw(rng: np.random.Generator, logits: np.ndarray, rows: int, k: int) -> np.ndarray:
    """[L, rows, K] distinct expert ids per row, Gumbel top-k over logits [L, E]."""
    g = logits[:, None, :] + rng.gumbel(size=(logits.shape[0], rows, logits.shape[1]))
    return np.argpartition(-g, k - 1, axis=-1)[..., :k]


def synthetic_trace(
    *,
    num_layers: int = 19,
    num_experts: int = 256,
    top_k: int = 8,
    blocks: int = 4,
    block_length: int = 32,
    commits_per_iteration: int = 2,
    skew: float = 2.5,
    drift: float = 0.05,
    block_drift: float = 0.3,
    seed: int = 0,
) -> Trace:
    """A trace of `blocks` blocks; about block_length / commits_per_iteration forwards each."""
    rng = np.random.default_rng(seed)
    L, E, K, B = num_layers, num_experts, top_k, block_length
    logits = skew * rng.standard_normal((L, E))
    route = _draw(rng, logits, B, K)  # [L, B, K]
    ids, weights, states, confs, offsets = [], [], [], [], [0]
    meta_rows: list[tuple[int, int, int]] = []
    step, pending = 0, np.zeros((L, 0, K), np.int64)
    for block in range(blocks):
        masked = np.ones(B, bool)
        conf = rng.uniform(0.0, 0.5, B)
        it = 0
        while masked.any():
            conf = np.where(masked, np.minimum(1.0, conf + rng.uniform(0.0, 0.15, B)), 1.0)
            order = np.argsort(-np.where(masked, conf, -1.0))
            n = min(commits_per_iteration, int(masked.sum()))
            committed = np.zeros(B, bool)
            committed[order[:n]] = True
            state = np.where(masked, TOKEN_MASKED, TOKEN_FIXED).astype(np.int8)
            state[committed] = TOKEN_COMMITTED
            rows = np.concatenate([pending, route], axis=1)  # prefix rows first
            w = rng.dirichlet(np.ones(K), size=(L, rows.shape[1])).astype(np.float32)
            ids.append(rows)
            weights.append(w)
            states.append(np.concatenate([np.full(pending.shape[1], TOKEN_FIXED, np.int8), state]))
            confs.append(np.concatenate([np.ones(pending.shape[1]), np.where(masked, conf, 1.0)]))
            offsets.append(offsets[-1] + rows.shape[1])
            meta_rows.append((block, it, step))
            # next forward: committed rows reroute, masked rows drift a little
            route = route.copy()
            route[:, committed] = _draw(rng, logits, int(committed.sum()), K)
            _redraw(rng, route, masked & ~committed, drift, E)
            masked &= ~committed
            pending = np.zeros((L, 0, K), np.int64)
            step, it = step + 1, it + 1
        pending = route[:, order[:n]]
        _redraw(rng, route, np.ones(B, bool), block_drift, E)
    return Trace(
        meta=TraceMeta(num_moe_layers=L, num_experts=E, top_k=K, expert_bytes=6 << 20),
        ids=np.concatenate(ids, axis=1).astype(np.int16),
        weights=np.concatenate(weights, axis=1).astype(np.float16),
        token_state=np.concatenate(states).astype(np.int8),
        confidence=np.concatenate(confs).astype(np.float32),
        row_offsets=np.asarray(offsets, np.int64),
        block=np.array([m[0] for m in meta_rows], np.int32),
        iteration=np.array([m[1] for m in meta_rows], np.int32),
        step=np.array([m[2] for m in meta_rows], np.int32),
    )


def _redraw(
    rng: np.random.Generator, route: np.ndarray, rows: np.ndarray, p: float, e: int
) -> None:
    """Redraw a fraction p of the routes of the selected rows in place (ids may repeat in a row)."""
    sel = rng.random(route.shape) < p
    sel &= rows[None, :, None]
    route[sel] = rng.integers(0, e, int(sel.sum()))
