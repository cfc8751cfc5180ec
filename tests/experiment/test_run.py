"""`oled run`: summary figures, the JSON report and plots, MLflow runs (finished and failed)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from oled.cli import app
from oled.experiment.report import median_and_p90, per_layer, summarize
from oled.experiment.run import run_experiment
from oled.recipe import load_recipe
from tests.conftest import RECIPE
from tests.experiment.conftest import SyntheticRuntime, mlflow_runs, tracked_recipe_text


def _recipe(tmp_path: Path, uri: str, experiment: str, mlflow: bool = True):
    text = tracked_recipe_text(RECIPE, uri, tmp_path / "reports", experiment)
    if not mlflow:
        text = text.replace("mlflow = true", "mlflow = false")
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_recipe(path)


def test_summarize() -> None:
    gens = [
        {
            "iterations": 2,
            "tokens": 4,
            "seconds": 0.5,
            "iteration_ms": [1.0, 3.0],
            "hits": 3,
            "misses": 1,
            "cpu_experts": 1,
            "gpu_experts": 3,
            "copy_bytes": 2e9,
            "stall_ms": 4.0,
            "per_layer": [{"hits": 1, "misses": 1}, {"hits": 2, "misses": 0}],
        },
        {
            "iterations": 2,
            "tokens": 4,
            "seconds": 0.5,
            "iteration_ms": [2.0, 4.0],
            "hits": 1,
            "misses": 3,
            "cpu_experts": 0,
            "gpu_experts": 4,
            "copy_bytes": 0,
            "stall_ms": 0.0,
            "per_layer": [{"hits": 0, "misses": 2}, {"hits": 1, "misses": 1}],
        },
    ]
    s = summarize(gens)
    assert s["ms_per_token"] == 125.0 and s["tokens_per_forward"] == 2.0
    # the first forward of each generation runs the prompt: apart from the decode iterations
    assert s["ms_per_iteration"] == 3.5 and s["ms_per_iteration_p90"] == pytest.approx(3.9)
    assert s["prompt_ms"] == 1.5 and s["stall_ms_per_iteration"] == 2.0
    assert s["hit_rate"] == 0.5 and s["cpu_share"] == 0.125 and s["copy_gb"] == 2.0
    assert [layer["hit_rate"] for layer in per_layer(gens)] == [0.25, 0.75]
    assert summarize([])["hit_rate"] is None and median_and_p90([]) == (None, None)
    assert median_and_p90([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, pytest.approx(4.6))


def test_run_is_logged_to_mlflow(tmp_path: Path, components, mlflow_uri: str) -> None:
    recipe = _recipe(tmp_path, mlflow_uri, "run-ok")
    result = run_experiment(recipe, factory=SyntheticRuntime.from_recipe)
    (run,) = mlflow_runs(mlflow_uri, "run-ok")
    assert run.info.run_id == result.run_id and run.info.status == "FINISHED"
    assert run.data.params["model.path"] == "builtin:tiny"
    assert run.data.params["policy.retention.threshold"] == "0.7"
    assert run.data.tags["oled.recipe_hash"] == recipe.hash()
    assert run.data.tags["oled.device"] == "cpu"
    summary = result.report["summary"]
    assert run.data.metrics["ms_per_iteration"] == summary["ms_per_iteration"]
    assert 0 < summary["hit_rate"] < 1
    # one named metric per layer, each a single value (the runs table's and compare view's)
    layers = {k: v for k, v in run.data.metrics.items() if k.startswith("hit_rate.layer_")}
    rates = [layer["hit_rate"] for layer in result.report["per_layer"]]
    assert layers == {
        "hit_rate.layer_00": rates[0],
        "hit_rate.layer_01": rates[1],
        "hit_rate.layer_02": rates[2],
    }
    client = MlflowClient(mlflow_uri)
    for key in [*layers, "ms_per_iteration"]:
        assert len(client.get_metric_history(run.info.run_id, key)) == 1
    assert not {"iteration_ms", "layer_hit_rate"} & set(run.data.metrics)  # no stepped series
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.json", "iteration_ms.csv", "hit_rate_per_layer.png", "latency.png"} <= names
    assert [a.path for a in client.list_artifacts(run.info.run_id, "recipe")] == ["recipe/run.toml"]
    # the per-iteration series is an artifact: every forward of every timed generation
    table = client.download_artifacts(run.info.run_id, "iteration_ms.csv", str(tmp_path))
    rows = list(csv.reader(Path(table).read_text().splitlines()))
    gens = result.report["generations"]
    assert rows[0] == ["generation", "iteration", "ms"] and len(rows) == 1 + 4 * 8
    assert [float(r[2]) for r in rows[1:]] == [ms for g in gens for ms in g["iteration_ms"]]
    assert rows[9][:2] == ["1", "0"]  # the second generation's prompt forward
    png = client.download_artifacts(run.info.run_id, "latency.png", str(tmp_path))
    assert Path(png).read_bytes()[:4] == b"\x89PNG"
    report = json.loads((result.report_dir / "report.json").read_text())
    assert report["recipe_hash"] == recipe.hash() and len(report["per_layer"]) == 3


class BrokenRuntime(SyntheticRuntime):
    """Fails in the middle of the workload."""

    def generate(self, prompt, **options):
        raise RuntimeError("expert copy failed")


def test_failed_run_ends_failed(tmp_path: Path, components, mlflow_uri: str) -> None:
    recipe = _recipe(tmp_path, mlflow_uri, "run-fail")
    with pytest.raises(RuntimeError, match="expert copy failed"):
        run_experiment(recipe, factory=lambda r: BrokenRuntime())
    (run,) = mlflow_runs(mlflow_uri, "run-fail")
    assert run.info.status == "FAILED"


@pytest.mark.parametrize(
    ("model", "budget", "message"),
    [
        ("{tmp}/no-model", "expert_fraction = 0.5", "setup.toml:2: model.path: no such directory"),
        ("builtin:tiny", "expert_budget = 1", "budget too small"),
    ],
)
def test_setup_error_leaves_no_run(
    tmp_path: Path, components, mlflow_uri: str, model: str, budget: str, message: str
) -> None:
    """A missing model or a budget too small fails in one line, exit 2, with no MLflow run."""
    experiment = f"setup-{budget.split()[0]}"
    text = tracked_recipe_text(RECIPE, mlflow_uri, tmp_path / "reports", experiment)
    text = text.replace('"builtin:tiny"', f'"{model.format(tmp=tmp_path)}"')
    path = tmp_path / "setup.toml"
    path.write_text(text.replace("expert_fraction = 0.5", budget))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert mlflow_runs(mlflow_uri, experiment) == [] and not (tmp_path / "reports").exists()


def test_run_without_mlflow(tmp_path: Path, components) -> None:
    recipe = _recipe(tmp_path, "sqlite:///unused.db", "x", mlflow=False)
    result = run_experiment(recipe, factory=SyntheticRuntime.from_recipe)
    assert result.run_id is None and (result.report_dir / "latency.png").exists()
    assert not Path("unused.db").exists()


def test_an_mlflow_store_that_cannot_open_fails_before_any_work(tmp_path: Path, components):
    (tmp_path / "a-file").write_text("")
    uri = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    recipe = tmp_path / "run.toml"
    recipe.write_text(tracked_recipe_text(RECIPE, uri, tmp_path / "reports", "no-store"))
    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: cannot open the MLflow store {uri}: ")
    assert result.output.count("\n") == 1 and not (tmp_path / "reports").exists()


def test_the_decisions_line_says_how_the_calibration_stands() -> None:
    from oled.experiment.run import decisions_text

    costs = {"source": "calibrated", "measured": "2026-12-04T15:39:27+00:00", "stored": True}
    clean = costs | {"state": "stored clean, re-check agrees"}
    assert decisions_text({"adaptive": False, "costs": clean}) == (
        "calibrated 2026-12-04T15:39:27+00:00 (stored clean, re-check agrees); deterministic"
    )
    loaded = costs | {"stored": False, "state": "not stored: measured under load: 1 thread"}
    assert decisions_text({"adaptive": False, "costs": loaded}).endswith(
        "(not stored: measured under load: 1 thread); this run's costs: the next run measures again"
    )
    profile = {"source": "profile cpu-ci"}
    assert decisions_text({"adaptive": False, "costs": profile}) == "profile cpu-ci; deterministic"
