"""Checkpoints: written by `oled model init`, loaded back, and the errors users meet."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from oled.model.checkpoint import CheckpointError, check_shards, load_checkpoint
from oled.model.config import ConfigError, ModelConfig
from oled.model.experts import ExpertStore, ResidentExperts
from oled.model.model import LLaDA2Model
from oled.model.presets import random_tensors, tiny_config
from oled.model.tokenizer import TokenizerError


def in_memory_logits(tokens: torch.Tensor) -> torch.Tensor:
    """The tiny model built straight from the random tensors, never touching disk."""
    cfg = tiny_config()
    tensors = dict(random_tensors(cfg, seed=0))
    model = LLaDA2Model(cfg)
    dense = {k: v.float() for k, v in tensors.items() if ".experts." not in k}
    model.load_state_dict(dense)
    i = cfg.moe_intermediate_size
    store = ExpertStore.empty(
        layers=cfg.num_moe_layers,
        experts=cfg.num_experts,
        hidden=cfg.hidden_size,
        inter=i,
        dtype=torch.float32,
        pin=False,
    )
    for m, layer in enumerate(cfg.moe_layers):
        for e in range(cfg.num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            store.w13[m][e] = torch.cat(
                [tensors[p + "gate_proj.weight"], tensors[p + "up_proj.weight"]]
            )
            store.w2[m][e] = tensors[p + "down_proj.weight"]
    model.set_executor(ResidentExperts(store, "cpu"))
    return model(tokens, block_length=32)


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_single_dir"])
def test_loads_back_to_the_same_logits(fixture, request):
    path = request.getfixturevalue(fixture)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    ckpt.model.set_executor(ResidentExperts(ckpt.experts, "cpu"))
    tokens = torch.randint(0, 700, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(ckpt.model(tokens, block_length=32), in_memory_logits(tokens))


def test_sharded_layout(tiny_dir):
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert "model.layers.1.mlp.experts.31.down_proj.weight" in index["weight_map"]
    assert "model.layers.1.mlp.gate.expert_bias" in index["weight_map"]


def test_expert_store_layout(tiny_dir):
    ckpt = load_checkpoint(tiny_dir)
    cfg = ckpt.config
    assert ckpt.experts.num_layers == cfg.num_moe_layers
    assert ckpt.experts.w13[0].shape == (32, 2 * 64, 128)
    assert ckpt.experts.w2[0].shape == (32, 128, 64)
    assert ckpt.experts.w13[0][3].is_contiguous()
    # routed experts are not model parameters: they are held once, in the store
    assert not any(".experts." in name for name in ckpt.model.state_dict())


def test_a_share_of_the_experts_loads_as_its_own_store(tiny_dir):
    whole = load_checkpoint(tiny_dir).experts
    share = load_checkpoint(tiny_dir, experts=range(8, 16)).experts
    assert share.num_experts == 8
    assert torch.equal(share.w13[1], whole.w13[1][8:16])
    assert torch.equal(share.w2[2], whole.w2[2][8:16])


def test_flash_shape_is_llada2_flash_and_its_init_checks_the_disk(tmp_path, monkeypatch):
    """LLaDA2.0-flash's published shape (102.9B parameters); a disk too small for its 206 GB
    is said before anything is written."""
    from oled.model import presets

    cfg = presets.preset_config("flash-shape")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (32, 4096, 32)
    assert (cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (1024, 256, 8)
    assert 205e9 < presets.checkpoint_bytes(cfg) < 206e9
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(free=10**11))
    with pytest.raises(ValueError, match=r"flash-shape takes 205.8 GB; the disk of .* 100.0 GB"):
        presets.init_checkpoint(tmp_path / "flash", preset="flash-shape")
    assert not (tmp_path / "flash").exists()


def copy_of(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_names_file_and_tensor(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    del index["weight_map"]["model.layers.2.mlp.experts.7.up_proj.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError,
        match=r"index.json: tensor 'model\.layers\.2\.mlp\.experts\.7\.up_proj\.weight' is missing",
    ):
        load_checkpoint(path)


def test_misshaped_tensor(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["moe_intermediate_size"] = 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \[.*\], expected \[.*\]"):
        load_checkpoint(path)


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(tmp_path)
    gone = f"^{tmp_path / 'gone'}: no such checkpoint directory$"
    with pytest.raises(ConfigError, match=gone):
        ModelConfig.from_json(tmp_path / "gone")
    with pytest.raises(CheckpointError, match=gone):
        load_checkpoint(tmp_path / "gone")


def test_unsupported_config_value(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["score_function"] = "softmax"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: score_function = 'softmax'"):
        load_checkpoint(path)


def test_missing_tokenizer(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_checkpoint(path)


def test_missing_shard(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors: shard named"):
        load_checkpoint(path)


def _truncate(file, size: int) -> None:
    with file.open("r+b") as f:
        f.truncate(size)


def _garble_header(file) -> None:
    data = bytearray(file.read_bytes())
    data[8:16] = b"{garbage"
    file.write_bytes(bytes(data))


DAMAGE = {  # what is done to a shard, and what the error then says of it
    "cut in its data": (lambda f: _truncate(f, f.stat().st_size // 2), "truncated: "),
    "cut in its header": (lambda f: _truncate(f, 100), "truncated: 100 bytes"),
    "cut to 4 bytes": (lambda f: _truncate(f, 4), "not a safetensors file"),
    "garbled header": (_garble_header, "not a safetensors file (malformed header)"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_single_dir"])
def test_a_damaged_shard_is_named_by_loading_and_by_the_check(fixture, damage, request, tmp_path):
    path = copy_of(request.getfixturevalue(fixture), tmp_path)
    shard = sorted(path.glob("*.safetensors"))[-1]
    harm, problem = DAMAGE[damage]
    harm(shard)
    for attempt in (lambda: load_checkpoint(path), lambda: check_shards(path, _config(path))):
        with pytest.raises(CheckpointError) as info:
            attempt()
        message = str(info.value)
        assert message.startswith(f"{shard}: ") and problem in message, message
        assert "\n" not in message


def _config(path) -> ModelConfig:
    return ModelConfig.from_json(path)


@pytest.mark.parametrize("fixture", ["tiny_dir", "tiny_single_dir"])
def test_the_check_of_an_intact_checkpoint_counts_its_shards(fixture, request):
    path = request.getfixturevalue(fixture)
    files = sorted(path.glob("*.safetensors"))
    assert check_shards(path, _config(path)) == (len(files), sum(f.stat().st_size for f in files))


def test_the_check_finds_a_missing_or_misshaped_tensor_as_loading_does(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path / "misshaped")
    cfg = json.loads((path / "config.json").read_text())
    cfg["moe_intermediate_size"] = 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \[.*\], expected \[.*\]"):
        check_shards(path, _config(path))
    path = copy_of(tiny_dir, tmp_path / "misplaced")  # the index names the wrong shard
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = "model.norm.weight"
    wrong = next(
        f.name for f in sorted(path.glob("*.safetensors")) if f.name != index["weight_map"][name]
    )
    index["weight_map"][name] = wrong
    index_file.write_text(json.dumps(index))
    for attempt in (lambda: load_checkpoint(path), lambda: check_shards(path, _config(path))):
        with pytest.raises(CheckpointError, match=f"{wrong}: tensor '{name}' is missing"):
            attempt()
