"""`oled bench` on the tiny model, its report, its table, and the flags that wait for features."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import torch
from typer.testing import CliRunner

from oled import bench
from oled.bench.profile import _stage_device_us, union_us
from oled.cli import app
from oled.decoding.decoder import GenerationStats
from oled.offload.metrics import EngineMetrics

runner = CliRunner()


def bench_tiny(model: object) -> list[str]:
    """`oled bench` on a tiny checkpoint on the CPU in float32: the arguments every test
    starts from."""
    return ["bench", "--model", str(model), "--device", "cpu", "--dtype", "float32"]


def test_bench_tiny_writes_a_report(tiny_dir, tmp_path):
    args = [
        *bench_tiny(tiny_dir),
        "--gen-length",
        "8",
        "--block-length",
        "8",
        "--prompt-length",
        "20",
        "--runs",
        "2",
        "--warmup-runs",
        "1",
        "--profile",
        "--report-dir",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "ms/iter p50" in result.output and "tokens/fwd" in result.output
    assert "no device timeline on cpu" in result.output
    report = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    row = report["rows"][0]
    assert row["runs"] == 2 and row["tokens"] == 16 and row["ms_per_iteration_median"] > 0
    assert report["config"]["prompt_length"] == 20 and "offload" not in row


def test_rows_report_their_agreement_with_the_resident_tokens(tiny_dir):
    """Free running, each timed run is compared with the resident tokens; following, the runs
    commit them and one more free run measures the agreement."""
    from oled.decoding import DecodeConfig
    from oled.runtime import load_runtime

    rt = load_runtime(
        str(tiny_dir), device="cpu", dtype="float32", decode=DecodeConfig(block_length=8)
    )
    cfg = bench.BenchConfig(gen_length=8, prompt_length=20, runs=2, warmup_runs=0)
    free = bench.bench_runtime(rt, cfg, "free")
    assert free["agreement"] == {
        "tokens_equal": 1.0,
        "first_divergence": None,
        "max_logit_diff": 0.0,
        "runs": 2,
    }
    assert "followed_agreement" not in free
    followed = bench.bench_runtime(rt, cfg, "follow", follow=True)
    assert followed["followed_agreement"] == 1.0 and followed["agreement"]["runs"] == 1
    assert followed["output"] == free["output"]


def _engine_summary(prompt: dict, *decode: dict) -> dict:
    """An engine summary of one generation: the prompt forward's figures, then each decode
    iteration's (one layer call each)."""
    metrics = EngineMetrics(1)
    for values in (prompt, *decode):
        metrics.add(0, calls=1, **values)
        metrics.end_iteration()
    return metrics.summary()


def test_offload_columns_and_ratios():
    def stats(ms):
        return GenerationStats(
            iterations=len(ms), new_tokens=len(ms), seconds=sum(ms) / 1000, iteration_ms=ms
        )

    def row(label, ms, hits):
        off = _engine_summary(
            {"misses": 9, "copies": 90}, *({"hits": hits, "misses": 1, "copies": 4} for _ in ms[1:])
        )
        return bench.summarise(label, [stats(ms)], [off])

    rows = [row("resident", [50.0, 10.0, 12.0], 1), row("half", [90.0, 20.0, 24.0], 3)]
    rows = bench.with_ratios(rows)
    # decode iterations only: the prompt forward (the first) is apart
    assert rows[0]["ms_per_iteration_median"] == 11.0 and rows[0]["prompt_ms"] == 50.0
    assert rows[1]["ms_per_iteration_mean"] == 22.0
    assert rows[1]["ms_ratio_to_first"] == 2.0
    off = rows[1]["offload"]
    assert off["hit_rate"] == 0.75 and off["copies_per_iteration"] == 4.0
    assert off["prompt_copies"] == 90.0
    copied = _engine_summary({}, {"copy_bytes": 6e9, "copy_ms": 120.0})
    copied = bench.summarise("c", [stats([1.0, 5.0])], [copied])
    assert copied["offload"]["copy_gb_per_s"] == 50.0  # bytes over the copy stream's busy time
    from rich.console import Console

    console = Console(record=True, width=290)
    console.print(bench.table(rows))
    text = console.export_text()
    assert "2.00x" in text and "50.0%" in text and "hit rate" in text
    assert "ahead/it" not in text  # no row copied ahead
    ahead = _engine_summary(
        {},
        {
            "copies": 8,
            "predicted": 4,
            "predicted_hits": 1,
            "cpu_experts": 2,
            "cpu_ms": 0.5,
            "cpu_model_ms": 0.4,
        },
    )
    rows = bench.with_ratios([*rows, bench.summarise("ahead", [stats([1.0, 5.0])], [ahead])])
    assert rows[-1]["offload"]["predicted_used"] == 0.25
    assert rows[-1]["offload"]["cpu_ms_per_expert"] == 0.25
    assert rows[-1]["offload"]["cpu_time_over_model"] == 1.25
    console = Console(record=True, width=360)
    console.print(bench.table(rows))
    text = console.export_text()
    assert "ahead/it (used)" in text and "4.0 (25%)" in text
    # the CPU expert's time and the model's fit, beside rows without CPU experts (n/a)
    assert "CPU / model" in text and "0.250" in text and "1.25x" in text


def test_random_prompt_is_seeded(tiny_dir):
    from oled.runtime import load_runtime

    rt = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    a = bench.random_prompt(rt, 512, 0)
    assert a == bench.random_prompt(rt, 512, 0) != bench.random_prompt(rt, 512, 1)
    assert len(a) == 512 and rt.tokenizer.mask_id not in a


def test_bench_with_an_expert_cache_shows_offload_columns(tiny_dir):
    args = [
        *bench_tiny(tiny_dir),
        "--cache-size",
        "8",
        "--gen-length",
        "8",
        "--block-length",
        "8",
        "--prompt-length",
        "20",
        "--runs",
        "1",
        "--warmup-runs",
        "0",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "cache=8" in result.output and "hit rate" in result.output and "%" in result.output


def test_bench_profile_shows_the_host_path(tiny_dir, tmp_path):
    """--profile without a device timeline still times the engine's host stages."""
    args = [
        *bench_tiny(tiny_dir),
        "--cache-size",
        "8",
        "--gen-length",
        "16",
        "--block-length",
        "8",
        "--prompt-length",
        "20",
        "--runs",
        "1",
        "--warmup-runs",
        "0",
        "--profile",
        "--report-dir",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "host ms per iteration by stage" in result.output
    row = json.loads(next(tmp_path.glob("bench-*.json")).read_text())["rows"][0]
    host = row["host_ms_per_iteration"]
    assert min(host["host decision"], host["copies"], host["grouped GEMM"]) > 0
    assert row["offload"]["plan_us_per_layer"] > 0


def test_bench_compares_recipes_side_by_side(tiny_dir, tmp_path):
    common = f'[model]\npath = "{tiny_dir}"\n[decoding]\nmax_new_tokens = 8\nblock_length = 8\n'
    a, b = tmp_path / "resident.toml", tmp_path / "lru.toml"
    a.write_text(common + '[runtime]\ndevice = "cpu"\nbudget = { resident = true }\n')
    b.write_text(
        common + '[runtime]\ndevice = "cpu"\nbudget = { expert_fraction = 0.25 }\n'
        'cost = "cpu-ci"\n[policy.retention]\nkind = "lru"\n'
    )
    args = [
        "bench",
        str(a),
        str(b),
        "--prompt-length",
        "20",
        "--runs",
        "1",
        "--warmup-runs",
        "0",
        "--report-dir",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "resident" in result.output and "lru" in result.output
    first, second = json.loads(next(tmp_path.glob("bench-*.json")).read_text())["rows"]
    # each row ran free and was compared with the resident tokens: the resident row is them
    assert first["agreement"]["tokens_equal"] == 1.0 and first["agreement"]["max_logit_diff"] == 0
    assert set(second["agreement"]) == {
        "tokens_equal",
        "first_divergence",
        "max_logit_diff",
        "runs",
    }
    assert second["decisions"]["costs"]["source"] == "profile cpu-ci" and first["decisions"] is None
    assert "= resident" in result.output and "prompt CPU" in result.output


def test_rows_done_stay_in_the_report_when_a_later_one_fails(tiny_dir, tmp_path, monkeypatch):
    from oled import runtime

    recipes = []
    for name in ("first", "second"):
        recipes.append(tmp_path / f"{name}.toml")
        recipes[-1].write_text(
            f'[model]\npath = "{tiny_dir}"\n[runtime]\ndevice = "cpu"\n'
            "[decoding]\nmax_new_tokens = 8\nblock_length = 8\n"
        )
    real, built = runtime.build, []

    def build_then_fail(spec):
        built.append(spec)
        if len(built) > 1:
            raise RuntimeError("out of memory (test)")
        return real(spec)

    monkeypatch.setattr(runtime, "build", build_then_fail)
    args = [
        "bench",
        *map(str, recipes),
        "--prompt-length",
        "20",
        "--runs",
        "1",
        "--warmup-runs",
        "0",
        "--report-dir",
        str(tmp_path / "out"),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code != 0 and len(built) == 2
    (report,) = (tmp_path / "out").glob("bench-*.json")
    assert [row["label"] for row in json.loads(report.read_text())["rows"]] == ["first"]


def test_bad_recipe_fails_with_one_line(tmp_path):
    recipe = tmp_path / "a.toml"
    recipe.write_text("[model]\npath = 'builtin:tiny'\n[runtime]\ndevcie = 'cpu'\n")
    for args in (["bench", str(recipe)], ["chat", "--recipe", str(recipe)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "a.toml:4: runtime.devcie: unknown key (did you mean 'device'?)" in result.output


def test_stage_times_go_to_the_innermost_stage():
    """A kernel or copy counts for the innermost stage around its host API call (found by
    correlation id; Triton's kernels have no torch op), else around the op it is linked to,
    else for 'other'; stage ranges mirrored on the device and syncs do not count."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def host(name, children=(), id=0):
        e = SimpleNamespace(
            name=name, device_type=cpu, id=id, cpu_parent=None, cpu_children=list(children)
        )
        for child in children:
            child.cpu_parent = e
        return e

    def device(id, us, linked=0, kind="kernel", name="kernel"):
        return SimpleNamespace(
            name=name,
            device_type=cuda,
            id=id,
            cpu_parent=None,
            linked_correlation_id=linked,
            activity_type=kind,
            time_range=SimpleNamespace(elapsed_us=lambda: us),
        )

    mm = host("aten::mm", [host("cudaLaunchKernel", id=1)], id=500)
    attention = host("attention", [mm])
    copy = host("aten::copy_", [host("cudaMemcpyAsync", id=2)], id=501)
    decision = host("host decision", [host("copies", [copy])])
    routing = host("routing", [host("cuLaunchKernelEx", id=3)])  # a Triton launch
    linked_only = host("aten::_grouped_mm", id=502)  # its launch call was not recorded
    routed = host("grouped GEMM", [linked_only])
    loose = host("aten::add", [host("cudaLaunchKernel", id=4)], id=503)
    hosts = [attention, decision, routing, routed, loose]
    flat = []
    for root in hosts:
        stack = [root]
        while stack:
            e = stack.pop()
            flat.append(e)
            stack += e.cpu_children
    kernels = [
        device(1, 5.0, linked=500),
        device(2, 7.0, linked=501),
        device(3, 3.0),
        device(9, 30.0, linked=502),
        device(4, 4.0, linked=503, name="k4"),
        device(8, 0.5, name="k8"),
        device(10, 99.0, kind="gpu_user_annotation", name="routing"),
        device(11, 50.0, kind="cuda_sync", name="Stream Sync"),
    ]
    stages, named = _stage_device_us(flat + kernels)
    assert stages == {
        "attention": 5.0,
        "copies": 7.0,
        "routing": 3.0,
        "grouped GEMM": 30.0,
        "other": 4.5,
    }
    assert named["other"] == {"k4": 4.0, "k8": 0.5}  # each stage's by kernel name
    assert named["attention"] == {"kernel": 5.0} and set(named) == set(stages)


def test_device_busy_counts_overlapping_work_once():
    assert union_us([]) == 0.0
    spans = [(10.0, 20.0), (0.0, 4.0), (15.0, 25.0), (30.0, 31.0), (16.0, 18.0)]
    assert union_us(spans) == 4.0 + 15.0 + 1.0  # 0-4, 10-25, 30-31


def test_bench_eager_flag(tiny_dir):
    args = [
        "bench",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--eager",
        "--gen-length",
        "4",
        "--block-length",
        "4",
        "--prompt-length",
        "8",
        "--runs",
        "1",
        "--warmup-runs",
        "0",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


def test_kernels_flag_errors_before_loading(tiny_dir, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # outside the interpreter, triton needs CUDA
    base = ["bench", "--model", str(tiny_dir), "--device", "cpu", "--gen-length", "4"]
    for kernels, message in (("triton", "need a CUDA device"), ("fast", "unknown kernels")):
        result = runner.invoke(app, [*base, "--kernels", kernels])
        assert result.exit_code == 2, result.output
        assert message in result.output
    result = runner.invoke(
        app,
        [
            *base,
            "--kernels",
            "torch",
            "--block-length",
            "4",
            "--prompt-length",
            "8",
            "--runs",
            "1",
            "--warmup-runs",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output


def test_bench_replays_a_routing_trace(tiny_dir, tmp_path, trace_file):
    """`--routing trace:PATH`: each row replays the selected traced prompts (their lengths,
    commits and routing) on its model; `--routing model` overrides a recipe's trace."""
    args = [
        *bench_tiny(tiny_dir),
        "--cache-size",
        "8",
        "--routing",
        f"trace:{trace_file}",
        "--prompts",
        "0,2",
        "--runs",
        "1",
        "--warmup-runs",
        "1",
        "--report-dir",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "2 prompts of default.oledtrace" in result.output
    # one warm-up asked for, one replay of each selected prompt given: both prompts' shapes
    assert "2 warm-up replays + 1 timed passes" in result.output
    (row,) = json.loads(next(tmp_path.glob("bench-*.json")).read_text())["rows"]
    assert row["runs"] == 2 and row["iterations"] == 13 + 16 and row["tokens"] == 13 + 16
    assert row["routing"] == {"trace": "default.oledtrace", "prompts": [0, 2]}
    assert row["offload"]["hit_rate"] < 1
    assert row["decisions"]["costs"]["source"]  # the cost model the replay's decisions used

    recipe = tmp_path / "traced.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_dir}"\n[runtime]\ndevice = "cpu"\ndtype = "float32"\n'
        f'[workload]\nrouting = "trace:{trace_file}"\ntrace_prompts = "1"\n'
    )
    base = [
        "bench",
        str(recipe),
        "--runs",
        "1",
        "--warmup-runs",
        "0",
        "--gen-length",
        "8",
        "--block-length",
        "8",
        "--prompt-length",
        "20",
    ]
    result = runner.invoke(app, [*base, "--report-dir", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(next((tmp_path / "a").glob("bench-*.json")).read_text())["rows"]
    assert row["routing"]["prompts"] == [1] and row["iterations"] == 12
    result = runner.invoke(app, [*base, "--routing", "model", "--report-dir", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(next((tmp_path / "b").glob("bench-*.json")).read_text())["rows"]
    assert "routing" not in row and row["tokens"] == 8


def test_bench_refuses_a_trace_of_another_geometry_before_loading(
    tiny_dir, tmp_path, trace_file, monkeypatch
):
    from oled.trace.format import Trace

    trace = Trace.load(trace_file)
    wider = tmp_path / "wide.oledtrace"
    replace(trace, meta=replace(trace.meta, num_experts=64)).save(wider)
    monkeypatch.setattr("oled.runtime.build", lambda spec: (_ for _ in ()).throw(AssertionError))
    args = ["bench", "--model", str(tiny_dir), "--device", "cpu", "--routing", f"trace:{wider}"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert (
        "(3 MoE layers x 64 experts, top-4) does not match the model's (3 MoE layers x 32"
        in " ".join(result.output.split())
    )
    result = runner.invoke(app, ["bench", "--model", str(tiny_dir), "--prompts", "0"])
    assert result.exit_code == 2 and "--routing trace:PATH" in result.output


def test_bad_counts_name_their_flag_before_anything_loads():
    for args, line in (
        (["bench", "--gen-length", "-1"], "error: --gen-length: must be at least 1 (got -1)"),
        (["bench", "--max-tokens", "0"], "error: --max-tokens: must be at least 1 (got 0)"),
        (["bench", "--warmup-runs", "-1"], "error: --warmup-runs: must be at least 0 (got -1)"),
        (["serve", "--max-tokens", "-1"], "error: --max-tokens: must be at least 1 (got -1)"),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and result.output.strip() == line, result.output


def test_bench_shows_progress_on_a_terminal_only(tiny_dir, tmp_path):
    import os
    import sys
    from pathlib import Path

    import pexpect

    args = [
        "bench",
        "--model",
        str(tiny_dir),
        "--device",
        "cpu",
        "--gen-length",
        "8",
        "--block-length",
        "8",
        "--prompt-length",
        "20",
        "--runs",
        "3",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "timing" not in result.output  # no terminal, no bar
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OLED_HOME": str(tmp_path), "TERM": "xterm"}
    child = pexpect.spawn(
        sys.executable, ["-m", "oled.cli", *args], env=env, encoding="utf-8", timeout=120
    )
    child.expect(r"timing .*\d/3")  # the bar, counting the timed runs
    child.expect("tokens/s")  # then the table
    child.expect(pexpect.EOF)


def test_the_caption_names_the_calibration_the_rows_used():
    from oled.bench.tables import _caption

    costs = {
        "source": "calibrated",
        "measured": "2026-12-04T15:39:27+00:00",
        "state": "not stored: measured under load: 1 thread",
    }
    rows = [{"decisions": None}, {"decisions": {"costs": costs}}]
    assert _caption(rows).endswith(
        "costs: calibrated 2026-12-04T15:39:27+00:00 (not stored: measured under load: 1 thread)"
    )


def test_bench_streams_passes_joins_and_profile(tiny_dir, tmp_path):
    """`--streams` rows: timed passes with their range, time to first token, the running
    streams' slowdown while prompts join (in chunks), host time per forward; every batched
    request's tokens are its single-request tokens."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ROMEO:"}\n{"prompt": "Say something from Macbeth."}\n')
    args = [
        *bench_tiny(tiny_dir),
        "--gen-length",
        "16",
        "--block-length",
        "8",
        "--streams",
        "1,3",
        "--runs",
        "2",
        "--warmup-runs",
        "0",
        "--prefill-chunk",
        "8",
        "--prompt-file",
        str(prompts),
        "--profile",
        "--report-dir",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "running slowdown" in result.output and "host ms per iteration" in result.output
    report = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    one, three = report["rows"]
    for row in (one, three):
        assert row["passes"] == 2 and len(row["tokens_per_second_passes"]) == 2
        assert row["requests"] == 6 and row["equal"] == 6
        assert row["ttft_ms_p90"] >= row["ttft_ms_p50"] > 0
        assert row["host_ms_per_iteration"]["iteration"] > 0
    assert three["join_forwards"] > 0 and three["running_slowdown"] > 0
    assert three["stall_ms_per_join"] is not None
    assert one["join_forwards"] == 0 and one["running_slowdown"] is None


def test_prompt_file_needs_streams(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ROMEO:"}\n')
    result = runner.invoke(app, ["bench", "--prompt-file", str(prompts)])
    assert result.exit_code != 0 and "--streams" in result.output


def test_bench_streams_replay_a_routing_trace(tiny_dir, trace_file, tmp_path):
    """`--streams` with `--routing`: the trace's selected prompts, replayed one at a time and
    two at a time under a budget; every request decodes its traced blocks, and the report
    names the trace and the prompts of the pool."""
    args = [
        *bench_tiny(tiny_dir),
        "--cache-size",
        "16",
        "--streams",
        "1,2",
        "--routing",
        f"trace:{trace_file}",
        "--prompts",
        "0:2",
        "--runs",
        "2",
        "--warmup-runs",
        "1",
        "--profile",
        "--report-dir",
        str(tmp_path),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "2 replays of 2 prompts of default.oledtrace" in result.output
    report = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    one, two = report["rows"]
    for row in (one, two):
        assert row["requests"] == 4 and row["equal"] == 4
        assert row["tokens"] == 2 * (13 + 19)  # two passes; prompts 0 and 1: 13 and 19 tokens
        assert row["routing"] == {"trace": "default.oledtrace", "prompts": [0, 1]}
        assert row["copies_per_token"] > 0 and row["cpu_experts_per_token"] == 0  # on a CPU
    assert two["graph_captures"] == 0
    for row in (one, two):  # --profile: host time per stage of replayed forwards
        assert row["host_ms_per_iteration"]["iteration"] > 0
        assert row["host_ms_per_iteration"]["routing"] > 0
