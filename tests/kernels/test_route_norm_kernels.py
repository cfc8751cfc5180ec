"""The routing, RMSNorm and q/k-norm + rotary + KV-write kernels against the torch code in
oled.model.layers: under the Triton interpreter on CPU, at the model's real shapes on CUDA."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from torch import nn  # noqa: E402

import oled.kernels as kernels  # noqa: E402
import oled.kernels.norm as norm_module  # noqa: E402
import oled.kernels.route as route_module  # noqa: E402
from oled.kernels.norm import qk_norm_rotary, rms_norm  # noqa: E402
from oled.kernels.route import select_experts  # noqa: E402
from oled.model.config import mini_config  # noqa: E402
from oled.model.layers import Attention, RMSNorm, Rotary, route, router_logits  # noqa: E402
from oled.model.presets import tiny_config  # noqa: E402
from tests.kernels.conftest import assert_within_one_ulp  # noqa: E402

CUDA = torch.device("cuda")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # small-shape tests


def fused_route(x, weight, bias, **routing) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused path of `route`: the reference's fp32 GEMM, then the routing kernel."""
    return select_experts(router_logits(x, weight), bias, **routing)


def _refuse(*args, **kwargs):
    raise AssertionError("the torch reference took the fused path")


@contextlib.contextmanager
def torch_path():
    """The oled.model.layers code runs its torch ops, never these kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "fused", lambda *args, **kwargs: False, raising=False)
        patch.setattr(route_module, "select_experts", _refuse)
        patch.setattr(norm_module, "rms_norm", _refuse)
        patch.setattr(norm_module, "qk_norm_rotary", _refuse)
        yield


def exact_values(shape, dtype, device=DEVICE, seed=0) -> torch.Tensor:
    """Multiples of 1/8 in [-2, 2]: squares and their sums are exact in fp32 in any order, so
    a norm's mean is the same however it is summed."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, shape, generator=g) / 8).to(device, dtype)


# Routing ------------------------------------------------------------------------------------


def route_inputs(t, h, e, *, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(device, dtype)
    weight = (torch.randn(e, h, generator=g) * h**-0.5).to(device)  # fp32, as callers keep it
    bias = (torch.randn(e, generator=g) * 0.1).to(device)
    return x, weight, bias


def check_route(x, weight, bias, **routing) -> None:
    ids, weights = fused_route(x, weight, bias, **routing)
    with torch_path():
        ref_ids, ref_weights = route(x, weight, bias, **routing)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)  # same experts, same (descending) order
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "experts,groups,keep,top_k", [(32, 4, 2, 4), (256, 8, 4, 8), (64, 8, 4, 6), (16, 8, 3, 1)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_torch(experts, groups, keep, top_k, dtype):
    x, weight, bias = route_inputs(24, 128, experts, dtype=dtype, seed=experts + top_k)
    check_route(
        x,
        weight,
        bias,
        top_k=top_k,
        n_group=groups,
        topk_group=keep,
        scale=2.5,
        normalise=top_k > 1,
    )


def test_route_bf16_weight_and_no_normalise():
    x, weight, bias = route_inputs(8, 128, 32, dtype=torch.bfloat16, seed=3)
    routing = dict(top_k=4, n_group=4, topk_group=2, scale=1.0, normalise=False)
    check_route(x, weight.bfloat16(), bias.bfloat16(), **routing)


def test_route_ties_go_to_the_lower_index():
    x = torch.zeros(3, 128, device=DEVICE)  # every score 0.5: all experts and all groups tie
    weight, bias = torch.randn(32, 128, device=DEVICE), torch.zeros(32, device=DEVICE)
    ids, weights = fused_route(
        x, weight, bias, top_k=4, n_group=4, topk_group=2, scale=2.0, normalise=True
    )
    assert ids.tolist() == [[0, 1, 2, 3]] * 3
    torch.testing.assert_close(weights, torch.full((3, 4), 0.5, device=DEVICE))


def test_route_rejects_bad_groups():
    x, weight, bias = route_inputs(2, 128, 32, dtype=torch.float32)
    with pytest.raises(ValueError):
        fused_route(x, weight, bias, top_k=4, n_group=5, topk_group=2, scale=1.0, normalise=True)
    with pytest.raises(ValueError):
        fused_route(x, weight, bias, top_k=9, n_group=4, topk_group=1, scale=1.0, normalise=True)


# RMSNorm ------------------------------------------------------------------------------------


def torch_rms_norm(x, weight, eps) -> torch.Tensor:
    module = RMSNorm(x.shape[-1], eps=eps).to(x.device)
    module.weight = nn.Parameter(weight, requires_grad=False)
    with torch_path(), torch.no_grad():
        return module(x)


@pytest.mark.parametrize("d", [128, 2048])
@pytest.mark.parametrize(
    "dtype,weight_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_rms_norm_exact_values_equal_torch(d, dtype, weight_dtype):
    x = exact_values((2, 3, d), dtype)
    weight = torch.randn(d).to(DEVICE, weight_dtype)
    out = rms_norm(x, weight, 1e-6)
    assert torch.equal(out, torch_rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_random_values(dtype):
    g = torch.Generator().manual_seed(0)  # not the global generator: other tests move it
    x = (torch.randn(4, 9, 128, generator=g) * 3).to(DEVICE, dtype)
    weight = torch.randn(128, generator=g).to(DEVICE, dtype)
    out, ref = rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert_within_one_ulp(out, ref, max_fraction=0.01)


def test_rms_norm_strided_rows():
    x = exact_values((6, 256), torch.bfloat16)[:, :128]  # rows with stride 256
    weight = torch.randn(128).to(DEVICE, torch.bfloat16)
    assert torch.equal(rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))


# q/k norm + rotary + KV write ---------------------------------------------------------------


class FixedProjection(nn.Module):
    """Stands in for the fused QKV projection: returns a given qkv."""

    def __init__(self, qkv: torch.Tensor) -> None:
        super().__init__()
        self.qkv = qkv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv


def make_attention(cfg, dtype, device, seed=0) -> Attention:
    attn = Attention(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in (attn.query_layernorm, attn.key_layernorm):
            norm.weight.copy_(1 + 0.5 * torch.randn(cfg.head_dim, generator=g))
    return attn.to(device, dtype)


def torch_attention_inputs(attn, qkv, rotary, cos, sin, kv, past):
    """The q given to SDPA by Attention.forward on this qkv; writes the keys/values into kv."""
    b, t, _ = qkv.shape
    seen = {}

    def sdpa(q, k, v, **kwargs):
        seen["q"] = q.clone()
        return torch.zeros_like(q)

    attn.query_key_value = FixedProjection(qkv)
    with torch_path(), torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        attn(qkv.new_zeros(b, t, attn.dense.out_features), rotary, cos, sin, kv, past, None)
    return seen["q"]


def kernel_qk(cfg, qkv, weights, cos, sin, cache, past, rows=None):
    """qk_norm_rotary on qkv [B, T, W], writing keys/values at `past` of cache (kbuf, vbuf), or
    with `rows` (slots [T], positions [T]) into the whole buffers at those slots and positions."""
    t = qkv.shape[1]
    window = slice(None) if rows is not None else slice(past, past + t)
    return qk_norm_rotary(
        qkv,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        q_weight=weights[0],
        k_weight=weights[1],
        eps=cfg.rms_norm_eps,
        cos=cos,
        sin=sin,
        rotary_dim=cfg.rotary_dim,
        k_out=cache[0][:, :, window],
        v_out=cache[1][:, :, window],
        rows=rows,
    )


def check_qk_norm_rotary(cfg, *, b, t, past, s_max, dtype, device, exact, seed=0):
    """The kernel's q and cache writes against Attention.forward on the same qkv."""
    attn = make_attention(cfg, dtype, device, seed)
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    if exact:
        qkv = exact_values((b, t, width), dtype, device, seed)
    else:
        g = torch.Generator().manual_seed(seed)
        qkv = (torch.randn(b, t, width, generator=g) * 2).to(device, dtype)
    rotary = Rotary(dim=cfg.rotary_dim, theta=cfg.rope_theta)
    cos, sin = rotary.cos_sin(torch.arange(past, past + t, device=device), dtype)
    kv_shape = (b, cfg.num_key_value_heads, s_max, cfg.head_dim)
    kbuf = torch.randn(kv_shape).to(device, dtype)  # earlier contents must survive
    vbuf = torch.randn(kv_shape).to(device, dtype)
    ref_k, ref_v = kbuf.clone(), vbuf.clone()
    ref_q = torch_attention_inputs(attn, qkv, rotary, cos, sin, (ref_k, ref_v), past)

    weights = attn.query_layernorm.weight.detach(), attn.key_layernorm.weight.detach()
    q = kernel_qk(cfg, qkv, weights, cos, sin, (kbuf, vbuf), past)
    assert q.shape == (b, cfg.num_attention_heads, t, cfg.head_dim) and q.is_contiguous()
    assert torch.equal(vbuf, ref_v)
    if exact:
        assert torch.equal(q, ref_q)
        assert torch.equal(kbuf, ref_k)
    elif dtype == torch.float32:
        torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kbuf, ref_k, rtol=1e-5, atol=1e-6)
    else:
        assert_within_one_ulp(q, ref_q, max_fraction=0.01)
        assert_within_one_ulp(kbuf, ref_k, max_fraction=0.01)


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_qk_norm_rotary_matches_attention(dtype, exact):
    check_qk_norm_rotary(
        tiny_config(), b=2, t=5, past=3, s_max=12, dtype=dtype, device=DEVICE, exact=exact
    )


def test_qk_norm_rotary_at_cache_start_and_single_token():
    cfg = tiny_config()
    check_qk_norm_rotary(
        cfg, b=1, t=4, past=0, s_max=4, dtype=torch.bfloat16, device=DEVICE, exact=True
    )
    check_qk_norm_rotary(
        cfg, b=1, t=1, past=7, s_max=8, dtype=torch.bfloat16, device=DEVICE, exact=True
    )


def check_qk_rows(cfg, *, dtype, device, rows_per_slot=(3, 1, 4), s_max=16, seed=0):
    """With rows, each row's key and value land in its slot at its position, the same values as
    the kernel writing them in order, and nothing else in the buffers changes."""
    t = sum(rows_per_slot)
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(1, t, width, generator=g).to(device, dtype)
    slots = [s for s, n in zip((2, 0, 1), rows_per_slot, strict=True) for _ in range(n)]
    positions = [
        p
        for n, start in zip(rows_per_slot, (5, 0, 9), strict=True)
        for p in range(start, start + n)
    ]
    slot_t = torch.tensor(slots, device=device)  # [T]
    pos_t = torch.tensor(positions, device=device)  # [T]
    rotary = Rotary(dim=cfg.rotary_dim, theta=cfg.rope_theta)
    cos, sin = rotary.cos_sin(pos_t, dtype)
    weights = (torch.randn(cfg.head_dim, generator=g).to(device, dtype),) * 2
    ref = tuple(
        torch.empty(1, cfg.num_key_value_heads, t, cfg.head_dim, device=device, dtype=dtype)
        for _ in range(2)
    )
    ref_q = kernel_qk(cfg, qkv, weights, cos, sin, ref, 0)
    shape = (3, cfg.num_key_value_heads, s_max, cfg.head_dim)
    kbuf, vbuf = torch.randn(shape).to(device, dtype), torch.randn(shape).to(device, dtype)
    want_k, want_v = kbuf.clone(), vbuf.clone()
    want_k[slot_t, :, pos_t] = ref[0][0].transpose(0, 1)
    want_v[slot_t, :, pos_t] = ref[1][0].transpose(0, 1)
    q = kernel_qk(cfg, qkv, weights, cos, sin, (kbuf, vbuf), 0, rows=(slot_t, pos_t))
    assert torch.equal(q, ref_q)
    assert torch.equal(kbuf, want_k) and torch.equal(vbuf, want_v)


def test_qk_norm_rotary_writes_batched_rows_into_their_slots():
    cfg = tiny_config()
    check_qk_rows(cfg, dtype=torch.bfloat16, device=DEVICE)
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    buf = torch.zeros(2, cfg.num_key_value_heads, 8, cfg.head_dim, device=DEVICE)
    ones = torch.ones(cfg.head_dim, device=DEVICE)
    cos = torch.ones(3, cfg.rotary_dim, device=DEVICE)
    short = (torch.zeros(2, dtype=torch.long, device=DEVICE),) * 2  # rows of 2 tokens, not 3
    with pytest.raises(ValueError, match="rows must be"):
        qkv = torch.zeros(1, 3, width, device=DEVICE)
        kernel_qk(cfg, qkv, (ones, ones), cos, cos * 0, (buf, buf.clone()), 0, rows=short)


# CUDA, real shapes --------------------------------------------------------------------------

MINI = mini_config()
MINI_ROUTING = dict(
    top_k=MINI.num_experts_per_tok,
    n_group=MINI.n_group,
    topk_group=MINI.topk_group,
    scale=MINI.routed_scaling_factor,
    normalise=True,
)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 64])
def test_gpu_route(t):
    x, weight, bias = route_inputs(
        t, MINI.hidden_size, MINI.num_experts, dtype=torch.bfloat16, device=CUDA, seed=t
    )
    check_route(x, weight, bias, **MINI_ROUTING)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 64])
def test_gpu_route_bf16_weight(t):
    """A bf16 router weight (the loader keeps it fp32) still routes as the reference does."""
    x, weight, bias = route_inputs(
        t, MINI.hidden_size, MINI.num_experts, dtype=torch.bfloat16, device=CUDA, seed=t + 1
    )
    weight = weight.bfloat16()
    ids, weights = fused_route(x, weight, bias, **MINI_ROUTING)
    with torch_path():
        ref_ids, ref_weights = route(x, weight, bias, **MINI_ROUTING)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 64])
def test_gpu_rms_norm(t):
    d = MINI.hidden_size
    weight = torch.randn(d, device=CUDA).bfloat16()
    x = exact_values((1, t, d), torch.bfloat16, CUDA)
    assert torch.equal(rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
    x = torch.randn(1, t, d, device=CUDA).bfloat16()
    assert_within_one_ulp(
        rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6), max_fraction=0.01
    )
    x = torch.randn(1, t, d, device=CUDA)
    torch.testing.assert_close(
        rms_norm(x, weight.float(), 1e-6),
        torch_rms_norm(x, weight.float(), 1e-6),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 64])
@pytest.mark.parametrize("exact", [True, False])
def test_gpu_qk_norm_rotary(t, exact):
    check_qk_norm_rotary(
        MINI, b=1, t=t, past=96, s_max=256, dtype=torch.bfloat16, device=CUDA, exact=exact
    )


@pytest.mark.gpu
def test_gpu_qk_norm_rotary_batched_rows():
    check_qk_rows(MINI, dtype=torch.bfloat16, device=CUDA, rows_per_slot=(32, 32, 32), s_max=128)


def graph_matches_eager(fn, make_inputs) -> None:
    """fn's outputs captured in a CUDA graph and replayed on new inputs equal eager fn's."""
    static = make_inputs(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*static)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static)
    for seed in (1, 2):
        for dst, src in zip(static, make_inputs(seed), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for out, ref in zip(outs, fn(*make_inputs(seed)), strict=True):
            assert torch.equal(out, ref)


@pytest.mark.gpu
def test_gpu_graph_route_and_rms_norm():
    t, h, e = 32, MINI.hidden_size, MINI.num_experts
    weight = torch.randn(h, device=CUDA).bfloat16()

    def fn(x, router, router_bf16, bias):
        normed = rms_norm(x, weight, 1e-6).view(t, h)
        return (
            normed,
            *fused_route(normed, router, bias, **MINI_ROUTING),
            *fused_route(normed, router_bf16, bias, **MINI_ROUTING),
        )

    def inputs(seed):
        x, router, bias = route_inputs(t, h, e, dtype=torch.bfloat16, device=CUDA, seed=seed)
        return x.view(1, t, h), router, router.bfloat16(), bias

    graph_matches_eager(fn, inputs)


@pytest.mark.gpu
def test_gpu_graph_qk_norm_rotary():
    cfg, t, past = MINI, 32, 64
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    kv_shape = (1, cfg.num_key_value_heads, 128, cfg.head_dim)
    kbuf = torch.zeros(kv_shape, device=CUDA, dtype=torch.bfloat16)
    vbuf = torch.zeros_like(kbuf)
    rotary = Rotary(dim=cfg.rotary_dim, theta=cfg.rope_theta)
    cos, sin = rotary.cos_sin(torch.arange(past, past + t, device=CUDA), torch.bfloat16)
    qw = torch.randn(cfg.head_dim, device=CUDA).bfloat16()
    kw = torch.randn(cfg.head_dim, device=CUDA).bfloat16()

    def fn(qkv):
        q = kernel_qk(cfg, qkv, (qw, kw), cos, sin, (kbuf, vbuf), past)
        return q, kbuf.clone(), vbuf.clone()

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(1, t, width, generator=g).to(CUDA, torch.bfloat16),)

    graph_matches_eager(fn, inputs)
