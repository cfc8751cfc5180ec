"""Every mistake a user can make on the command line is one line, `error: ...`, exit code 2, and
loses nothing: the real `oled` app on the project's own tiny checkpoints."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from oled.cli import app
from oled.cli.experiment import shipped_recipes
from oled.model.config import ModelConfig
from oled.model.presets import preset_config
from oled.model.tokenizer import Tokenizer, TokenizerError
from oled.policies import native
from oled.runtime import shipped_default

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


class Built(Exception):
    """Raised by the stand-in for oled.runtime.build: something started to load."""


@pytest.fixture
def built(monkeypatch) -> list:
    """The specs handed to oled.runtime.build (which then stops the command)."""
    specs: list = []

    def build(spec, **_):
        specs.append(spec)
        raise Built

    monkeypatch.setattr("oled.runtime.build", build)
    return specs


def one_error(result) -> str:
    """The one `error:` line of a command that failed with exit code 2 (and nothing else)."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def tiny_recipe(tmp_path: Path, runtime: str = "", name: str = "r.toml") -> Path:
    path = tmp_path / name
    path.write_text(
        '[model]\npath = "builtin:tiny"\n[runtime]\ndevice = "cpu"\ndtype = "float32"\n'
        f'cost = "cpu-ci"\n{runtime}\n[decoding]\nmax_new_tokens = 4\n'
        f'[tracking]\nmlflow = false\nreport_dir = "{tmp_path / "reports"}"\n'
    )
    return path


def test_a_binary_file_given_as_a_recipe(tmp_path, built):
    from oled.trace.synthetic import synthetic_trace

    binary = tmp_path / "program"
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:8192])
    trace = tmp_path / "t.oledtrace"
    synthetic_trace(num_layers=3, num_experts=32, top_k=4, blocks=1).save(trace)
    out = tmp_path / "new.oledtrace"
    for args in (
        ["validate", binary],
        ["run", binary],
        ["tune", binary],
        ["generate", "hi", "--recipe", binary],
        ["trace", "record", binary, "-o", out],
        ["simulate", trace, "--recipe", binary],
    ):
        result = runner.invoke(app, [str(a) for a in args])
        assert f"{binary}: not a TOML recipe: not UTF-8 text (byte 0x" in one_error(result), args
    assert built == []


def _truncated_copy(src: Path, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    shard = sorted(path.glob("*.safetensors"))[0]
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return path, shard


def test_a_truncated_shard_is_named_by_generate_chat_and_model_info(tiny_dir, tmp_path):
    result = runner.invoke(app, ["model", "info", str(tiny_dir)])
    shards = sorted(tiny_dir.glob("*.safetensors"))
    mib = sum(f.stat().st_size for f in shards) / 2**20
    assert result.exit_code == 0
    assert f"shards: {len(shards)} ({mib:.1f} MiB; headers, sizes and shapes checked)" in (
        result.output
    )
    path, shard = _truncated_copy(tiny_dir, tmp_path)
    flags = ["--model", str(path), "--device", "cpu", "--dtype", "float32"]
    for args in (["generate", "hi", *flags], ["chat", *flags], ["model", "info", str(path)]):
        line = one_error(runner.invoke(app, args, input="hi\n"))
        assert line.startswith(f"error: {shard}: truncated: "), (args, line)


def test_a_prompt_that_is_not_utf8_stops_before_loading(built):
    prompt = os.fsdecode(b"\xff\xfe")  # what Python makes of these bytes on the command line
    line = one_error(runner.invoke(app, ["generate", prompt]))
    assert line == "error: the prompt is not valid UTF-8 text (byte 0xff at character 0)"
    line = one_error(runner.invoke(app, ["chat", "--system", "be " + prompt]))
    assert line == "error: --system is not valid UTF-8 text (byte 0xff at character 3)"
    assert built == []
    tokenizer = Tokenizer.from_dir(shipped_default() or ROOT / "oled" / "data" / "default")
    with pytest.raises(TokenizerError, match="not valid UTF-8 text"):  # a chat line, a request
        tokenizer.encode("a" + prompt)


def test_the_compiled_planner_without_a_c_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("OLED_HOME", str(tmp_path / "home"))  # no library built there yet
    monkeypatch.setenv("CC", "/nonexistent")
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no cc, no gcc
    compiled = tiny_recipe(tmp_path, 'planner = "compiled"\nbudget = { expert_fraction = 0.5 }')
    python = tiny_recipe(
        tmp_path, 'planner = "python"\nbudget = { expert_fraction = 0.5 }', "p.toml"
    )
    native.LIBRARY.forget()
    try:
        line = one_error(runner.invoke(app, ["generate", "hi", "--recipe", str(compiled)]))
        assert "no C compiler found (tried $CC=/nonexistent, gcc on $PATH)" in line
        assert 'runtime.planner = "python"' in line
        result = runner.invoke(app, ["generate", "hi", "--recipe", str(python)])
        assert result.exit_code == 0, result.output
    finally:
        native.LIBRARY.forget()


def test_cp_keeps_an_edited_copy_unless_forced(tmp_path):
    shipped = shipped_recipes()["quickstart"].read_text()
    target = tmp_path / "quickstart.toml"
    for _ in range(2):  # over an identical copy too
        result = runner.invoke(app, ["cp", "quickstart", str(tmp_path)])
        assert result.exit_code == 0 and target.read_text() == shipped
    target.write_text(shipped + "# mine\n")
    line = one_error(runner.invoke(app, ["cp", "quickstart", str(tmp_path)]))
    assert line == (
        f"error: {target} exists and differs from the shipped quickstart recipe: "
        "give --force to overwrite it"
    )
    assert target.read_text() == shipped + "# mine\n"
    assert runner.invoke(app, ["cp", "quickstart", str(tmp_path), "--force"]).exit_code == 0
    assert target.read_text() == shipped
    nowhere = tmp_path / "nowhere" / "q.toml"
    line = one_error(runner.invoke(app, ["cp", "quickstart", str(nowhere)]))
    assert line == f"error: DEST {nowhere}: no such directory {nowhere.parent}"


def test_the_shipped_tune_recipe_runs_as_shipped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its study and report go here
    shipped = ROOT / "recipes" / "tune.toml"
    args = ["--set", "tune.trials=1", "--set", "tracking.mlflow=false"]
    result = runner.invoke(app, ["tune", str(shipped), *args])
    assert result.exit_code == 0, result.output
    assert re.search(r"^best [\d.]+ \{", result.output, flags=re.M), result.output
    runner.invoke(app, ["cp", "tune", str(tmp_path)])  # the copy, without the trace beside it
    line = one_error(runner.invoke(app, ["tune", "tune.toml", *args]))
    assert "tune.toml:" in line and ": tune.trace: no such file: twin/twin-tune.oledtrace" in line
    assert "oled trace record RECIPE -o twin/twin-tune.oledtrace" in line


def test_validate_needs_the_model_and_its_traces(tmp_path):
    from oled.trace.synthetic import synthetic_trace

    missing = tmp_path / "no-model"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[model]\npath = "{missing}"\n')
    line = one_error(runner.invoke(app, ["validate", str(recipe)]))
    assert line.startswith(f"error: {recipe}:2: model.path: no such directory: {missing} (")
    result = runner.invoke(app, ["validate", "--skip-model", str(recipe)])
    assert result.exit_code == 0 and result.output.startswith(f"ok  {recipe}  ")
    wide = tmp_path / "wide.oledtrace"  # LLaDA2.0-mini's routing, not the tiny model's
    synthetic_trace(num_layers=19, num_experts=256, top_k=8, blocks=1).save(wide)
    tune = '[tune]\n[tune.params]\n"decoding.threshold" = { low = 0.5, high = 0.9 }\n'
    base = '[model]\npath = "builtin:tiny"\n'
    cases = {
        tune: "tune.objective: 'simulate' replays a trace: set tune.trace",
        tune.replace("[tune]\n", '[tune]\ntrace = "none.oledtrace"\n'): (
            "tune.trace: no such file: none.oledtrace"
        ),
        tune.replace("[tune]\n", f'[tune]\ntrace = "{wide}"\n'): (
            "tune.trace: the trace's routing geometry (19 MoE layers x 256 experts, top-8) "
            "does not match the model's"
        ),
        f'[workload]\nrouting = "trace:{wide}"\n': "workload.routing: the trace's routing",
    }
    for text, problem in cases.items():
        recipe.write_text(base + text)
        assert problem in one_error(runner.invoke(app, ["validate", str(recipe)])), text


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "hi"],
        ["chat"],
        ["generate", "hi", "--recipe", "RECIPE"],
        ["chat", "-r", "RECIPE"],
    ],
)
def test_a_bad_max_tokens_names_the_flag(args, tmp_path, built):
    recipe = tiny_recipe(tmp_path)
    args = [str(recipe) if a == "RECIPE" else a for a in args]
    for value in ("-1", "0"):
        line = one_error(runner.invoke(app, [*args, "--max-tokens", value]))
        assert line == "error: --max-tokens: Input should be greater than or equal to 1"
    assert built == []


def test_serve_names_its_default_max_tokens_flag(built):
    line = one_error(runner.invoke(app, ["serve", "--default-max-tokens", "-1"]))
    assert line == "error: --default-max-tokens: Input should be greater than or equal to 1"


def test_an_empty_prompt(built):
    for prompt in ("", "  \n"):
        line = one_error(runner.invoke(app, ["generate", prompt]))
        assert line.startswith("error: the prompt is empty")
    assert built == []


def test_chat_asks_again_after_an_empty_line(tiny_dir, tmp_path):
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "oled.cli",
        "chat",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OLED_HOME": str(tmp_path)}
    done = subprocess.run(
        cmd, input="\n   \n/stats\n/exit\n", capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(">>> ") == 4  # each empty line: the prompt again, no reply
    assert "no reply yet" in done.stdout and "error" not in done.stdout + done.stderr


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


BRACKETED = re.compile(r"\[[A-Za-z][\w.:-]*\]")


def test_help_texts_show_their_brackets():
    """Help text is rich markup to typer: a `[word]` in it must be escaped to show."""
    checked = 0
    for path, command in _commands(typer.main.get_command(app)):
        texts = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
        words = set(BRACKETED.findall(" ".join(texts).replace("\\[", "[")))
        if not words:
            continue
        output = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "250"}).output
        for word in words:
            assert word in output, (path, word)
        checked += 1
    assert checked  # `oled tune`'s recipe argument names its [tune] section


def test_ls_shows_summaries_as_written():
    result = runner.invoke(app, ["ls", "objective"], env={"COLUMNS": "250"})
    assert result.exit_code == 0 and "`[tune] trace`" in result.output


def test_ls_tells_built_in_checkpoints_from_presets():
    result = runner.invoke(app, ["ls", "model"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    rows = {}
    for line in result.output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 4 and cells[0] == "model":
            rows[cells[1]] = cells[2]
    trained = ModelConfig.from_json(shipped_default()) if shipped_default() else None
    for name, summary in rows.items():
        kind, _, preset = name.partition(" ")
        if name == "builtin:tiny" and trained is not None:
            cfg, what = trained, "the trained default, shipped"
        elif kind == "preset":
            cfg, what = (
                preset_config(preset),
                f"random init (oled model init DIR --preset {preset})",
            )
        else:
            cfg, what = preset_config(name.removeprefix("builtin:")), "random init (seed 0)"
        assert summary.startswith(what) and f"hidden {cfg.hidden_size}," in summary, name
    assert {
        "builtin:tiny",
        "builtin:small",
        "preset tiny",
        "preset small",
        "preset mini-shape",
    } <= (set(rows))
