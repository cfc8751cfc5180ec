"""Model presets and random-initialised checkpoints in the real LLaDA2 layout."""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from oled.model.checkpoint import expected_shapes, save_checkpoint
from oled.model.config import SHAPES, SHIPPED, ModelConfig, shipped_default
from oled.model.config import small_config as small_config  # re-exported: the shapes' home
from oled.model.config import tiny_config as tiny_config
from oled.model.tokenizer import Tokenizer, special_ids, train_byte_bpe
from oled.paths import cache_home
from oled.progress import track

PRESETS = SHAPES  # the presets of `oled model init --preset`: the named shapes
BPE_SIZE = {
    "tiny": 700,
    "small": 3000,
    "mini-shape": 8000,
    "flash-shape": 8000,
}  # each preset's tokenizer vocabulary


def preset_config(name: str) -> ModelConfig:
    """The config of preset `name` (ModelConfig.from_name)."""
    return ModelConfig.from_name(name)


def builtin_checkpoint(name: str) -> Path:
    """The checkpoint directory of built-in `name` (oled.model.config.BUILTIN_MODELS): the
    shipped default for the trained one, else a random-initialised checkpoint (seed 0) made
    under cache_home()/models on first use."""
    if name == SHIPPED and (shipped := shipped_default()) is not None:
        return shipped
    target = cache_home() / "models" / f"{name}-seed0"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            init_checkpoint(tmp, preset=name, seed=0)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def corpus() -> list[str]:
    """The small built-in text the presets' tokenizers are trained on."""
    text = resources.files("oled").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return text.splitlines()


def preset_tokenizer(name: str, cfg: ModelConfig) -> Tokenizer:
    return train_byte_bpe(corpus(), vocab_size=BPE_SIZE[name], specials=special_ids(cfg.vocab_size))


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """The bytes of a checkpoint's tensors as `random_tensors` writes them."""
    return sum(
        math.prod(shape) * (4 if name.endswith("expert_bias") else 2)
        for name, shape in expected_shapes(cfg).items()
    )


def random_tensors(
    cfg: ModelConfig, *, seed: int, device: torch.device | str = "cpu", progress: bool = False
) -> Iterator[tuple[str, Tensor]]:
    """Every checkpoint tensor, random, streamed in name order (bf16; expert_bias in fp32): one
    at a time, so that no process ever holds the model whole.

    Word embeddings have unit variance so that routing follows the token as in a trained model;
    with std 0.02 everywhere routing collapses onto a few experts per layer and flatters caches.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = list(expected_shapes(cfg).items())
    for name, shape in track(shapes, "writing tensors", show=progress):
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
    progress: bool = False,
) -> Path:
    """Write a random-initialised checkpoint of `preset` to `path` in the LLaDA2 layout, shard
    by shard (a ValueError first when the disk holds less than it needs)."""
    cfg = preset_config(preset)
    need = checkpoint_bytes(cfg)
    existing = next(p for p in (Path(path), *Path(path).absolute().parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if need > free:
        raise ValueError(
            f"{preset} takes {need / 1e9:.1f} GB; the disk of {existing} has {free / 1e9:.1f} GB "
            "free"
        )
    tokenizer = preset_tokenizer(preset, cfg)
    return save_checkpoint(
        path,
        config=cfg,
        tensors=random_tensors(cfg, seed=seed, device=device, progress=progress),
        tokenizer=tokenizer,
        shard_bytes=shard_bytes,
    )
