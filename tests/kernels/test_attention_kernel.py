"""The ragged attention kernel against the torch path of a batched forward (keys gathered and
padded, BatchRows.mask, SDPA): under the Triton interpreter on CPU, at LLaDA2.0-mini's attention
shape on CUDA; and a tiny model's batched forward with it against the torch kernels."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from oled import kernels  # noqa: E402
from oled.kernels import attention as attention_module  # noqa: E402
from oled.kernels.attention import ragged_attention  # noqa: E402
from oled.model.config import mini_config  # noqa: E402
from oled.model.model import BatchRows, KVCache  # noqa: E402

CUDA = torch.device("cuda")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # small-shape tests


def make_case(slots, starts, lengths, *, heads, kv_heads, dim, dtype, s_max, device=DEVICE):
    """Batch rows, KV buffers with random keys in every position, and a random padded query
    block [B, h, t_max, D] laid out as the model lays it (a transposed view)."""
    needed = max(s + n for s, n in zip(starts, lengths, strict=True))
    keys = min(s_max, max(64, 1 << (needed - 1).bit_length()))  # padded as the batch decoder
    rows = BatchRows.build(slots, starts, lengths, [0] * len(slots), keys=keys, device=device)
    g = torch.Generator().manual_seed(len(slots) * 100 + heads + kv_heads)
    shape = (max(slots) + 1, kv_heads, s_max, dim)  # [slots, kv, S_max, D]
    kbuf = torch.randn(shape, generator=g).to(device, dtype)
    vbuf = torch.randn(shape, generator=g).to(device, dtype)
    nb, t_max = rows.queries.shape
    q = torch.randn(nb, t_max, heads, dim, generator=g).to(device, dtype).transpose(1, 2)
    return rows, kbuf, vbuf, q


def reference(q, kbuf, vbuf, rows, block_length):
    """The torch path of Attention._batched, in fp32."""
    keys = kbuf[:, :, : rows.keys].index_select(0, rows.slots).float()  # [B, kv, S, D]
    values = vbuf[:, :, : rows.keys].index_select(0, rows.slots).float()
    return F.scaled_dot_product_attention(
        q.float(),
        keys,
        values,
        attn_mask=rows.mask(block_length),
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )  # [B, h, t_max, D]


def kernel(q, kbuf, vbuf, rows, block_length):
    return ragged_attention(
        q, kbuf, vbuf, rows.slots, rows.key_len, rows.query_pos, block_length, q.shape[-1] ** -0.5
    )


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def check(slots, starts, lengths, *, block_length=32, dtype=torch.float32, **shape):
    rows, kbuf, vbuf, q = make_case(slots, starts, lengths, dtype=dtype, **shape)
    out = kernel(q, kbuf, vbuf, rows, block_length)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(
        out.float(), reference(q, kbuf, vbuf, rows, block_length), **TOL[dtype]
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 2), (32, 1)])
def test_streams_of_very_different_lengths(heads, kv_heads):
    """5 and 300 keys and a prefill-like stream over three diffusion blocks, in slots out of
    order; every ratio of query to key heads (3 too: a group that is no power of two)."""
    check([3, 0, 2], [0, 290, 60], [5, 10, 40], heads=heads, kv_heads=kv_heads, dim=16, s_max=320)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_per_stream(dtype):
    check([1, 0], [7, 250], [1, 1], heads=4, kv_heads=2, dim=32, s_max=256, dtype=dtype)


def test_decode_blocks_in_bf16():
    """Blocks of 32 queries at their block's start, as the batch decoder runs them."""
    check(
        [2, 1, 0],
        [32, 128, 0],
        [32, 32, 32],
        heads=8,
        kv_heads=2,
        dim=32,
        s_max=192,
        dtype=torch.bfloat16,
    )


def test_prefill_rows_span_blocks():
    """Small blocks: one stream's rows cross several of them, whose queries must not see the
    later blocks' keys; another stream's rows start in the middle of a block."""
    check([0, 1], [0, 13], [40, 9], heads=4, kv_heads=2, dim=16, s_max=64, block_length=8)


def test_a_stream_without_keys_gives_zeros():
    rows, kbuf, vbuf, q = make_case(
        [1, 0], [0, 40], [8, 8], heads=4, kv_heads=2, dim=16, dtype=torch.float32, s_max=64
    )
    rows.key_len[0] = 0  # no real row has none; the kernel must still not give NaN
    out = kernel(q, kbuf, vbuf, rows, 32)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1], reference(q, kbuf, vbuf, rows, 32)[1], **TOL[torch.float32])


def test_keys_past_a_streams_length_are_never_read():
    """NaN in every key and value past each stream's keys (another forward's, or none yet)."""
    rows, kbuf, vbuf, q = make_case(
        [0, 1], [20, 70], [12, 6], heads=4, kv_heads=2, dim=16, dtype=torch.float32, s_max=128
    )
    ref = reference(q, kbuf, vbuf, rows, 32)
    for b, end in enumerate(rows.key_len.tolist()):
        kbuf[rows.slots[b], :, end:] = float("nan")
        vbuf[rows.slots[b], :, end:] = float("nan")
    torch.testing.assert_close(kernel(q, kbuf, vbuf, rows, 32), ref, **TOL[torch.float32])


def test_bad_shapes_are_refused():
    rows, kbuf, vbuf, q = make_case(
        [0], [0], [4], heads=3, kv_heads=2, dim=16, dtype=torch.float32, s_max=64
    )
    with pytest.raises(ValueError, match="does not attend"):
        kernel(q, kbuf, vbuf, rows, 32)


# A tiny model's batched forward ---------------------------------------------------------------


def batched_logits(rt, mode: str) -> list[torch.Tensor]:
    """Logits of two batched forwards with the given kernels: three prompts' prefill rows
    side by side, then a decode block of each over its prompt's keys."""
    kernels.use(mode)
    cfg, bl = rt.config, 8
    cache = KVCache(cfg, max_len=64, batch=3, dtype=torch.float32, device=rt.device)
    slots, prompts = [2, 0, 1], [20, 5, 11]
    g = torch.Generator().manual_seed(0)
    out = []
    with torch.inference_mode():
        for starts, lengths in (([0, 0, 0], prompts), (prompts, [bl] * 3)):
            rows = BatchRows.build(slots, starts, lengths, [0] * 3, keys=32, device=rt.device)
            tokens = torch.randint(0, cfg.vocab_size, (1, sum(lengths)), generator=g)
            out.append(rt.model(tokens.to(rt.device), cache=cache, block_length=bl, rows=rows))
    return out


def single_logits(rt, mode: str) -> list[torch.Tensor]:
    """Logits of one sequence's forwards with the given kernels: a prompt spanning blocks into
    the cache, a decode block over it (its queries in one block), and a forward without a
    cache."""
    kernels.use(mode)
    cfg, bl = rt.config, 8
    cache = KVCache(cfg, max_len=64, batch=1, dtype=torch.float32, device=rt.device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, 28), generator=g).to(rt.device)
    with torch.inference_mode():
        out = [rt.model(tokens[:, :20], cache=cache, block_length=bl)]
        cache.length = 20
        out.append(rt.model(tokens[:, 20:], cache=cache, start=20, block_length=bl))
        out.append(rt.model(tokens, block_length=bl))
    return out


@pytest.mark.parametrize("logits, forwards", [(batched_logits, 2), (single_logits, 3)])
def test_forwards_attend_with_the_kernel_and_match_the_torch_kernels(
    tiny_dir, monkeypatch, logits, forwards
):
    """Batched forwards and one sequence's forwards attend through the fused kernel (so a
    sequence rounds alone as it does in a batch), and match the torch kernels."""
    from oled.runtime import load_runtime

    calls = []
    real = attention_module.ragged_attention

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(attention_module, "ragged_attention", counted)
    rt = load_runtime(str(tiny_dir), device=DEVICE.type, dtype="float32", kernels="triton")
    try:
        fused = logits(rt, "triton")
        assert len(calls) == forwards * rt.config.num_hidden_layers
        plain = logits(rt, "torch")
    finally:
        kernels.use("auto")
    assert len(calls) == forwards * rt.config.num_hidden_layers  # the torch kernels never do
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# CUDA, real shapes ----------------------------------------------------------------------------

MINI = mini_config()
MINI_SHAPE = dict(
    heads=MINI.num_attention_heads, kv_heads=MINI.num_key_value_heads, dim=MINI.head_dim
)


@pytest.mark.gpu
@pytest.mark.parametrize("t_max", [1, 32, 96])
def test_gpu_mini_shape(t_max):
    n = 8
    starts = [32 * (5 + 17 * b % 40) for b in range(n)]
    check(
        [(5 * b + 3) % n for b in range(n)],
        starts,
        [t_max - (b % 3 if t_max > 3 else 0) for b in range(n)],
        dtype=torch.bfloat16,
        s_max=2048,
        device=CUDA,
        **MINI_SHAPE,
    )


@pytest.mark.gpu
def test_gpu_graph_replays_for_new_positions_and_lengths():
    """Captured once, replayed with other positions, key lengths and slots: the kernel reads
    them from the rows' tensors."""
    n, t_max, bl = 4, 32, 32
    shape = (n, MINI.num_key_value_heads, 1024, MINI.head_dim)
    kbuf = torch.randn(shape, device=CUDA, dtype=torch.bfloat16)
    vbuf = torch.randn_like(kbuf)
    q = torch.randn(n, MINI.num_attention_heads, t_max, MINI.head_dim, device=CUDA).bfloat16()

    def rows_for(seed):
        g = torch.Generator().manual_seed(seed)
        starts = (torch.randint(0, 28, (n,), generator=g) * 32).tolist()
        slots = torch.randperm(n, generator=g).tolist()
        return BatchRows.build(slots, starts, [t_max] * n, [0] * n, keys=1024, device=CUDA)

    static = rows_for(0).clone()
    out = kernel(q, kbuf, vbuf, static, bl)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(q, kbuf, vbuf, static, bl)
    for seed in (1, 2, 3):
        rows = rows_for(seed)
        static.copy_(rows)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, kernel(q, kbuf, vbuf, rows, bl), rtol=0, atol=0)
        torch.testing.assert_close(
            out.float(), reference(q, kbuf, vbuf, rows, bl), **TOL[torch.bfloat16]
        )
