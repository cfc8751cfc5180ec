"""LLaDA2's group-limited sigmoid routing after the router GEMM, in one Triton kernel.

The GEMM is the reference's own (`oled.model.layers.router_logits`, fp32 cuBLAS), so the logits
are bit-identical and the expert choice cannot flip at near-ties; a GEMV per token row inside
the kernel would stream the whole router weight once per row from L2 on only T SMs (T=32 at
decode), no faster than cuBLAS plus one launch. Everything after it (sigmoid, bias, group
scores, group choice, top-k, gather, normalisation, scaling) is one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from oled.kernels import interpreting
from oled.kernels.common import expf


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    logits_row_stride,
    scale,
    E: tl.constexpr,
    GROUP: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_EG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORMALISE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One program per token row: logits [E] -> ids [K], weights [K]."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)  # [G]
    j = tl.arange(0, BLOCK_EG)  # [E/G]
    e = g[:, None] * GROUP + j[None, :]  # [G, E/G] expert ids
    valid = (g[:, None] < N_GROUP) & (j[None, :] < GROUP)  # [G, E/G]
    logit = tl.load(logits_ptr + row * logits_row_stride + e, mask=valid, other=0.0)
    ex = expf(-logit, INTERPRET)  # as torch.sigmoid's kernel
    one = tl.full([BLOCK_G, BLOCK_EG], 1.0, tl.float32)
    scores = tl.math.div_rn(one, 1.0 + ex)  # [G, E/G]: IEEE 1 / (1 + e^-x), as torch
    bias = tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    biased = tl.where(valid, scores + bias, float("-inf"))  # [G, E/G]

    # Group score: the sum of each group's two best biased scores.
    best = tl.max(biased, axis=1)  # [G]
    first = tl.min(tl.where(biased == best[:, None], j[None, :], BLOCK_EG), axis=1)  # [G]
    second = tl.max(tl.where(j[None, :] == first[:, None], float("-inf"), biased), axis=1)
    group_score = best + second  # [G]

    # Keep the TOPK_GROUP best groups: a group's rank counts the groups ahead of it.
    gs_row, gs_col = group_score[None, :], group_score[:, None]  # [1, G] others, [G, 1] mine
    ahead = (gs_row > gs_col) | ((gs_row == gs_col) & (g[None, :] < g[:, None]))  # [G, G]
    rank = tl.sum(ahead.to(tl.int32), axis=1)  # [G]
    keep = (rank < TOPK_GROUP) & (g < N_GROUP)  # [G]
    cand = tl.where(keep[:, None] & valid, biased, float("-inf"))  # [G, E/G]

    # Top K by biased score, ties to the lower expert id; gate weights are unbiased scores.
    k = tl.arange(0, BLOCK_K)  # [K]
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(K):
        top = tl.max(cand)
        chosen = tl.min(tl.where(cand == top, e, E))
        hit = e == chosen  # [G, E/G]
        w = tl.sum(tl.where(hit, scores, 0.0))
        ids = tl.where(k == i, chosen, ids)
        weights = tl.where(k == i, w, weights)
        cand = tl.where(hit, float("-inf"), cand)
    if NORMALISE:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scale
    km = k < K
    tl.store(ids_ptr + row * K + k, ids.to(tl.int64), mask=km)
    tl.store(weights_ptr + row * K + k, weights, mask=km)


def select_experts(
    logits: Tensor,
    bias: Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    scale: float,
    normalise: bool,
) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] fp32 -> (ids [T, K] int64, weights [T, K] fp32), as `route` after
    its GEMM. ids come in descending biased-score order with ties broken by the lower expert id
    (torch.topk leaves the order of ties unspecified); kept groups are chosen the same way.
    Needs E divisible by n_group and at least top_k experts in the kept groups. No host sync;
    capturable in a CUDA graph.
    """
    t, e = logits.shape
    if e % n_group or e // n_group < 2:
        raise ValueError(f"{e} experts do not split into {n_group} groups of at least 2")
    if not 0 < topk_group <= n_group or not 0 < top_k <= topk_group * (e // n_group):
        raise ValueError(f"cannot pick {top_k} experts from {topk_group} of {n_group} groups")
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)  # [T, K]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)  # [T, K]
    if t == 0:
        return ids, weights
    _route_kernel[(t,)](
        logits,
        bias,
        ids,
        weights,
        logits.stride(0),
        scale,
        E=e,
        GROUP=e // n_group,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        K=top_k,
        BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_EG=triton.next_power_of_2(e // n_group),
        BLOCK_K=triton.next_power_of_2(top_k),
        NORMALISE=normalise,
        INTERPRET=interpreting(),  # the interpreter has no libdevice
        num_warps=1,
        enable_fp_fusion=False,
    )
    return ids, weights
