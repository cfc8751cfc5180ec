"""`oled trace record` and `oled simulate` end to end on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from oled.cli import app
from oled.policies import ANCHORS
from oled.trace.format import Trace


def test_record_then_simulate_every_baseline(tmp_path, tiny_dir):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_dir}"\n[runtime]\ndevice = "cpu"\ndtype = "float32"\n'
        'budget = { expert_fraction = 0.25 }\ncost = "cpu-ci"\n'
        "[decoding]\nmax_new_tokens = 32\n"
    )
    out = tmp_path / "t.oledtrace"
    runner = CliRunner()
    res = runner.invoke(app, ["trace", "record", str(recipe), "-o", str(out)])
    assert res.exit_code == 0, res.output
    trace = Trace.load(out)
    assert trace.meta.num_moe_layers == 3 and trace.num_steps > 10
    res = runner.invoke(app, ["simulate", str(out), "--recipe", str(recipe), "--baselines"])
    assert res.exit_code == 0, res.output
    for name in ("lru", "hybrimoe", "tide", "fiddler", "llamacpp", "oled", "Belady"):
        assert name in res.output
    assert trace.ranks == 16  # the router's ranking, recorded by default
    curves = tmp_path / "curves.json"
    res = runner.invoke(app, ["trace", "curves", str(out), "-o", str(curves)])
    assert res.exit_code == 0, res.output
    assert "3 layers x capacities 0-32 under lfu" in res.output
    text = recipe.read_text() + f'[policy.allocation]\nkind = "curves"\ncurves = "{curves}"\n'
    recipe.write_text(text)
    res = runner.invoke(app, ["simulate", str(out), "--recipe", str(recipe)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["trace", "curves", str(out), "-o", str(curves), "--retention", "lfx"])
    assert res.exit_code != 0 and "lfx" in res.output


def _simulate(tmp_path, tiny_dir, runtime: str, *args: str, **geometry):
    """`oled simulate ARGS` of a synthetic trace of `geometry` with a recipe of the tiny model
    and the `[runtime]` lines given."""
    from oled.trace.synthetic import synthetic_trace

    trace_file = tmp_path / "s.oledtrace"
    synthetic_trace(**geometry, blocks=1).save(trace_file)
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[model]\npath = "{tiny_dir}"\n[runtime]\n{runtime}\n')
    cmd = ["simulate", str(trace_file), "--recipe", str(recipe), *args]
    return CliRunner().invoke(app, cmd, env={"COLUMNS": "200"})


def test_simulate_splits_the_experts_over_devices(tmp_path, tiny_dir):
    """`--devices 2`: each device's misses per forward beside their total; an expert count
    that does not split is named."""
    geometry = {"num_layers": 3, "num_experts": 32, "top_k": 4}
    runtime = 'budget = { expert_fraction = 0.5 }\ncost = "cpu-ci"'
    res = _simulate(tmp_path, tiny_dir, runtime, "--devices", "2", "--baselines", **geometry)
    assert res.exit_code == 0, res.output
    assert "2 devices" in res.output and "per device" in res.output
    rows = [line for line in res.output.splitlines() if line.startswith("│")]
    assert len(rows) == 1 + len(ANCHORS)  # the recipe and every baseline, fiddler's too
    for row in rows:
        total, each = (cell.strip() for cell in row.split("│")[2:4])
        assert float(total) == pytest.approx(sum(map(float, each.split(" / "))), abs=0.1)
    res = _simulate(tmp_path, tiny_dir, runtime, "--devices", "3", **geometry)
    assert res.exit_code == 2 and "32 experts per layer do not split evenly over 3" in res.output


def test_simulate_adds_the_clairvoyant_bound(tmp_path, tiny_dir):
    """`--bound`: a row of the recipe's split with Belady's choice inside the planner, at most
    the recipe's misses, and the same with each layer's misses split between the link and the
    CPU, shorter in the model where the CPU is cheap; one device only."""
    geometry = {"num_layers": 3, "num_experts": 32, "top_k": 4}
    runtime = 'budget = { expert_fraction = 0.5 }\ncost = "cpu-ci"'
    res = _simulate(tmp_path, tiny_dir, runtime, "--bound", **geometry)
    assert res.exit_code == 0, res.output
    rows = {
        cells[1].strip(): (float(cells[2]), float(cells[5]), float(cells[7].strip(" %")))
        for line in res.output.splitlines()
        if line.startswith("│") and (cells := line.split("│"))
    }  # name: (misses/it, ms/it, CPU share)
    assert set(rows) == {"recipe", "bound", "bound, both links"}
    assert rows["bound"][0] <= rows["recipe"][0] and rows["bound"][2] == 0
    assert rows["bound, both links"][1] < rows["bound"][1] and rows["bound, both links"][2] > 0
    res = _simulate(tmp_path, tiny_dir, runtime, "--bound", "--devices", "2", **geometry)
    assert res.exit_code == 2 and "the clairvoyant bound is for one device" in res.output


def test_simulate_needs_a_slot_budget(tmp_path, tiny_dir):
    res = _simulate(
        tmp_path,
        tiny_dir,
        'budget = { gpu_memory = "8GiB" }',
        num_layers=3,
        num_experts=32,
        top_k=4,
    )
    assert res.exit_code == 2
    assert (
        "gpu_memory budget needs a device to size: give expert_fraction, expert_budget or "
        "slots_per_layer" in " ".join(res.output.split())
    )


def _recipe(tmp_path, model) -> Path:
    """A resident CPU recipe that records two short prompts quickly."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Who wrote Hamlet?"}\n{"prompt": "Hi"}\n')
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[model]\npath = "{model}"\n[runtime]\ndevice = "cpu"\ndtype = "float32"\n'
        "[decoding]\nblock_length = 8\nmax_new_tokens = 4\n"
        f'[workload]\nprompts = "{prompts}"\n'
    )
    return recipe


def _one_error(res) -> str:
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def test_record_checks_its_output_before_loading(tmp_path, tiny_dir, monkeypatch):
    def build(*_, **__):
        raise AssertionError("loaded before checking --out")

    monkeypatch.setattr("oled.runtime.build", build)
    recipe = _recipe(tmp_path, tiny_dir)
    nowhere = tmp_path / "nowhere" / "t.oledtrace"
    for out, problem in (
        (nowhere, f"no such directory {nowhere.parent}"),
        (tmp_path, "is a directory, not a file"),
    ):
        res = CliRunner().invoke(app, ["trace", "record", str(recipe), "-o", str(out)])
        assert _one_error(res) == f"error: --out {out}: {problem}"


def test_record_keeps_the_trace_when_the_final_write_fails(tmp_path, tiny_dir, monkeypatch):
    import shutil
    import tempfile

    from oled.trace import record as recording

    folder = tmp_path / "out"
    folder.mkdir()
    real = recording.record

    def record_then_lose_the_folder(*args, **kwargs):
        trace = real(*args, **kwargs)
        shutil.rmtree(folder)  # the output's folder goes away while recording
        return trace

    monkeypatch.setattr(recording, "record", record_then_lose_the_folder)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    out = folder / "t.oledtrace"
    res = CliRunner().invoke(
        app, ["trace", "record", str(_recipe(tmp_path, tiny_dir)), "-o", str(out)]
    )
    line = _one_error(res)
    assert line.startswith(f"error: cannot write {out} (")
    (kept,) = (tmp_path / "tmp").glob("t-*.oledtrace")
    assert line.endswith(f"; the trace is kept at {kept} instead")
    trace = Trace.load(kept)
    assert trace.meta.prompt_count == 2 and trace.num_steps > 0


def test_record_shows_progress_on_a_terminal_only(tmp_path, tiny_dir):
    import os
    import sys

    import pexpect

    recipe = _recipe(tmp_path, tiny_dir)
    out = tmp_path / "t.oledtrace"
    res = CliRunner().invoke(app, ["trace", "record", str(recipe), "-o", str(out)])
    assert res.exit_code == 0 and "recording" not in res.output  # not a terminal: no bar
    assert res.output.startswith(f"wrote {out}: ")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OLED_HOME": str(tmp_path), "TERM": "xterm"}
    cmd = ["-m", "oled.cli", "trace", "record", str(recipe), "-o", str(out)]
    child = pexpect.spawn(sys.executable, cmd, env=env, encoding="utf-8", timeout=120)
    child.expect(r"recording.*\d/2")  # the bar, counting prompts
    child.expect(f"wrote {out}")
    child.expect(pexpect.EOF)


def test_simulate_refuses_a_trace_of_another_routing(tmp_path, tiny_dir):
    res = _simulate(
        tmp_path,
        tiny_dir,
        'budget = { expert_fraction = 0.25 }\ncost = "cpu-ci"',
        num_layers=19,
        num_experts=256,
        top_k=8,
    )
    assert _one_error(res) == (
        "error: simulation: the trace's routing geometry (19 MoE layers x 256 experts, top-8) "
        "does not match the model's (3 MoE layers x 32 experts, top-4) "
        f"(model.path {tiny_dir})"
    )


def test_simulate_replays_copies_ahead_from_the_recorded_prediction(tmp_path, tiny_dir, trace_file):
    """`runtime.prefetch` > 0 on a recorded trace: copies ahead per forward (and used) beside
    the copies, and where they came from: the trace's prediction, or the forward before."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_dir}"\n[runtime]\nbudget = {{ expert_fraction = 0.5 }}\n'
        'cost = "h200"\nprefetch = 16\n'
    )
    cmd = ["simulate", str(trace_file), "--recipe", str(recipe)]
    res = CliRunner().invoke(app, cmd, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "ahead/it (used)" in res.output and "copies ahead: router (recorded)" in res.output
    row = next(line for line in res.output.splitlines() if line.startswith("│ recipe"))
    ahead, used = map(float, row.split("│")[7].replace("(", "").replace(")", "").split())
    assert 0 < used <= ahead
    res = CliRunner().invoke(
        app, [*cmd, "--set", "runtime.ahead_from=previous"], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0 and "copies ahead: previous" in res.output, res.output
