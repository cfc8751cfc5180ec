"""Pieces every Triton kernel here shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # dtype -> `round_to` mode


@triton.jit
def round_bf16(x):
    """fp32 x rounded to bf16 (to nearest even) on the bits, kept in fp32: the Triton
    interpreter's own fp32 -> bf16 cast truncates, so interpreted and GPU runs agree."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def expf(x, INTERPRET: tl.constexpr):
    """e^x as CUDA's expf (torch's sigmoid and silu kernels call it); the interpreter has no
    libdevice, so there tl.exp."""
    if INTERPRET:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def round_to(x, ROUND: tl.constexpr):
    """fp32 x rounded to the model dtype (ROUNDING: 0 fp32, 1 bf16, 2 fp16), kept in fp32."""
    if ROUND == 1:
        y = round_bf16(x)
    elif ROUND == 2:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b with fp32 accumulation; in IEEE mode on fp32 operands in full fp32 (no TF32;
    the interpreter's bf16 dots are wrong)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)
