"""Routed experts: the host-side expert store and the grouped expert computation.

Every path that computes routed experts (all-resident, GPU slot cache, CPU workers) goes through
`expert_pairs`, so the same tokens meet the same kernels and the offloaded runtime computes the
same function as the all-resident model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from oled import kernels
from oled.kernels import cpu
from oled.model.stages import stage

_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


@dataclass
class ExpertStore:
    """All routed experts of a model, per MoE layer one stacked tensor pair.

    w13[l]: [E, 2I, H] (gate rows then up rows), w2[l]: [E, H, I]; one expert is contiguous,
    so moving it is one copy. Lives in host memory (pinned when serving a CUDA device).
    """

    w13: list[Tensor]
    w2: list[Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.w13)

    @property
    def num_experts(self) -> int:
        return self.w13[0].shape[0] if self.w13 else 0

    @property
    def expert_bytes(self) -> int:
        if not self.w13:
            return 0
        return (self.w13[0][0].numel() + self.w2[0][0].numel()) * self.w13[0].element_size()

    @property
    def pinned(self) -> bool:
        return bool(self.w13) and self.w13[0].is_pinned()

    @classmethod
    def empty(
        cls,
        *,
        layers: int,
        experts: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        pin: bool,
        device: torch.device | str = "cpu",
    ) -> ExpertStore:
        def alloc(*shape: int) -> Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=pin, device=device)

        return cls(
            w13=[alloc(experts, 2 * inter, hidden) for _ in range(layers)],
            w2=[alloc(experts, hidden, inter) for _ in range(layers)],
        )

    def to(self, device: torch.device | str) -> ExpertStore:
        """A copy of every expert on `device` (the all-resident configuration)."""
        return ExpertStore(
            w13=[w.to(device, non_blocking=True) for w in self.w13],
            w2=[w.to(device, non_blocking=True) for w in self.w2],
        )


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Grouped GEMM: rows a[offs[g-1]:offs[g]] @ b[g]. a [N, K], b [G, K, M], offs [G] int32.

    Uses `torch._grouped_mm` where this torch and device support it (checked once per device
    type and dtype), else a loop over the groups that have rows. The loop also serves the CPU:
    there `_grouped_mm` runs the same matmul per group but pays for every empty group too (a CPU
    expert's call has 1-2 groups with rows out of 256).
    """
    key = (a.device.type, a.dtype)
    if a.device.type != "cpu" and _GROUPED_MM_OK.get(key, True) and hasattr(torch, "_grouped_mm"):
        try:
            out = torch._grouped_mm(a, b, offs=offs)
            _GROUPED_MM_OK[key] = True
            return out
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_OK[key] = False
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def expert_pairs(x: Tensor, slots: Tensor, weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Weighted outputs of routed (token, expert) pairs computed from a weight table.

    x [T, H]; slots [T, K] int64 row of each pair in the table, -1 for pairs computed elsewhere;
    weights [T, K] fp32; w13 [S, 2I, H]; w2 [S, H, I]. Returns [T, K, H] fp32 with zeros where
    slots < 0. On a GPU: no host sync and static shapes (so CUDA graphs can capture it): one
    sort, a searchsorted for the group offsets, two grouped GEMMs, one scatter; the fused Triton
    kernels of `oled.kernels.moe` compute the same contract (`oled.kernels.fused`). On the CPU:
    `expert_rows`, scattered.
    """
    if kernels.fused(x):
        from oled.kernels.moe import fused_expert_pairs

        with kernels.serial():
            return fused_expert_pairs(x, slots, weights, w13, w2)
    t, k = slots.shape
    if x.device.type == "cpu":
        index, rows = expert_rows(x, slots, weights, w13, w2)
        out = torch.zeros(t * k, x.shape[-1], dtype=torch.float32)
        out[index] = rows
        return out.view(t, k, -1)
    order, grouped = _by_slot(slots, w13.shape[0])
    y = _weighted_mlp(x, order, grouped, k, weights, w13, w2)  # [T*K, H]
    y = torch.where((grouped < w13.shape[0]).unsqueeze(-1), y, 0.0)
    out = torch.empty(t * k, x.shape[-1], dtype=torch.float32, device=x.device)
    out[order] = y
    return out.view(t, k, -1)


def expert_rows(
    x: Tensor,
    slots: Tensor,
    weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    *,
    native: bool = False,
    space: cpu.Space | None = None,
) -> tuple[Tensor, Tensor]:
    """On the CPU, only the pairs this table computes: (index [N] of each pair in the T*K
    flattened pairs, its weighted output [N, H] fp32); the same values as `expert_pairs`.
    A CPU expert's call has a few rows of the T*K, and touching all of them costs milliseconds.
    With `native` (CPU experts beside a GPU: the host as a second link), bf16 experts with at
    most `cpu.MAX_TOKENS` pairs go through the C kernel where `cpu.chosen`: the same rounding
    points, sums in another order; the pairs are then grouped in C, and the outputs are views
    of `space`'s buffers (given, or a new one). Without it (the CPU device's own path) torch
    computes every pair, as the resident model there does.
    """
    if native and cpu.chosen(x, w13, w2):
        w = weights if weights.dtype == torch.float32 else weights.float()
        return _native_rows(x, slots.numpy(), w.numpy(), w13, w2, space or cpu.Space())
    s, k = w13.shape[0], slots.shape[1]
    order, grouped = _by_slot(slots, s)
    n = int(torch.count_nonzero(grouped < s))  # valid pairs sort first
    order, grouped = order[:n], grouped[:n]  # [N]
    return order, _weighted_mlp(x, order, grouped, k, weights, w13, w2)


def _native_rows(
    x: Tensor, slots: np.ndarray, weights: np.ndarray, w13: Tensor, w2: Tensor, space: cpu.Space
) -> tuple[Tensor, Tensor]:
    """`expert_rows` of the pairs at `slots` [T, K] (gate weights [T, K] fp32) through the C
    kernel, but for experts with more than `cpu.MAX_TOKENS` pairs (torch's products are faster
    there): (index [N], rows [N, H] fp32), views of `space`'s outputs."""
    g = cpu.group(slots, weights, w13.shape[0], space)  # its order is the index's buffer
    index, rows = space.outputs(len(g.order), x.shape[-1])  # [N], [N, H]
    if not len(g.order):
        return index, rows
    if g.largest <= cpu.MAX_TOKENS:
        cpu.expert_rows(x, g.experts, g.offs, g.tokens, g.weights, w13, w2, out=rows, space=space)
        return index, rows
    counts = g.counts  # [G]
    small = counts <= cpu.MAX_TOKENS  # [G] experts for the C kernel
    few = np.repeat(small, counts)  # [N] their pairs
    offs = np.concatenate(([0], counts[small].cumsum()))  # [G' + 1]
    part = cpu.expert_rows(
        x, g.experts[small], offs, g.tokens[few], g.weights[few], w13, w2, space=space
    )
    rows[torch.from_numpy(few)] = part
    many = torch.from_numpy(g.order[~few])  # [N - N'] pairs of the large groups (a copy)
    grouped = torch.from_numpy(np.repeat(g.experts[~small], counts[~small]))
    rows[torch.from_numpy(~few)] = _weighted_mlp(
        x, many, grouped, slots.shape[1], torch.from_numpy(weights), w13, w2
    )
    return index, rows


def _by_slot(slots: Tensor, s: int) -> tuple[Tensor, Tensor]:
    """Pairs sorted by slot: (order [T*K] into the flattened pairs, slot of each [T*K]); pairs
    done elsewhere (slot -1) get slot s and sort last, past every group."""
    flat = slots.reshape(-1)  # [T*K]
    flat = torch.where(flat < 0, s, flat)
    order = torch.argsort(flat, stable=True)  # [T*K]
    return order, flat[order]


def _weighted_mlp(
    x: Tensor, order: Tensor, grouped: Tensor, k: int, weights: Tensor, w13: Tensor, w2: Tensor
) -> Tensor:
    """Gate weight x SwiGLU expert of each sorted pair: [N, H] fp32 (N = len(order))."""
    ends = torch.arange(1, w13.shape[0] + 1, device=x.device)  # [S]
    offs = torch.searchsorted(grouped, ends, out_int32=True)  # [S] end of each slot's rows
    xs = x[order // k]  # [N, H] tokens grouped by slot
    h = grouped_mm(xs, w13.transpose(-2, -1), offs)  # [N, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)  # [N, H]
    return y.float() * weights.reshape(-1)[order].unsqueeze(-1)


def combine(pairs: Tensor, dtype: torch.dtype) -> Tensor:
    """Sum the weighted expert outputs over top-k in fp32, then cast: [T, K, H] -> [T, H]
    (one launch where the fused kernels run: oled.kernels.elementwise)."""
    if kernels.fused(pairs):
        from oled.kernels.elementwise import combine_pairs

        with kernels.serial():
            return combine_pairs(pairs, dtype)
    return pairs.sum(dim=1).to(dtype)


class ResidentExperts:
    """Every routed expert on the compute device: the latency floor, and the reference."""

    graph_safe = True  # no host decision: a whole forward can be one CUDA graph

    def __init__(self, store: ExpertStore, device: torch.device | str) -> None:
        self.table = store.to(device)

    def __call__(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        with stage("grouped GEMM"):
            pairs = self.pairs(layer, x, ids, weights)  # [T, K, H] fp32
        pairs = self.gather(pairs)
        with stage("combine"):
            return combine(pairs, x.dtype)

    def pairs(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """The weighted (token, expert) outputs [T, K, H] fp32 of the table's experts."""
        return expert_pairs(x, ids, weights, self.table.w13[layer], self.table.w2[layer])

    def gather(self, pairs: Tensor) -> Tensor:
        """Every pair of the layer, where other executors computed some (here: all are)."""
        return pairs
