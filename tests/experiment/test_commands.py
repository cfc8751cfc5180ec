"""The experiment commands through the `oled` app: validate, ls, cp, run end to end."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from oled.cli import app
from oled.cli.experiment import shipped_recipes
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


def run_tiny(tmp_path: Path, mlflow_uri: str, name: str, runtime: str, rest: str) -> dict:
    """`oled run` of a tiny CPU recipe (`runtime` and `rest` add TOML lines); its report."""
    path = tmp_path / f"{name}.toml"
    path.write_text(
        '[model]\npath = "builtin:tiny"\n[runtime]\ndevice = "cpu"\ndtype = "float32"\n'
        f"{runtime}\n[decoding]\nmax_new_tokens = 8\n{rest}\n"
        f'[tracking]\ntracking_uri = "{mlflow_uri}"\nexperiment = "{name}"\n'
        f'report_dir = "{tmp_path / "reports"}"\n'
    )
    load_recipe(path)
    result = runner.invoke(app, ["run", str(path)])
    assert result.exit_code == 0, result.output
    (report_file,) = (tmp_path / "reports").glob(f"{name}-*/report.json")
    # the results go to stdout (`oled run R > out.txt` keeps them), progress to stderr
    assert "tokens / s (end to end)" in result.stdout and "tokens / s" not in result.stderr
    assert f"report: {report_file.parent}" in result.stdout
    return json.loads(report_file.read_text())


def test_run_tiny_end_to_end(tmp_path: Path, mlflow_uri: str) -> None:
    report = run_tiny(
        tmp_path,
        mlflow_uri,
        "tiny",
        "budget = { resident = true }",
        "[workload]\nwarmup = 0\nrepeats = 1",
    )
    assert report["summary"]["generations"] == 4 and report["summary"]["iterations"] > 0
    assert not report["summary"]["copies"]  # every expert resident


def test_run_follows_the_resident_tokens(tmp_path: Path, mlflow_uri: str) -> None:
    """`workload.follow`: every timed generation commits the reference's tokens."""
    report = run_tiny(
        tmp_path,
        mlflow_uri,
        "follow",
        'budget = { expert_fraction = 0.25 }\ncost = "cpu-ci"',
        '[policy.allocation]\nkind = "uniform"\n[policy.retention]\nkind = "lru"\n'
        '[policy.compensation]\nkind = "cpu_only"\n'
        "[workload]\nwarmup = 1\nrepeats = 1\nfollow = true",
    )
    gens = report["generations"]
    assert len(gens) == 4 and all(g["followed"] > 0 and g["cpu_experts"] > 0 for g in gens)
    assert report["summary"]["agreement"] == 1.0  # one device: the same choices
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("follow").experiment_id])
    assert run.data.tags["oled.planner"] == "compiled"  # the run says how it planned
    assert run.data.tags["oled.launch"] == "python"  # and launched (on the CPU: no driver)


def test_run_replays_a_routing_trace(tmp_path: Path, mlflow_uri: str, trace_file: Path) -> None:
    """`workload.routing = "trace:PATH"`: the prompts, lengths, commits and routing are the
    trace's (its prompts selected by `workload.trace_prompts`), not workload.prompts'."""
    (tmp_path / "t.oledtrace").write_bytes(trace_file.read_bytes())
    report = run_tiny(
        tmp_path,
        mlflow_uri,
        "replay",
        'budget = { expert_fraction = 0.25 }\ncost = "cpu-ci"',
        '[workload]\nwarmup = 1\nrepeats = 2\nrouting = "trace:t.oledtrace"\ntrace_prompts = "1:"',
    )
    gens = report["generations"]
    assert [g["trace_prompt"] for g in gens] == [1, 2, 1, 2]
    assert [g["iterations"] for g in gens] == [12, 16, 12, 16]
    assert [g["prompt_tokens"] for g in gens] == [13, 16, 13, 16]
    assert all(g["misses"] > 0 for g in gens)
