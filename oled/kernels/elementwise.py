"""The small steps around a layer's GEMMs, each one launch instead of two or three torch ops:
SwiGLU's silu(gate) * up, the MoE layer's residual + (routed + shared), and the routed pairs'
sum over top-k.

`silu_mul` and `residual_add` round where torch's ops produce a model-dtype tensor and compute
silu as torch's kernel does (IEEE 1 / (1 + expf(-x))), so on a GPU they equal the torch ops bit
for bit. `combine_pairs` sums the K pairs of a row in order 0..K-1, in fp32, then rounds:
another order than torch's reduction, so it agrees with `pairs.sum(1)` to rounding; every row
is summed alike whatever the batch (a row's result does not depend on the other rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from oled.kernels import interpreting
from oled.kernels.common import ROUNDING, expf, round_to

BLOCK = 1024  # elements per program of the elementwise kernels


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, N, ROUND: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr
):
    """out = round(round(silu(gate)) * up) over N elements."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m = i < N
    g = tl.load(gate_ptr + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + i, mask=m, other=0.0).to(tl.float32)
    silu = round_to(tl.math.div_rn(g, 1.0 + expf(-g, INTERPRET)), ROUND)  # as torch's silu
    tl.store(out_ptr + i, round_to(silu * u, ROUND).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _residual_add_kernel(x_ptr, a_ptr, b_ptr, out_ptr, N, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """out = round(x + round(a + b)) over N elements."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m = i < N
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + i, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + i, mask=m, other=0.0).to(tl.float32)
    y = round_to(x + round_to(a + b, ROUND), ROUND)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_kernel(
    pairs_ptr, out_ptr, H, K: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr
):
    """Grid (T, cdiv(H, BLOCK)): out[t, h] = round(sum over k in order of pairs[t, k, h])."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    m = h < H
    row = pairs_ptr + t * K * H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(row + k * H + h, mask=m, other=0.0)
    tl.store(out_ptr + t * H + h, round_to(acc, ROUND).to(out_ptr.dtype.element_ty), mask=m)


def _flat_grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """F.silu(gate) * up in gate's dtype (gate and up of one shape and dtype)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if out.numel():
        _silu_mul_kernel[_flat_grid(out.numel())](
            gate,
            up,
            out,
            out.numel(),
            ROUND=ROUNDING[gate.dtype],
            BLOCK=BLOCK,
            INTERPRET=interpreting(),  # the interpreter has no libdevice
            enable_fp_fusion=False,
        )
    return out


def residual_add(x: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """x + (a + b), as torch computes it in x's dtype (all three of one shape and dtype)."""
    if not (x.shape == a.shape == b.shape) or not (x.dtype == a.dtype == b.dtype):
        raise ValueError(f"x {tuple(x.shape)}, a {tuple(a.shape)} and b {tuple(b.shape)} differ")
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    out = torch.empty_like(x)
    if out.numel():
        _residual_add_kernel[_flat_grid(out.numel())](
            x, a, b, out, out.numel(), ROUND=ROUNDING[x.dtype], BLOCK=BLOCK, enable_fp_fusion=False
        )
    return out


def combine_pairs(pairs: Tensor, dtype: torch.dtype) -> Tensor:
    """Weighted expert outputs [T, K, H] fp32 summed over K in fp32, then cast: [T, H] dtype."""
    if pairs.dim() != 3 or pairs.dtype != torch.float32:
        raise ValueError(f"pairs must be [T, K, H] fp32, not {tuple(pairs.shape)} {pairs.dtype}")
    t, k, h = pairs.shape
    pairs = pairs.contiguous()
    out = torch.empty(t, h, dtype=dtype, device=pairs.device)  # [T, H]
    if out.numel():
        _combine_kernel[(t, triton.cdiv(h, BLOCK))](
            pairs, out, h, K=k, ROUND=ROUNDING[dtype], BLOCK=BLOCK, enable_fp_fusion=False
        )
    return out
