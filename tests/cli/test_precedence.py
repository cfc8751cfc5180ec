"""One rule from input to runtime for every command: flags over the recipe, the recipe over the
schema's defaults. Each command hands its spec to `oled.runtime.build`, caught here before any
weight loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from oled.cli import app
from oled.recipe import DecodingSection, Recipe

runner = CliRunner()
DEFAULTS = DecodingSection()


class Built(Exception):
    """Raised by the stand-in for oled.runtime.build once it has the spec."""


@pytest.fixture
def recipe(tiny_dir, tmp_path) -> Path:
    """A recipe that sets some decoding and runtime keys and leaves others at the defaults."""
    path = tmp_path / "mine.toml"
    path.write_text(
        f'[model]\npath = "{tiny_dir}"\n'
        '[runtime]\ndevice = "cpu"\ndtype = "float32"\nbudget = { slots_per_layer = 4 }\n'
        "[decoding]\nthreshold = 0.8\nblock_length = 16\nmax_new_tokens = 24\n"
        "[tracking]\nmlflow = false\n"
    )
    return path


@pytest.fixture
def built(monkeypatch) -> list[Recipe]:
    """The specs handed to oled.runtime.build (which then stops the command)."""
    specs: list[Recipe] = []

    def build(spec, **_):
        specs.append(spec)
        raise Built

    monkeypatch.setattr("oled.runtime.build", build)
    return specs


def _served(monkeypatch) -> list[Recipe]:
    """The specs `oled serve` would serve (the server itself is not started)."""
    specs: list[Recipe] = []
    monkeypatch.setattr(
        "oled.serve.server.run_server", lambda spec, **kw: specs.append(spec) or None
    )
    return specs


def _check(spec: Recipe, tiny_dir: Path) -> None:
    d = spec.decoding
    assert d.threshold == 0.7  # the flag over the recipe's 0.8
    assert d.block_length == 16  # the recipe over the default
    assert d.temperature == DEFAULTS.temperature and d.seed == DEFAULTS.seed  # the schema's
    assert spec.model.path == str(tiny_dir) and spec.runtime.device == "cpu"
    assert spec.runtime.budget.slots_per_layer == 4


@pytest.mark.parametrize("command", ["chat", "bench", "generate"])
def test_flags_override_the_recipe_which_overrides_the_defaults(command, recipe, built, tiny_dir):
    args = [command, *(["hello"] if command == "generate" else [])]
    result = runner.invoke(app, [*args, "--recipe", str(recipe), "--threshold", "0.7"])
    assert isinstance(result.exception, Built), result.output
    (spec,) = built
    _check(spec, tiny_dir)
    assert spec.decoding.max_new_tokens == 24  # (bench generates --gen-length tokens)


def test_serve_takes_the_recipe_decoding_and_the_flags(recipe, tiny_dir, monkeypatch):
    served = _served(monkeypatch)
    result = runner.invoke(app, ["serve", "--recipe", str(recipe), "--threshold", "0.7"])
    assert result.exit_code == 0, result.output
    (spec,) = served
    _check(spec, tiny_dir)
    assert spec.decoding.max_new_tokens == 24  # a request without max_tokens gets this
    result = runner.invoke(app, ["serve", "--recipe", str(recipe), "--default-max-tokens", "5"])
    assert result.exit_code == 0 and served[-1].decoding.max_new_tokens == 5


def test_run_takes_set_over_the_recipe(recipe, built, tiny_dir):
    result = runner.invoke(app, ["run", str(recipe), "--set", "decoding.threshold=0.7"])
    assert isinstance(result.exception, Built), result.output
    (spec,) = built
    _check(spec, tiny_dir)


def test_without_a_recipe_the_flags_are_over_the_schema_defaults(tiny_dir, built):
    args = ["chat", "--model", str(tiny_dir), "--device", "cpu", "--cache-size", "3"]
    result = runner.invoke(app, args)
    assert isinstance(result.exception, Built), result.output
    (spec,) = built
    assert spec.decoding == DEFAULTS and spec.runtime.budget.slots_per_layer == 3
    assert spec.runtime.dtype == "bfloat16" and spec.policy.retention is None  # OLED's then


def test_a_bad_flag_is_named_and_nothing_loads(recipe, built):
    for flag, value in (("--threshold", "1.5"), ("--cache-size", "0"), ("--device", "tpu")):
        result = runner.invoke(app, ["chat", "--recipe", str(recipe), flag, value])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"error: {flag}: "), result.output
    assert built == []


def test_prefill_chunk_flag_over_the_recipe_and_validated(recipe, tiny_dir, monkeypatch):
    served = _served(monkeypatch)
    result = runner.invoke(app, ["serve", "--recipe", str(recipe)])
    assert result.exit_code == 0 and served[-1].runtime.prefill_chunk == 0  # the default
    result = runner.invoke(app, ["serve", "--recipe", str(recipe), "--prefill-chunk", "64"])
    assert result.exit_code == 0 and served[-1].runtime.prefill_chunk == 64
    result = runner.invoke(app, ["serve", "--recipe", str(recipe), "--prefill-chunk", "-1"])
    assert result.exit_code == 2 and result.output.startswith("error: --prefill-chunk: ")
