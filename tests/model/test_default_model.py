"""The trained default model shipped as `builtin:tiny`, and the training objective's forward."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from oled.model.config import ModelConfig
from oled.runtime import load_runtime, resolve_model, shipped_default

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shipped_default() is None, reason="no shipped default model")


@pytest.fixture(scope="module")
def runtime():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rt = load_runtime("builtin:tiny", device="cpu", dtype="bfloat16")
    yield rt


def test_builtin_tiny_is_the_shipped_checkpoint():
    path = resolve_model("builtin:tiny")
    assert path == shipped_default()
    cfg = ModelConfig.from_json(path)
    assert cfg.first_k_dense_replace == 1 and cfg.num_moe_layers >= 3
    assert cfg.num_shared_experts == 1 and cfg.num_experts >= 32
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 40 * 2**20, f"{size / 2**20:.1f} MiB shipped"
    assert (path / "tokenizer.json").exists() and (path / "model.safetensors").exists()


def test_answers_a_question_in_words(runtime):
    t0 = time.perf_counter()
    gen = runtime.generate("Who wrote Hamlet?", max_new_tokens=32)
    seconds = time.perf_counter() - t0
    words = re.findall(r"[^\s]+", gen.text)
    assert len(words) >= 3, gen.text
    alphabetic = [w for w in words if re.fullmatch(r"[A-Za-z']+[.,;:!?)]*", w.strip("(\"'"))]
    assert len(alphabetic) / len(words) >= 0.6, gen.text
    assert seconds < 20, f"{seconds:.1f} s on CPU"


def test_routing_uses_most_experts(runtime):
    cfg = runtime.config
    used = [set() for _ in range(cfg.num_moe_layers)]
    remove = runtime.model.add_routing_hook(
        lambda layer, ids, w: used[layer].update(ids.ravel().tolist())
    )
    try:
        text = (
            "In the beginning God created the heaven and the earth. To be, or not to be: "
            "that is the question. Now is the winter of our discontent made glorious summer. "
            "And the LORD spake unto Moses, saying, Speak unto the children of Israel. "
            "O Romeo, Romeo! wherefore art thou Romeo? Friends, Romans, countrymen, lend me "
            "your ears; I come to bury Caesar, not to praise him. Blessed are the meek."
        )
        ids = torch.tensor([runtime.tokenizer.encode(text)])
        with torch.inference_mode():
            runtime.model(ids, block_length=32)
    finally:
        remove()
    for layer, experts in enumerate(used):
        assert len(experts) >= 0.75 * cfg.num_experts, (layer, len(experts))


def test_training_forward_matches_block_causal_decoding():
    """The noisy+clean copy forward gives each block what LLaDA2Model.forward gives it."""
    import oled.train as T

    cfg = T.TrainConfig(
        hidden=64,
        layers=3,
        heads=2,
        kv_heads=1,
        head_dim=32,
        intermediate=64,
        experts=8,
        top_k=2,
        groups=2,
        topk_group=1,
        moe_intermediate=16,
        vocab_size=600,
    )
    mcfg = cfg.model_config()
    gen = torch.Generator().manual_seed(0)
    model = T.init_model(mcfg, gen).double()
    experts = T.TrainExperts(mcfg, gen).to("cpu")
    experts.w13 = [torch.nn.Parameter(w.double()) for w in experts.w13]
    experts.w2 = [torch.nn.Parameter(w.double()) for w in experts.w2]
    model.set_executor(experts)
    L, bl = 96, 32
    clean = torch.randint(0, 300, (1, L), generator=gen)
    noisy = torch.where(torch.rand(1, L, generator=gen) < 0.5, 305, clean)
    h = T.hidden_states(
        model, torch.cat([noisy, clean], 1), torch.arange(L).repeat(2), T.dual_mask(L, bl, "cpu")
    )
    logits = model.lm_head(h[:, :L]).float()
    for b in range(L // bl):
        inputs = torch.cat([clean[:, : b * bl], noisy[:, b * bl : (b + 1) * bl]], 1)
        ref = model(inputs, block_length=bl, logits_from=b * bl)
        assert torch.allclose(ref, logits[:, b * bl : (b + 1) * bl], atol=1e-6)


def test_training_experts_match_a_loop_over_pairs_with_gradients():
    """The grouped training executor computes sum_k w_k * expert_k(x), gradients included."""
    import oled.train as T

    cfg = T.parse_config(["--preset", "twin", "--hidden", "32", "--moe-intermediate", "8"])
    assert (cfg.layers, cfg.experts, cfg.top_k, cfg.groups, cfg.topk_group) == (20, 256, 8, 8, 4)
    mcfg = cfg.model_config()
    gen = torch.Generator().manual_seed(0)
    experts = T.TrainExperts(mcfg, gen).to("cpu")
    x = torch.randn(6, 32, requires_grad=True)
    ids = torch.stack([torch.randperm(256, generator=gen)[:8] for _ in range(6)])  # [T, K]
    w = torch.rand(6, 8)
    out = experts(2, x, ids, w)
    ref = []
    for t in range(6):
        acc = torch.zeros(32)
        for k in range(8):
            g, u = (x[t] @ experts.w13[2][ids[t, k]].t()).chunk(2)
            acc = acc + w[t, k] * ((torch.nn.functional.silu(g) * u) @ experts.w2[2][ids[t, k]].t())
        ref.append(acc)
    ref = torch.stack(ref)
    assert torch.allclose(out, ref, atol=1e-5)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    assert torch.allclose(gx, rx, atol=1e-4)
    assert experts.load[2].sum() == 6 * 8 and experts.load[2][ids.reshape(-1)].min() >= 1
