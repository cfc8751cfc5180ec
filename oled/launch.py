"""Build a runtime for the interactive commands (chat, serve, bench) from their shared flags.

`--recipe` and `--cache-size` need the recipe framework (`oled.recipe`, `oled.build`) and the
offload engine (`oled.runtime.build_runtime`); when this build lacks them the commands fail with
a message that says so instead of silently running all-resident.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oled.decoding import DecodeConfig, GenerationStats
from oled.runtime import Runtime, load_runtime


class MissingFeature(ValueError):
    """A flag needs a part of OLED-MoE that this build does not include."""


@dataclass(frozen=True, kw_only=True)
class RuntimeSpec:
    """What the user asked for on the command line."""

    model: str = "builtin:tiny"
    device: str = "auto"
    dtype: str = "bfloat16"
    recipe: Path | None = None
    cache_size: int | None = None
    decode: DecodeConfig = DecodeConfig()


def _optional(module: str, attr: str, what: str) -> Any:
    """`module.attr`, or a MissingFeature naming the flag's requirement."""
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except ModuleNotFoundError:
        found = None
    if found is None:
        raise MissingFeature(f"{what} needs {module}.{attr}, which this build of OLED-MoE lacks")
    return found


def check(spec: RuntimeSpec) -> None:
    """Fail now (not after loading starts) when the spec needs a feature this build lacks."""
    if spec.recipe is not None:
        _optional("oled.recipe", "load_recipe", "--recipe")
        _optional("oled.build", "build", "--recipe")
        if not Path(spec.recipe).is_file():
            raise FileNotFoundError(f"{spec.recipe}: no such recipe file")
    if spec.cache_size is not None:
        _optional("oled.runtime", "build_runtime", "--cache-size")


def build(spec: RuntimeSpec) -> Runtime:
    """A runtime: from a recipe, with an offload cache, or all experts resident."""
    if spec.recipe is not None:
        load_recipe = _optional("oled.recipe", "load_recipe", "--recipe")
        build_fn = _optional("oled.build", "build", "--recipe")
        return build_fn(load_recipe(spec.recipe), decode=spec.decode)
    if spec.cache_size is not None:
        if spec.cache_size < 1:
            raise ValueError("--cache-size must be at least 1 expert slot per layer")
        build_runtime = _optional("oled.runtime", "build_runtime", "--cache-size")
        return build_runtime(
            spec.model, device=spec.device, dtype=spec.dtype, decode=spec.decode,
            cache_size=spec.cache_size,
        )  # fmt: skip
    return load_runtime(spec.model, device=spec.device, dtype=spec.dtype, decode=spec.decode)


def offload_stats(stats: GenerationStats) -> dict[str, Any] | None:
    """The offload engine's figures for one generation, or None when all experts are resident."""
    found = getattr(stats, "offload", None)
    if found is None:
        found = stats.to_dict().get("offload")
    if found is None:
        return None
    if hasattr(found, "to_dict"):
        found = found.to_dict()
    return dict(found) if isinstance(found, dict) else None


def stats_dict(stats: GenerationStats) -> dict[str, Any]:
    """Per-generation figures without the per-iteration list (for reports and the API)."""
    out = {k: v for k, v in stats.to_dict().items() if k != "iteration_ms"}
    out["offload"] = offload_stats(stats)
    return out
