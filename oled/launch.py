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

from oled.decoding import DecodeConfig
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
        from oled.model.config import ModelConfig
        from oled.offload.budget import Budget
        from oled.runtime import resolve_model

        layers = ModelConfig.from_json(resolve_model(spec.model)).num_moe_layers
        budget = Budget(kind="expert_budget", value=spec.cache_size * layers)
        return build_runtime(
            model=spec.model, device=spec.device, dtype=spec.dtype, decode=spec.decode,
            budget=budget,
        )  # fmt: skip
    return load_runtime(spec.model, device=spec.device, dtype=spec.dtype, decode=spec.decode)


OFFLOAD_KEYS = ("hit_rate", "hits", "misses", "copies", "copy_bytes", "cpu_experts",
                "gpu_experts", "cpu_share", "stall_ms")  # fmt: skip


def offload_stats(rt: Runtime) -> dict[str, float] | None:
    """The offload engine's figures for the last generation; None when all experts are resident."""
    metrics = getattr(rt.executor, "metrics", None)
    if metrics is None:
        return None
    summary = metrics.summary()
    return {k: float(summary[k]) for k in OFFLOAD_KEYS if k in summary}


def stats_dict(rt: Runtime) -> dict[str, Any]:
    """The last generation's figures without per-iteration lists (for reports and the API)."""
    out = {k: v for k, v in rt.last_stats.to_dict().items() if k != "iteration_ms"}
    out["offload"] = offload_stats(rt)
    return out
