"""The whole model with the fused kernels: close to the torch kernels, and still exact offloaded.

Without a GPU the kernels run through Triton's interpreter (tests/conftest.py sets it), so the
same checks run in CI on the CPU and on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from oled import kernels
from oled.offload.budget import Budget
from oled.policies import allocation as A
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.runtime import build_runtime, load_runtime

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = "Once upon a time there was a small robot"


@pytest.fixture
def fused_mode():
    kernels.use("triton")
    yield
    kernels.use("auto")


def logits(rt, mode: str) -> torch.Tensor:
    kernels.use(mode)
    ids = torch.tensor([rt.prompt_ids(PROMPT, chat=False)], device=rt.device)
    with torch.inference_mode():
        return rt.model(ids)[0]  # [T, V]


FUSED = [
    ("norm", "rms_norm"),
    ("norm", "qk_norm_rotary"),
    ("route", "select_experts"),
    ("moe", "fused_expert_pairs"),
    ("elementwise", "silu_mul"),
    ("elementwise", "residual_add"),
    ("elementwise", "combine_pairs"),
]


def test_fused_logits_match_the_torch_kernels(tiny_dir, fused_mode, monkeypatch):
    import importlib

    calls = {name: 0 for _, name in FUSED}
    for module, name in FUSED:
        mod = importlib.import_module(f"oled.kernels.{module}")
        real = getattr(mod, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*args, **kw)

        monkeypatch.setattr(mod, name, counted)
    rt = load_runtime(str(tiny_dir), device=DEVICE, dtype="float32", kernels="triton")
    fused = logits(rt, "triton")
    layers, moe = rt.config.num_hidden_layers, rt.config.num_moe_layers
    shared = moe if rt.config.shared_intermediate_size else 0
    assert shared  # the tiny preset has shared experts
    assert calls == {
        "rms_norm": 2 * layers + 1,
        "qk_norm_rotary": layers,
        "select_experts": moe,
        "fused_expert_pairs": moe,
        "silu_mul": layers - moe + shared,  # dense MLPs and shared experts
        "residual_add": shared,
        "combine_pairs": moe,
    }
    plain = logits(rt, "torch")
    assert calls["select_experts"] == moe  # the torch kernels call none of them
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def resident_fused_tokens(tiny_dir) -> list[int]:
    kernels.use("triton")
    try:
        rt = load_runtime(str(tiny_dir), device=DEVICE, dtype="float32", kernels="triton")
        return rt.generate(PROMPT, **SHORT).token_ids
    finally:
        kernels.use("auto")


SHORT = dict(max_new_tokens=6, block_length=6, threshold=0.6)


@pytest.mark.parametrize(
    "compensation", [C.TransferOnly, C.CpuOnly], ids=["transfer_only", "cpu_only"]
)
def test_offloaded_fused_tokens_equal_resident_fused(
    tiny_dir, fused_mode, resident_fused_tokens, compensation
):
    rt = build_runtime(
        model=str(tiny_dir),
        device=DEVICE,
        dtype="float32",
        budget=Budget("expert_budget", 3),
        cost="cpu-ci",
        retention=R.LRURetention(),
        compensation=compensation(),
        allocation=A.UniformAllocation(),
        stage_capacity=2,
        kernels="triton",
    )
    assert rt.generate(PROMPT, **SHORT).token_ids == resident_fused_tokens
    assert rt.stats()["misses"] > 0


def test_triton_kernels_need_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need a CUDA device"):
        kernels.check("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown kernels"):
        kernels.use("fast")
    kernels.check("torch", torch.device("cpu"))


def test_a_padded_batch_with_the_fused_kernels_matches_the_torch_kernels(tiny_dir, fused_mode):
    """A batch laid out as the graphed forward lays it out (padded query blocks over each
    slot's keys; the q/k kernel writing each row's key and value into its slot) keeps the keys
    and values, and so the tokens, of the torch kernels' scatter."""
    from oled.decoding import DecodeConfig
    from oled.decoding.batch import BatchDecoder
    from oled.model.graphs import EagerForward

    rt = load_runtime(str(tiny_dir), device=DEVICE, dtype="float32", kernels="triton")
    prompts = [rt.prompt_ids(PROMPT, chat=False), rt.prompt_ids("A cat sat", chat=False)]
    caches, tokens = {}, {}
    for mode in ("triton", "torch"):
        kernels.use(mode)
        dec = BatchDecoder(
            rt.model,
            mask_id=rt.tokenizer.mask_id,
            forward=EagerForward(rt.model, exact_batches=False),
            max_batch=2,
            block_length=4,
        )
        streams = [dec.add(p, DecodeConfig(max_new_tokens=4, block_length=4)) for p in prompts]
        with torch.inference_mode():
            for _ in range(2):  # the prompts' forward, then a block's
                dec.step()
        assert dec.cache is not None and dec._layout is not None
        assert dec._layout.rows.spans is None  # padded blocks: the graphed forward's rows
        caches[mode] = [t.clone() for t in dec.cache.layer(0)]
        tokens[mode] = [dec.seqs[s.slot].tolist() for s in streams]
    for fused, plain in zip(caches["triton"], caches["torch"], strict=True):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert tokens["triton"] == tokens["torch"]
