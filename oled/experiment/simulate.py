"""A recipe's simulation: its policies and budget replayed over a routing trace
(oled.trace.simulate), for `oled simulate` and the `simulate` tune objective."""

from __future__ import annotations

import json
from pathlib import Path

from oled.offload.budget import shape_slots
from oled.policies import with_oled_defaults
from oled.policies.base import CostModel
from oled.policies.compensation import MakespanCompensation, TransferOnly
from oled.recipe import Recipe
from oled.recipe.load import routes_unlike
from oled.trace.format import Trace
from oled.trace.simulate import ClairvoyantRetention, SimResult, belady_bypass, simulate


def simulate_recipe(
    trace: Trace,
    recipe: Recipe,
    *,
    profile: str | None = None,
    devices: int | None = None,
    clairvoyant: bool = False,
    split: bool = False,
) -> tuple[SimResult, float]:
    """Replay `trace` through a recipe's policies and budget (the runtime's budget kinds that
    count slots, sized for the traced model's shape; the recipe's stage capacity and copies
    ahead, `runtime.prefetch` from `runtime.ahead_from`: "previous", the forward before, or
    "router", the next-layer prediction the trace records): (SimResult, Belady bound).
    `devices` (default: the recipe's `runtime.devices`): that many devices split the experts,
    the budget per device over its share. The bound is Belady's at the devices' slots together
    (a split's hits never exceed it). A ValueError when the recipe's model (where it is on
    this machine) does not route like the trace. `clairvoyant`: the recipe's allocation with
    Belady's choice inside the planner (ClairvoyantRetention, every miss copied), the bound for
    its retention; one device only. With `split` too, each layer's misses are split between
    the link and the CPU so that both finish together (MakespanCompensation): a reference for
    the time that the two links allow with Belady's choice of what stays."""
    meta = trace.meta
    mismatch = routes_unlike(meta, recipe.model.path)
    if mismatch is not None:
        raise ValueError(f"simulation: {mismatch}")
    devices = devices or recipe.runtime.devices
    if meta.num_experts % devices:
        raise ValueError(
            f"simulation: {meta.num_experts} experts per layer do not split evenly over "
            f"{devices} devices"
        )
    if clairvoyant and devices > 1:
        raise ValueError("simulation: the clairvoyant bound is for one device")
    share = meta.num_experts // devices
    try:
        slots = shape_slots(recipe.runtime.budget, meta.num_moe_layers, share)
    except ValueError as exc:
        raise ValueError(f"simulation: {exc}") from None
    cost_name = profile or recipe.runtime.cost
    if cost_name == "calibrate":
        raise ValueError(
            "simulation needs a named cost profile or a file of costs: --profile h200, cpu-ci "
            "or a stored calibration's JSON (`oled env` lists them)"
        )
    policies = with_oled_defaults(**recipe.policy.build())
    if clairvoyant:
        compensation = MakespanCompensation() if split else TransferOnly()
        policies |= {"retention": ClairvoyantRetention(trace), "compensation": compensation}
    result = simulate(
        trace,
        total_slots=slots,
        cost=cost_model(cost_name),
        stage_capacity=recipe.runtime.stage_capacity,
        prefetch_limit=recipe.runtime.prefetch,
        ahead_from=recipe.runtime.ahead_from,
        devices=devices,
        fresh_policies=lambda: with_oled_defaults(**recipe.policy.build()),
        **policies,
    )
    bound = belady_bypass(trace, result.capacity_history)
    return result, bound


def cost_model(name: str) -> CostModel:
    """A named cost profile, or a JSON file of costs: a stored calibration (its `cost`, as the
    engine measured them on a machine) or a CostModel's fields. ValueError naming the file
    when it is not one."""
    path = Path(name).expanduser()
    if name in CostModel.profiles() or path.suffix != ".json":
        return CostModel.profile(name)
    try:
        data = json.loads(path.read_text())
        return CostModel.from_json(json.dumps(data.get("cost", data)))
    except OSError as exc:
        raise ValueError(f"cost file {path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"cost file {path}: not a calibration or cost model ({exc})") from None
