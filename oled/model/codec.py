"""Encoded expert rows: fewer bytes per copy from host to device.

A codec turns one table of a layer's experts (w13 [E, 2I, H] or w2 [E, H, I], bf16) into
encoded rows of one fixed size, [E, R] uint8, which the offload engine copies instead of the
bf16 rows and decodes on the device straight into the slot (oled.kernels.codec on CUDA, the
torch reference here elsewhere). Each row starts with a 64-byte header (int32 words) that says
everything its decoder needs, so one decoder launch serves rows of any layer and table.

"lossless" (bit-exact): a bf16 weight is sign, 8 exponent bits and 7 mantissa bits. Sign and
mantissa go as one raw byte (they carry about 8 bits); the exponent, which carries about 2.55
bits, goes as a 2-bit code naming one of the row's three most frequent exponents, or 3: the next
level. There a 3-bit code names one of the next seven exponents, or 7: the raw byte follows in
the escape stream. The second and third levels are packed densely in the order of the weights
that use them; a table of where each chunk of CHUNK weights starts in them lets every chunk
decode on its own. On expert weights this moves about 67.5-68% of the bytes (docs/codecs.md).

"fp8" (lossy): each output channel (a row of the weight matrix) scaled by its absolute maximum
/ 448 into float8 e4m3, with the fp32 scale: about 50% of the bytes. Named lossy everywhere.

"int4" (lossy): each run of INT4_GROUP consecutive weights of a channel (the whole channel when
it is shorter) scaled by its absolute maximum / 7 into a signed integer in [-7, 7], stored as a
4-bit code (value + 8), with the fp32 scale: 4.25 bits a weight, 26.6% of the bytes.

Row layout (byte offsets in the header; every row of a table has the same):
    lossless: header | sign+mantissa [n] | primary codes [ceil(n/4)] | chunk starts [C, 2]
              int32 | secondary codes (3 bits each) | escape bytes
    fp8:      header | scales [rows] fp32 | e4m3 [n]
    int4:     header | scales [n / group] fp32 | codes [n / 2], two a byte, the first low
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from oled.kernels.codec_format import (
    CHUNK,
    FP8,
    HEADER,
    INT4,
    LOSSLESS,
    PRIMARY_BOOK,
    SECONDARY_BOOK,
)

CODECS = ("plain", "lossless", "fp8", "int4")
LOSSY = ("fp8", "int4")
TAGS = {"lossless": LOSSLESS, "fp8": FP8, "int4": INT4}  # by codec name
FP8_MAX = 448.0
INT4_GROUP = 128  # weights of a channel per int4 scale


def describe(codec: str) -> str:
    """The codec's name as reports print it: lossy codecs say so."""
    return f"{codec} (lossy)" if codec in LOSSY else codec


def check_codec(codec: str, dtype: torch.dtype) -> None:
    """ValueError for an unknown codec, or one that cannot encode `dtype`."""
    if codec not in CODECS:
        raise ValueError(f"unknown transfer {codec!r}; choose from {', '.join(CODECS)}")
    if codec != "plain" and dtype != torch.bfloat16:
        raise ValueError(f"transfer {codec!r} encodes bfloat16 experts (this runtime: {dtype})")


def encode(
    table: Tensor, codec: str, *, counts: Tensor | None = None, size: int = 0, group: int = 8
) -> Tensor:
    """Encode a table [E, *shape] bf16 on its device, `group` experts at a time (bounded
    memory): rows [E, R] uint8 on the same device, R at least `size`. `counts`: the table's
    exponent counts [E, 256] (`exponent_counts`) when already known (lossless only)."""
    e, shape = table.shape[0], tuple(table.shape[1:])
    flat = table.reshape(e, -1)  # [E, n]
    if codec == "fp8":
        return _fp8_rows(flat, shape, size)
    if codec == "int4":
        return _int4_rows(flat, shape, size)
    if codec != "lossless":
        raise ValueError(f"no encoding for transfer {codec!r}")
    if counts is None:
        counts = exponent_counts(table, table.device, group)
    counts = counts.to(table.device)
    layout = _Layout.of(flat.shape[1], counts, size)
    rows = torch.zeros(e, layout.size, dtype=torch.uint8, device=table.device)
    for lo in range(0, e, group):
        rows[lo : lo + group] = layout.encode(flat[lo : lo + group], counts[lo : lo + group])
    return rows


def exponent_counts(table: Tensor, device: torch.device, group: int = 8) -> Tensor:
    """How often each exponent occurs in each expert of `table` [E, ...] bf16: [E, 256] int64
    on `device`, counted there `group` experts at a time."""
    e, n = table.shape[0], table[0].numel()
    parts = [
        _histogram(_fields(table[lo : lo + group].to(device).reshape(-1, n))[0])
        for lo in range(0, e, group)
    ]
    return torch.cat(parts)


def encoded_size(
    shape: tuple[int, ...], codec: str, counts: Tensor | None = None, group: int = 8
) -> int:
    """Bytes of one encoded row of a table whose rows have `shape`: fixed for fp8; for
    lossless from the table's exponent counts [E, 256], as `encode` lays out each `group` of
    experts (the largest group's)."""
    n = math.prod(shape)
    if codec == "fp8":
        return _scaled_layout(n, shape[-1], n)[2]
    if codec == "int4":
        return _scaled_layout(n, int4_group(shape[-1]), n // 2)[2]
    if counts is None:
        raise ValueError("a lossless row's size needs its table's exponent counts")
    return max(_Layout.of(n, counts[lo : lo + group]).size for lo in range(0, len(counts), group))


def decode(rows: Tensor, n: int) -> Tensor:
    """The torch reference decoder: encoded rows [N, R] uint8 -> [N, n] bf16 (any device).
    Rows may come from different tables: those with the same header decode together."""
    words = rows[:, :HEADER].contiguous().view(torch.int32)  # [N, 16]
    headers, group = torch.unique(words, dim=0, return_inverse=True)
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16, device=rows.device)
    for g, header in enumerate(headers.tolist()):
        pick = (group == g).nonzero(as_tuple=True)[0]
        out[pick] = _decode_alike(rows[pick], header, n)
    return out


def _decode_alike(rows: Tensor, header: list[int], n: int) -> Tensor:
    """Rows [N, R] sharing one header -> [N, n] bf16."""
    if header[1] != n:
        raise ValueError(f"encoded rows hold {header[1]} weights, not {n}")
    if header[0] == LOSSLESS:
        return _lossless_decode(rows, header, n)
    if header[0] == FP8:
        return _fp8_decode(rows, header, n)
    if header[0] == INT4:
        return _int4_decode(rows, header, n)
    raise ValueError(f"encoded rows with an unknown tag {header[0]}")


# -- lossless ------------------------------------------------------------------------------------


def _fields(flat: Tensor) -> tuple[Tensor, Tensor]:
    """bf16 [G, n] -> (exponent [G, n] int64, sign and mantissa byte [G, n] uint8)."""
    u = flat.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [G, n]
    exponent = ((u >> 7) & 0xFF).long()
    sign_mantissa = (((u >> 8) & 0x80) | (u & 0x7F)).to(torch.uint8)
    return exponent, sign_mantissa


def _histogram(exponent: Tensor) -> Tensor:
    """[G, n] exponents -> [G, 256] counts."""
    g = exponent.shape[0]
    rows = torch.arange(g, device=exponent.device).unsqueeze(1) * 256  # [G, 1]
    return torch.bincount((exponent + rows).flatten(), minlength=256 * g).view(g, 256)


def _books(counts: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's three most frequent exponents and the next seven: ([G, 3], [G, 7]) int64
    (ties by exponent value, so the books do not depend on the device)."""
    key = counts * 256 + (255 - torch.arange(256, device=counts.device))  # unique per row
    order = torch.argsort(key, dim=1, descending=True)  # [G, 256]
    return order[:, :3], order[:, 3:10]


@dataclass(frozen=True)
class _Layout:
    """The section offsets of one table's lossless rows (the same for every row)."""

    n: int
    primary: int
    chunks: int
    secondary: int
    escapes: int
    size: int

    @classmethod
    def of(cls, n: int, counts: Tensor, size: int = 0) -> _Layout:
        """Sized from the rows' exponent counts [G, 256]: room for the busiest row's second and
        third levels; at least `size` bytes a row."""
        primary_book, secondary_book = _books(counts)
        top3 = counts.gather(1, primary_book).sum(1)
        top10 = top3 + counts.gather(1, secondary_book).sum(1)
        most_secondary, most_escapes = int((n - top3).max()), int((n - top10).max())
        # every section starts 16-byte aligned: the decoder reads them in 16-byte vectors
        primary = _align(HEADER + n, 16)
        chunks = _align(primary + -(-n // 4), 16)
        secondary = _align(chunks + 8 * -(-n // CHUNK), 16)
        escapes = _align(secondary + -(-3 * most_secondary // 8) + 2, 16)  # reads 2 bytes
        size = max(size, _align(escapes + most_escapes, 16))
        return cls(n, primary, chunks, secondary, escapes, size)

    def encode(self, flat: Tensor, counts: Tensor) -> Tensor:
        """bf16 [G, n] with its exponent counts [G, 256] -> rows [G, size] uint8."""
        g, n, dev = flat.shape[0], self.n, flat.device
        exponent, sign_mantissa = _fields(flat)  # [G, n] each
        primary_book, secondary_book = _books(counts)  # [G, 3], [G, 7]
        code = torch.full((g, 256), 3, dtype=torch.long, device=dev)
        code.scatter_(1, primary_book, torch.arange(3, device=dev).expand(g, 3))
        level2 = torch.full((g, 256), 7, dtype=torch.long, device=dev)
        level2.scatter_(1, secondary_book, torch.arange(7, device=dev).expand(g, 7))
        primary = code.gather(1, exponent)  # [G, n] 0..3
        is_secondary = primary == 3
        secondary = level2.gather(1, exponent)  # [G, n] 0..7 (used where is_secondary)
        is_escape = is_secondary & (secondary == 7)

        rows = torch.zeros(g, self.size, dtype=torch.uint8, device=dev)
        header = torch.zeros(g, 16, dtype=torch.int32, device=dev)
        header[:, :7] = torch.tensor(
            [LOSSLESS, n, self.primary, self.chunks, self.secondary, self.escapes, CHUNK],
            dtype=torch.int32,
            device=dev,
        )
        rows[:, :HEADER] = header.view(torch.uint8)
        rows[:, PRIMARY_BOOK : PRIMARY_BOOK + 3] = primary_book.to(torch.uint8)
        rows[:, SECONDARY_BOOK : SECONDARY_BOOK + 7] = secondary_book.to(torch.uint8)
        rows[:, HEADER : HEADER + n] = sign_mantissa
        rows[:, self.primary : self.primary + -(-n // 4)] = _pack2(primary)
        starts = torch.stack([_chunk_starts(is_secondary), _chunk_starts(is_escape)], -1)
        table = starts.to(torch.int32).reshape(g, -1).view(torch.uint8)  # [G, C * 8]
        rows[:, self.chunks : self.chunks + table.shape[1]] = table
        _scatter_bits(rows, self.secondary, is_secondary, secondary)
        rank = torch.cumsum(is_escape, 1) - 1  # [G, n]
        row, col = is_escape.nonzero(as_tuple=True)
        rows[row, self.escapes + rank[row, col]] = exponent[row, col].to(torch.uint8)
        return rows


def _align(x: int, to: int) -> int:
    return -(-x // to) * to


def _pack2(codes: Tensor) -> Tensor:
    """2-bit codes [G, n] -> [G, ceil(n/4)] uint8, four per byte, the first in the low bits."""
    g, n = codes.shape
    padded = torch.zeros(g, _align(n, 4), dtype=torch.long, device=codes.device)
    padded[:, :n] = codes
    quads = padded.view(g, -1, 4) << torch.tensor([0, 2, 4, 6], device=codes.device)
    return quads.sum(-1).to(torch.uint8)


def _chunk_starts(used: Tensor) -> Tensor:
    """[G, n] bool -> [G, C] int64: how many of a row's weights before each chunk use it."""
    g, n = used.shape
    padded = torch.zeros(g, _align(n, CHUNK), dtype=torch.long, device=used.device)
    padded[:, :n] = used
    per_chunk = padded.view(g, -1, CHUNK).sum(-1)  # [G, C]
    return torch.cumsum(per_chunk, 1) - per_chunk


def _scatter_bits(rows: Tensor, offset: int, used: Tensor, codes: Tensor) -> None:
    """Pack 3-bit `codes` where `used` ([G, n]) densely at bit 3 * rank from byte `offset`."""
    rank = torch.cumsum(used, 1) - 1  # [G, n]
    row, col = used.nonzero(as_tuple=True)
    bit = 3 * rank[row, col]
    value = codes[row, col] << (bit & 7)  # up to 10 bits: this byte and the next
    width = rows.shape[1]
    flat = torch.zeros(rows.shape[0] * width, dtype=torch.long, device=rows.device)
    at = row * width + offset + (bit >> 3)
    flat.index_add_(0, at, value & 0xFF)  # bits never overlap: adding is or-ing
    flat.index_add_(0, at + 1, value >> 8)
    rows |= flat.view(rows.shape).to(torch.uint8)


def _lossless_decode(rows: Tensor, header: list[int], n: int) -> Tensor:
    """The reference of oled.kernels.codec's lossless decoder: [N, R] -> [N, n] bf16."""
    p_off, c_off, s_off, x_off, chunk_size = header[2:7]
    if chunk_size != CHUNK:
        raise ValueError(f"encoded rows in chunks of {chunk_size}, this decoder's are {CHUNK}")
    g, dev = rows.shape[0], rows.device
    w = torch.arange(n, device=dev)
    sm = rows[:, HEADER : HEADER + n].to(torch.int32)  # [N, n]
    primary = (rows[:, p_off + (w >> 2)].to(torch.int32) >> (2 * (w & 3))) & 3
    is_secondary = primary == 3
    table = rows[:, c_off : c_off + 8 * -(-n // CHUNK)].contiguous()
    starts = table.view(torch.int32).view(g, -1, 2).long()  # [N, C, 2]
    chunk = w // CHUNK
    rank = _chunk_rank(is_secondary) + starts[:, chunk, 0]  # [N, n]
    bit = 3 * rank
    lo = rows.gather(1, (s_off + (bit >> 3)).clamp(max=rows.shape[1] - 2)).to(torch.int32)
    hi = rows.gather(1, (s_off + (bit >> 3) + 1).clamp(max=rows.shape[1] - 1)).to(torch.int32)
    secondary = ((lo | (hi << 8)) >> (bit & 7)) & 7
    is_escape = is_secondary & (secondary == 7)
    escape_rank = _chunk_rank(is_escape) + starts[:, chunk, 1]
    escaped = rows.gather(1, (x_off + escape_rank).clamp(max=rows.shape[1] - 1)).to(torch.int32)
    p_book = rows[:, PRIMARY_BOOK : PRIMARY_BOOK + 4].to(torch.int32)  # [N, 4]
    s_book = rows[:, SECONDARY_BOOK : SECONDARY_BOOK + 8].to(torch.int32)  # [N, 8]
    exponent = torch.where(
        is_escape,
        escaped,
        torch.where(is_secondary, s_book.gather(1, secondary), p_book.gather(1, primary)),
    )
    u = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)  # [N, n] 16 bits
    return u.to(torch.int16).view(torch.bfloat16)


def _chunk_rank(used: Tensor) -> Tensor:
    """[N, n] bool -> [N, n] int64: how many weights before this one in its chunk use it."""
    g, n = used.shape
    padded = torch.zeros(g, _align(n, CHUNK), dtype=torch.long, device=used.device)
    padded[:, :n] = used
    chunks = padded.view(g, -1, CHUNK)
    return (torch.cumsum(chunks, -1) - chunks).view(g, -1)[:, :n]


# -- fp8 and int4: scaled codes -------------------------------------------------------------------
# Both rows are: header | scales [n / per] fp32 | codes; a weight is its code's value times the
# scale of its run of `per` weights (fp8: a channel; int4: a group), in fp32, rounded to bf16.


def _scaled(flat: Tensor, per: int, top: float, codec: str) -> tuple[Tensor, Tensor]:
    """bf16 [E, n] in runs of `per` weights -> (the weights over their run's scale [E, n / per,
    per] fp32, the scales [E, n / per] fp32: each run's absolute maximum / `top`)."""
    e, n = flat.shape
    x = flat.float().view(e, n // per, per)
    _check_finite(x, codec)
    amax = x.abs().amax(-1)  # [E, runs]
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    return x / scale.unsqueeze(-1), scale


def _scaled_layout(n: int, per: int, code_bytes: int) -> tuple[int, int, int]:
    """(scales offset, codes offset, row size) of a row of n weights, `per` a scale, whose
    codes take `code_bytes`."""
    data = _align(HEADER + 4 * (n // per), 16)
    return HEADER, data, _align(data + code_bytes, 16)


def _scaled_rows(tag: int, n: int, per: int, scale: Tensor, codes: Tensor, size: int) -> Tensor:
    """Rows [E, R] uint8 (R at least `size`) of scales [E, n / per] fp32 and codes [E, B]."""
    e = codes.shape[0]
    scales, data, need = _scaled_layout(n, per, codes.shape[1])
    rows = torch.zeros(e, max(size, need), dtype=torch.uint8, device=codes.device)
    header = torch.zeros(e, 16, dtype=torch.int32, device=codes.device)
    header[:, :5] = torch.tensor([tag, n, per, scales, data], dtype=torch.int32)
    rows[:, :HEADER] = header.view(torch.uint8)
    rows[:, scales : scales + 4 * (n // per)] = scale.contiguous().view(torch.uint8)
    rows[:, data : data + codes.shape[1]] = codes
    return rows


def _scaled_parts(
    rows: Tensor, header: list[int], n: int, code_bytes: int
) -> tuple[Tensor, Tensor, int]:
    """(scales [N, n / per] fp32, codes [N, code_bytes] uint8, per) of rows sharing `header`."""
    per, s_off, d_off = header[2:5]
    scale = rows[:, s_off : s_off + 4 * (n // per)].contiguous().view(torch.float32)
    return scale, rows[:, d_off : d_off + code_bytes].contiguous(), per


def _fp8_rows(flat: Tensor, shape: tuple[int, ...], size: int = 0) -> Tensor:
    """bf16 [E, n], channels of shape[-1] weights -> rows [E, R] uint8, R at least `size`."""
    e, n = flat.shape
    x, scale = _scaled(flat, shape[-1], FP8_MAX, "fp8")
    q = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(e, n).view(torch.uint8)
    return _scaled_rows(FP8, n, shape[-1], scale, q, size)


def _fp8_decode(rows: Tensor, header: list[int], n: int) -> Tensor:
    """The reference of oled.kernels.codec's fp8 decoder: [N, R] -> [N, n] bf16."""
    scale, codes, cols = _scaled_parts(rows, header, n, n)
    q = codes.view(torch.float8_e4m3fn).float().view(rows.shape[0], n // cols, cols)
    return (q * scale.unsqueeze(-1)).view(-1, n).to(torch.bfloat16)


def int4_group(cols: int) -> int:
    """Weights per int4 scale for channels of `cols` weights (ValueError where channels do not
    split into whole groups of an even size)."""
    group = min(INT4_GROUP, cols)
    if cols % group or group % 2:
        raise ValueError(
            f"transfer 'int4' scales runs of {INT4_GROUP} weights of a channel (or whole channels "
            f"of an even length): channels of {cols} weights do not split into them"
        )
    return group


def _int4_rows(flat: Tensor, shape: tuple[int, ...], size: int = 0) -> Tensor:
    """bf16 [E, n], channels of shape[-1] weights -> rows [E, R] uint8, R at least `size`."""
    e, n = flat.shape
    group = int4_group(shape[-1])
    x, scale = _scaled(flat, group, 7.0, "int4")
    pairs = (x.round().clamp(-7, 7).to(torch.int32) + 8).view(e, n // 2, 2)  # codes 1..15
    codes = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)  # [E, n / 2]
    return _scaled_rows(INT4, n, group, scale, codes, size)


def _int4_decode(rows: Tensor, header: list[int], n: int) -> Tensor:
    """The reference of oled.kernels.codec's int4 decoder: [N, R] -> [N, n] bf16."""
    scale, codes, group = _scaled_parts(rows, header, n, n // 2)
    codes = codes.to(torch.int32)  # [N, n / 2]
    q = torch.stack([codes & 15, codes >> 4], -1).view(rows.shape[0], n // group, group) - 8
    return (q.float() * scale.unsqueeze(-1)).view(-1, n).to(torch.bfloat16)


def _check_finite(x: Tensor, codec: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"transfer {codec!r} cannot encode experts with inf or nan weights")


def lossy_copy(table: Tensor, codec: str) -> Tensor:
    """What a table [E, ...] becomes after an encode and decode round trip (for measuring a
    lossy codec's quality cost; the table itself for a lossless one)."""
    if codec == "plain":
        return table
    return decode(encode(table, codec), table[0].numel()).view(table.shape)
