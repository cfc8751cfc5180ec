"""oled.threads: the load other processes put on the cores, and the intra-op thread count
taken from the free cores unless the user fixed it."""

from __future__ import annotations

import os

import pytest

from oled import threads
from oled.threads import CpuSample, choose, contended, others_busy, read_sample


def test_the_wait_policy_is_the_users_or_libgomps():
    assert threads.wait_policy({}).startswith("libgomp's default")
    assert threads.wait_policy({"OMP_WAIT_POLICY": "passive"}) == "OMP_WAIT_POLICY=passive"


def test_a_sample_sums_the_visible_cpus_busy_ticks(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 30 900 5 0 3 0 0 0\n"
        "cpu0 100 0 10 300 5 0 1 0 0 0\n"
        "cpu1 100 0 10 300 0 0 1 0 0 0\n"
        "cpu2 100 0 10 300 0 0 1 0 0 0\n"
        "intr 1 2 3\n"
    )
    tick = os.sysconf("SC_CLK_TCK")
    sample = read_sample(stat, cpus={0, 2})
    assert sample is not None and sample.busy_s == pytest.approx(2 * 111 / tick)
    assert read_sample(tmp_path / "missing") is None
    assert read_sample(stat, cpus={7}) is None


def test_others_busy_leaves_out_this_process():
    before = CpuSample(busy_s=10.0, own_s=1.0, wall_s=100.0)
    after = CpuSample(busy_s=13.0, own_s=2.0, wall_s=101.0)  # 3 core-s busy, 1 of them ours
    assert others_busy(before, after) == pytest.approx(2.0)
    assert others_busy(before, CpuSample(10.0, 1.0, 100.01)) is None  # shorter than a tick
    assert others_busy(None, after) is None


def test_the_thread_count_follows_the_free_cores():
    env: dict[str, str] = {}
    quiet = choose(cpu_threads=None, default=2, others=0.1, cores=2, environ=env)
    assert (quiet.threads, quiet.configured, quiet.fixed) == (2, 2, False)
    assert choose(cpu_threads=None, default=2, others=1.0, cores=2, environ=env).threads == 1
    assert choose(cpu_threads=None, default=2, others=5.0, cores=2, environ=env).threads == 1
    assert choose(cpu_threads=None, default=16, others=4.0, cores=16, environ=env).threads == 12
    assert choose(cpu_threads=None, default=2, others=None, cores=2, environ=env).threads == 2


def test_runtime_cpu_threads_and_omp_num_threads_are_never_overridden():
    busy = {"default": 2, "others": 1.9, "cores": 2}
    fixed = choose(cpu_threads=2, environ={"OMP_NUM_THREADS": "1"}, **busy)
    assert (fixed.threads, fixed.source, fixed.fixed) == (2, "runtime.cpu_threads", True)
    omp = choose(cpu_threads=None, environ={"OMP_NUM_THREADS": "2"}, **busy)
    assert (omp.threads, omp.configured, omp.source) == (2, 2, "OMP_NUM_THREADS")
    assert "OMP_NUM_THREADS" in omp.describe() and "1.9 of 2 cores" in omp.describe()


def test_contention_means_a_thread_without_a_core_of_its_own():
    assert not contended(2, 2, 0.1)
    assert contended(2, 2, 0.5)
    assert not contended(1, 2, 1.0)  # one busy neighbour, one thread: a core each
    assert contended(1, 2, 1.4)
    assert not contended(2, 2, None)  # unknown: not claimed


def test_the_monitor_reports_a_window_of_at_least_its_minimum(monkeypatch):
    samples = iter([CpuSample(0.0, 0.0, 0.0), CpuSample(0.0, 0.0, 0.05), CpuSample(0.3, 0.1, 0.2)])
    monkeypatch.setattr(threads, "read_sample", lambda: next(samples))
    slept: list[float] = []
    monkeypatch.setattr(threads.time, "sleep", slept.append)
    monitor = threads.CpuMonitor(min_s=0.1)
    assert monitor.others() == pytest.approx(1.0)  # (0.3 - 0.1) core-s over 0.2 s
    assert slept == [pytest.approx(0.05)]


@pytest.fixture
def torch_threads():
    """torch's intra-op threads as they were, restored after the test."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _runtime(**runtime):
    from oled.runtime import build_runtime

    return build_runtime(model="builtin:tiny", device="cpu", dtype="float32", **runtime)


def test_a_runtime_takes_its_threads_from_the_free_cores(monkeypatch, torch_threads):
    import torch

    from oled import runtime

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "_AUTO", None)
    monkeypatch.setattr(runtime, "_DEFAULT_THREADS", None)
    torch.set_num_threads(2)  # the caller's count: the most a runtime chooses
    monkeypatch.setattr(runtime, "visible_cpus", lambda: {0, 1})
    monkeypatch.setattr(threads.MONITOR, "others", lambda: 1.0)  # a busy neighbour
    rt = _runtime(budget={"expert_fraction": 0.5}, cost="cpu-ci")
    assert rt.threads is not None and (rt.threads.threads, rt.threads.configured) == (1, 2)
    assert torch.get_num_threads() == 1
    decisions = rt.decisions()
    assert decisions is not None
    assert decisions["threads"] == "1 of 2 (other processes keep 1.0 of 2 cores busy)"
    monkeypatch.setattr(threads.MONITOR, "others", lambda: 0.0)  # the neighbour has gone
    rt.generate("Hi", max_new_tokens=1)  # the process keeps its threads: the same numerics
    again = _runtime()
    assert again.threads == rt.threads and torch.get_num_threads() == 1


def test_a_fixed_count_does_not_cap_later_runtimes(monkeypatch, torch_threads):
    import torch

    from oled import runtime

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "_AUTO", None)
    monkeypatch.setattr(runtime, "_DEFAULT_THREADS", None)
    monkeypatch.setattr(threads.MONITOR, "others", lambda: 0.0)
    monkeypatch.setattr(runtime, "visible_cpus", lambda: {0, 1})
    torch.set_num_threads(2)
    assert runtime.cpu_threads(1).threads == 1 and torch.get_num_threads() == 1
    assert runtime.cpu_threads().threads == 2  # runtime.cpu_threads was that runtime's only


def test_a_runtime_keeps_runtime_cpu_threads_and_omp_num_threads(monkeypatch, torch_threads):
    import torch

    monkeypatch.setattr(threads.MONITOR, "others", lambda: 64.0)  # every core busy
    rt = _runtime(cpu_threads=2)
    assert rt.threads is not None and rt.threads.source == "runtime.cpu_threads"
    assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rt = _runtime()
    assert rt.threads is not None and rt.threads.source == "OMP_NUM_THREADS"
    assert torch.get_num_threads() == 2
    rt.generate("Hi", max_new_tokens=1)  # never chosen again
    assert torch.get_num_threads() == 2
