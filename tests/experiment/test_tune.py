"""`oled tune`: a study over [tune.params] with nested MLflow runs and artifacts, errors found
before any trial, results kept when `--out` fails, journal-file workers."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient
from rich.console import Console
from typer.testing import CliRunner

from oled import registry as reg
from oled.cli import app
from oled.experiment.tune import tune_recipe
from oled.recipe import Recipe, load_recipe
from tests.experiment.conftest import mlflow_runs, tune_recipe_file, tune_tracking
from tests.experiment.tune_objective import bowl

runner = CliRunner()

ROOT = Path(__file__).resolve().parents[2]

PNG = b"\x89PNG"
COMPLETE = optuna.trial.TrialState.COMPLETE


@pytest.fixture
def bowl_objective(components):
    reg.register("objective", "bowl", bowl)
    yield
    reg.registry("objective").unregister("bowl")


def test_tune_writes_best_recipe(tmp_path: Path, bowl_objective, mlflow_uri: str) -> None:
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    recipe = load_recipe(
        tune_recipe_file(tmp_path, storage, 20, tune_tracking(tmp_path, mlflow_uri))
    )
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
    runs = mlflow_runs(mlflow_uri, "tune")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 2 and len(children) == 20
    first = parents[-1]  # newest first
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {first.info.run_id}
    assert all(r.info.status == "FINISHED" and "loss" in r.data.metrics for r in children)
    # which worker ran each trial, where the study lives
    worker = first.data.tags["oled.worker"]
    assert worker.endswith(f":{os.getpid()}") and first.data.tags["oled.storage"] == storage
    assert {r.data.tags["oled.worker"] for r in children} == {worker}
    # the study run's artifacts: the best recipe, the study's plots, the recipe tuned
    names = {a.path for a in client.list_artifacts(first.info.run_id)}
    assert {"best.toml", "optimization_history.png", "param_importances.png", "recipe"} <= names
    logged = client.download_artifacts(first.info.run_id, "best.toml", str(tmp_path))
    assert Path(logged).read_text() == out.read_text()
    plot = client.download_artifacts(first.info.run_id, "param_importances.png", str(tmp_path))
    assert Path(plot).read_bytes()[:4] == PNG
    assert result.report_dir is not None and result.report_dir.parent == tmp_path / "reports"
    assert (result.report_dir / "best.toml").read_text() == out.read_text()


def test_one_trial_study_plots_its_history(tmp_path: Path, bowl_objective) -> None:
    """Too few trials for parameter importances: the study ends well and says so."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    recipe = load_recipe(tune_recipe_file(tmp_path, storage, 1, tune_tracking(tmp_path, None)))
    console = Console(file=io.StringIO(), width=200)
    result = tune_recipe(recipe, console=console)
    assert result.report_dir is not None
    files = sorted(p.name for p in result.report_dir.iterdir())
    assert files == ["best.toml", "optimization_history.png"]
    assert (result.report_dir / "optimization_history.png").read_bytes()[:4] == PNG
    text = console.file.getvalue()
    assert "no param_importances plot: it needs tuned parameters and two complete trials" in text


@pytest.mark.parametrize("scheme", ["sqlite:///", "journal:"])
@pytest.mark.parametrize("folder", ["missing", "a-file"])
def test_unusable_storage_fails_in_one_line(
    tmp_path: Path, bowl_objective, mlflow_uri: str, scheme: str, folder: str
) -> None:
    """A storage in a missing folder or below a file: one line naming it, exit 2, no run."""
    (tmp_path / "a-file").write_text("")
    storage = f"{scheme}{tmp_path / folder / 'study.db'}"
    experiment = f"storage-{scheme[:6]}-{folder}"
    path = tune_recipe_file(tmp_path, storage, 4, tune_tracking(tmp_path, mlflow_uri, experiment))
    result = runner.invoke(app, ["tune", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: cannot open the study storage {storage}: ")
    assert result.output.count("\n") == 1
    assert mlflow_runs(mlflow_uri, experiment) == [] and not (tmp_path / "reports").exists()


@pytest.mark.parametrize("where", ["missing/best.toml", "a-file/best.toml", "folder"])
def test_unwritable_out_fails_before_any_trial(
    tmp_path: Path, bowl_objective, mlflow_uri: str, where: str
) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "folder").mkdir()
    experiment = f"out-{where.split('/')[0]}"
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    path = tune_recipe_file(tmp_path, storage, 4, tune_tracking(tmp_path, mlflow_uri, experiment))
    out = tmp_path / where
    result = runner.invoke(app, ["tune", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: --out {out}: ")
    assert result.output.count("\n") == 1
    assert not (tmp_path / "optuna.db").exists() and mlflow_runs(mlflow_uri, experiment) == []


def test_out_unwritable_at_the_end_keeps_the_results(tmp_path: Path, bowl_objective) -> None:
    """`--out` checked at the start but unwritable at the end (here it became a folder while
    the study ran): the error names the storage and the best recipe's copy, which loads."""
    out = tmp_path / "best.toml"

    def bowl_taking_out(recipe: Recipe) -> dict[str, float]:
        out.mkdir(exist_ok=True)
        return bowl(recipe)

    reg.register("objective", "bowl_taking_out", bowl_taking_out)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking = tune_tracking(tmp_path, None)
    path = tune_recipe_file(tmp_path, storage, 6, tracking, objective="bowl_taking_out")
    try:
        result = runner.invoke(app, ["tune", str(path), "--out", str(out)])
    finally:
        reg.registry("objective").unregister("bowl_taking_out")
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    found = re.fullmatch(
        rf"error: cannot write {out}: Is a directory; the best recipe is in (\S+) instead, "
        rf"and the study 'bowl' stays in {re.escape(storage)}",
        error,
    )
    assert found, error
    study = optuna.load_study(study_name="bowl", storage=storage)
    assert len(study.get_trials(states=(COMPLETE,))) == 6
    copy = load_recipe(Path(found[1]))
    assert copy.policy.retention is not None
    assert copy.policy.retention.params["window"] == study.best_params["policy.retention.window"]


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
    path = tune_recipe_file(tmp_path, f"journal:{journal}", 16, tune_tracking(tmp_path, None))
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


def test_run_objective_without_its_model_fails_before_the_study(
    tmp_path: Path, components, mlflow_uri: str
) -> None:
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    tracking = tune_tracking(tmp_path, mlflow_uri, "run-missing")
    path = tune_recipe_file(tmp_path, storage, 2, tracking, objective="run")
    missing = tmp_path / "no-model"
    path.write_text(path.read_text().replace('path = "builtin:tiny"', f'path = "{missing}"'))
    result = runner.invoke(app, ["tune", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and str(missing) in result.output
    assert result.output.count("\n") == 1
    assert not (tmp_path / "optuna.db").exists() and mlflow_runs(mlflow_uri, "run-missing") == []


def test_recipes_of_one_name_keep_their_own_studies(tmp_path: Path, bowl_objective) -> None:
    """Two `tune.toml` of other search spaces in one storage (as recipes/tune.toml and
    recipes/twin/tune.toml): each its own study; a study name given to both is one line."""
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    paths = []
    for folder in ["two-keys", "one-key"]:
        (tmp_path / folder).mkdir()
        path = tune_recipe_file(tmp_path / folder, storage, 2, tune_tracking(tmp_path, None))
        text = path.read_text().replace('study_name = "bowl"\n', "")
        if folder == "one-key":
            text = text.replace('"policy.retention.window" = { low = 1, high = 8, int = true }', "")
        path.write_text(text)
        paths.append(path)
    for path in paths:
        result = runner.invoke(app, ["tune", str(path)])
        assert result.exit_code == 0, result.output
    names = sorted(s.study_name for s in optuna.get_all_study_summaries(storage))
    assert len(names) == 2 and all(re.fullmatch(r"tune-[0-9a-f]{8}", n) for n in names), names
    for path in paths:
        path.write_text(path.read_text().replace("[tune]\n", '[tune]\nstudy_name = "mine"\n'))
        result = runner.invoke(app, ["tune", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(
        f"error: study 'mine' in {storage} tuned other keys (policy.retention.window): "
    ), result.output
