"""SwiGLU's silu * up, the MoE residual sum and the pairs' sum over top-k as single kernels,
against the torch ops they replace: under the Triton interpreter on CPU, bit for bit on CUDA."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from oled.kernels.elementwise import (  # noqa: E402
    combine_pairs,
    residual_add,
    silu_mul,
)
from oled.model.config import mini_config  # noqa: E402
from tests.kernels.conftest import assert_within_one_ulp  # noqa: E402

CUDA = torch.device("cuda")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def randn(*shape, dtype, device=DEVICE, seed=0, scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate, up = randn(5, 37, dtype=dtype, seed=1), randn(5, 37, dtype=dtype, seed=2)
    out, ref = silu_mul(gate, up), F.silu(gate) * up
    if dtype == torch.float32:  # two roundings, each after an exp that may differ in the last bit
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert_within_one_ulp(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_equals_torch(dtype):
    x, a, b = (randn(2, 3, 1100, dtype=dtype, seed=s) for s in (1, 2, 3))
    out = residual_add(x, a, b)
    assert out.shape == x.shape and torch.equal(out, x + (a + b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_pairs_sums_over_top_k(dtype):
    pairs = randn(6, 8, 1030, dtype=torch.float32, seed=4)
    out = combine_pairs(pairs, dtype)
    assert out.dtype == dtype and out.shape == (6, 1030)
    torch.testing.assert_close(out, pairs.sum(dim=1).to(dtype), rtol=1e-5, atol=1e-5)
    exact = torch.randint(-64, 65, (3, 5, 70), generator=torch.Generator().manual_seed(5)) / 8
    exact = exact.to(DEVICE)  # eighths: every order sums them exactly
    assert torch.equal(combine_pairs(exact, torch.float32), exact.sum(dim=1))


def test_combine_pairs_of_a_row_do_not_depend_on_the_others():
    pairs = randn(32, 8, 300, dtype=torch.float32, seed=6)
    whole = combine_pairs(pairs, torch.bfloat16)
    assert torch.equal(combine_pairs(pairs[5:9], torch.bfloat16), whole[5:9])


def test_bad_inputs_are_refused():
    a = torch.zeros(2, 3, device=DEVICE)
    with pytest.raises(ValueError, match="differ"):
        silu_mul(a, torch.zeros(3, 2, device=DEVICE))
    with pytest.raises(ValueError, match="differ"):
        residual_add(a, a, a.bfloat16())
    with pytest.raises(ValueError, match="fp32"):
        combine_pairs(torch.zeros(2, 3, 4, device=DEVICE).bfloat16(), torch.bfloat16)
    assert combine_pairs(torch.zeros(0, 8, 4, device=DEVICE), torch.bfloat16).shape == (0, 4)


# CUDA, real shapes --------------------------------------------------------------------------

MINI = mini_config()


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 256])
def test_gpu_elementwise_equal_torch_bit_for_bit(t):
    h, i = MINI.hidden_size, MINI.moe_intermediate_size
    gate, up = randn(t, i, dtype=torch.bfloat16, seed=1), randn(t, i, dtype=torch.bfloat16, seed=2)
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
    x, a, b = (randn(1, t, h, dtype=torch.bfloat16, seed=s) for s in (3, 4, 5))
    assert torch.equal(residual_add(x, a, b), x + (a + b))
    pairs = randn(t, MINI.num_experts_per_tok, h, dtype=torch.float32, seed=6, scale=0.05)
    torch.testing.assert_close(
        combine_pairs(pairs, torch.bfloat16), pairs.sum(1).bfloat16(), rtol=1e-2, atol=1e-3
    )
    assert torch.equal(
        combine_pairs(pairs[:8], torch.bfloat16), combine_pairs(pairs, torch.bfloat16)[:8]
    )


def test_moe_residual_sum_is_one_kernel_or_torch_promotion():
    """MoE.add_to: residual + (routed + shared) in one kernel when the three share a dtype
    (bit for bit as torch's two adds), torch's promotion when they do not."""
    from oled import kernels
    from oled.model.model import MoE, MoERequest
    from oled.model.presets import tiny_config

    moe = MoE(tiny_config(), 0).to(DEVICE, torch.bfloat16)
    h = tiny_config().hidden_size
    x = randn(3, h, dtype=torch.bfloat16, seed=1)
    residual, routed = (
        randn(1, 3, h, dtype=torch.bfloat16, seed=2),
        randn(3, h, dtype=torch.bfloat16, seed=3),
    )
    request = MoERequest(0, x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    kernels.use("triton")
    try:
        with torch.inference_mode():
            shared = moe.shared_experts(x).view(residual.shape)  # [1, 3, H]
            fused = moe.add_to(residual, request, routed)
            promoted = moe.add_to(residual, request, routed.float())
    finally:
        kernels.use("auto")
    assert fused.dtype == torch.bfloat16
    assert torch.equal(fused, residual + (routed.view(residual.shape) + shared))
    assert promoted.dtype == torch.float32
    assert torch.equal(promoted, residual + (routed.float().view(residual.shape) + shared))
