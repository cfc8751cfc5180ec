"""Routed experts as trainable parameters, computed with grouped GEMMs (a loop elsewhere)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.types import Device

from oled.model.config import ModelConfig


class TrainExperts:
    """Routed experts as trainable parameters: w13 [E, 2I, H], w2 [E, H, I] per MoE layer.

    Not an nn.Module, so that attaching it to the MoE blocks does not register it there.
    Plugged in as the MoE executor; computes sum_k w_k * expert(x) over (token, expert) pairs
    sorted by expert: on a GPU two grouped GEMMs (`torch._grouped_mm`, with autograd) and no
    Python loop over experts; elsewhere the same contract per group. Counts each expert's load
    (on the device, no host sync) for the balancing rule.
    """

    graph_safe = False  # (ExpertExecutor) training runs eagerly

    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        out_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
        layers = range(cfg.num_moe_layers)
        self.w13 = [torch.randn(e, 2 * i, h, generator=gen) * 0.02 for _ in layers]
        self.w2 = [torch.randn(e, h, i, generator=gen) * out_std for _ in layers]
        self.load = torch.zeros(cfg.num_moe_layers, e)

    def to(self, device: Device) -> TrainExperts:
        self.w13 = [nn.Parameter(w.detach().to(device)) for w in self.w13]
        self.w2 = [nn.Parameter(w.detach().to(device)) for w in self.w2]
        self.load = self.load.to(device)
        return self

    def parameters(self) -> list[Tensor]:
        return [*self.w13, *self.w2]

    def __call__(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        t, k = ids.shape
        e = self.load.shape[1]
        flat = ids.reshape(-1)  # [T*K]
        counts = torch.bincount(flat, minlength=e)  # [E]
        self.load[layer] += counts.to(self.load.dtype)
        order = torch.argsort(flat, stable=True)  # [T*K] pairs grouped by expert
        offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] end of each expert's rows
        token = order // k  # [T*K] token of each sorted pair
        dtype = torch.bfloat16 if x.is_cuda else x.dtype
        xs = x[token].to(dtype)  # [T*K, H]
        w13 = self.w13[layer].to(dtype).transpose(-2, -1)  # [E, H, 2I]
        g, u = train_grouped_mm(xs, w13, offs).chunk(2, dim=-1)  # [T*K, I] each
        w2 = self.w2[layer].to(dtype).transpose(-2, -1)  # [E, I, H]
        y = train_grouped_mm(F.silu(g) * u, w2, offs)  # [T*K, H]
        y = y.float() * weights.reshape(-1)[order][:, None]  # [T*K, H] fp32
        out = torch.zeros(t, x.shape[-1], dtype=torch.float32, device=x.device)
        out = out.index_add(0, token, y)
        return out.to(x.dtype)


def train_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """a [N, K] rows grouped by `offs` [G] (ends) times b [G, K, M], differentiable.

    CUDA: `torch._grouped_mm` (bf16; its backward is two grouped GEMMs). Elsewhere a matmul per
    group with rows (CPU training and tests only)."""
    if a.is_cuda and grouped_mm_trains(a.device):
        return torch._grouped_mm(a, b, offs=offs)
    outs, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            outs.append(a[start:end] @ b[g])
        start = end
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[-1])


_GROUPED_OK: dict[str, bool] = {}


def grouped_mm_trains(device: torch.device) -> bool:
    """Whether this torch's `_grouped_mm` runs forward and backward on `device` (checked once;
    without it training falls back to a matmul per expert, much slower, and says so)."""
    key = str(device)
    if key not in _GROUPED_OK:
        try:
            a = torch.randn(32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(2, 32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
            offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
            torch._grouped_mm(a, w.transpose(-2, -1), offs=offs).sum().backward()
            _GROUPED_OK[key] = True
        except (AttributeError, RuntimeError, NotImplementedError) as e:
            print(f"warning: torch._grouped_mm cannot train here ({e}); one matmul per expert")
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]
