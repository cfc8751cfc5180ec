"""RMSNorm and the attention's q/k RMSNorm + partial rotary + KV-cache write, as Triton kernels.

Both follow the torch code in oled.model.layers rounding for rounding: they compute in fp32 and
round to the model dtype exactly where the eager torch ops produce a model-dtype tensor. The
rounding to bf16 is done on the bits (round to nearest even) so that the Triton CPU interpreter,
whose float casts truncate, gives the same results as the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from oled.kernels.common import ROUNDING, round_to


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    eps,
    inv_d,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    X_ROUND: tl.constexpr,
    OUT_ROUND: tl.constexpr,
):
    """One program per row: out = w * round_x(x * rsqrt(mean(x^2) + eps))."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dm = d < D
    x = tl.load(x_ptr + row * x_row_stride + d, mask=dm, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_d + eps)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    y = round_to(w * round_to(x * r, X_ROUND), OUT_ROUND)
    tl.store(out_ptr + row * out_row_stride + d, y.to(out_ptr.dtype.element_ty), mask=dm)


def _warps(block: int) -> int:
    """Warps for a one-row program of `block` elements: 1 up to 256 elements, at most 8."""
    return max(1, min(8, block // 256))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Same result as oled.model.layers.RMSNorm: weight * (x.float() * rsqrt(mean(x.float()**2)
    + eps)).to(x.dtype), over the last dim; any leading shape.

    The output dtype is torch's promotion of weight's and x's dtypes, as in the torch module.
    The mean's summation order differs from torch's, so rare elements may differ by one unit
    in the last place of the output dtype; everything after the mean rounds as torch does.
    """
    d = x.shape[-1]
    rows = x.reshape(-1, d)  # [N, D]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)  # [N, D]
    if rows.shape[0] == 0:
        return out.view(x.shape)
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        weight,
        out,
        rows.stride(0),
        out.stride(0),
        eps,
        1.0 / d,
        D=d,
        BLOCK_D=block,
        X_ROUND=ROUNDING[x.dtype],
        OUT_ROUND=ROUNDING[out_dtype],
        num_warps=_warps(block),
        enable_fp_fusion=False,
    )
    return out.view(x.shape)


@triton.jit
def _normed(row_ptr, w_ptr, offs, mask, r, ROUND: tl.constexpr):
    """RMSNorm of a head's elements at offs, given its inverse rms r: round(w * round(x * r))."""
    x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_to(w * round_to(x * r, ROUND), ROUND)


@triton.jit
def _norm_rotary_head(
    row_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    cs_d_stride,
    eps,
    inv_d,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROT: tl.constexpr,
    ROUND: tl.constexpr,
):
    """One head [BLOCK_D] fp32: RMSNorm over D, then rotate-half rotary on the first ROT dims."""
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dm = d < D
    x = tl.load(row_ptr + d, mask=dm, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_d + eps)
    n = _normed(row_ptr, w_ptr, d, dm, r, ROUND)  # [BLOCK_D]
    if ROT > 0:
        half: tl.constexpr = ROT // 2
        rm = d < ROT
        first = d < half
        partner = tl.where(first, d + half, d - half)  # rotate_half's source index
        p = _normed(row_ptr, w_ptr, partner, rm, r, ROUND)
        rotated = tl.where(first, -p, p)
        c = tl.load(cos_ptr + d * cs_d_stride, mask=rm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + d * cs_d_stride, mask=rm, other=0.0).to(tl.float32)
        o = round_to(round_to(n * c, ROUND) + round_to(rotated * s, ROUND), ROUND)
        n = tl.where(rm, o, n)
    return n


@triton.jit(do_not_specialize=["T"])  # one compiled kernel for every token count
def _qk_norm_rotary_kernel(
    qkv_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    pos_ptr,
    T,
    s_qkv_b,
    s_qkv_t,
    s_q_b,
    s_q_h,
    s_q_t,
    s_k_b,
    s_k_h,
    s_k_t,
    s_v_b,
    s_v_h,
    s_v_t,
    s_cs_t,
    s_cs_d,
    eps,
    inv_d,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROT: tl.constexpr,
    ROUND: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Grid (B*T, HEADS + 2*KV_HEADS): one program per token and head of the fused projection.
    With ROWS, token t's key and value go to slot slot[t], position pos[t] of k/v (B = 1)."""
    bt = tl.program_id(0)
    hid = tl.program_id(1)
    b = (bt // T).to(tl.int64)
    t = (bt % T).to(tl.int64)
    if ROWS:
        kv_b = tl.load(slot_ptr + t).to(tl.int64)
        kv_t = tl.load(pos_ptr + t).to(tl.int64)
    else:
        kv_b, kv_t = b, t
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dm = d < D
    row_ptr = qkv_ptr + b * s_qkv_b + t * s_qkv_t + hid * D  # this head's D elements
    cos_row, sin_row = cos_ptr + t * s_cs_t, sin_ptr + t * s_cs_t
    if hid < HEADS:
        y = _norm_rotary_head(
            row_ptr, qw_ptr, cos_row, sin_row, s_cs_d, eps, inv_d, D, BLOCK_D, ROT, ROUND
        )
        out = q_ptr + b * s_q_b + hid * s_q_h + t * s_q_t
        tl.store(out + d, y.to(q_ptr.dtype.element_ty), mask=dm)
    elif hid < HEADS + KV_HEADS:
        y = _norm_rotary_head(
            row_ptr, kw_ptr, cos_row, sin_row, s_cs_d, eps, inv_d, D, BLOCK_D, ROT, ROUND
        )
        out = k_ptr + kv_b * s_k_b + (hid - HEADS) * s_k_h + kv_t * s_k_t
        tl.store(out + d, y.to(k_ptr.dtype.element_ty), mask=dm)
    else:
        v = tl.load(row_ptr + d, mask=dm, other=0.0)
        out = v_ptr + kv_b * s_v_b + (hid - HEADS - KV_HEADS) * s_v_h + kv_t * s_v_t
        tl.store(out + d, v.to(v_ptr.dtype.element_ty), mask=dm)


def qk_norm_rotary(
    qkv: Tensor,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: Tensor,
    k_weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    rotary_dim: int,
    k_out: Tensor,
    v_out: Tensor,
    rows: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """qkv [B, T, (heads + 2 kv_heads) * head_dim] (the fused projection output) -> q [B, heads,
    T, head_dim] normed and rotated; writes the normed, rotated keys into k_out [B, kv_heads, T,
    head_dim] and the values into v_out (same shape). k_out/v_out may be strided views into a
    larger KV cache buffer, e.g. kbuf[:, :, past:past+T] of a [B, kv, S_max, D] tensor, so use
    their strides. cos, sin: [T, rotary_dim] in x's dtype, as Rotary.cos_sin returns.

    With `rows` (slots [T], positions [T] int64; B = 1: a batched forward's rows), k_out and
    v_out are whole cache buffers [slots, kv_heads, S_max, head_dim] and token t's key and
    value go to slot slots[t] at position positions[t] (no separate scatter).

    One launch for q, k and v. Computes as Attention.forward does with weights in qkv's dtype:
    after each head's mean of squares (summed in another order than torch's, so rare elements
    may differ by one unit in the last place) every step rounds to qkv's dtype where torch's
    does, and the rotary is bit-identical to Rotary.apply on the same normed values.
    """
    b, t, width = qkv.shape
    if width != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"qkv width {width} is not (heads + 2 kv_heads) * head_dim")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim")
    for name, out in (("k_out", k_out), ("v_out", v_out)):
        if rows is not None:
            if b != 1 or out.dim() != 4 or tuple(out.shape[1::2]) != (kv_heads, head_dim):
                raise ValueError(f"with rows, {name} must be [slots, kv_heads, S_max, head_dim]")
        elif tuple(out.shape) != (b, kv_heads, t, head_dim):
            raise ValueError(f"{name} must be [B, kv_heads, T, head_dim]")
        if out.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")
    if rows is not None and any(r.shape != (t,) for r in rows):
        raise ValueError(f"rows must be two tensors [T] of T = {t} slots and positions")
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(b, heads, t, head_dim, dtype=qkv.dtype, device=qkv.device)  # [B, h, T, D]
    if b * t == 0:
        return q
    if rotary_dim > 0 and (cos.stride(-1) != sin.stride(-1) or cos.stride(0) != sin.stride(0)):
        cos, sin = cos.contiguous(), sin.contiguous()
    _qk_norm_rotary_kernel[(b * t, heads + 2 * kv_heads)](
        qkv,
        q,
        k_out,
        v_out,
        q_weight,
        k_weight,
        cos,
        sin,
        *(rows if rows is not None else (q, q)),  # slots, positions (unread without rows)
        t,
        qkv.stride(0),
        qkv.stride(1),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_out.stride(0),
        k_out.stride(1),
        k_out.stride(2),
        v_out.stride(0),
        v_out.stride(1),
        v_out.stride(2),
        cos.stride(0),
        cos.stride(-1),
        eps,
        1.0 / head_dim,
        HEADS=heads,
        KV_HEADS=kv_heads,
        D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        ROT=rotary_dim,
        ROUND=ROUNDING[qkv.dtype],
        ROWS=rows is not None,
        num_warps=_warps(triton.next_power_of_2(head_dim)),
        enable_fp_fusion=False,
    )
    return q
