"""Next-layer routing prediction: layer l + 1's router on layer l's router input, rescaled to
layer l + 1's norm."""

from __future__ import annotations

from dataclasses import replace

import torch

from oled.offload.budget import Budget
from oled.offload.predict import NextLayerRouting
from oled.runtime import Runtime, build_runtime, load_runtime


def test_prediction_is_the_next_router_on_the_same_residual(tiny_dir):
    model = load_runtime(str(tiny_dir), device="cpu", dtype="float32").checkpoint.model
    first = model.config.first_k_dense_replace
    layers = model.model.layers[first:]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms that differ per layer, as in a trained model
        for layer in layers:
            w = layer.post_attention_layernorm.weight
            w.copy_(0.5 + torch.rand(w.shape, generator=gen))
    predict = NextLayerRouting(model)
    assert predict.num_layers == len(layers) and all(r is not None for r in predict.rescale)
    h = torch.randn(64, model.config.hidden_size, generator=gen)  # [T, H] residual
    for m in range(len(layers) - 1):
        x = layers[m].post_attention_layernorm(h)  # layer m's router input
        want = model.moe_blocks[m + 1].gate(layers[m + 1].post_attention_layernorm(h))[0]
        got = predict(m, x)
        assert got.shape == want.shape == (64, model.config.num_experts_per_tok)
        same_rows = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean()
        assert same_rows > 0.95  # fp32 rounding of the rescale may flip a near-tie


def test_equal_norms_predict_with_the_input_as_it_is(tiny_dir):
    model = load_runtime(str(tiny_dir), device="cpu", dtype="float32").checkpoint.model
    predict = NextLayerRouting(model)  # random checkpoints have unit norms
    assert predict.rescale == [None] * (predict.num_layers - 1)
    x = torch.randn(8, model.config.hidden_size)
    assert torch.equal(predict(0, x), model.moe_blocks[1].gate(x)[0])


def _copying_ahead(tiny_dir, fraction: float, retention, compensation, **runtime) -> Runtime:
    """The tiny checkpoint offloaded on the CPU at `fraction` of its experts, copying up to 8
    experts a layer ahead."""
    return build_runtime(
        model=str(tiny_dir),
        device="cpu",
        dtype="float32",
        cost="cpu-ci",
        budget=Budget("expert_fraction", fraction),
        retention=retention,
        compensation=compensation,
        prefetch=8,
        **runtime,
    )


def test_recorded_routing_predicts_the_next_layer_exactly(tiny_dir):
    """A trace of the followed generation is a perfect prediction: every expert copied ahead
    is then needed, and the tokens stay the resident ones."""
    from oled.decoding import Trajectory
    from oled.offload.predict import RecordedRouting
    from oled.policies import compensation as C
    from oled.policies import retention as R
    from oled.trace.record import record

    kw = dict(max_new_tokens=24, threshold=0.6, block_length=8)
    resident = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    trajectory = Trajectory()
    want = resident.generate("Once upon a time", observers=[trajectory], **kw).token_ids
    prompt = resident.prompt_ids("Once upon a time", chat=True)
    oracle = RecordedRouting(
        record(resident, [prompt], decode=replace(resident.decode, **kw), follow=trajectory)
    )
    rt = _copying_ahead(tiny_dir, 0.25, R.LRURetention(), C.TransferOnly())
    rt.executor.predict = oracle
    rt.observers.append(oracle)
    got = rt.generate("Once upon a time", follow=trajectory, **kw).token_ids
    s = rt.stats()
    assert got == want
    assert s["predicted"] > 0 and s["predicted_hits"] == s["predicted"]


def test_copies_ahead_from_the_forward_before_give_the_resident_tokens(tiny_dir):
    """ahead_from "previous": each layer's plan copies ahead into the next layer what that layer
    routed the forward before and its cache lacks (here: what went to the CPU); the engine
    issues them after the layer's own copies, and the tokens stay the resident ones."""
    from oled.policies import compensation as C
    from oled.policies import retention as R

    kw = dict(max_new_tokens=32, threshold=0.6, block_length=8)
    resident = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    want = resident.generate("Once upon a time", **kw).token_ids
    rt = _copying_ahead(
        tiny_dir, 0.75, R.LFURetention(), C.MakespanCompensation(), ahead_from="previous"
    )
    assert rt.executor.predict is None  # no router prediction: the planner's own memory
    got = rt.generate("Once upon a time", **kw).token_ids
    s = rt.stats()
    assert got == want
    assert 0 < s["predicted_hits"] <= s["predicted"] <= s["copies"]
