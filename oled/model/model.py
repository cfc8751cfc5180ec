"""The LLaDA2 MoE transformer in plain torch. Module names follow the checkpoint's tensor names."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn

from oled import kernels
from oled.model.config import ModelConfig
from oled.model.layers import (
    MLP,
    Attention,
    BlockCausal,
    RMSNorm,
    Rotary,
    Router,
    SequenceBlocks,
)
from oled.model.stages import stage

if TYPE_CHECKING:
    from torch.types import Device

    from oled.model.layers import KV, Mask


class ExpertExecutor(Protocol):
    """Computes the routed-expert part of one MoE layer: sum_k w_k * expert_k(x), cast to x.
    `graph_safe`: it makes no host decision, so a whole forward can be one CUDA graph
    (oled.model.graphs); an executor that decides on the host between layers is not."""

    graph_safe: bool

    def __call__(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor: ...


RoutingHook = Callable[[int, Tensor, Tensor], None]  # (moe layer, ids [T, K], weights [T, K])


@dataclass
class MoERequest:
    """What a forward needs from the expert executor at one MoE layer."""

    layer: int  # MoE layer index
    x: Tensor  # [T, H] the layer's normed input
    ids: Tensor  # [T, K] routed expert ids
    weights: Tensor  # [T, K] fp32 gate weights


ForwardSteps = Generator[MoERequest, Tensor, Tensor]  # yields requests, is sent [T, H] routed


class RoutingOverride:
    """Routing that replaces every MoE layer's own (routing replay: oled.trace.replay).

    Static device buffers hold the current forward's ids [L, T, K] int64 and weights [L, T, K]
    fp32 as one contiguous block each, so one host-to-device copy fills them before the forward
    (`load`). A MoE layer still runs its router (its cost stays in the timing), then takes
    `view(layer, T)` instead of the router's output, in eager forwards and inside CUDA graphs
    alike: the views of a given T always lie at the same addresses. `key` changes with every
    override, so graphs captured with one are never replayed without it (oled.model.graphs).
    """

    _serial = itertools.count(1)

    def __init__(self, *, layers: int, top_k: int, rows: int, device: Device) -> None:
        self.layers, self.top_k, self.capacity = layers, top_k, rows
        size = layers * rows * top_k
        self.ids = torch.zeros(size, dtype=torch.long, device=device)  # [L * R * K]
        self.weights = torch.zeros(size, dtype=torch.float32, device=device)  # [L * R * K]
        self.rows = 0  # rows T of the forward the buffers hold
        self.key = next(self._serial)

    def load(self, ids: Tensor, weights: Tensor) -> None:
        """Fill the buffers from host ids [L, T, K] int64 and weights [L, T, K] fp32
        (contiguous; pinned ones copy without blocking the host)."""
        layers, t, k = ids.shape
        if (layers, k) != (self.layers, self.top_k) or t > self.capacity:
            raise ValueError(
                f"routing of shape {tuple(ids.shape)} does not fit the override's "
                f"[{self.layers}, <={self.capacity}, {self.top_k}]"
            )
        n = ids.numel()
        self.ids[:n].copy_(ids.view(-1), non_blocking=True)
        self.weights[:n].copy_(weights.view(-1), non_blocking=True)
        self.rows = t

    def view(self, layer: int, tokens: int) -> tuple[Tensor, Tensor]:
        """The replaced routing of MoE layer `layer`: ids [T, K], weights [T, K]."""
        if tokens != self.rows:
            raise ValueError(
                f"the forward routes {tokens} rows, the replayed routing holds {self.rows}"
            )
        n = self.layers * tokens * self.top_k
        shape = (self.layers, tokens, self.top_k)
        return self.ids[:n].view(shape)[layer], self.weights[:n].view(shape)[layer]


class KVCache:
    """Preallocated per-layer key/value buffers; `length` tokens of prefix are valid."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_len: int,
        batch: int,
        dtype: torch.dtype,
        device: Device,
    ) -> None:
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self.k[i], self.v[i]


@dataclass
class BatchRows:
    """Where the rows of one batched forward belong: several sequences' rows side by side.

    Sequence b runs `lengths[b]` rows at absolute positions starts[b]..., over the keys its KV
    slot `slots[b]` holds before them. The linear layers and the experts see the rows as one
    [1, T, H] batch (one routing plan for all of them); attention gathers each sequence's rows
    into a padded [B, t_max] query block over its own slot's keys, with a mask built on the
    device from these tensors (the fused kernel reads the rule from them directly), so a
    forward's kernels depend only on the shapes (T, B, t_max, keys, logits rows) and replay as
    CUDA graphs whatever the positions (oled.model.graphs).
    """

    positions: Tensor  # [T] int64: each row's absolute position
    row_slots: Tensor  # [T] int64: each row's KV slot
    queries: (
        Tensor  # [B, t_max] int64: the row each padded query takes (pads: the sequence's first)
    )
    unpad: Tensor  # [T] int64: each row's index in the flattened [B * t_max] query block
    query_pos: Tensor  # [B, t_max] int64: the padded queries' positions
    key_len: Tensor  # [B] int64: keys valid per sequence (start + rows)
    slots: Tensor  # [B] int64: each sequence's KV slot
    logit_rows: Tensor  # [R] int64: the rows whose logits the forward returns
    keys: int  # keys attended per sequence (>= every key_len: the padded key length)
    spans: tuple[tuple[int, int, int], ...] | None = None  # exact: (slot, start, rows) each

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        logits_from: list[int],
        *,
        keys: int,
        device: Device,
        exact: bool = False,
    ) -> BatchRows:
        """Rows of sequences in `slots` order; each returns the logits of its rows from
        `logits_from[b]` on; `keys` >= every start + length; `exact`: attention per sequence
        over its own keys (no graphs)."""
        t_max = max(lengths)
        ends = [s + n for s, n in zip(starts, lengths, strict=True)]
        if keys < max(ends):
            raise ValueError(f"{keys} keys do not cover the batch's sequences (up to {max(ends)})")
        flat: list[list[int]] = [
            [],
            [],
            [],
            [],
        ]  # per row: position, slot, index in the padded block; logit rows
        pads: list[list[int]] = [[], []]  # per padded query: its row, its position
        row = 0
        for b, (slot, start, n, skip) in enumerate(
            zip(slots, starts, lengths, logits_from, strict=True)
        ):
            flat[0] += range(start, start + n)
            flat[1] += [slot] * n
            flat[2] += range(b * t_max, b * t_max + n)
            flat[3] += range(row + skip, row + n)
            pads[0] += [*range(row, row + n), *[row] * (t_max - n)]
            pads[1] += [*range(start, start + n), *[start] * (t_max - n)]
            row += n

        parts = [*flat, *pads, ends, slots]
        host = torch.tensor([v for part in parts for v in part], dtype=torch.long)
        flat_dev = host.to(device).split([len(part) for part in parts])  # one copy for all
        nb = len(slots)
        return cls(
            positions=flat_dev[0],
            row_slots=flat_dev[1],
            unpad=flat_dev[2],
            logit_rows=flat_dev[3],
            queries=flat_dev[4].view(nb, t_max),
            query_pos=flat_dev[5].view(nb, t_max),
            key_len=flat_dev[6],
            slots=flat_dev[7],
            keys=keys,
            spans=tuple(zip(slots, starts, lengths, strict=True)) if exact else None,
        )

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """What the forward's kernels depend on: (T, B, t_max, keys, logits rows)."""
        b, t_max = self.queries.shape
        return (self.positions.shape[0], b, t_max, self.keys, self.logit_rows.shape[0])

    def clone(self) -> BatchRows:
        """Buffers of their own holding these rows (a graph's static input)."""
        return replace(self, **{name: getattr(self, name).clone() for name in TENSORS})

    def copy_(self, other: BatchRows) -> None:
        """Take `other`'s rows (of the same shape) into these buffers."""
        for name in TENSORS:
            getattr(self, name).copy_(getattr(other, name))

    def mask(self, block_length: int) -> Tensor:
        """[B, 1, t_max, keys] bool: query p of sequence b sees key j < key_len[b] with
        block(j) <= block(p), block-causal as `block_causal_mask`."""
        keys = torch.arange(self.keys, device=self.positions.device)  # [S]
        valid = keys[None, :] < self.key_len[:, None]  # [B, S]
        causal = (keys[None, None, :] // block_length) <= (
            self.query_pos[:, :, None] // block_length
        )  # [B, t_max, S]
        return (valid[:, None, :] & causal)[:, None]


TENSORS = [f.name for f in fields(BatchRows) if f.name not in ("keys", "spans")]


class MoE(nn.Module):
    """Router + routed experts (computed by an executor, stored elsewhere) + shared expert."""

    def __init__(self, cfg: ModelConfig, moe_index: int) -> None:
        super().__init__()
        self.gate = Router(cfg)
        shared = cfg.shared_intermediate_size  # 0: none (num_shared_experts null or 0)
        self.shared_experts = MLP(cfg.hidden_size, shared) if shared else None
        self.moe_index = moe_index
        self.executor: ExpertExecutor | None = None
        self.hooks: list[RoutingHook] = []
        self.override: RoutingOverride | None = None  # replaces the router's output

    def forward(self, x: Tensor) -> Tensor:
        request = self.route(x)
        return self.finish(x, request, self.execute(request))

    def route(self, x: Tensor) -> MoERequest:
        """x [B, T, H] -> the routing of its T = B*T rows (the override's, when one is set:
        the router still runs)."""
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        ids, weights = self.gate(flat)  # [T, K], [T, K]
        if self.override is not None:
            ids, weights = self.override.view(self.moe_index, flat.shape[0])
        return MoERequest(self.moe_index, flat, ids, weights)

    def execute(self, request: MoERequest) -> Tensor:
        """The routed experts' sum [T, H] through the hooks and the attached executor."""
        for hook in self.hooks:
            hook(self.moe_index, request.ids, request.weights)
        if self.executor is None:
            raise RuntimeError("no expert executor attached: load the model through load_model()")
        return self.executor(self.moe_index, request.x, request.ids, request.weights)

    def finish(self, x: Tensor, request: MoERequest, routed: Tensor) -> Tensor:
        """Routed [T, H] plus the shared expert, in x's shape [B, T, H]."""
        if self.shared_experts is None:
            return routed.view(x.shape)
        return (routed + self.shared_experts(request.x)).view(x.shape)

    def add_to(self, residual: Tensor, request: MoERequest, routed: Tensor) -> Tensor:
        """residual [B, T, H] + `finish`: the two sums in one launch where the fused kernels
        run (oled.kernels.elementwise, bit for bit as torch's)."""
        if self.shared_experts is None or not kernels.fused(residual):
            return residual + self.finish(residual, request, routed)
        shared = self.shared_experts(request.x).view(residual.shape)
        if not residual.dtype == routed.dtype == shared.dtype:  # torch's promotion decides
            return residual + (routed.view(residual.shape) + shared)
        from oled.kernels.elementwise import residual_add

        return residual_add(residual, routed.view(residual.shape), shared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        dense = index < cfg.first_k_dense_replace
        self.mlp: MLP | MoE = (
            MLP(cfg.hidden_size, cfg.intermediate_size)
            if dense
            else MoE(cfg, index - cfg.first_k_dense_replace)
        )

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
        x = self.attend(x, rotary, cos, sin, kv, past, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def attend(
        self,
        x: Tensor,
        rotary: Rotary,
        cos: Tensor,
        sin: Tensor,
        kv: KV | None,
        past: int | BatchRows,
        mask: Mask,
    ) -> Tensor:
        """The attention half with its residual: x [B, T, H] -> [B, T, H]."""
        return x + self.attention(self.input_layernorm(x), rotary, cos, sin, kv, past, mask)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """`layers`, typed: the ModuleList holds only DecoderLayers."""
        return cast("Sequence[DecoderLayer]", self.layers)


class LLaDA2Model(nn.Module):
    """LLaDA2 MoE diffusion LM. Routed experts are not parameters: see ExpertStore."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(dim=cfg.rotary_dim, theta=cfg.rope_theta)
        self.tie_weights()

    def tied_names(self) -> set[str]:
        """State-dict names that are views of another tensor (not read from a checkpoint):
        lm_head.weight when tie_word_embeddings is true, as the reference code ties it."""
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()

    def tie_weights(self) -> None:
        """The output projection is the embedding matrix when tie_word_embeddings is true."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.word_embeddings.weight

    @property
    def moe_blocks(self) -> list[MoE]:
        """The MoE layers' blocks, by MoE layer index."""
        return [layer.mlp for layer in self.model.decoder_layers() if isinstance(layer.mlp, MoE)]

    def execute(self, request: MoERequest) -> Tensor:
        """Answer a forward's MoE request through its layer's hooks and executor: [T, H]."""
        layer = self.model.decoder_layers()[self.config.first_k_dense_replace + request.layer]
        return cast(MoE, layer.mlp).execute(request)

    def set_executor(self, executor: ExpertExecutor) -> None:
        for block in self.moe_blocks:
            block.executor = executor

    def set_routing_override(self, override: RoutingOverride | None) -> None:
        """Replace every MoE layer's routing by `override`'s (None: the routers' own again)."""
        for block in self.moe_blocks:
            block.override = override

    @property
    def routing_key(self) -> int | None:
        """Which routing override the forwards use (None: the routers'); part of graph keys."""
        blocks = self.moe_blocks
        override = blocks[0].override if blocks else None
        return override.key if override is not None else None

    def add_routing_hook(self, hook: RoutingHook) -> Callable[[], None]:
        """Call `hook(moe_layer, ids, weights)` after each MoE layer routes; returns a remover."""
        for block in self.moe_blocks:
            block.hooks.append(hook)

        def remove() -> None:
            for block in self.moe_blocks:
                if hook in block.hooks:
                    block.hooks.remove(hook)

        return remove

    def forward(self, tokens: Tensor, **options: Any) -> Tensor:
        """Logits [B, T - logits_from, V] fp32 for tokens [B, T]: `steps` (same keywords)
        driven through each MoE layer's hooks and executor."""
        return drive(self.steps(tokens, **options), self.execute)

    def steps(
        self,
        tokens: Tensor,
        *,
        start: int = 0,
        cache: KVCache | None = None,
        block_length: int = 32,
        logits_from: int = 0,
        rows: BatchRows | None = None,
    ) -> ForwardSteps:
        """The forward as a generator over tokens [B, T] at absolute positions start...: it
        yields each MoE layer's request, is sent the routed sum [T, H], and returns the logits
        [B, T - logits_from, V] fp32. Whoever drives it decides how experts are computed
        (eagerly through the executor, or as pieces of CUDA graphs: oled.model.graphs).

        Attention is block-causal over blocks of `block_length` absolute positions. With a cache,
        the cache's first `start` positions are the prefix and the new tokens' keys and values are
        written after it (the caller decides how many of them to keep by setting cache.length).
        With `rows`, tokens [1, T] are several sequences' rows side by side (BatchRows), each
        over its own slot of the cache; the logits are those of `rows.logit_rows`, [1, R, V].
        """
        b, t = tokens.shape
        if rows is not None:
            if cache is None:
                raise ValueError("a batched forward needs a KV cache with a slot per sequence")
        elif cache is not None and cache.length != start:
            raise ValueError(f"cache holds {cache.length} tokens but start is {start}")
        elif cache is None and start != 0:
            raise ValueError("without a cache the tokens must start at position 0")
        mask: Mask
        with stage("embedding"):
            if rows is None:
                positions = torch.arange(start, start + t, device=tokens.device)  # [T]
                mask = SequenceBlocks(start, t, block_length, b, tokens.device)
                past: int | BatchRows = start
            else:
                positions, past = rows.positions, rows
                mask = (
                    BlockCausal(rows, block_length)
                    if rows.spans is None
                    else [
                        SequenceBlocks(start, n, block_length, 1, tokens.device)
                        for _, start, n in rows.spans
                    ]
                )  # the padded blocks' rule, or each sequence's
            x = self.model.word_embeddings(tokens)  # [B, T, H]
            cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.decoder_layers()):
            kv = cache.layer(i) if cache is not None else None
            with stage("attention"):
                x = layer.attend(x, self.rotary, cos, sin, kv, past, mask)
            if isinstance(layer.mlp, MoE):
                with stage("routing"):
                    h = layer.post_attention_layernorm(x)
                    request = layer.mlp.route(h)
                routed = yield request
                with stage("shared expert"):
                    x = layer.mlp.add_to(x, request, routed)
            else:
                with stage("dense MLP"):
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
        with stage("lm head"):
            x = x[:, logits_from:] if rows is None else x[:, rows.logit_rows]
            x = self.model.norm(x)
            return self.lm_head(x).float()


def drive(steps: ForwardSteps, routed: Callable[[MoERequest], Tensor]) -> Tensor:
    """Run a forward's steps, answering each MoE request with `routed(request)`; the logits."""
    try:
        request = next(steps)
        while True:
            request = steps.send(routed(request))
    except StopIteration as done:
        return done.value
