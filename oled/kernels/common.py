"""Pieces every Triton kernel here shares."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 x rounded to bf16 (to nearest even) on the bits, kept in fp32: the Triton
    interpreter's own fp32 -> bf16 cast truncates, so interpreted and GPU runs agree."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
