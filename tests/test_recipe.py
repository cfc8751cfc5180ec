"""Recipe schema, one-line errors with file and line, overrides, flatten/hash/to_toml."""

from __future__ import annotations

from pathlib import Path

import pytest

from oled import registry as reg
from oled.recipe import Recipe, RecipeError, dump_toml, key_lines, load_recipe, parse_size

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").glob("*.toml"))


def _missing_policy_modules() -> set[str]:
    """Policy kinds whose module is not in this tree yet (their parameters cannot be checked)."""
    return {k for k in reg.POLICY_KINDS if not (ROOT / "oled" / "policies" / f"{k}.py").exists()}


def _error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides or [])
    message = str(info.value)
    assert "\n" not in message
    return message


def _line(path: Path, needle: str) -> int:
    """1-based line of the first line of `path` that contains `needle`."""
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if needle in line)


def _at(path: Path, needle: str) -> str:
    """`file:line` of the first line of `path` that contains `needle`."""
    return f"{path}:{_line(path, needle)}"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def test_shipped_recipes_exist() -> None:
    names = {p.stem for p in SHIPPED}
    baselines = {"lru", "lfu", "hybrimoe", "tide", "fiddler", "llamacpp", "oled", "resident"}
    assert {"quickstart", "tune"} | baselines <= names


def test_a_shipped_recipe_loads_by_name_from_anywhere(tmp_path: Path, monkeypatch) -> None:
    """`builtin:quickstart` is the packaged copy of the quickstart recipe, from any folder."""
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe("builtin:quickstart")
    assert recipe.name == "quickstart"
    assert recipe.hash() == load_recipe(ROOT / "recipes" / "quickstart.toml").hash()
    with pytest.raises(RecipeError, match=r"^builtin:quickstrt: no such shipped recipe \(did you"):
        load_recipe("builtin:quickstrt")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_recipe_validates(path: Path) -> None:
    skip = _missing_policy_modules()
    if skip:
        # Component names are still checked against the registry; only their parameters wait
        # for the policy modules.
        print(f"parameters of {sorted(skip)} not checked: oled.policies modules not importable")
    recipe = load_recipe(path, skip_params=skip)
    assert load_recipe(path, skip_params=skip).hash() == recipe.hash()


def test_valid_recipe(recipe_file: Path) -> None:
    recipe = load_recipe(recipe_file)
    assert isinstance(recipe, Recipe)
    assert recipe.policy.retention is not None
    assert recipe.policy.retention.params == {"threshold": 0.7}
    assert recipe.runtime.budget.expert_fraction == 0.5
    assert recipe.decoding.block_length == 32  # default
    assert recipe.path == recipe_file and recipe.name == "recipe"


def test_unknown_key_with_suggestion(recipe_file: Path) -> None:
    text = recipe_file.read_text().replace("threshold = 0.7", "treshold = 0.7")
    path = _write(recipe_file.parent, text)
    line = text.splitlines().index("treshold = 0.7") + 1
    assert _error(path) == (
        f"{path}:{line}: policy.retention.treshold: unknown key (did you mean 'threshold'?)"
    )


def test_unknown_schema_key_and_section(recipe_file: Path) -> None:
    text = recipe_file.read_text()
    path = _write(recipe_file.parent, text.replace("max_new_tokens", "max_new_token"))
    assert _error(path) == (
        f"{_at(path, 'max_new_token')}: decoding.max_new_token:"
        " unknown key (did you mean 'max_new_tokens'?)"
    )
    path = _write(recipe_file.parent, text.replace("[workload]", "[wrkload]"))
    assert _error(path).startswith(
        f"{_at(path, '[wrkload]')}: wrkload: unknown key (did you mean 'workload'?)"
    )


def test_wrong_type(recipe_file: Path) -> None:
    path = _write(recipe_file.parent, recipe_file.read_text().replace("= 0.7", '= "high"'))
    message = _error(path)
    assert message.startswith(
        f"{_at(path, 'threshold')}: policy.retention.threshold: Input should be a valid"
    )
    assert "'high'" in message
    path = _write(recipe_file.parent, recipe_file.read_text().replace("= 8", "= 8.5"))
    assert _error(path).startswith(f"{_at(path, 'max_new_tokens')}: decoding.max_new_tokens: ")


def test_unknown_component_with_suggestion(recipe_file: Path) -> None:
    text = recipe_file.read_text().replace('"keep_recent"', '"keep_recnt"')
    path = _write(recipe_file.parent, text)
    assert _error(path) == (
        f"{_at(path, 'keep_recnt')}: policy.retention.kind: unknown retention 'keep_recnt'"
        " (did you mean 'keep_recent'?)"
    )


def test_unknown_model_preset(recipe_file: Path) -> None:
    text = recipe_file.read_text().replace("builtin:tiny", "builtin:tyni")
    path = _write(recipe_file.parent, text)
    assert _error(path) == f"{path}:2: model.path: unknown model 'tyni' (did you mean 'tiny'?)"


def test_bad_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, '[model]\npath = "builtin:tiny"\n\n[runtime\ndevice = "cpu"\n')
    message = _error(path)
    assert message.startswith(f"{path}:4: invalid TOML: ")


def test_missing_required(tmp_path: Path) -> None:
    path = _write(tmp_path, '[runtime]\ndevice = "cpu"\n')
    assert _error(path) == f"{path}:1: model: missing required key"
    path = _write(tmp_path, "[model]\n\n[policy.retention]\nkind = 'lru'\n")
    assert _error(path) == f"{path}:1: model.path: missing required key"


def test_missing_component_kind(recipe_file: Path) -> None:
    path = _write(recipe_file.parent, recipe_file.read_text().replace('kind = "always_copy"', ""))
    assert (
        _error(path)
        == f"{_at(path, '[policy.compensation]')}: policy.compensation.kind: missing required key"
    )


def test_budget_exactly_one(recipe_file: Path) -> None:
    text = recipe_file.read_text()
    path = _write(recipe_file.parent, text.replace("{ expert_fraction = 0.5 }", "{}"))
    assert "runtime.budget: set exactly one of expert_fraction" in _error(path)
    path = _write(recipe_file.parent, text.replace("0.5 }", "1.5 }"))
    assert _error(path).startswith(f"{_at(path, 'budget')}: runtime.budget.expert_fraction: ")
    path = _write(recipe_file.parent, text.replace("expert_fraction = 0.5", 'gpu_memory = "24GB"'))
    assert load_recipe(path).runtime.budget.gpu_memory == "24GB"
    path = _write(recipe_file.parent, text.replace("expert_fraction = 0.5", 'gpu_memory = "lots"'))
    assert "not a size" in _error(path)


def test_overrides(recipe_file: Path) -> None:
    recipe = load_recipe(
        recipe_file,
        ["decoding.threshold=0.8", "policy.retention.window=2", "runtime.device=cuda:1"],
    )
    assert recipe.decoding.threshold == 0.8
    assert recipe.policy.retention is not None and recipe.policy.retention.params["window"] == 2
    assert recipe.runtime.device == "cuda:1"
    assert recipe.runtime.cuda_graphs is True
    assert load_recipe(recipe_file, ["runtime.cuda_graphs=false"]).runtime.cuda_graphs is False
    assert "runtime.cuda_graphs" in _error(recipe_file, ["runtime.cuda_graphs=sometimes"])
    recipe = load_recipe(recipe_file, ["policy.retention.name=plain text"])
    assert recipe.policy.retention is not None
    assert recipe.policy.retention.params["name"] == "plain text"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "policy.retention.treshold=0.5",
            "--set policy.retention.treshold: unknown key (did you mean 'threshold'?)",
        ),
        ("decoding.block_length=abc", "--set decoding.block_length: Input should be a valid"),
        ("policy.retention.kind=keep_recnt", "--set policy.retention.kind: unknown retention"),
        ("decoding", "--set decoding: expected KEY=VALUE"),
        ("model.path.x=1", "--set model.path.x: model.path is a value, not a table"),
    ],
)
def test_bad_override(recipe_file: Path, override: str, expected: str) -> None:
    assert _error(recipe_file, [override]).startswith(expected)


def test_tune_params_are_checked(recipe_file: Path) -> None:
    text = recipe_file.read_text() + '\n[tune]\ntrials = 3\nobjective = "run"\n\n[tune.params]\n'
    good = text + '"policy.retention.threshold" = { low = 0.1, high = 0.9 }\n'
    recipe = load_recipe(_write(recipe_file.parent, good))
    assert recipe.tune is not None and recipe.tune.params["policy.retention.threshold"].high == 0.9
    bad = text + '"policy.retention.treshold" = { low = 0.1, high = 0.9 }\n'
    path = _write(recipe_file.parent, bad)
    assert _error(path) == (
        f"{_at(path, 'treshold')}: tune.params.policy.retention.treshold:"
        " unknown key (did you mean 'threshold'?)"
    )
    path = _write(recipe_file.parent, text + '"decoding.seed" = { low = 3 }\n')
    assert "tune.params.decoding.seed: give 'low' <= 'high'" in _error(path)
    path = _write(recipe_file.parent, text.replace('objective = "run"', 'objective = "simulte"'))
    assert "tune.objective: unknown objective 'simulte' (did you mean 'simulate'?)" in _error(path)


def test_flatten_hash_to_toml_roundtrip(recipe_file: Path, tmp_path: Path) -> None:
    recipe = load_recipe(recipe_file)
    flat = recipe.flatten()
    assert flat["policy.retention.threshold"] == "0.7"
    assert flat["model.path"] == "builtin:tiny"
    assert flat["runtime.budget.expert_fraction"] == "0.5"
    again = _write(tmp_path, recipe.to_toml())
    reloaded = load_recipe(again)
    assert reloaded.hash() == recipe.hash() and reloaded.flatten() == flat
    assert load_recipe(recipe_file, ["decoding.seed=1"]).hash() != recipe.hash()
    assert load_recipe(recipe_file, ["tracking.experiment=x"]).hash() == recipe.hash()


def test_with_values(recipe_file: Path) -> None:
    recipe = load_recipe(recipe_file).with_values({"policy.retention.window": 3})
    assert recipe.policy.retention is not None and recipe.policy.retention.params["window"] == 3
    with pytest.raises(RecipeError, match="--set policy.retention.windw: unknown key"):
        load_recipe(recipe_file).with_values({"policy.retention.windw": 3})


def test_key_lines_and_dump() -> None:
    text = '[a]\nx = 1\n[a."b.c"]\ny = { z = 2 }\n'
    assert key_lines(text) == {
        ("a",): 1,
        ("a", "x"): 2,
        ("a", "b.c"): 3,
        ("a", "b.c", "y"): 4,
        ("a", "b.c", "y", "z"): 4,
    }
    data = {"a": {"x": 1, "s": 'q"\\', "l": [1.5, True], "b.c": {"y": {"z": 2}}}}
    from oled.recipe import tomllib

    assert tomllib.loads(dump_toml(data)) == data
    assert parse_size("24GiB") == 24 * 2**30 and parse_size("500 MB") == 500 * 10**6


def test_shipped_anchor_recipes_match_the_anchor_table():
    """recipes/<anchor>.toml names the same components as oled.policies.ANCHORS."""
    from oled.policies import ANCHORS

    for name, kinds in ANCHORS.items():
        recipe = load_recipe(ROOT / "recipes" / f"{name}.toml")
        policy = recipe.policy
        assert (policy.allocation.kind, policy.retention.kind, policy.compensation.kind) == kinds


def test_workload_routing(recipe_file: Path, trace_file: Path) -> None:
    """`workload.routing`: "model" (the default, hashed as before the key) or "trace:PATH",
    a trace file next to the recipe (or from the working directory), checked at load."""
    base = load_recipe(recipe_file)
    assert base.workload.routing == "model" and base.routing_trace() is None
    assert load_recipe(recipe_file, ["workload.routing=model"]).hash() == base.hash()
    (recipe_file.parent / "traces").mkdir()
    (recipe_file.parent / "traces" / "t.oledtrace").write_bytes(trace_file.read_bytes())
    text = recipe_file.read_text().replace(
        "repeats = 1", 'repeats = 1\nrouting = "trace:traces/t.oledtrace"\ntrace_prompts = "1:"'
    )
    path = recipe_file.parent / "traced.toml"
    path.write_text(text)
    recipe = load_recipe(path)
    assert recipe.routing_trace() == recipe_file.parent / "traces" / "t.oledtrace"
    assert recipe.hash() != base.hash()
    assert recipe.with_values({"workload.trace_prompts": "0"}).workload.trace_prompts == "0"
    assert load_recipe(path, [f"workload.routing=trace:{trace_file}"]).routing_trace() == trace_file

    bad = recipe_file.parent / "bad.toml"
    bad.write_text(text.replace("trace:traces", "trace:nowhere"))
    assert _error(bad) == (
        f"{_at(bad, 'routing =')}: workload.routing: no such file: nowhere/t.oledtrace "
        "(oled trace record RECIPE -o nowhere/t.oledtrace records one)"
    )
    (recipe_file.parent / "plain.txt").write_text("not a trace")
    message = _error(path, ["workload.routing=trace:plain.txt"])
    assert message.startswith("--set workload.routing: ")
    assert "plain.txt is not an OLED-MoE trace file" in message
    assert _error(path, ["workload.routing=replay"]) == (
        "--set workload.routing: expected 'model' or 'trace:PATH' (got 'replay')"
    )
    assert _error(path, ["workload.trace_prompts=7"]) == (
        "--set workload.trace_prompts: prompt selection '7': the trace holds 3 prompts"
    )
    assert _error(recipe_file, ["workload.trace_prompts=0"]) == (
        "--set workload.trace_prompts: needs workload.routing = 'trace:PATH'"
    )


def test_validate_reports_a_bad_trace_in_one_line(recipe_file: Path) -> None:
    from typer.testing import CliRunner

    from oled.cli import app

    (recipe_file.parent / "plain.txt").write_text("not a trace")
    text = recipe_file.read_text().replace(
        "repeats = 1", 'repeats = 1\nrouting = "trace:plain.txt"'
    )
    path = _write(recipe_file.parent, text)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "workload.routing: " in lines[0]
    assert "plain.txt is not an OLED-MoE trace file" in lines[0]


def test_a_binary_file_is_not_a_recipe(tmp_path: Path) -> None:
    path = tmp_path / "program.toml"
    data = b"[model]\npath = 1\n\x7fELF\xff\xfe\x00"
    path.write_bytes(data)
    offset = data.index(b"\xff")
    assert (
        _error(path) == f"{path}: not a TOML recipe: not UTF-8 text (byte 0xff at offset {offset})"
    )


def _wide_trace(tmp_path: Path) -> Path:
    """A trace of LLaDA2.0-mini's routing (19 MoE layers x 256 experts, top-8)."""
    from oled.trace.synthetic import synthetic_trace

    path = tmp_path / "wide.oledtrace"
    synthetic_trace(num_layers=19, num_experts=256, top_k=8, blocks=1).save(path)
    return path


STUDY = '[tune]\n{trace}[tune.params]\n"decoding.threshold" = {{ low = 0.5, high = 0.9 }}\n'


def test_a_study_that_simulates_names_a_trace_that_routes_like_its_model(
    recipe_file: Path, trace_file: Path, tmp_path: Path
) -> None:
    text = recipe_file.read_text()
    path = _write(tmp_path, text + STUDY.format(trace=""))
    assert _error(path) == (
        f"{_at(path, '[tune]')}: tune.objective: 'simulate' replays a trace: set tune.trace "
        "(oled trace record RECIPE -o PATH records one)"
    )
    path = _write(tmp_path, text + STUDY.format(trace='trace = "none.oledtrace"\n'))
    assert _error(path) == (
        f"{_at(path, 'trace =')}: tune.trace: no such file: none.oledtrace "
        "(oled trace record RECIPE -o none.oledtrace records one)"
    )
    (tmp_path / "t.oledtrace").write_bytes(trace_file.read_bytes())  # beside the recipe
    path = _write(tmp_path, text + STUDY.format(trace='trace = "t.oledtrace"\n'))
    assert load_recipe(path).tune.trace == "t.oledtrace"
    wide = _wide_trace(tmp_path)
    message = _error(path, [f'tune.trace="{wide}"'])
    assert message == (
        "--set tune.trace: the trace's routing geometry (19 MoE layers x 256 experts, top-8) "
        "does not match the model's (3 MoE layers x 32 experts, top-4) (model.path builtin:tiny)"
    )
    assert _error(recipe_file, [f"workload.routing=trace:{wide}"]).startswith(
        "--set workload.routing: the trace's routing geometry (19 MoE layers"
    )


def test_a_trace_of_a_model_not_on_this_machine_is_not_compared(recipe_file, tmp_path) -> None:
    """A recipe for another machine (its model directory is not here) still loads."""
    text = recipe_file.read_text().replace("builtin:tiny", str(tmp_path / "elsewhere"))
    wide = _wide_trace(tmp_path)
    path = _write(tmp_path, text + STUDY.format(trace=f'trace = "{wide}"\n'))
    assert load_recipe(path).tune.trace == str(wide)
    with pytest.raises(RecipeError, match=r":2: model.path: no such directory: .*elsewhere"):
        load_recipe(path, require_model=True)


def test_the_shipped_study_replays_a_shipped_trace() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tune.toml")
    from oled.recipe import beside

    assert recipe.tune is not None and recipe.tune.objective == "simulate"
    trace = beside(recipe.tune.trace, recipe.folder)
    assert trace.is_file() and trace.is_relative_to(ROOT / "recipes")


def test_transfer_is_checked_and_named(recipe_file: Path) -> None:
    from oled.cli.using import transfer_label

    assert "transfer" in _error(recipe_file, ["runtime.transfer=zip"])
    recipe = load_recipe(recipe_file, ["runtime.transfer=fp8"])
    assert recipe.runtime.transfer == "fp8" and transfer_label(recipe) == " fp8 (lossy)"
    plain = load_recipe(recipe_file)
    assert transfer_label(plain) == "" and plain.hash() != recipe.hash()
    assert plain.hash() == load_recipe(recipe_file, ["runtime.transfer=plain"]).hash()


def test_ahead_from_is_checked_and_hashed_only_when_set(recipe_file: Path) -> None:
    message = _error(recipe_file, ["runtime.ahead_from=next"])
    assert "unknown ahead_from 'next'; choose from router, previous" in message
    previous = load_recipe(recipe_file, ["runtime.ahead_from=previous"])
    assert previous.runtime.ahead_from == "previous"
    plain = load_recipe(recipe_file)
    assert plain.hash() == load_recipe(recipe_file, ["runtime.ahead_from=router"]).hash()
    assert plain.hash() != previous.hash()
