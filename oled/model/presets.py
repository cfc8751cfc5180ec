"""Model presets and random-initialised checkpoints in the real LLaDA2 layout."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from oled.model.checkpoint import expected_shapes, save_checkpoint
from oled.model.config import ModelConfig, mini_config
from oled.model.tokenizer import Tokenizer, special_ids, train_byte_bpe


def tiny_config() -> ModelConfig:
    """Decodes quickly on 2 CPU cores: 4 layers (1 dense), hidden 128, 32 experts, top-4."""
    return replace(
        mini_config(),
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        n_group=4,
        topk_group=2,
        max_position_embeddings=4096,
        pad_token_id=1024 - 292,
        eos_token_id=1024 - 292,
    )


def small_config() -> ModelConfig:
    """A step up for CPU policy studies: 8 layers, hidden 256, 64 experts, top-6."""
    return replace(
        tiny_config(),
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        head_dim=32,
        num_experts=64,
        num_experts_per_tok=6,
        moe_intermediate_size=128,
        n_group=8,
        topk_group=4,
        pad_token_id=4096 - 292,
        eos_token_id=4096 - 292,
    )


PRESETS = {"tiny": tiny_config, "small": small_config, "mini-shape": mini_config}
BPE_SIZE = {"tiny": 700, "small": 3000, "mini-shape": 8000}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        from oled.registry import suggest

        hint = suggest(name, PRESETS)
        raise ValueError(f"unknown preset {name!r}{hint}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]()


def corpus() -> list[str]:
    """The small built-in text the presets' tokenizers are trained on."""
    text = resources.files("oled").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return text.splitlines()


def preset_tokenizer(name: str, cfg: ModelConfig) -> Tokenizer:
    return train_byte_bpe(corpus(), vocab_size=BPE_SIZE[name], specials=special_ids(cfg.vocab_size))


def random_tensors(
    cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, Tensor]]:
    """Every checkpoint tensor, random, streamed in name order (bf16; expert_bias in fp32).

    Word embeddings have unit variance so that routing follows the token as in a trained model;
    with std 0.02 everywhere routing collapses onto a few experts per layer and flatters caches.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = torch.ones(shape, device=device)
        elif name.endswith("expert_bias"):
            yield name, torch.zeros(shape, dtype=torch.float32, device=device)
            continue
        else:
            std = 1.0 if name == "model.word_embeddings.weight" else 0.02
            t = torch.randn(shape, generator=gen, device=device) * std
        yield name, t.to(torch.bfloat16)


def init_checkpoint(
    path: str | Path,
    *,
    preset: str,
    seed: int = 0,
    device: torch.device | str = "cpu",
    shard_bytes: int | None = 2 << 30,
) -> Path:
    """Write a random-initialised checkpoint of `preset` to `path` in the LLaDA2 layout."""
    cfg = preset_config(preset)
    tokenizer = preset_tokenizer(preset, cfg)
    return save_checkpoint(
        path,
        config=cfg,
        tensors=random_tensors(cfg, seed=seed, device=device),
        tokenizer=tokenizer,
        shard_bytes=shard_bytes,
    )
