"""OLED-MoE: MoE diffusion language models on GPUs too small to hold all experts."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["build", "load_recipe", "registry"]


def __getattr__(name: str) -> Any:
    # Lazy: importing `oled` must stay cheap (no torch) until something is used.
    if name == "load_recipe":
        from oled.recipe import load_recipe

        return load_recipe
    if name == "build":
        from oled.experiment.build import build

        return build
    if name == "registry":
        import oled.registry

        return oled.registry
    raise AttributeError(f"module 'oled' has no attribute {name!r}")
