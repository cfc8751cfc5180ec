"""LLaDA2's reference semantics where a config field or the loader decides (DESIGN.md section 4):
the router's values rounded to the model dtype, RoPE frequencies in fp32, tied embeddings, the
shared expert's size and the fields that the reference code ignores."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oled.model.checkpoint import load_checkpoint, save_checkpoint
from oled.model.config import ConfigWarning, ModelConfig
from oled.model.layers import Rotary
from oled.model.presets import preset_config, preset_tokenizer, random_tensors
from oled.runtime import resolve_model


def _write(path, cfg: ModelConfig, seed: int = 0):
    tensors = random_tensors(cfg, seed=seed)
    return save_checkpoint(
        path,
        config=cfg,
        tensors=tensors,
        tokenizer=preset_tokenizer("tiny", cfg),
        shard_bytes=None,
    )


def test_router_values_are_rounded_to_the_model_dtype():
    """The default's expert_bias is stored in F32 with values bf16 cannot hold: a bf16 model
    routes with them rounded to bf16 (in fp32 arithmetic), an fp32 model with them as stored."""
    path = resolve_model("builtin:tiny")
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as f:
        name = next(k for k in f.keys() if k.endswith("expert_bias"))
        stored = f.get_tensor(name)
    assert stored.dtype == torch.float32
    assert (stored.bfloat16().float() != stored).any()  # else this test shows nothing
    layer = int(name.split(".")[2])
    for dtype, expected in ((torch.bfloat16, stored.bfloat16().float()), (torch.float32, stored)):
        router = load_checkpoint(path, dtype=dtype).model.model.layers[layer].mlp.gate
        assert router.expert_bias.dtype == torch.float32 == router.weight.dtype
        assert torch.equal(router.expert_bias, expected)


def test_rope_frequencies_in_fp32_as_the_reference():
    rot = Rotary(dim=64, theta=600000.0)
    assert rot.inv_freq.dtype == torch.float32
    exact = 600000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    # fp32 arithmetic, not float64 rounded once: they differ in some frequencies
    assert not torch.equal(rot.inv_freq, exact.float())
    assert torch.allclose(rot.inv_freq.double(), exact, rtol=1e-6)


def test_tied_embeddings_share_one_tensor(tmp_path):
    cfg = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=True)
    _write(tmp_path, cfg)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # stored once, as the embeddings
    model = load_checkpoint(tmp_path).model
    assert model.lm_head.weight is model.model.word_embeddings.weight


def test_shared_expert_sized_as_the_reference_and_ignored_fields_warned(tmp_path):
    base = preset_config("tiny")
    odd = dataclasses.replace(
        base,
        moe_shared_expert_intermediate_size=3 * base.moe_intermediate_size,
        norm_topk_prob=False,
    )
    _write(tmp_path, odd)
    with pytest.warns(ConfigWarning) as seen:
        cfg = ModelConfig.from_json(tmp_path)
    text = " ".join(str(w.message) for w in seen)
    assert "moe_shared_expert_intermediate_size" in text and "norm_topk_prob" in text
    assert cfg.shared_intermediate_size == base.moe_intermediate_size * base.num_shared_experts
    model = load_checkpoint(tmp_path).model
    shared = model.moe_blocks[0].shared_experts
    assert shared.gate_proj.weight.shape[0] == base.moe_intermediate_size
    assert model.moe_blocks[0].gate.normalise  # the gate weights are normalised anyway


def test_no_shared_expert_when_null(tmp_path):
    cfg = dataclasses.replace(preset_config("tiny"), num_shared_experts=None)
    _write(tmp_path, cfg)
    assert ModelConfig.from_json(tmp_path).num_shared_experts is None  # null survives the file
    model = load_checkpoint(tmp_path).model
    assert model.moe_blocks[0].shared_experts is None
    x = torch.randn(1, 3, cfg.hidden_size, dtype=torch.bfloat16)
    block = model.moe_blocks[0]
    request = block.route(x)
    routed = torch.zeros_like(request.x)
    assert torch.equal(block.finish(x, request, routed), routed.view(x.shape))


def test_the_command_line_shows_an_ignored_field_as_one_warning_line(tmp_path):
    from typer.testing import CliRunner

    from oled.cli import app

    _write(tmp_path, dataclasses.replace(preset_config("tiny"), norm_topk_prob=False))
    result = CliRunner().invoke(app, ["model", "info", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "norm_topk_prob" in line]
    assert lines == [
        f"warning: {tmp_path / 'config.json'}: norm_topk_prob = false: LLaDA2's "
        "reference code ignores it and always normalises the top-k gate weights; "
        "so does OLED-MoE"
    ]
