"""Fused routed-expert computation: the Triton replacement of `expert_pairs`' grouped GEMMs.

At decode shapes (T=32 tokens, top-8, a 256-slot table, ~30-70 experts used per layer) each used
expert sees 1-32 rows, so the work is bound by reading the used experts' weights from memory.
Four launches, every grid a function of shapes only (no host sync; CUDA-graph capturable):

1. `_rank_kernel`: a stable counting sort of the T*K pairs by slot (rank = pairs with a smaller
   slot, or the same slot and a smaller index): 2 us at T*K=256 where torch's sort of 256 int64
   keys costs 25 us. Past RANK_MAX_PAIRS pairs (prefill) torch's stable sort gives the same
   order. Pairs of slot -1 sort first.
2. `_plan_kernel` (one program): the groups (runs of one slot) of the sorted pairs, compacted:
   their count, first rows and slots.
3. `_gate_up_kernel`: per work item (group, I-tile) the gate and up tiles over H and the
   silu(gate) * up epilogue, written as the activation [P, I] in x.dtype (sorted rows).
4. `_down_kernel`: per work item (group, H-tile) the down projection over I, scaled by each
   pair's weight and stored straight at the pair's original row of the [T*K, H] output (no
   scatter); the slot -1 group writes its rows as zeros.

Kernels 3 and 4 are persistent: a fixed grid of a few programs per multiprocessor walks the
work items of the groups that exist, reading the next item's group while the current one
streams. A grid over every (slot, tile) would start thousands of programs for empty slots,
each a dependent read before it can exit; padding each slot's rows to blocks would need a
second plan pass. One tile holds BLOCK_M=32 rows, so an expert's rows of a 32-token block take
one pass over its weights (more rows loop over further 32-row blocks).

Batch invariance: the tile sizes, warps and stages depend only on H, I and the dtype, never on S,
on the rows per expert or on data; every row of a tile is reduced over the same K order, and
rows do not interact. So a pair's output depends only on its token row, its expert's weights and
its weight, whatever the slot placement, the table size or the other pairs of the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from oled.kernels import interpreting, on_device
from oled.kernels.common import dot, round_bf16

BLOCK_M = 32  # rows of one expert per tile: a whole 32-token decode block in one pass
NUM_WARPS = 4
NUM_STAGES = 3  # software pipelining depth of the K loops
PROGRAMS_PER_SM = (3, 2)  # persistent programs per multiprocessor (gate/up, down): all resident
RANK_BLOCK = (16, 256)  # (pairs ranked per program, pairs compared per step) of the ranking
RANK_MAX_PAIRS = 2048  # above this many pairs torch's sort is cheaper than the O(P^2) ranks
INTERPRET_PROGRAMS = 4  # programs under the Triton interpreter (each runs in turn)
_SM_COUNT: dict[int, int] = {}


@triton.jit
def _rank_kernel(
    slots_ptr, order_ptr, grouped_ptr, P, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr
):
    """Stable counting sort of the pairs by slot: pair i goes to row rank(i) = #pairs before it
    (a smaller slot, or the same slot and a smaller index); order[rank] = i, grouped[rank] = slot."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BI]
    inside = i < P
    si = tl.load(slots_ptr + i, mask=inside, other=0).to(tl.int32)  # [BI]
    rank = tl.zeros((BLOCK_I,), dtype=tl.int32)  # [BI]
    j0 = tl.full([], 0, tl.int32)
    while j0 < P:  # while loops: the interpreter takes no tensor bounds in range()
        j = j0 + tl.arange(0, BLOCK_J)  # [BJ]
        sj = tl.load(slots_ptr + j, mask=j < P, other=1 << 30).to(tl.int32)  # [BJ] pads last
        before = (sj[None, :] < si[:, None]) | (
            (sj[None, :] == si[:, None]) & (j[None, :] < i[:, None])
        )  # [BI, BJ]
        rank += tl.sum(before.to(tl.int32), axis=1)
        j0 += BLOCK_J
    tl.store(order_ptr + rank, i.to(tl.int64), mask=inside)
    tl.store(grouped_ptr + rank, si, mask=inside)


@triton.jit
def _plan_kernel(grouped_ptr, plan_ptr, P, BLOCK: tl.constexpr):
    """The groups (runs of one slot) of the sorted pairs: plan[0] = G; plan[1 + g] = first row
    of group g, plan[1 + G] = P; plan[2 + P + g] = slot of group g."""
    count = tl.full([], 0, tl.int32)
    i0 = tl.full([], 0, tl.int32)
    while i0 < P:
        idx = i0 + tl.arange(0, BLOCK)  # [BLOCK]
        inside = idx < P
        cur = tl.load(grouped_ptr + idx, mask=inside, other=0)  # [BLOCK]
        prev = tl.load(grouped_ptr + idx - 1, mask=inside & (idx > 0), other=-2)  # [BLOCK]
        new = (cur != prev) & inside  # [BLOCK] first row of a group
        gid = count + tl.cumsum(new.to(tl.int32), 0)  # [BLOCK] 1-based group of each row
        tl.store(plan_ptr + gid, idx, mask=new)
        tl.store(plan_ptr + 1 + P + gid, cur.to(tl.int32), mask=new)
        count += tl.sum(new.to(tl.int32), 0)
        i0 += BLOCK
    tl.store(plan_ptr, count)
    tl.store(plan_ptr + 1 + count, P)


@triton.jit
def _group(plan_ptr, P, g):
    """(first row, end row, slot) of group g."""
    return tl.load(plan_ptr + 1 + g), tl.load(plan_ptr + 2 + g), tl.load(plan_ptr + 2 + P + g)


@triton.jit
def _round(v, dtype: tl.constexpr, BF16_BITS: tl.constexpr):
    """fp32 v rounded to dtype (to nearest even), returned as fp32; with BF16_BITS on the bits
    (the interpreter's own fp32 -> bf16 cast truncates)."""
    if BF16_BITS:
        return round_bf16(v)
    return v.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["P", "TOPK"])
def _gate_up_kernel(
    x_ptr,
    order_ptr,
    plan_ptr,
    w13_ptr,
    act_ptr,
    P,
    TOPK,
    H: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """act[r, n] = silu(x[tok] . gate[n]) * (x[tok] . up[n]) for each sorted row r of a slot."""
    N_TILES: tl.constexpr = INTER // BLOCK_N
    dtype = act_ptr.dtype.element_ty
    first = (tl.load(plan_ptr + 2 + P) < 0).to(tl.int32)  # group 0 of slot -1 pairs: skipped
    num_work = (tl.load(plan_ptr) - first) * N_TILES
    rm = tl.arange(0, BLOCK_M)  # [BM]
    rn = tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    last = tl.maximum(num_work - 1, 0)  # next-item reads past the end re-read the last group
    work = tl.program_id(0)
    start, end, slot = _group(plan_ptr, P, first + tl.minimum(work, last) // N_TILES)
    while work < num_work:
        n0 = (work % N_TILES) * BLOCK_N
        expert = w13_ptr + slot.to(tl.int64) * (2 * INTER * H)  # gate rows, then up rows
        gate_ptr = expert + (n0 + rn)[None, :] * H + rk[:, None]  # [BK, BN]
        up_ptr = gate_ptr + INTER * H  # [BK, BN]
        m0 = start
        m_end = end
        work += tl.num_programs(0)  # the next item's group, read while this one streams
        start, end, slot = _group(plan_ptr, P, first + tl.minimum(work, last) // N_TILES)
        while m0 < m_end:
            rows = m0 + rm  # [BM] sorted rows
            live = rows < m_end  # [BM]
            tok = tl.load(order_ptr + rows, mask=live, other=0) // TOPK  # [BM] int64
            x_row = x_ptr + tok[:, None] * H + rk[None, :]  # [BM, BK]
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                a = tl.load(x_row + k0, mask=live[:, None], other=0.0)  # [BM, BK]
                acc_g = dot(a, tl.load(gate_ptr + k0), acc_g, IEEE)  # [BM, BN]
                acc_u = dot(a, tl.load(up_ptr + k0), acc_u, IEEE)  # [BM, BN]
            gate = _round(acc_g, dtype, BF16_BITS)  # [BM, BN] rounded as the GEMM output is
            up = _round(acc_u, dtype, BF16_BITS)  # [BM, BN]
            silu = _round(gate / (1.0 + tl.exp(-gate)), dtype, BF16_BITS)  # [BM, BN]
            act = _round(silu * up, dtype, BF16_BITS)  # [BM, BN]
            out = act_ptr + rows[:, None] * INTER + (n0 + rn)[None, :]  # [BM, BN]
            tl.store(out, act.to(dtype), mask=live[:, None])
            m0 += BLOCK_M


@triton.jit(do_not_specialize=["P", "TOPK"])
def _down_kernel(
    act_ptr,
    order_ptr,
    plan_ptr,
    weights_ptr,
    w2_ptr,
    out_ptr,
    P,
    H: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """out[pair, n] = weight[pair] * (act[r] . down[n]) for each sorted row r; zeros for slot -1."""
    N_TILES: tl.constexpr = H // BLOCK_N
    dtype = act_ptr.dtype.element_ty
    num_work = tl.load(plan_ptr) * N_TILES
    rm = tl.arange(0, BLOCK_M)  # [BM]
    rn = tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    last = num_work - 1  # next-item reads past the end re-read the last group
    work = tl.program_id(0)
    start, end, slot = _group(plan_ptr, P, tl.minimum(work, last) // N_TILES)
    while work < num_work:
        n0 = (work % N_TILES) * BLOCK_N
        expert = w2_ptr + slot.to(tl.int64) * (H * INTER)  # down rows (unread for slot -1)
        down_ptr = expert + (n0 + rn)[None, :] * INTER + rk[:, None]  # [BK, BN]
        m0 = start
        m_end = end
        skip = slot < 0
        work += tl.num_programs(0)  # the next item's group, read while this one streams
        start, end, slot = _group(plan_ptr, P, tl.minimum(work, last) // N_TILES)
        while m0 < m_end:
            rows = m0 + rm  # [BM] sorted rows
            live = rows < m_end  # [BM]
            pair = tl.load(order_ptr + rows, mask=live, other=0)  # [BM] original index
            out = out_ptr + pair[:, None] * H + (n0 + rn)[None, :]  # [BM, BN]
            if skip:
                tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), mask=live[:, None])
            else:
                a_row = act_ptr + rows[:, None] * INTER + rk[None, :]  # [BM, BK]
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, INTER, BLOCK_K):
                    a = tl.load(a_row + k0, mask=live[:, None], other=0.0)  # [BM, BK]
                    acc = dot(a, tl.load(down_ptr + k0), acc, IEEE)  # [BM, BN]
                wt = tl.load(weights_ptr + pair, mask=live, other=0.0)  # [BM] fp32
                y = _round(acc, dtype, BF16_BITS) * wt[:, None]  # [BM, BN]
                tl.store(out, y, mask=live[:, None])
            m0 += BLOCK_M


def _tile(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n (n a multiple of 16)."""
    t = cap
    while n % t:
        t //= 2
    return t


def _tiles(h: int, inter: int, wide: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N over I, BLOCK_K over H) of the gate/up kernel, (BLOCK_N over H, BLOCK_K over I)
    of the down kernel: functions of the shape and the element width only. 16 KB of weights
    per pipeline stage (gate/up: 2 x 64 x 64, down: 128 x 64 in bf16/fp16), fp32 half as deep."""
    bk = 32 if wide else 64
    return _tile(inter, 64), _tile(h, bk), _tile(h, 128), _tile(inter, bk)


def _programs(device: torch.device, work: int, per_sm: int) -> int:
    """Persistent grid size: a fixed number of programs per multiprocessor, capped by the work."""
    if device.type != "cuda":
        return max(1, min(work, INTERPRET_PROGRAMS))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(work, _SM_COUNT[index] * per_sm))


def fused_expert_pairs(
    x: Tensor, slots: Tensor, weights: Tensor, w13: Tensor, w2: Tensor
) -> Tensor:
    """Same contract as oled.model.experts.expert_pairs: x [T, H]; slots [T, K] int64 (row of
    each pair in the table, -1 = pair computed elsewhere -> zeros); weights [T, K] fp32; w13
    [S, 2I, H] (gate rows then up rows); w2 [S, H, I]. Returns [T, K, H] fp32.

    No host sync and launch grids from shapes only, so CUDA graphs can capture it. Tiles depend
    on H, I and dtype only (see the module docstring), so each pair's row is batch invariant.
    """
    t, k = slots.shape
    h = x.shape[-1]
    inter = w2.shape[-1]
    assert h % 16 == 0 and inter % 16 == 0, "H and I must be multiples of 16"
    assert w13.shape[1:] == (2 * inter, h) and w2.shape[1:] == (h, inter)
    assert x.dtype == w13.dtype == w2.dtype
    p = t * k
    x = x.contiguous()  # [T, H]
    w13 = w13.contiguous()  # [S, 2I, H]
    w2 = w2.contiguous()  # [S, H, I]
    wts = weights.reshape(-1).to(torch.float32).contiguous()  # [P]
    if p <= RANK_MAX_PAIRS:  # one launch, and no sort's several
        order = torch.empty(p, dtype=torch.int64, device=x.device)  # [P] pair of each row
        grouped = torch.empty(p, dtype=torch.int32, device=x.device)  # [P] slot of each row
    plan = torch.empty(2 * p + 3, dtype=torch.int32, device=x.device)  # groups: _plan_kernel
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)  # [P, I] sorted rows
    out = torch.empty(p, h, dtype=torch.float32, device=x.device)  # [P, H]

    interpret = interpreting()
    ieee = x.dtype == torch.float32 or interpret  # the interpreter's bf16 dots are wrong
    bf16_bits = interpret and x.dtype == torch.bfloat16
    max_groups = min(w13.shape[0] + 1, p)
    bn1, bk1, bn2, bk2 = _tiles(h, inter, x.element_size() >= 4)
    flags = dict(
        BLOCK_M=BLOCK_M, IEEE=ieee, BF16_BITS=bf16_bits, num_warps=NUM_WARPS, num_stages=NUM_STAGES
    )
    with on_device(x):
        flat = slots.reshape(-1)  # [P]
        if p <= RANK_MAX_PAIRS:
            bi, bj = RANK_BLOCK
            _rank_kernel[(triton.cdiv(p, bi),)](flat, order, grouped, p, BLOCK_I=bi, BLOCK_J=bj)
        else:  # many pairs (prefill): the same stable order from torch's sort
            grouped, order = torch.sort(flat, stable=True)
        _plan_kernel[(1,)](grouped, plan, p, BLOCK=min(triton.next_power_of_2(p), 1024))
        grid = (_programs(x.device, max_groups * (inter // bn1), PROGRAMS_PER_SM[0]),)
        _gate_up_kernel[grid](
            x, order, plan, w13, act, p, k, H=h, INTER=inter, BLOCK_N=bn1, BLOCK_K=bk1, **flags
        )
        grid = (_programs(x.device, max_groups * (h // bn2), PROGRAMS_PER_SM[1]),)
        _down_kernel[grid](
            act, order, plan, wts, w2, out, p, H=h, INTER=inter, BLOCK_N=bn2, BLOCK_K=bk2, **flags
        )
    return out.view(t, k, h)
