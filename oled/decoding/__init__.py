"""Block diffusion decoding.

Names load on first use, so that the settings (`oled.decoding.config`) come without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "BlockDecoder": "decoder",
    "GenerationStats": "decoder",
    "DecodeConfig": "config",
    "Trajectory": "follow",
    "BlockInfo": "observers",
    "DecodeObserver": "observers",
    "IterationInfo": "observers",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'oled.decoding' has no attribute {name!r}")
    return getattr(importlib.import_module(f"oled.decoding.{_HOMES[name]}"), name)
