"""Retention policies: which cached experts to evict, and how likely each is to be reused.

State is kept per MoE layer as [L, E] numpy arrays, views of the planner's plan state
(oled.policies.state) that `reset` fills in place; every hook is vectorised over experts.
"""

from __future__ import annotations

import numpy as np

from oled.policies.base import RetentionPolicy, StepContext, lowest
from oled.policies.state import InState, Kind, Stateful
from oled.registry import component
from oled.token_states import TOKEN_COMMITTED, TOKEN_MASKED


class _Scored(Stateful, RetentionPolicy):
    """Retention with one priority per (layer, expert); victims have the lowest priority."""

    priority = InState()  # [L, E]

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Zero all priorities."""
        super().reset(num_layers=num_layers, num_experts=num_experts)
        self.own_state(num_layers=num_layers, num_experts=num_experts)
        self.priority.fill(0.0)
        self.now = 0

    def victims(self, layer: int, candidates: np.ndarray, n: int) -> np.ndarray:
        """Lowest-priority candidates."""
        return lowest(self.priority[layer], candidates, n)


@component("retention", "lru")
class LRURetention(_Scored):
    """Evict the least recently used expert (mixtral-offloading's LRU cache)."""

    compiled_as = Kind(1, "lru")

    def __init__(self) -> None:
        pass

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Nothing used yet."""
        super().reset(num_layers=num_layers, num_experts=num_experts)
        self.priority.fill(-1.0)

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray, step: int = 0) -> None:
        """Every routed expert counts as used now."""
        self.now = step
        self.priority[layer, ids.reshape(-1)] = step

    def on_insert(self, layer: int, experts: np.ndarray) -> None:
        """An inserted expert is fresh."""
        self.priority[layer, experts] = self.now

    def on_hit(self, layer: int, experts: np.ndarray, step: int) -> None:
        """A hit refreshes recency."""
        self.now = step
        self.priority[layer, experts] = step

    def reuse(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Halves with every step since last use."""
        return 0.5 ** np.maximum(0.0, self.now - self.priority[layer, experts])


@component("retention", "lfu")
class LFURetention(_Scored):
    """Evict the least frequently used expert (MoE-Infinity-style activation counts)."""

    compiled_as = Kind(2, "lfu", {"decay": "double", "per_token": "int64_t"})

    def __init__(self, *, decay: float = 1.0, per_token: bool = False) -> None:
        self.decay = decay  # multiply counts by this every forward (1.0 = plain LFU)
        self.per_token = per_token  # count routed tokens instead of forwards that used the expert

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray, step: int = 0) -> None:
        """Count this forward's use."""
        p = self.priority[layer]
        if self.decay != 1.0:
            p *= self.decay
        if self.per_token:
            p += np.bincount(ids.reshape(-1), minlength=self.num_experts)
        else:
            p[ids.reshape(-1)] += 1.0  # fancy-index add: once per distinct expert

    def reuse(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Frequency relative to the layer's most frequent expert."""
        p = self.priority[layer]
        return p[experts] / max(1e-9, float(p.max()))


@component("retention", "score_ema")
class ScoreEMARetention(_Scored):
    """Evict the lowest exponential moving average of gate scores (HybriMoE score-aware cache)."""

    compiled_as = Kind(3, "ema", {"alpha": "double"})

    def __init__(self, *, alpha: float = 0.7) -> None:
        self.alpha = alpha  # weight of the history

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray, step: int = 0) -> None:
        """Fold this forward's gate-weight mass into the EMA."""
        mass = np.bincount(
            ids.reshape(-1),
            weights=weights.reshape(-1).astype(np.float64),
            minlength=self.num_experts,
        )
        p = self.priority[layer]
        p *= self.alpha
        p += (1.0 - self.alpha) * mass

    def reuse(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Saturating map of the score."""
        s = self.priority[layer, experts]
        return s / (s + 0.1)


@component("retention", "confidence")
class ConfidenceRetention(Stateful, RetentionPolicy):
    """OLED: priority of a cached expert from its tokens' gate weights, decode state and confidence.

    Per observed forward each (token, expert) pair adds gate weight x a factor of the token:
    masked tokens `masked_weight * (1 - confidence_slope * confidence)` (low confidence stays
    masked and routes the same way next iteration), just-committed tokens `committed_weight`
    (their input changes, so their routes change), fixed block tokens `fixed_weight` (stable),
    pending prefix rows `prefix_weight` (they leave the forward). Older evidence decays by
    `decay` per forward. At a block boundary every token becomes prefix: the stable part decays by
    `block_carry` while the masked part is kept x `masked_carry` (the next block's masked tokens
    route like the previous block's). Reuse = 1 - exp(-priority / reuse_scale).
    """

    compiled_as = Kind(4, "confidence", {"now_weight": "double", "reuse_scale": "double"})

    masked = InState()  # [L, E] evidence from masked tokens
    stable = InState()  # [L, E] evidence from fixed / committed / prefix tokens
    current = InState()  # [L, E] this forward's gate mass (seen at plan time)
    score = InState("priority")  # [L, E] masked + stable + now_weight x current
    block = InState("last_block")  # [L] the block each layer last observed

    def __init__(
        self,
        *,
        masked_weight: float = 1.0,
        confidence_slope: float = 0.8,
        committed_weight: float = 0.15,
        fixed_weight: float = 0.5,
        prefix_weight: float = 0.05,
        decay: float = 0.6,
        block_carry: float = 0.25,
        masked_carry: float = 1.0,
        now_weight: float = 1.0,
        reuse_scale: float = 0.5,
        block_length: int = 32,
    ) -> None:
        self.masked_weight = masked_weight
        self.confidence_slope = confidence_slope
        self.committed_weight = committed_weight
        self.fixed_weight = fixed_weight
        self.prefix_weight = prefix_weight
        self.decay = decay
        self.block_carry = block_carry
        self.masked_carry = masked_carry
        self.now_weight = now_weight  # weight of this forward's gate mass in `reuse`
        self.reuse_scale = reuse_scale
        self.block_length = block_length  # rows before the last block_length are prefix rows

    def reset(self, *, num_layers: int, num_experts: int) -> None:
        """Zero all evidence."""
        super().reset(num_layers=num_layers, num_experts=num_experts)
        self.own_state(num_layers=num_layers, num_experts=num_experts)
        for evidence in (self.masked, self.stable, self.current, self.score):
            evidence.fill(0.0)
        self.block.fill(-1)

    def route(self, layer: int, ids: np.ndarray, weights: np.ndarray, step: int = 0) -> None:
        """Remember this forward's gate mass per expert (feeds `reuse` of the misses)."""
        cur = np.bincount(ids.reshape(-1), weights=weights.reshape(-1), minlength=self.num_experts)
        self.current[layer] = cur
        score = self.score[layer]
        np.add(self.masked[layer], self.stable[layer], out=score)
        score += self.now_weight * cur

    def row_factors(self, ctx: StepContext) -> tuple[np.ndarray, np.ndarray]:
        """Per-row factors [T] for the masked and the stable evidence."""
        state, conf = ctx.token_state, ctx.confidence.astype(np.float64)
        masked = state == TOKEN_MASKED
        fm = np.where(masked, self.masked_weight * (1.0 - self.confidence_slope * conf), 0.0)
        fs = np.where(state == TOKEN_COMMITTED, self.committed_weight, self.fixed_weight)
        fs[masked] = 0.0
        if ctx.prefix is not None:
            fs[ctx.prefix] = self.prefix_weight
        elif (n_prefix := len(state) - self.block_length) > 0:
            fs[:n_prefix] = self.prefix_weight
        return fm, fs

    def observe(self, layer: int, ids: np.ndarray, weights: np.ndarray, ctx: StepContext) -> None:
        """Decay old evidence and add this forward's."""
        m, s = self.masked[layer], self.stable[layer]
        if ctx.block != self.block[layer]:  # a new block: previous tokens are prefix now
            self.block[layer] = ctx.block
            m *= self.masked_carry
            s *= self.block_carry
        m *= self.decay
        s *= self.decay
        fm, fs = self.row_factors(ctx)
        flat = ids.reshape(-1)
        w = weights.astype(np.float64)
        E = self.num_experts
        m += np.bincount(flat, weights=(w * fm[:, None]).reshape(-1), minlength=E)
        s += np.bincount(flat, weights=(w * fs[:, None]).reshape(-1), minlength=E)
        np.add(m, s, out=self.score[layer])

    def priority(self, layer: int) -> np.ndarray:
        """[E] eviction priority of the layer (higher = keep)."""
        return self.masked[layer] + self.stable[layer]

    def victims(self, layer: int, candidates: np.ndarray, n: int) -> np.ndarray:
        """Lowest predicted reuse."""
        return lowest(self.score[layer], candidates, n)

    def reuse(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """1 - exp(-(priority + now_weight x this forward's mass) / reuse_scale).

        The exponential is the C library's in extended precision, rounded once: numpy's own
        float64 exp depends on the CPU's vector instructions (the last bit of about 5% of
        results), and so would every decision that compares reuse."""
        p = self.score[layer, experts]
        p *= -1.0 / self.reuse_scale
        return 1.0 - np.exp(p.astype(np.longdouble)).astype(np.float64)
