"""The LLaDA2 MoE model: config, layers, checkpoints, tokenizer and presets.

The names below load on first use, so that `oled.model.config` (the config and the named
shapes, which recipes check) imports without torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_HOMES = {
    "Checkpoint": "checkpoint",
    "CheckpointError": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "ConfigError": "config",
    "ModelConfig": "config",
    "ExpertStore": "experts",
    "ResidentExperts": "experts",
    "LLaDA2Model": "model",
    "Tokenizer": "tokenizer",
    "TokenizerError": "tokenizer",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"oled.model.{_HOMES[name]}"), name)
