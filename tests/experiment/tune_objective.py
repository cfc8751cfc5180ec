"""Cheap real objectives for tune tests: a bowl over two retention parameters, and a slow bowl
whose worker processes can be made to wait or to hang in a trial (environment variables)."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

from oled import registry as reg
from oled.recipe import Recipe

_calls = itertools.count(1)


def bowl(recipe: Recipe) -> dict[str, float]:
    """Smallest at threshold 0.3, window 2."""
    assert recipe.policy.retention is not None
    params = recipe.policy.retention.params
    loss = (params.get("threshold", 0.5) - 0.3) ** 2 + 0.01 * (params.get("window", 4) - 2) ** 2
    return {"loss": loss, "window": float(params.get("window", 4))}


def slow_bowl(recipe: Recipe) -> dict[str, float]:
    """`bowl` after BOWL_SECONDS. This process's first call waits for the file BOWL_WAIT_FILE
    (when set); its BOWL_HANG_AT-th call writes the file BOWL_HANG_FILE and never returns."""
    call = next(_calls)
    wait = os.environ.get("BOWL_WAIT_FILE")
    while call == 1 and wait and not Path(wait).exists():
        time.sleep(0.05)
    if call == int(os.environ.get("BOWL_HANG_AT", "0")):
        Path(os.environ["BOWL_HANG_FILE"]).write_text(str(os.getpid()))
        while True:
            time.sleep(1)
    time.sleep(float(os.environ.get("BOWL_SECONDS", "0")))
    return bowl(recipe)


def register() -> None:
    """Register `bowl`, `slow_bowl` and the test policy components."""
    from tests.conftest import TEST_COMPONENTS

    reg.register("objective", "bowl", bowl)
    reg.register("objective", "slow_bowl", slow_bowl)
    for kind, entries in TEST_COMPONENTS.items():
        for name, target in entries.items():
            reg.register(kind, name, target)
