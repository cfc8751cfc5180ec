"""The forward as steps (what CUDA graph pieces are cut from) and the eager forward strategy."""

from __future__ import annotations

import torch

from oled.model.graphs import EagerForward, GraphedForward
from oled.model.model import KVCache, drive
from oled.runtime import load_runtime


def test_steps_yield_each_moe_layer_and_give_the_forward(tiny_dir):
    rt = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    model, cfg = rt.model, rt.config
    tokens = torch.randint(0, 200, (1, 40))
    seen = []

    def routed(request):
        seen.append((request.layer, request.x.shape, request.ids.shape, request.weights.dtype))
        return rt.executor(request.layer, request.x, request.ids, request.weights)

    with torch.inference_mode():
        logits = drive(model.steps(tokens, block_length=8, logits_from=32), routed)
        assert torch.equal(logits, model(tokens, block_length=8, logits_from=32))
    h, k = cfg.hidden_size, cfg.num_experts_per_tok
    assert seen == [
        (m, torch.Size([40, h]), torch.Size([40, k]), torch.float32)
        for m in range(cfg.num_moe_layers)
    ]
    assert logits.shape == (1, 8, cfg.vocab_size)


def test_eager_forward_matches_the_model_over_a_cache(tiny_dir):
    rt = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    forward = EagerForward(rt.model)
    assert not isinstance(rt.forward, GraphedForward)  # CUDA graphs only on CUDA devices
    tokens = torch.randint(0, 200, (1, 24))
    with torch.inference_mode():
        cache = forward.new_cache(24, "cpu")
        assert isinstance(cache, KVCache) and cache.max_len == 24 and cache.length == 0
        first = forward(tokens[:, :16], start=0, cache=cache, block_length=8, logits_from=8)
        cache.length = 16
        second = forward(tokens[:, 16:], start=16, cache=cache, block_length=8, logits_from=0)
        full = rt.model(tokens, block_length=8)
    assert torch.allclose(first[0], full[0, 8:16], atol=1e-5)
    assert torch.allclose(second[0], full[0, 16:], atol=1e-5)
