"""A cheap real objective for tune tests: a bowl over two retention parameters."""

from __future__ import annotations

from oled import registry as reg
from oled.recipe import Recipe


def bowl(recipe: Recipe) -> dict[str, float]:
    """Smallest at threshold 0.3, window 2."""
    assert recipe.policy.retention is not None
    params = recipe.policy.retention.params
    loss = (params.get("threshold", 0.5) - 0.3) ** 2 + 0.01 * (params.get("window", 4) - 2) ** 2
    return {"loss": loss, "window": float(params.get("window", 4))}


def register() -> None:
    """Register `bowl` and the test policy components."""
    from tests.conftest import TEST_COMPONENTS

    reg.register("objective", "bowl", bowl)
    for kind, entries in TEST_COMPONENTS.items():
        for name, target in entries.items():
            reg.register(kind, name, target)
