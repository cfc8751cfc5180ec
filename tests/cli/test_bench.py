"""`oled bench` on the tiny model, its report, its table, and the flags that wait for features."""

from __future__ import annotations

import json
from types import SimpleNamespace

from typer.testing import CliRunner

from oled import bench
from oled.cli import app

runner = CliRunner()


def test_bench_tiny_writes_a_report(tiny_dir, tmp_path):
    args = ["bench", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32",
            "--gen-length", "8", "--block-length", "8", "--prompt-length", "20", "--runs", "2",
            "--warmup-runs", "1", "--profile", "--report-dir", str(tmp_path)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "ms/iter p50" in result.output and "tokens/fwd" in result.output
    assert "no device timeline on cpu" in result.output
    report = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    row = report["rows"][0]
    assert row["runs"] == 2 and row["tokens"] == 16 and row["ms_per_iteration_median"] > 0
    assert report["config"]["prompt_length"] == 20 and "offload" not in row


def test_offload_columns_and_ratios():
    def stats(ms):
        return SimpleNamespace(iteration_ms=ms, iterations=len(ms), new_tokens=len(ms),
                               seconds=sum(ms) / 1000)  # fmt: skip

    def row(label, ms, hit):
        return bench.summarise(label, [stats(ms)], [{"hit_rate": hit, "copies": 4.0}])

    rows = bench.with_ratios([row("resident", [10.0, 12.0], 1.0), row("half", [20.0, 24.0], 0.5)])
    assert rows[1]["ms_ratio_to_first"] == 2.0
    assert rows[1]["offload"] == {"hit_rate": 0.5, "copies_per_iteration": 2.0}
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(bench.table(rows))
    text = console.export_text()
    assert "2.00x" in text and "50.0%" in text and "hit rate" in text


def test_random_prompt_is_seeded(tiny_dir):
    from oled.runtime import load_runtime

    rt = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    a = bench.random_prompt(rt, 512, 0)
    assert a == bench.random_prompt(rt, 512, 0) != bench.random_prompt(rt, 512, 1)
    assert len(a) == 512 and rt.tokenizer.mask_id not in a


def test_bench_with_an_expert_cache_shows_offload_columns(tiny_dir):
    args = ["bench", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32",
            "--cache-size", "8", "--gen-length", "8", "--block-length", "8",
            "--prompt-length", "20", "--runs", "1", "--warmup-runs", "0"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "cache=8" in result.output and "hit rate" in result.output and "%" in result.output


def test_bench_compares_recipes_side_by_side(tiny_dir, tmp_path):
    common = f'[model]\npath = "{tiny_dir}"\n[decoding]\nmax_new_tokens = 8\nblock_length = 8\n'
    a, b = tmp_path / "resident.toml", tmp_path / "lru.toml"
    a.write_text(common + '[runtime]\ndevice = "cpu"\nbudget = { resident = true }\n')
    b.write_text(
        common + '[runtime]\ndevice = "cpu"\nbudget = { expert_fraction = 0.25 }\n'
        'cost = "cpu-ci"\n[policy.retention]\nkind = "lru"\n'
    )
    args = ["bench", str(a), str(b), "--prompt-length", "20", "--runs", "1", "--warmup-runs", "0"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "resident" in result.output and "lru" in result.output


def test_bad_recipe_fails_with_one_line(tmp_path):
    recipe = tmp_path / "a.toml"
    recipe.write_text("[model]\npath = 'builtin:tiny'\n[runtime]\ndevcie = 'cpu'\n")
    for args in (["bench", str(recipe)], ["chat", "--recipe", str(recipe)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "a.toml:4: runtime.devcie: unknown key (did you mean 'device'?)" in result.output


def test_stage_times_go_to_the_innermost_stage():
    """Kernels count for the innermost enclosing stage, 'other' outside every stage."""

    def event(name, kernels=(), children=()):
        e = SimpleNamespace(name=name, kernels=[SimpleNamespace(duration=d) for d in kernels],
                            cpu_children=list(children), cpu_parent=None)  # fmt: skip
        for child in e.cpu_children:
            child.cpu_parent = e
        return e

    mm = event("aten::mm", [5.0])
    copies = event("copies", [7.0])
    decision = event("host decision", [1.0], [copies])
    routed = event("grouped GEMM", [], [event("aten::_grouped_mm", [30.0, 2.0])])
    layer = event("attention", [], [mm])
    loose = event("aten::add", [4.0])
    events = [layer, mm, decision, copies, routed, *routed.cpu_children, loose]
    assert bench._stage_device_us(events) == {
        "attention": 5.0, "host decision": 1.0, "copies": 7.0, "grouped GEMM": 32.0, "other": 4.0,
    }  # fmt: skip


def test_bench_eager_flag(tiny_dir):
    args = ["bench", "--model", str(tiny_dir), "--device", "cpu", "--eager", "--gen-length", "4",
            "--block-length", "4", "--prompt-length", "8", "--runs", "1", "--warmup-runs", "0"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
