"""Build a runtime for the interactive commands (chat, serve, bench) from their shared flags.

`--recipe` builds from a recipe (its budget, policies and decoding); `--cache-size N` gives every
MoE layer N GPU expert slots with OLED's policies; otherwise every expert is resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oled.decoding import DecodeConfig
from oled.runtime import Runtime, load_runtime


@dataclass(frozen=True, kw_only=True)
class RuntimeSpec:
    """What the user asked for on the command line."""

    model: str = "builtin:tiny"
    device: str = "auto"
    dtype: str = "bfloat16"
    recipe: Path | None = None
    cache_size: int | None = None
    graphs: bool = True
    kernels: str | None = None  # None: the recipe's (or "auto")
    decode: DecodeConfig = DecodeConfig()


def check(spec: RuntimeSpec) -> None:
    """Fail now (before loading starts) on flags that cannot work."""
    if spec.recipe is not None:
        from oled.recipe import load_recipe

        load_recipe(spec.recipe)  # one-line error with file, line and key
    if spec.cache_size is not None and spec.cache_size < 1:
        raise ValueError("--cache-size must be at least 1 expert slot per layer")
    if spec.kernels is not None:
        from oled import kernels
        from oled.runtime import pick_device

        kernels.check(spec.kernels, pick_device(spec.device))


def build(spec: RuntimeSpec) -> Runtime:
    """A runtime: from a recipe (its decoding applies), with an offload cache, or all resident."""
    check(spec)
    if spec.recipe is not None:
        from oled.experiment.build import build as build_recipe
        from oled.recipe import load_recipe

        return build_recipe(load_recipe(spec.recipe), graphs=spec.graphs, kernels=spec.kernels)
    if spec.cache_size is not None:
        from oled.model.config import ModelConfig
        from oled.offload.budget import Budget
        from oled.runtime import build_runtime, resolve_model

        layers = ModelConfig.from_json(resolve_model(spec.model)).num_moe_layers
        budget = Budget(kind="expert_budget", value=spec.cache_size * layers)
        return build_runtime(
            model=spec.model, device=spec.device, dtype=spec.dtype, decode=spec.decode,
            budget=budget, graphs=spec.graphs, kernels=spec.kernels or "auto",
        )  # fmt: skip
    return load_runtime(
        spec.model, device=spec.device, dtype=spec.dtype, decode=spec.decode, graphs=spec.graphs,
        kernels=spec.kernels or "auto",
    )  # fmt: skip


OFFLOAD_KEYS = ("hit_rate", "hits", "misses", "copies", "copy_bytes", "cpu_experts",
                "gpu_experts", "cpu_share", "stall_ms")  # fmt: skip


def offload_stats(rt: Runtime) -> dict[str, float] | None:
    """The offload engine's headline figures for the last generation; None when resident."""
    summary = rt.offload_summary()
    if summary is None:
        return None
    return {k: float(summary[k]) for k in OFFLOAD_KEYS if k in summary}


def stats_dict(rt: Runtime) -> dict[str, Any]:
    """The last generation's figures without per-iteration lists (for reports and the API)."""
    out = {k: v for k, v in rt.last_stats.to_dict().items() if k != "iteration_ms"}
    out["offload"] = offload_stats(rt)
    return out
