"""The same recipe, prompt and seed give the same tokens and the same decisions on every run:
the decisions follow a cost model measured once (oled.offload.calibrate), not live timings."""

from __future__ import annotations

import pytest

from oled.cli.experiment import shipped_recipes
from oled.recipe import load_recipe
from oled.runtime import build

DECISIONS = (
    "hits",
    "misses",
    "copies",
    "staged",
    "cpu_experts",
    "cpu_tokens",
    "gpu_experts",
    "predicted",
)
POLICIES = [name for name in sorted(shipped_recipes()) if name not in ("quickstart", "tune")]


def _run(recipe) -> tuple[list[int], list, dict | None]:
    """A fresh runtime's tokens, its decision counters per forward, and its decisions record."""
    rt = build(recipe)
    generation = rt.generate("Who wrote Hamlet? Tell me about the play.", chat=True)
    summary = rt.offload_summary()
    rows = (
        [] if summary is None else [[row[k] for k in DECISIONS] for row in summary["per_iteration"]]
    )
    return generation.token_ids, rows, rt.decisions()


@pytest.mark.parametrize("name", POLICIES)
def test_each_builtin_policy_decides_the_same_twice(name: str):
    recipe = load_recipe(shipped_recipes()[name]).with_values(
        {
            "model.path": "builtin:tiny",
            "runtime.device": "cpu",
            "runtime.dtype": "float32",
            "runtime.budget": {"expert_fraction": 0.25}
            if name != "resident"
            else {"resident": True},
            "runtime.cost": "calibrate",
            "decoding.max_new_tokens": 32,
        }
    )
    tokens, decisions, how = _run(recipe)
    again = _run(recipe)
    assert again[0] == tokens and again[1] == decisions  # tokens, and every forward's counters
    if name == "resident":
        assert how is None
        return
    assert sum(row[1] for row in decisions) > 0  # it missed: there were decisions to make
    assert how["adaptive"] is False and how["costs"]["source"] == "calibrated"
    assert again[2]["costs"]["measured"] == how["costs"]["measured"]  # measured once, reused


def test_live_adaptation_is_opt_in_and_reported():
    recipe = load_recipe(shipped_recipes()["oled"]).with_values(
        {
            "model.path": "builtin:tiny",
            "runtime.device": "cpu",
            "runtime.dtype": "float32",
            "runtime.cost": "cpu-ci",
            "decoding.max_new_tokens": 8,
            "policy.compensation": {"kind": "cooperative", "learn_rate": 0.2},
        }
    )
    how = build(recipe).decisions()
    assert how["adaptive"] is True and how["costs"]["source"] == "profile cpu-ci"


def test_the_calibration_used_shows_in_oled_env():
    from oled.env import collect

    recipe = load_recipe(shipped_recipes()["lru"]).with_values(
        {
            "model.path": "builtin:tiny",
            "runtime.device": "cpu",
            "runtime.dtype": "float32",
            "runtime.cost": "calibrate",
        }
    )
    costs = build(recipe).decisions()["costs"]
    rows = dict(collect(bandwidth=False).rows)
    shown = rows[f"cost {costs['key']}"]
    assert shown.startswith(costs["measured"])
    assert f"experts {costs['expert shape']} float32" in shown and "ms/expert" in shown
