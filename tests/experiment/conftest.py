"""A small real runtime for experiment tests: LRU expert caches over seeded synthetic routing."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import pytest

from oled.recipe import Recipe


@dataclass
class Generation:
    """One generation's text and stats dict."""

    text: str
    stats: dict


class SyntheticRuntime:
    """Routes each token to seeded experts and keeps per-layer LRU caches; reports stats."""

    device = "cpu"
    engine = None  # no offload engine (Runtime.engine)

    def __init__(self, *, layers: int = 3, experts: int = 16, slots: int = 6, seed: int = 0):
        self.layers = layers
        self.experts = experts
        self.slots = slots
        self.rng = random.Random(seed)
        self.caches = [OrderedDict() for _ in range(layers)]
        self.last: dict = {}

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> SyntheticRuntime:
        fraction = recipe.runtime.budget.expert_fraction or 1.0
        return cls(slots=max(1, int(16 * fraction)), seed=recipe.decoding.seed)

    def _access(self, layer: int, expert: int, stats: dict) -> None:
        cache = self.caches[layer]
        hit = expert in cache
        stats["per_layer"][layer]["hits" if hit else "misses"] += 1
        if hit:
            cache.move_to_end(expert)
            return
        cache[expert] = True
        if len(cache) > self.slots:
            cache.popitem(last=False)

    def generate(self, prompt, *, chat: bool, follow=None, observers=()) -> Generation:
        iterations = 8
        stats = {"per_layer": [{"hits": 0, "misses": 0} for _ in range(self.layers)]}
        for _ in range(iterations):
            for layer in range(self.layers):
                for expert in self.rng.sample(range(self.experts // 2), 3):
                    self._access(layer, expert, stats)
        hits = sum(layer["hits"] for layer in stats["per_layer"])
        misses = sum(layer["misses"] for layer in stats["per_layer"])
        iteration_ms = [2.0 + 0.5 * (i % 3) for i in range(iterations)]
        stats |= {
            "iterations": iterations,
            "tokens": 16,
            "seconds": sum(iteration_ms) / 1000,
            "iteration_ms": iteration_ms,
            "hits": hits,
            "misses": misses,
            "copies": misses,
            "copy_bytes": misses * 6 * 2**20,
            "cpu_experts": 0,
            "gpu_experts": hits + misses,
            "stall_ms": 0.1 * misses,
        }
        self.last = stats
        return Generation(text="", stats=stats)

    def stats(self) -> dict:
        """The last generation's figures, as `oled.runtime.Runtime.stats` gives them."""
        return self.last


@pytest.fixture(scope="session")
def mlflow_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite tracking store for the whole session (creating one takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def tracked_recipe_text(base: str, uri: str, report_dir: Path, experiment: str) -> str:
    """`base` recipe text plus a [tracking] section."""
    return base + (
        f'\n[tracking]\nmlflow = true\ntracking_uri = "{uri}"\n'
        f'experiment = "{experiment}"\nreport_dir = "{report_dir}"\n'
    )


def mlflow_runs(uri: str, experiment: str) -> list:
    """The runs of `experiment` in the store at `uri` (none if it does not exist)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


TUNE = """
[tune]
trials = {trials}
objective = "{objective}"
metric = "loss"
storage = "{storage}"
study_name = "bowl"
seed = 0

[tune.params]
"policy.retention.threshold" = {{ low = 0.0, high = 1.0 }}
"policy.retention.window" = {{ low = 1, high = 8, int = true }}
"""


def tune_tracking(tmp_path: Path, uri: str | None, experiment: str = "tune") -> str:
    """A [tracking] section: MLflow at `uri` (None: off), reports under `tmp_path`."""
    mlflow = f'tracking_uri = "{uri}"\nexperiment = "{experiment}"' if uri else "mlflow = false"
    return f'\n[tracking]\n{mlflow}\nreport_dir = "{tmp_path / "reports"}"\n'


def tune_recipe_file(
    tmp_path: Path, storage: str, trials: int, tracking: str, objective: str = "bowl"
) -> Path:
    """`tune.toml` in `tmp_path`: the test recipe, `tracking` and a study of `objective` (the
    bowl's loss) over two retention parameters."""
    from tests.conftest import RECIPE

    path = tmp_path / "tune.toml"
    tune = TUNE.format(trials=trials, storage=storage, objective=objective)
    path.write_text(RECIPE + tracking + tune)
    return path
