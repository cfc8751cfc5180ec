"""oled.offload.calibrate: figures inside physical bounds, stored only when measured on a quiet
machine, re-checked at start-up, measured again by `oled env --recalibrate`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from oled.model.experts import ExpertStore
from oled.offload import calibrate
from oled.offload.calibrate import (
    Calibration,
    CalibrationWarning,
    calibrated_cost,
    machine_key,
    machine_parts,
    violation,
)
from oled.policies.base import CostModel
from oled.threads import visible_cpus

CPU = torch.device("cpu")


@pytest.fixture
def store() -> ExpertStore:
    """One layer of 8 experts of the built-in tiny model's shape (384 KiB each, fp32)."""
    store = ExpertStore.empty(
        layers=1, experts=8, hidden=256, inter=128, dtype=torch.float32, pin=False
    )
    for w in (*store.w13, *store.w2):
        w.normal_(std=0.02)
    return store


@pytest.fixture
def quiet(monkeypatch):
    """The machine counts as quiet whatever else runs beside the tests."""
    monkeypatch.setattr(calibrate, "contended", lambda threads, cores, others: False)


@pytest.fixture(autouse=True)
def _fresh_process_memory(monkeypatch):
    monkeypatch.setattr(calibrate, "_THIS_PROCESS", {})


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every calibration here on one thread (conftest's one_thread)."""


def _sane(store: ExpertStore) -> CostModel:
    return CostModel(
        copy_ms_per_expert=0.02,
        copy_fixed_ms=0.01,
        cpu_fixed_ms=0.2,
        cpu_ms_per_token=0.005,
        gpu_fixed_ms=0.5,
        gpu_ms_per_expert=0.3,
        expert_bytes=store.expert_bytes,
    )


def _write(
    store: ExpertStore, folder, cost: CostModel, measured: str = "2026-01-01T00:00:00+00:00"
):
    """A stored calibration of `cost` under this process's key for `store`."""
    parts = machine_parts(store, CPU, torch.get_num_threads())
    file = folder / f"cost-{machine_key(parts)}.json"
    load = {"threads": torch.get_num_threads(), "cores": 2, "others_cores": 0.0}
    Calibration(cost, parts, measured, file, load=load, experts=store.num_experts).write()
    return file


def test_a_figure_outside_its_bound_is_named_with_the_bound(store):
    assert violation(_sane(store)) is None
    slow_fixed = replace(_sane(store), gpu_fixed_ms=102.6)
    assert violation(slow_fixed) == (
        "gpu_fixed_ms = 103 ms is above its bound 10 ms (a fixed cost: launches, a hand-off, a "
        "sync)"
    )
    line = violation(replace(_sane(store), copy_ms_per_expert=0.0001))
    assert line is not None and line.startswith("copy_ms_per_expert = 0.0001 ms is below")
    assert "393216 bytes at 1000 to 0.1 GB/s" in line


def test_a_stored_calibration_with_an_impossible_figure_is_measured_again(store, tmp_path, quiet):
    file = _write(store, tmp_path, replace(_sane(store), gpu_fixed_ms=102.6))
    with pytest.warns(CalibrationWarning, match="rejected: gpu_fixed_ms = 103 ms is above"):
        used = calibrated_cost(store, CPU, tmp_path)
    assert used.stored and used.state == "measured now, stored clean"
    assert violation(used.cost) is None and Calibration.read(file) == used  # replaced
    assert Calibration.read(file.with_suffix(".rejected")).cost.gpu_fixed_ms == 102.6  # aside


def test_a_rejected_file_is_set_aside_even_when_the_new_one_is_not_stored(
    store, tmp_path, monkeypatch
):
    file = _write(store, tmp_path, replace(_sane(store), copy_ms_per_expert=0.0001))
    monkeypatch.setattr(calibrate, "others_busy", lambda before, after: 1.9)
    with pytest.warns(CalibrationWarning) as caught:
        used = calibrated_cost(store, CPU, tmp_path)
    lines = [str(w.message) for w in caught]
    assert "rejected: copy_ms_per_expert = 0.0001 ms is below its bound" in lines[0]
    assert lines[1].startswith("cost calibration not stored: measured under load")
    assert not used.stored and not file.exists() and file.with_suffix(".rejected").exists()


def test_a_calibration_stores_the_load_and_every_round(store, tmp_path, quiet):
    used = calibrated_cost(store, CPU, tmp_path)
    data = json.loads(used.file.read_text())
    assert data["load"]["threads"] == torch.get_num_threads()
    assert data["load"]["cores"] == len(visible_cpus()) and "loadavg" in data["load"]
    assert data["experts"] == 8
    assert all(len(v) == calibrate.ROUNDS for v in data["rounds"].values())
    assert used.describe()["stored"] is True and used.describe()["key"] in used.file.name


def test_a_calibration_measured_under_load_is_not_stored(store, tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "others_busy", lambda before, after: 1.9)
    with pytest.warns(CalibrationWarning, match="not stored: measured under load"):
        used = calibrated_cost(store, CPU, tmp_path)
    assert not used.stored and not list(tmp_path.glob("cost-*"))
    assert "other processes keeping 1.9 of" in used.state
    assert used.describe()["stored"] is False
    assert calibrated_cost(store, CPU, tmp_path) is used  # this process decides alike
    assert calibrate.stored_calibrations(tmp_path) == [used]  # and `oled env` lists it


def test_a_calibration_beside_busy_loops_is_not_stored(store, tmp_path):
    """Real neighbours: two CPU-bound processes per core leave the measuring thread less than
    half a core, however many cores the machine has."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * len(visible_cpus()))
    ]
    try:
        time.sleep(0.5)  # the loops are running
        with pytest.warns(CalibrationWarning, match="not stored: measured under load"):
            used = calibrated_cost(store, CPU, tmp_path)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert not used.stored and not list(tmp_path.glob("cost-*"))


def test_a_figure_without_a_quorum_of_rounds_inside_its_bound_is_not_stored(
    store, tmp_path, quiet, monkeypatch
):
    figures = calibrate._Probes.figures

    def slow_device(self, ms):
        return figures(self, ms) | {"gpu_fixed_ms": 87.3}  # a preemption in every round

    monkeypatch.setattr(calibrate._Probes, "figures", slow_device)
    with pytest.warns(CalibrationWarning, match="0 of 5 rounds inside the bounds: gpu_fixed_ms"):
        used = calibrated_cost(store, CPU, tmp_path)
    assert not used.stored and used.cost.gpu_fixed_ms == calibrate.MAX_FIXED_MS  # clamped


def test_the_figures_separate_fixed_costs_from_each_expert(store):
    """Timings of a layer's CPU call that cost 0.4 ms, plus 0.3 ms an expert and 0.01 ms a
    token, and of copies that cost 0.02 ms plus 0.125 ms an expert, give back those figures:
    the copy's fixed cost from the copies alone, not from the CPU's."""
    probes = calibrate._Probes(store, CPU)
    n = probes.n
    ms = {name: 1.0 for name in probes.timings()}
    ms |= {"cpu 1x1": 0.4 + 0.31, "cpu 4x1": 0.4 + 4 * 0.31, "cpu 4x8": 0.4 + 4 * 0.38}
    ms |= {"copy 1": 0.02 + 0.125, f"copy {n}": 0.02 + n * 0.125}
    got = probes.figures(ms)
    assert got["cpu_call_ms"] == pytest.approx(0.4)
    assert got["cpu_fixed_ms"] == pytest.approx(0.3)
    assert got["cpu_ms_per_token"] == pytest.approx(0.01)
    assert got["copy_ms_per_expert"] == pytest.approx(0.125)
    assert got["copy_fixed_ms"] == pytest.approx(0.02)


def test_the_start_up_recheck_warns_on_a_doctored_file(store, tmp_path):
    _write(store, tmp_path, replace(_sane(store), copy_ms_per_expert=3.0))  # 100x too slow
    with pytest.warns(CalibrationWarning, match=r"re-check disagrees: copy .* faster than"):
        used = calibrated_cost(store, CPU, tmp_path)
    assert used.stored and "re-check disagrees" in used.state
    check = used.recheck
    assert check is not None and check["factor"] == calibrate.RECHECK_FACTOR
    assert check["probes"]["copy"]["stored_ms"] == pytest.approx(8 * 3.0 + 0.01)
    assert used.describe()["recheck"] == check


def test_a_stored_calibration_that_holds_is_reused(store, tmp_path, quiet):
    first = calibrated_cost(store, CPU, tmp_path)
    calibrate._THIS_PROCESS.clear()  # as a later process reads it
    again = calibrated_cost(store, CPU, tmp_path)
    assert again == first and again.state.startswith("stored clean")
    assert again.recheck is not None and again.recheck["ms"] < 5000
