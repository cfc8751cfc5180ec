"""Building blocks of the LLaDA2 MoE transformer: norm, rotary, attention, MLP and routing."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oled import kernels
from oled.model.config import ModelConfig

if TYPE_CHECKING:
    from torch.types import Device

    from oled.model.model import BatchRows

KV = tuple[Tensor, Tensor]  # one layer's key and value buffers


@dataclass
class BlockCausal:
    """What a batched forward's padded query blocks see (BatchRows without spans): each
    sequence its own slot's keys, block-causal over blocks of `block_length` positions. The
    fused kernel reads the rule from the rows' tensors; the torch path attends with `tensor`,
    built once per forward where first needed."""

    rows: BatchRows
    block_length: int

    @functools.cached_property
    def tensor(self) -> Tensor:
        """rows.mask(block_length): [B, 1, t_max, keys] bool."""
        return self.rows.mask(self.block_length)

    @property
    def rule(self) -> tuple[Tensor, Tensor, Tensor]:
        """(slots [B], key_len [B], query_pos [B, t_max]) int64: the rows' own tensors."""
        return self.rows.slots, self.rows.key_len, self.rows.query_pos


def block_causal_mask(start: int, t: int, block_length: int, device: Device) -> Tensor | None:
    """Mask [T, start + T] for queries at start..start+T-1 over keys 0..start+T-1.

    Query p sees key j iff block(j) <= block(p); None when the queries share one block (they
    then see every key), which lets SDPA take its fastest path.
    """
    if start // block_length == (start + t - 1) // block_length:
        return None
    queries = torch.arange(start, start + t, device=device)  # [T]
    keys = torch.arange(start + t, device=device)  # [S]
    return (keys[None, :] // block_length) <= (queries[:, None] // block_length)


@dataclass
class SequenceBlocks:
    """What the queries of `batch` sequences at the same positions start..start+length-1 see:
    each its own keys 0..start+length-1, block-causal over blocks of `block_length` positions.
    The fused kernel reads the rule from `rule` (device tensors made by kernels, so a graph can
    capture them); the torch path attends with `tensor`. Both built once per forward, where
    first needed."""

    start: int
    length: int
    block_length: int
    batch: int
    device: Device

    @functools.cached_property
    def tensor(self) -> Tensor | None:
        """block_causal_mask: [T, start + T] bool, or None (the queries share one block)."""
        return block_causal_mask(self.start, self.length, self.block_length, self.device)

    @functools.cached_property
    def rule(self) -> tuple[Tensor, Tensor, Tensor]:
        """(slots [B], key_len [B], query_pos [B, T]) int64: sequence b is slot b of the keys."""
        slots = torch.arange(self.batch, device=self.device)  # [B]
        key_len = torch.full((self.batch,), self.start + self.length, device=self.device)
        positions = torch.arange(self.start, self.start + self.length, device=self.device)
        return slots, key_len, positions.expand(self.batch, self.length)  # [B], [B], [B, T]


# An attention mask: None (attend to all), a bool tensor, one forward's block-causal rule, the
# rule of a batched forward's padded blocks, or for a batched forward with exact spans
# (BatchRows.spans) one per sequence.
Mask = Tensor | SequenceBlocks | BlockCausal | list[Tensor | SequenceBlocks | None] | None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled by the weight (as LLaDA2)."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if kernels.fused(x):
            from oled.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary:
    """Partial rotary embedding: rotate-half over the first `dim` dims of each head."""

    def __init__(self, *, dim: int, theta: float) -> None:
        self.dim = dim
        # fp32 on the host, as LLaDA2's reference code computes them (float64 differs by one
        # rounding step in some frequencies, which grows with position); host even under meta
        steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
        self.inv_freq = 1.0 / (theta ** (steps / dim))  # [dim/2] fp32
        self._cached: dict[torch.device, Tensor] = {}

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin for absolute positions [T] -> each [T, dim]."""
        inv = self._cached.get(positions.device)
        if inv is None:
            inv = self._cached[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, heads, T, head_dim] -> rotated copy; dims past `dim` pass through."""
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        rot = rot * cos + rotated * sin
        return torch.cat((rot, rest), dim=-1)


class Attention(nn.Module):
    """Fused-QKV grouped-query attention with QK RMSNorm and partial rotary, via SDPA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        qkv_rows = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_rows, bias=False)
        self.dense = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.query_layernorm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        rotary: Rotary,
        cos: Tensor,
        sin: Tensor,
        kv: KV | None,
        past: int | BatchRows,
        mask: Mask,
    ) -> Tensor:
        """x [B, T, H]; kv: this layer's cache buffers [B, kv_heads, S_max, D] or None; past:
        the cached prefix length, or the BatchRows of a batched forward (x [1, T, H])."""
        b, t, _ = x.shape
        qkv = self.query_key_value(x)  # [B, T, (h + 2 kv) * D]
        if not isinstance(past, int):
            return self._batched(qkv, rotary, cos, sin, kv, past, mask)
        assert not isinstance(mask, (list, BlockCausal))  # one sequence, one mask
        fused = kernels.fused(qkv)
        qkv_ = self._qkv_fused if fused else self._qkv
        q, k, v = qkv_(qkv, rotary, cos, sin, kv, past)
        out = self._attend(q, k, v, mask, fused)  # [B, h, T, D]
        return self.dense(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))

    def _batched(
        self,
        qkv: Tensor,
        rotary: Rotary,
        cos: Tensor,
        sin: Tensor,
        kv: KV | None,
        rows: BatchRows,
        mask: Mask,
    ) -> Tensor:
        """Several sequences' rows qkv [1, T, ...] (oled.model.model.BatchRows): their keys and
        values into their slots, then one attention over padded [B, t_max] query blocks: the
        fused kernel over each slot's own keys where the fused kernels run, else SDPA over the
        slots' keys gathered and padded to rows.keys, masked."""
        t = qkv.shape[1]
        fused = kernels.fused(qkv)
        assert kv is not None  # a batched forward writes into its slots
        kbuf, vbuf = kv  # [slots, kv, S_max, D]
        if rows.spans is not None:
            assert isinstance(mask, list)  # one mask per sequence
            qkv_ = self._qkv_fused if fused else self._qkv
            q, k, v = qkv_(qkv, rotary, cos, sin, None, 0)  # [1, h, T, D], [1, kv, T, D] x2
            return self.dense(self._per_sequence(q, k, v, kbuf, vbuf, rows.spans, mask))
        if fused:  # the keys and values go straight into their slots
            q, _, _ = self._qkv_fused(qkv, rotary, cos, sin, kv, 0, rows)
        else:
            q, k, v = self._qkv(qkv, rotary, cos, sin, None, 0)
            kbuf[rows.row_slots, :, rows.positions] = k[0].transpose(0, 1)  # [T, kv, D]
            vbuf[rows.row_slots, :, rows.positions] = v[0].transpose(0, 1)
        assert not isinstance(mask, (list, SequenceBlocks))  # one rule for the padded block
        nb, t_max = rows.queries.shape
        padded = q[0].transpose(0, 1).index_select(0, rows.queries.view(-1))  # [B*t_max, h, D]
        padded = padded.view(nb, t_max, self.heads, self.head_dim).transpose(1, 2)
        if fused and isinstance(mask, BlockCausal):
            out = self._ragged(padded, kbuf, vbuf, mask)  # [B, h, t_max, D]
        else:
            keys = kbuf[:, :, : rows.keys].index_select(0, rows.slots)  # [B, kv, S, D]
            values = vbuf[:, :, : rows.keys].index_select(0, rows.slots)
            out = F.scaled_dot_product_attention(
                padded,
                keys,
                values,
                attn_mask=mask.tensor if isinstance(mask, BlockCausal) else mask,
                scale=self.head_dim**-0.5,
                enable_gqa=True,
            )  # [B, h, t_max, D]
        out = out.transpose(1, 2).reshape(nb * t_max, self.heads * self.head_dim)
        return self.dense(out.index_select(0, rows.unpad).view(1, t, -1))  # [1, T, H]

    def _ragged(
        self, q: Tensor, kbuf: Tensor, vbuf: Tensor, mask: BlockCausal | SequenceBlocks
    ) -> Tensor:
        """Query blocks q [B, h, t_max, D] over each sequence's own keys in its slot of kbuf /
        vbuf, by the mask's rule (the fused kernel: no gathered keys, no mask tensor)
        -> [B, h, t_max, D]."""
        from oled.kernels.attention import ragged_attention

        slots, key_len, query_pos = mask.rule
        with kernels.serial():
            return ragged_attention(
                q, kbuf, vbuf, slots, key_len, query_pos, mask.block_length, self.head_dim**-0.5
            )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | SequenceBlocks | None, fused: bool
    ) -> Tensor:
        """Sequences at the same positions: q [B, h, T, D] over their keys and values
        [B, kv, S, D] -> [B, h, T, D]; the fused kernel of batched forwards where the rule is
        known (a sequence decodes with the rounding it has in a batch), else SDPA."""
        if fused and isinstance(mask, SequenceBlocks):
            return self._ragged(q, k, v, mask)
        rule = mask.tensor if isinstance(mask, SequenceBlocks) else mask  # [T, S] | None
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=rule, scale=self.head_dim**-0.5, enable_gqa=True
        )

    def _per_sequence(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kbuf: Tensor,
        vbuf: Tensor,
        spans: tuple[tuple[int, int, int], ...],
        masks: list[Tensor | SequenceBlocks | None],
    ) -> Tensor:
        """Each sequence's attention over exactly its own keys, as a one-sequence forward:
        q [1, h, T, D], k/v [1, kv, T, D] -> [1, T, h * D]."""
        outs: list[Tensor] = []
        row, fused = 0, kernels.fused(q)
        for (slot, start, n), mask in zip(spans, masks, strict=True):
            kb, vb = kbuf[slot : slot + 1], vbuf[slot : slot + 1]  # [1, kv, S_max, D]
            kb[:, :, start : start + n] = k[:, :, row : row + n]
            vb[:, :, start : start + n] = v[:, :, row : row + n]
            q_, kb, vb = q[:, :, row : row + n], kb[:, :, : start + n], vb[:, :, : start + n]
            outs.append(self._attend(q_, kb, vb, mask, fused))
            row += n
        out = torch.cat(outs, dim=2)  # [1, h, T, D]
        return out.transpose(1, 2).reshape(1, row, self.heads * self.head_dim)

    def _qkv(
        self, qkv: Tensor, rotary: Rotary, cos: Tensor, sin: Tensor, kv: KV | None, past: int
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Normed, rotated q [B, h, T, D] and the keys/values to attend [B, kv, S, D] (torch)."""
        b, t, _ = qkv.shape
        kv_width = self.kv_heads * self.head_dim
        q, k, v = qkv.split([self.heads * self.head_dim, kv_width, kv_width], dim=-1)
        q = self.query_layernorm(q.view(b, t, self.heads, self.head_dim)).transpose(1, 2)
        k = self.key_layernorm(k.view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, D]
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        if kv is None:
            return q, k, v
        kbuf, vbuf = kv
        kbuf[:, :, past : past + t] = k
        vbuf[:, :, past : past + t] = v
        return q, kbuf[:, :, : past + t], vbuf[:, :, : past + t]

    def _qkv_fused(
        self,
        qkv: Tensor,
        rotary: Rotary,
        cos: Tensor,
        sin: Tensor,
        kv: KV | None,
        past: int,
        rows: BatchRows | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """As `_qkv`, in one kernel that also writes the new keys/values into the cache: at
        `past` on, or with `rows` (a batched forward's, qkv [1, T, ...]) each row's into its
        slot at its position (the keys and values returned are then the whole buffers)."""
        from oled.kernels.norm import qk_norm_rotary

        b, t, _ = qkv.shape
        if kv is None:
            k_out = qkv.new_empty(b, self.kv_heads, t, self.head_dim)  # [B, kv, T, D]
            v_out = torch.empty_like(k_out)
        elif rows is not None:
            k_out, v_out = kv  # [slots, kv, S_max, D]
        else:
            k_out, v_out = kv[0][:, :, past : past + t], kv[1][:, :, past : past + t]
        q = qk_norm_rotary(
            qkv,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            q_weight=self.query_layernorm.weight,
            k_weight=self.key_layernorm.weight,
            eps=self.query_layernorm.eps,
            cos=cos,
            sin=sin,
            rotary_dim=rotary.dim,
            k_out=k_out,
            v_out=v_out,
            rows=None if rows is None else (rows.row_slots, rows.positions),
        )
        if kv is None or rows is not None:
            return q, k_out, v_out
        return q, kv[0][:, :, : past + t], kv[1][:, :, : past + t]


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate x) * up x)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if kernels.fused(x):
            from oled.kernels.elementwise import silu_mul

            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """LLaDA2's group-limited sigmoid router; the expert bias only selects."""

    expert_bias: Tensor  # a buffer [E]: saved with the weights, not trained by the optimizer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.scale = cfg.routed_scaling_factor
        self.normalise = self.top_k > 1  # norm_topk_prob is ignored, as by the reference code

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (expert ids [T, K] int64, gate weights [T, K] fp32)."""
        return route(
            x,
            self.weight,
            self.expert_bias,
            top_k=self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scale=self.scale,
            normalise=self.normalise,
        )


def route(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    scale: float,
    normalise: bool,
) -> tuple[Tensor, Tensor]:
    """Group-limited top-k over sigmoid scores (DESIGN.md section 4). x [T, H]."""
    logits = router_logits(x, weight)  # [T, E] fp32
    if kernels.fused(x):
        from oled.kernels.route import select_experts

        return select_experts(
            logits,
            bias,
            top_k=top_k,
            n_group=n_group,
            topk_group=topk_group,
            scale=scale,
            normalise=normalise,
        )
    t, e = logits.shape
    scores = torch.sigmoid(logits)  # [T, E]
    biased = scores + bias.float()  # [T, E]: selection only
    groups = biased.view(t, n_group, e // n_group)  # [T, G, E/G]
    group_score = groups.topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep = group_score.topk(topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(groups).reshape(t, e)  # [T, E]
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if normalise:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scale


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """x [T, H] @ weight [E, H].T in fp32 (router_dtype), also inside a bf16 autocast region."""
    with _no_autocast(x.device):
        return x.float() @ weight.float().t()  # [T, E]


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast switched off where it is on (training runs the model under bf16 autocast)."""
    kind = device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()
