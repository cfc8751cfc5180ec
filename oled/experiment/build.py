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

    ((kind, value),) = section.model_dump(exclude_none=True).items()
    if kind == "gpu_memory":
        value = parse_size(value)
    return Budget(kind=kind, value=None if value is True else value)


def build(recipe: Recipe, *, graphs: bool = True, kernels: str | None = None) -> Any:
    """A ready runtime for `recipe` (policies are None when every expert is resident); CUDA
    graphs when both the recipe and `graphs` allow them; `kernels` overrides the recipe's."""
    from oled.decoding import DecodeConfig
    from oled.runtime import build_runtime

    rt = recipe.runtime
    resident = rt.budget.resident is True
    policies = {
        kind: None if resident else build_policy(kind, getattr(recipe.policy, kind))
        for kind in reg.POLICY_KINDS
    }
    optional = {"stage_capacity": rt.stage_capacity} if rt.stage_capacity else {}
    return build_runtime(
        model=recipe.model.path,
        device=rt.device,
        dtype=rt.dtype,
        budget=build_budget(rt.budget),
        cost=rt.cost,
        cpu_threads=rt.cpu_threads,
        prefetch=rt.prefetch,
        decode=DecodeConfig(**recipe.decoding.model_dump()),
        graphs=graphs and rt.cuda_graphs,
        kernels=kernels or rt.kernels,
        planner=rt.planner,
        **optional,
        **policies,
    )
