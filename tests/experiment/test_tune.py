"""`oled tune`: a study over [tune.params] with nested MLflow runs, journal-file workers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from oled import registry as reg
from oled.experiment.tune import tune_recipe
from oled.recipe import load_recipe
from tests.conftest import RECIPE
from tests.experiment.tune_objective import bowl

ROOT = Path(__file__).resolve().parents[2]

TUNE = """
[tune]
trials = {trials}
objective = "bowl"
metric = "loss"
storage = "{storage}"
study_name = "bowl"
seed = 0

[tune.params]
"policy.retention.threshold" = {{ low = 0.0, high = 1.0 }}
"policy.retention.window" = {{ low = 1, high = 8, int = true }}
"""


def _recipe_file(tmp_path: Path, storage: str, trials: int, tracking: str) -> Path:
    path = tmp_path / "tune.toml"
    path.write_text(RECIPE + tracking + TUNE.format(trials=trials, storage=storage))
    return path


@pytest.fixture
def bowl_objective(components):
    reg.register("objective", "bowl", bowl)
    yield
    reg.registry("objective").unregister("bowl")


def test_tune_writes_best_recipe(tmp_path: Path, bowl_objective, mlflow_uri: str) -> None:
    tracking = f'\n[tracking]\ntracking_uri = "{mlflow_uri}"\nexperiment = "tune"\n'
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    recipe = load_recipe(_recipe_file(tmp_path, storage, 20, tracking))
    out = tmp_path / "best.toml"
    result = tune_recipe(recipe, out=out)
    best = load_recipe(out)
    assert best.tune is None and best.policy.retention is not None
    assert best.policy.retention.params["threshold"] == result.params["policy.retention.threshold"]
    assert result.value < 0.05
    study = optuna.load_study(study_name="bowl", storage=storage)
    assert len(study.trials) == 20
    # resuming a finished study runs nothing more
    assert tune_recipe(recipe).value == result.value and len(study.trials) == 20
    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("tune").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 2 and len(children) == 20
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[-1].info.run_id}
    assert all(r.info.status == "FINISHED" and "loss" in r.data.metrics for r in children)


WORKER = """
import sys
sys.path.insert(0, {root!r})
from tests.experiment.tune_objective import register
from oled.experiment.tune import tune_recipe
from oled.recipe import load_recipe
register()
tune_recipe(load_recipe(sys.argv[1]))
"""


def test_two_workers_share_a_journal_study(tmp_path: Path) -> None:
    journal = tmp_path / "study.journal"
    tracking = "\n[tracking]\nmlflow = false\n"
    path = _recipe_file(tmp_path, f"journal:{journal}", 16, tracking)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(root=str(ROOT)))
    workers = [
        subprocess.Popen([sys.executable, str(script), str(path)], stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err.decode()[-2000:]
    from optuna.storages.journal import JournalFileBackend

    storage = optuna.storages.JournalStorage(JournalFileBackend(str(journal)))
    trials = optuna.load_study(study_name="bowl", storage=storage).trials
    numbers = [t.number for t in trials]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(set(numbers)) == len(numbers) and len(complete) >= 16
