"""The GPU decoders of encoded expert rows (oled.model.codec holds the format and the torch
reference they match bit for bit; oled.kernels.codec_format the header's numbers).

One launch decodes a list of rows: a descriptor [1 + 2M] int64 holds the count of rows, then
per row the byte offset of its encoded source and of its bf16 destination, both from one base
address. Sources and destinations may lie in different allocations (a landing buffer, a layer's
slot table, the stage), so the offsets are plain address differences. The grid is fixed,
(most rows, most chunks per row), and programs past the count or past a row's end return at
once: the launch can be captured as a CUDA graph once and replayed for any list (the offload
engine's copies, from Python or from C).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from oled.kernels import codec_format as layout
from oled.kernels.codec_format import CHUNK, FP8, INT4, LOSSLESS
from oled.kernels.common import round_bf16

# the format's offsets, as constants a kernel may read
HEADER = tl.constexpr(layout.HEADER)
PRIMARY_BOOK = tl.constexpr(layout.PRIMARY_BOOK)
SECONDARY_BOOK = tl.constexpr(layout.SECONDARY_BOOK)


@triton.jit
def _row(desc_ptr, base_ptr, BLOCK: tl.constexpr):
    """This program's row and chunk: (whether there is work, the encoded source, the bf16
    destination, the source's header words, its weights n, the chunk's first weight)."""
    item = tl.program_id(0)
    listed = item < tl.load(desc_ptr)
    # rows and their sections start 16-byte aligned (oled.model.codec, EncodedCopies)
    src_off = tl.multiple_of(tl.load(desc_ptr + 1 + 2 * item, mask=listed, other=0), 16)
    dst_off = tl.multiple_of(tl.load(desc_ptr + 2 + 2 * item, mask=listed, other=0), 16)
    src = base_ptr + src_off
    dst = (base_ptr + dst_off).to(tl.pointer_type(tl.int16))
    words = src.to(tl.pointer_type(tl.int32))
    n = tl.load(words + 1, mask=listed, other=0)
    start = tl.program_id(1) * BLOCK
    return listed & (start < n), src, dst, words, n, start


@triton.jit
def _lossless_kernel(desc_ptr, base_ptr, BLOCK: tl.constexpr):
    """One chunk of BLOCK weights of one row per program."""
    live, src, dst, words, n, start = _row(desc_ptr, base_ptr, BLOCK)
    if live:
        chunk = tl.program_id(1)
        p_off = tl.multiple_of(tl.load(words + 2), 16)
        c_off = tl.multiple_of(tl.load(words + 3), 16)
        s_off = tl.multiple_of(tl.load(words + 4), 16)
        x_off = tl.multiple_of(tl.load(words + 5), 16)
        sec_start = tl.load(words + c_off // 4 + 2 * chunk)
        esc_start = tl.load(words + c_off // 4 + 2 * chunk + 1)
        w = start + tl.arange(0, BLOCK)  # [BLOCK]
        m = w < n
        sm = tl.load(src + HEADER + w, mask=m, other=0).to(tl.int32)
        quad = tl.load(src + p_off + (w >> 2), mask=m, other=0).to(tl.int32)
        primary = (quad >> (2 * (w & 3))) & 3
        is_sec = (primary == 3) & m
        sec_i = is_sec.to(tl.int32)
        bit = 3 * (tl.cumsum(sec_i, 0) - sec_i + sec_start)
        lo = tl.load(src + s_off + (bit >> 3), mask=is_sec, other=0).to(tl.int32)
        hi = tl.load(src + s_off + (bit >> 3) + 1, mask=is_sec, other=0).to(tl.int32)
        secondary = ((lo | (hi << 8)) >> (bit & 7)) & 7
        is_esc = is_sec & (secondary == 7)
        esc_i = is_esc.to(tl.int32)
        esc_rank = tl.cumsum(esc_i, 0) - esc_i + esc_start
        escaped = tl.load(src + x_off + esc_rank, mask=is_esc, other=0).to(tl.int32)
        p_val = tl.load(src + PRIMARY_BOOK + primary, mask=m & ~is_sec, other=0)
        s_val = tl.load(src + SECONDARY_BOOK + secondary, mask=is_sec & ~is_esc, other=0)
        exponent = tl.where(
            is_esc, escaped, tl.where(is_sec, s_val.to(tl.int32), p_val.to(tl.int32))
        )
        u = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
        tl.store(dst + w, u.to(tl.int16), mask=m)


@triton.jit
def _scaled_row(words, n, start, BLOCK: tl.constexpr):
    """An fp8 or int4 row's (weights per scale, scales offset, codes offset) and this chunk's
    weights [BLOCK] with their mask."""
    per = tl.load(words + 2)
    s_off = tl.multiple_of(tl.load(words + 3), 16)
    d_off = tl.multiple_of(tl.load(words + 4), 16)
    w = start + tl.arange(0, BLOCK)  # [BLOCK]
    return per, s_off, d_off, w, w < n


@triton.jit
def _store_scaled(dst, src, s_off, per, w, m, value):
    """Weights `w` ([BLOCK]): `value` (fp32) times its run's scale, rounded to bf16."""
    scale = tl.load((src + s_off).to(tl.pointer_type(tl.float32)) + w // per, mask=m)
    bits = round_bf16(value * scale).to(tl.uint32, bitcast=True) >> 16
    tl.store(dst + w, bits.to(tl.int16), mask=m)


@triton.jit
def _fp8_kernel(desc_ptr, base_ptr, BLOCK: tl.constexpr):
    """One chunk of BLOCK weights of one row per program."""
    live, src, dst, words, n, start = _row(desc_ptr, base_ptr, BLOCK)
    if live:
        cols, s_off, d_off, w, m = _scaled_row(words, n, start, BLOCK)
        q = tl.load(src + d_off + w, mask=m, other=0).to(tl.int32)
        sign = (q >> 7) & 1
        e = (q >> 3) & 0xF
        mant = q & 7
        normal = ((e + 120) << 23) | (mant << 20)  # e4m3 bias 7 -> fp32 bias 127
        value = tl.where(
            e > 0, normal.to(tl.float32, bitcast=True), mant.to(tl.float32) * 0.001953125
        )  # m * 2^-9
        # the sign as a bit (negating would turn a -0 into +0 on the device)
        signed = value.to(tl.uint32, bitcast=True) | (sign.to(tl.uint32) << 31)
        _store_scaled(dst, src, s_off, cols, w, m, signed.to(tl.float32, bitcast=True))


@triton.jit
def _int4_kernel(desc_ptr, base_ptr, BLOCK: tl.constexpr):
    """One chunk of BLOCK weights of one row per program."""
    live, src, dst, words, n, start = _row(desc_ptr, base_ptr, BLOCK)
    if live:
        group, s_off, d_off, w, m = _scaled_row(words, n, start, BLOCK)
        pair = tl.load(src + d_off + (w >> 1), mask=m, other=0).to(tl.int32)
        q = ((pair >> (4 * (w & 1))) & 15) - 8  # the first weight of a byte in its low bits
        _store_scaled(dst, src, s_off, group, w, m, q.to(tl.float32))


# the faster of 1-8 on an H200 at CHUNK 1024 (docs/codecs.md)
WARPS = {LOSSLESS: 4, FP8: 8, INT4: 8}
KERNELS = {LOSSLESS: _lossless_kernel, FP8: _fp8_kernel, INT4: _int4_kernel}


def decode_listed(tag: int, desc: Tensor, base: Tensor, rows: int, chunks: int) -> None:
    """Decode the rows `desc` lists (at most `rows`, each at most `chunks` chunks of CHUNK
    weights) with the decoder of header tag `tag`, on the current stream."""
    KERNELS[tag][(rows, chunks)](desc, base, BLOCK=CHUNK, num_warps=WARPS[tag])
