"""The README's promises: its set-up commands are what CI runs, and its Python example runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_setup_commands_are_what_ci_runs():
    setup = blocks("bash")[0].strip().splitlines()
    assert len(setup) == 2, "the set-up is two commands"
    ci = (ROOT / ".ci" / "run").read_text()
    for command in setup:
        assert command in ci, f"README command not in .ci/run: {command}"


def test_python_example_runs(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # from any folder: the example names no path of the clone
    example = blocks("python")[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["answer"].stats.iterations > 0


def test_printed_recipe_hashes_are_what_the_code_prints():
    """Every `ok  <recipe file>  HASH` line of the README is today's hash of that recipe."""
    from oled.recipe import load_recipe

    printed = re.findall(r"^ok  (\S+\.toml)  ([0-9a-f]{12})$", README, flags=re.M)
    assert printed, "the README shows `oled validate` output"
    for path, digest in printed:
        assert load_recipe(ROOT / path).hash() == digest, f"{path}: the README's hash is stale"
