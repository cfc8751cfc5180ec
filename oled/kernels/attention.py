"""Block-causal attention of a batched forward's padded query blocks, each over its own KV slot.

A batched forward (oled.model.model.BatchRows) puts several sequences' rows side by side; each
sequence attends over the keys of its own KV-cache slot. The torch path gathers every slot's
keys into a [B, kv, keys, D] copy padded to the longest and masks them with a [B, 1, t_max,
keys] tensor. `ragged_attention` reads each sequence's keys where they lie instead, and only
the keys its query block may see: no gather, no mask tensor, no padded keys.

One program per (query block, sequence, kv head, chunk of that kv head's query heads): the
chunk's heads are stacked with the block's queries into one tile of rows, so each K/V tile it
loads serves all of them. It walks its keys in blocks with an online softmax in fp32 (flash
attention). How many key blocks it walks is read from the tensors (key_len, query_pos), never
from a Python number, so a CUDA graph captured once replays for any positions and lengths: the
grid depends only on the shapes (B, heads, t_max).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from oled.kernels import interpreting, on_device
from oled.kernels.common import dot

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e))
BLOCK_N = 64  # keys per step of the online softmax
MAX_ROWS = 64  # rows (heads x queries) of one program's tile
NUM_WARPS = 4
NUM_STAGES = 3  # software pipelining depth of the key loop


@triton.jit
def _kv_tiles(k_base, v_base, j, end, d, dm, s_k_t, s_v_t):
    """Keys j [BN] of one kv head: K^T [BD, BN] and V [BN, BD], zeros at j >= end."""
    jm = j < end
    k_ptrs = k_base + j[None, :] * s_k_t + d[:, None]  # [BD, BN]
    v_ptrs = v_base + j[:, None] * s_v_t + d[None, :]  # [BN, BD]
    k_tile = tl.load(k_ptrs, mask=dm[:, None] & jm[None, :], other=0.0)
    v_tile = tl.load(v_ptrs, mask=jm[:, None] & dm[None, :], other=0.0)
    return k_tile, v_tile


@triton.jit
def _step(q, k_tile, v_tile, j, limit, m_i, l_i, acc, zeros, qk_scale, IEEE: tl.constexpr):
    """One key block of the online softmax (log2 domain): rows see the keys j < limit; `zeros`
    [R, BN] fp32 starts the scores."""
    s = dot(q, k_tile, zeros, IEEE) * qk_scale  # [R, BN]
    s = tl.where(j[None, :] < limit[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [R]
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
    p = tl.math.exp2(s - m_safe[:, None])  # [R, BN]
    alpha = tl.math.exp2(m_i - m_safe)  # [R]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if not IEEE:
        p = p.to(v_tile.dtype)  # the probabilities in the values' dtype, as flash attention
    return m_new, l_i, dot(p, v_tile, acc * alpha[:, None], IEEE)  # [R, BD]


@triton.jit(do_not_specialize=["t_max", "block_length"])
def _ragged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    slots_ptr,
    key_len_ptr,
    pos_ptr,
    t_max,
    s_max,
    block_length,
    qk_scale,
    s_q_b,
    s_q_h,
    s_q_t,
    s_k_slot,
    s_k_h,
    s_k_t,
    s_v_slot,
    s_v_h,
    s_v_t,
    s_o_b,
    s_o_h,
    s_o_t,
    s_pos_b,
    s_pos_t,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Grid (query blocks, B * KV_HEADS * CHUNKS): rows r of the tile are (head r // BLOCK_M
    of the chunk, query r % BLOCK_M of the block)."""
    CHUNKS: tl.constexpr = (GROUP + HEADS - 1) // HEADS
    pid = tl.program_id(1)
    b = (pid // (KV_HEADS * CHUNKS)).to(tl.int64)
    kvh = ((pid // CHUNKS) % KV_HEADS).to(tl.int64)
    g = (pid % CHUNKS) * HEADS + tl.arange(0, HEADS * BLOCK_M) // BLOCK_M  # [R] head in group
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, HEADS * BLOCK_M) % BLOCK_M  # [R] query
    live = (g < GROUP) & (i < t_max)  # [R]
    head = kvh * GROUP + g  # [R]
    d = tl.arange(0, BLOCK_D)  # [BD]
    dm = d < D
    q_rows = q_ptr + b * s_q_b + head[:, None] * s_q_h + i[:, None] * s_q_t  # [R, 1]
    q = tl.load(q_rows + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)  # [R, BD]

    # Row r sees keys j < limit[r]: its own diffusion block and those before, of its sequence.
    pos = tl.load(pos_ptr + b * s_pos_b + i * s_pos_t, mask=live, other=0)  # [R]
    key_len = tl.minimum(tl.load(key_len_ptr + b), s_max)
    limit = tl.minimum((pos // block_length + 1) * block_length, key_len)  # [R]
    limit = tl.where(live, limit, 0)
    end = tl.max(limit, axis=0)  # the keys this tile reads

    slot = tl.load(slots_ptr + b)
    k_base = k_ptr + slot * s_k_slot + kvh * s_k_h
    v_base = v_ptr + slot * s_v_slot + kvh * s_v_h
    n = tl.arange(0, BLOCK_N)  # [BN]
    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), tl.float32)  # [R] running max
    l_i = tl.zeros([HEADS * BLOCK_M], tl.float32)  # [R] running sum
    acc = tl.zeros([HEADS * BLOCK_M, BLOCK_D], tl.float32)  # [R, BD]
    zeros = tl.zeros([HEADS * BLOCK_M, BLOCK_N], tl.float32)  # [R, BN]
    if INTERPRET:  # a while loop: some interpreters take no tensor bounds in range()
        n0 = 0
        while n0 < end:
            k_tile, v_tile = _kv_tiles(k_base, v_base, n0 + n, end, d, dm, s_k_t, s_v_t)
            m_i, l_i, acc = _step(
                q, k_tile, v_tile, n0 + n, limit, m_i, l_i, acc, zeros, qk_scale, IEEE
            )
            n0 += BLOCK_N
    else:  # range() over a bound read at run time: pipelined, faster than a while loop
        for n0 in range(0, end, BLOCK_N):
            k_tile, v_tile = _kv_tiles(k_base, v_base, n0 + n, end, d, dm, s_k_t, s_v_t)
            m_i, l_i, acc = _step(
                q, k_tile, v_tile, n0 + n, limit, m_i, l_i, acc, zeros, qk_scale, IEEE
            )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [R, BD]: a row without keys -> zeros
    o_rows = out_ptr + b * s_o_b + head[:, None] * s_o_h + i[:, None] * s_o_t  # [R, 1]
    tl.store(
        o_rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None] & dm[None, :]
    )


def _tile(group: int, t_max: int) -> tuple[int, int]:
    """(query heads, queries) of one program's tile: all t_max queries (up to MAX_ROWS), with
    as many of the kv head's query heads as fill MAX_ROWS rows, and at least 16 rows (tl.dot's
    smallest). At LLaDA2.0-mini's shape (4 query heads per kv head) a 32-query decode block
    takes 2 heads: on an H100 that was faster than 4 (fewer programs) or 1 (more K/V reads)."""
    queries = min(triton.next_power_of_2(t_max), MAX_ROWS)
    heads = min(triton.next_power_of_2(group), MAX_ROWS // queries)
    return heads, max(queries, 16 // heads)


def ragged_attention(
    q: Tensor,
    kbuf: Tensor,
    vbuf: Tensor,
    slots: Tensor,
    key_len: Tensor,
    query_pos: Tensor,
    block_length: int,
    scale: float,
) -> Tensor:
    """Attention of padded query blocks q [B, h, t_max, D] over KV-cache slots: sequence b's
    keys and values are kbuf/vbuf [slots, kv_heads, S_max, D] at slot slots[b] ([B] int64).
    Query (b, i) at query_pos[b, i] ([B, t_max] int64) sees key j iff j < key_len[b] ([B]
    int64) and j // block_length <= query_pos[b, i] // block_length (BatchRows.mask); head hh
    reads kv head hh // (h // kv_heads). Returns [B, h, t_max, D] in q's dtype (a view of a
    [B, t_max, h, D] tensor, so the heads' concatenation per row is free); a row without keys
    gives zeros. No host sync; capturable in a CUDA graph.
    """
    nb, heads, t_max, dim = q.shape
    kv_heads = kbuf.shape[1]
    if heads % kv_heads or tuple(kbuf.shape) != tuple(vbuf.shape) or kbuf.shape[3] != dim:
        raise ValueError(
            f"q {tuple(q.shape)} does not attend over kv buffers {tuple(kbuf.shape)}, "
            f"{tuple(vbuf.shape)}"
        )
    if tuple(query_pos.shape) != (nb, t_max) or slots.shape != (nb,) or key_len.shape != (nb,):
        raise ValueError("slots, key_len [B] and query_pos [B, t_max] must match q's B, t_max")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kbuf.stride(-1) != 1 or vbuf.stride(-1) != 1:
        raise ValueError("kbuf and vbuf need a unit last stride")
    out = torch.empty(nb, t_max, heads, dim, dtype=q.dtype, device=q.device)  # [B, t_max, h, D]
    out = out.transpose(1, 2)  # [B, h, t_max, D]
    if nb * t_max == 0:
        return out
    group = heads // kv_heads
    per, block_m = _tile(group, t_max)
    interpret = interpreting()
    grid = (triton.cdiv(t_max, block_m), nb * kv_heads * triton.cdiv(group, per))
    with on_device(q):
        _ragged_attention_kernel[grid](
            q,
            kbuf,
            vbuf,
            out,
            slots,
            key_len,
            query_pos,
            t_max,
            kbuf.shape[2],
            block_length,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            kbuf.stride(0),
            kbuf.stride(1),
            kbuf.stride(2),
            vbuf.stride(0),
            vbuf.stride(1),
            vbuf.stride(2),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            query_pos.stride(0),
            query_pos.stride(1),
            KV_HEADS=kv_heads,
            GROUP=group,
            HEADS=per,
            D=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            IEEE=q.dtype == torch.float32 or interpret,
            INTERPRET=interpret,
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )
    return out
