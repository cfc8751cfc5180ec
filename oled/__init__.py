"""OLED-MoE: MoE diffusion language models on GPUs too small to hold all experts.

`oled.load_recipe`, `oled.build` and `oled.registry` load on first use: importing `oled` stays
cheap (no torch), and the modules below that import `oled.<package>` never import the layers
above them through this facade.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
_FACADE = {"load_recipe": "oled.recipe", "build": "oled.runtime", "registry": None}
__all__ = sorted(_FACADE)


def __getattr__(name: str) -> Any:
    if name not in _FACADE:
        raise AttributeError(f"module 'oled' has no attribute {name!r}")
    home = _FACADE[name]
    if home is None:
        return importlib.import_module(f"oled.{name}")
    return getattr(importlib.import_module(home), name)
