"""Recipe -> runtime: construct the policy components and call the engine's `build_runtime`."""

from __future__ import annotations

from typing import Any

from oled import registry as reg
from oled.recipe import BudgetSection, Component, Recipe, parse_size


def build_policy(kind: str, component: Component | None) -> Any:
    """The policy object a recipe section names, or None when the section is absent."""
    if component is None:
        return None
    return reg.registry(kind).build(component.kind, **component.params)


def build_budget(section: BudgetSection) -> Any:
    """The engine's Budget from the recipe's budget section (exactly one field is set)."""
    from oled.offload.budget import Budget

    fields = section.model_dump(exclude_none=True)
    if "gpu_memory" in fields:
        fields["gpu_memory"] = parse_size(fields["gpu_memory"])
    return Budget(**fields)


def build(recipe: Recipe) -> Any:
    """A ready runtime for `recipe`: all experts resident, or offloaded under its budget."""
    from oled.decoding import DecodeConfig

    rt = recipe.runtime
    decode = DecodeConfig(**recipe.decoding.model_dump())
    if rt.budget.resident:
        from oled.runtime import load_runtime

        return load_runtime(recipe.model.path, device=rt.device, dtype=rt.dtype, decode=decode)
    try:
        from oled.runtime import build_runtime
    except ImportError:
        raise NotImplementedError(
            "offloaded budgets need oled.runtime.build_runtime, which this installation lacks;"
            " run with --set 'runtime.budget={ resident = true }'"
        ) from None
    policies = {kind: build_policy(kind, getattr(recipe.policy, kind)) for kind in reg.POLICY_KINDS}
    return build_runtime(
        model=recipe.model.path,
        device=rt.device,
        dtype=rt.dtype,
        budget=build_budget(rt.budget),
        cost=rt.cost,
        cpu_threads=rt.cpu_threads,
        stage_capacity=rt.stage_capacity,
        decode=decode,
        **policies,
    )
