"""A loaded model ready to decode: checkpoint + expert executor + decoder, on one device."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from oled.decoding import BlockDecoder, BlockInfo, DecodeConfig, DecodeObserver, GenerationStats
from oled.model.checkpoint import Checkpoint, load_checkpoint
from oled.model.experts import ResidentExperts
from oled.model.presets import PRESETS, init_checkpoint

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
BUILTIN = "builtin:"


def cache_home() -> Path:
    """Where built-in models are kept: $OLED_HOME, else ~/.cache/oled."""
    return Path(os.environ.get("OLED_HOME") or Path.home() / ".cache" / "oled")


def resolve_model(spec: str) -> Path:
    """A checkpoint directory for a path or `builtin:NAME` (made on first use, seed 0)."""
    if not spec.startswith(BUILTIN):
        return Path(spec).expanduser()
    name = spec[len(BUILTIN) :]
    if name not in PRESETS or name == "mini-shape":
        choices = [p for p in PRESETS if p != "mini-shape"]
        raise ValueError(f"unknown built-in model {spec!r}; choose from builtin:{choices}")
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


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def pick_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class Generation:
    """One finished answer."""

    text: str
    token_ids: list[int]
    stats: GenerationStats


class Runtime:
    """Model, tokenizer and expert execution on one device; decodes prompts."""

    def __init__(
        self,
        *,
        checkpoint: Checkpoint,
        device: torch.device,
        executor,
        decode: DecodeConfig,
        observers: Sequence[DecodeObserver] = (),
    ) -> None:
        self.checkpoint = checkpoint
        self.device = device
        self.executor = executor
        self.decode = decode
        self.observers = list(observers)
        checkpoint.model.set_executor(executor)
        self.last_stats = GenerationStats()

    @property
    def tokenizer(self):
        return self.checkpoint.tokenizer

    @property
    def config(self):
        return self.checkpoint.config

    @property
    def model(self):
        return self.checkpoint.model

    def prompt_ids(self, prompt: str | Sequence[dict[str, str]], *, chat: bool) -> list[int]:
        """Token ids of a plain prompt, or of a chat rendered in LLaDA2's format."""
        if not isinstance(prompt, str):
            return self.tokenizer.encode(self.tokenizer.render_chat(prompt))
        if chat:
            return self.tokenizer.encode(
                self.tokenizer.render_chat([{"role": "user", "content": prompt}])
            )
        return self.tokenizer.encode(prompt)

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        decode: DecodeConfig | None = None,
        observers: Sequence[DecodeObserver] = (),
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[BlockInfo]:
        """Yield each finished block; `last_stats` is complete once the iterator ends."""
        decoder = BlockDecoder(
            self.model,
            mask_id=self.tokenizer.mask_id,
            stop_ids=self.tokenizer.stop_ids,
            observers=[*self.observers, *observers],
        )
        self.last_stats = decoder.stats
        try:
            for block in decoder.stream(prompt_ids, decode or self.decode, cancelled=cancelled):
                self.last_stats = decoder.stats
                yield block
        finally:
            self.last_stats = decoder.stats

    def generate(
        self,
        prompt: str | Sequence[dict[str, str]],
        *,
        chat: bool = True,
        decode: DecodeConfig | None = None,
        **overrides,
    ) -> Generation:
        """Decode a whole answer; keyword overrides replace fields of the decode config."""
        cfg = replace(decode or self.decode, **overrides)
        ids: list[int] = []
        for block in self.stream(self.prompt_ids(prompt, chat=chat), decode=cfg):
            ids += block.new_tokens
        return Generation(text=self.tokenizer.decode(ids), token_ids=ids, stats=self.last_stats)


def load_runtime(
    model: str = "builtin:tiny",
    *,
    device: str = "auto",
    dtype: str = "bfloat16",
    decode: DecodeConfig | None = None,
    progress: bool = False,
) -> Runtime:
    """All experts resident on the device: the simplest runtime and the reference."""
    dev = pick_device(device)
    ckpt = load_checkpoint(
        resolve_model(model), device=dev, dtype=pick_dtype(dtype), progress=progress
    )
    executor = ResidentExperts(ckpt.experts, dev)
    return Runtime(checkpoint=ckpt, device=dev, executor=executor, decode=decode or DecodeConfig())
