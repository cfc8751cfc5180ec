"""`oled env`: the report, AMX detection, --require-cuda failing clearly without a GPU, the
threads a runtime would choose now, and --recalibrate replacing a stored calibration only with a
clean one."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from oled.cli import app
from oled.env import collect, cpu_flags, links_row, rate

runner = CliRunner()


def test_report_rows():
    rows = dict(collect(bandwidth=False).rows)
    assert rows["torch"] == torch.__version__
    assert {"Python", "CUDA" if not torch.cuda.is_available() else "GPU 0", "AMX"} <= set(rows)
    assert rows["pydantic"] != "not installed"


def test_amx_flags_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 amx_bf16 amx_tile avx512f\n")
    assert {"amx_bf16", "amx_tile"} <= cpu_flags(info)
    assert cpu_flags(tmp_path / "missing") == set()


def test_stored_costs_read_as_gb_per_s():
    """A mini expert (w13 [1024, 2048] and w2, bf16: 6.29 MB) copied in 0.125 ms is 50.3 GB/s."""
    parts = {"expert shape": "(1024, 2048)", "dtype": "bfloat16"}
    assert rate(parts, 0.125) == " (50.3 GB/s)"
    assert rate({**parts, "dtype": "int8"}, 0.125) == ""  # a size it does not know: no figure
    assert rate(parts, 0.0) == ""


def test_env_command_json():
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    assert "torch" in json.loads(result.stdout)["rows"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without CUDA")
def test_require_cuda_fails_clearly_without_a_gpu():
    result = runner.invoke(app, ["env", "--require-cuda"])
    assert result.exit_code == 1
    assert "CUDA is required but not available" in result.output
    assert "CPU-only build" in result.output


def test_kernel_row_names_what_cuda_runs(monkeypatch):
    from oled import env, kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert env.kernel_row().startswith("Triton")
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert "falls back" in env.kernel_row()


def test_copies_row_names_the_copy_path(monkeypatch):
    from oled import env
    from oled.offload import copies

    monkeypatch.setattr(copies, "runtime_library", lambda: "/x/libcudart.so.13")
    monkeypatch.setattr(copies, "runtime_memcpy_batch", lambda: None)
    assert env.copies_row() == "cudaMemcpyAsync through /x/libcudart.so.13"
    monkeypatch.setattr(copies, "runtime_memcpy_batch", lambda: object())
    assert env.copies_row() == "cudaMemcpyBatchAsync through /x/libcudart.so.13"
    monkeypatch.setattr(copies, "runtime_library", lambda: None)
    assert env.copies_row().startswith("torch's copy_")


def test_planner_row_says_whether_plans_run_compiled(monkeypatch):
    from oled import env
    from oled.policies import native

    report = env.Report()
    assert env.planner_row(report).startswith("compiled") and not report.failures
    monkeypatch.setattr(native.LIBRARY, "_loaded", native.NativeUnavailable("no C compiler found"))
    assert env.planner_row(report) == "Python (compiled planner unavailable: no C compiler found)"
    assert not report.failures


def test_a_broken_contract_fails_the_report(monkeypatch):
    from oled import env
    from oled.policies import native

    def broken():
        raise native.ContractError("plan.c and its ctypes mirror disagree on sizeof(Bind)")

    monkeypatch.setattr(native, "library", broken)
    report = env.Report()
    assert env.planner_row(report).startswith("refused")
    assert report.failures == ["plan.c and its ctypes mirror disagree on sizeof(Bind)"]


def test_launches_row_says_why_layer_calls_launch_in_python(monkeypatch):
    import torch

    from oled import env
    from oled.offload import copies

    if not torch.cuda.is_available():
        assert env.launches_row() == "Python (no CUDA device)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(copies, "_runtime_library", lambda: None)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec", lambda self: 0, raising=False)
    assert env.launches_row().startswith("Python (the CUDA runtime lacks cudaMemcpyAsync")


def test_the_report_says_how_threads_are_chosen_and_wait():
    rows = dict(collect(bandwidth=False).rows)
    assert "OMP_NUM_THREADS" in rows["threads now"]
    assert rows["OpenMP wait"] != ""


def _stored(tmp_path, *, copy_ms: float):
    """A stored calibration of this process's key for one layer of 8 tiny-model experts."""
    from dataclasses import replace

    from oled.model.experts import ExpertStore
    from tests.offload.test_calibrate import _sane, _write

    store = ExpertStore.empty(
        layers=1, experts=8, hidden=256, inter=128, dtype=torch.float32, pin=False
    )
    return _write(store, tmp_path / "cost", replace(_sane(store), copy_ms_per_expert=copy_ms))


def test_recalibrate_replaces_the_stored_file(tmp_path, monkeypatch, one_thread):
    from oled.offload import calibrate

    monkeypatch.setenv("OLED_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "contended", lambda threads, cores, others: False)  # quiet
    file = _stored(tmp_path, copy_ms=3.0)  # 100x the copy time of these experts
    result = runner.invoke(app, ["env", "--recalibrate", "--json"])
    assert result.exit_code == 0, result.output
    assert f"recalibrate: {file.name}: replaced" in result.stderr
    new = calibrate.Calibration.read(file)
    assert new.measured != "2026-01-01T00:00:00+00:00" and new.cost.copy_ms_per_expert < 3.0
    row = json.loads(result.stdout)["rows"][f"cost {file.stem.removeprefix('cost-')}"]
    assert row.startswith(new.measured) and "other processes keeping" in row


def test_recalibrate_keeps_the_stored_file_when_measured_under_load(
    tmp_path, monkeypatch, one_thread
):
    from oled.offload import calibrate

    monkeypatch.setenv("OLED_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "others_busy", lambda before, after: 1.9)
    file = _stored(tmp_path, copy_ms=0.02)
    result = runner.invoke(app, ["env", "--recalibrate"])
    assert result.exit_code == 0, result.output
    assert "kept the stored one; the new one is not stored: measured under load" in result.stderr
    assert calibrate.Calibration.read(file).measured == "2026-01-01T00:00:00+00:00"


def test_recalibrate_with_nothing_stored_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("OLED_HOME", str(tmp_path))
    result = runner.invoke(app, ["env", "--recalibrate"])
    assert result.exit_code == 0 and "no calibration stored in" in result.stderr


def test_links_between_gpus_are_named(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) != (1, 2))
    assert links_row() == "0-1 peer to peer, 0-2 peer to peer, 1-2 through the host"
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    assert links_row() == "every pair of the 3 GPUs peer to peer"
