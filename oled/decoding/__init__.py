"""Block diffusion decoding.

Names load on first use, so that the settings (`oled.decoding.config`) come without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as the type checker sees them; loaded lazily below
    from oled.decoding.config import DecodeConfig as DecodeConfig
    from oled.decoding.decoder import BlockDecoder as BlockDecoder
    from oled.decoding.decoder import GenerationStats as GenerationStats
    from oled.decoding.follow import Trajectory as Trajectory
    from oled.decoding.observers import BlockInfo as BlockInfo
    from oled.decoding.observers import DecodeObserver as DecodeObserver
    from oled.decoding.observers import IterationInfo as IterationInfo

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
