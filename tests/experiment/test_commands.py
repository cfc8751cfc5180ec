"""The experiment commands through the `oled` app: validate, ls, cp, run end to end."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from oled.cli import app
from oled.experiment.commands import shipped_recipes
from oled.recipe import load_recipe

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


def test_validate(recipe_file: Path) -> None:
    result = runner.invoke(app, ["validate", str(recipe_file)])
    assert result.exit_code == 0 and result.output.startswith(f"ok  {recipe_file}  ")
    result = runner.invoke(app, ["validate", str(recipe_file), "--set", "decoding.treshold=1"])
    assert result.exit_code == 2
    assert "--set decoding.treshold: unknown key (did you mean 'threshold'?)" in result.output


def test_ls(components) -> None:
    result = runner.invoke(app, ["ls", "retention"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    assert "keep_recent" in result.output and "threshold: float = 0.5" in result.output
    assert runner.invoke(app, ["ls", "retension"]).exit_code == 2


def test_cp(tmp_path: Path) -> None:
    assert set(shipped_recipes()) == {p.stem for p in (ROOT / "recipes").glob("*.toml")}
    result = runner.invoke(app, ["cp", "quickstart", str(tmp_path)])
    assert result.exit_code == 0
    copied = tmp_path / "quickstart.toml"
    assert copied.read_text() == (ROOT / "recipes" / "quickstart.toml").read_text()
    result = runner.invoke(app, ["cp", "quickstrat", str(tmp_path)])
    assert result.exit_code == 2 and "did you mean 'quickstart'?" in result.output


def test_run_tiny_end_to_end(tmp_path: Path, mlflow_uri: str) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(
        '[model]\npath = "builtin:tiny"\n[runtime]\ndevice = "cpu"\ndtype = "float32"\n'
        "budget = { resident = true }\n[decoding]\nmax_new_tokens = 8\n"
        "[workload]\nwarmup = 0\nrepeats = 1\n"
        f'[tracking]\ntracking_uri = "{mlflow_uri}"\nexperiment = "tiny"\n'
        f'report_dir = "{tmp_path / "reports"}"\n'
    )
    load_recipe(path)
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    (report_file,) = (tmp_path / "reports").glob("tiny-*/report.json")
    report = json.loads(report_file.read_text())
    assert report["summary"]["generations"] == 4 and report["summary"]["iterations"] > 0
    assert not report["summary"]["copies"]  # every expert resident
