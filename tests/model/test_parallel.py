"""Experts split across processes: the share each holds, and two gloo processes decoding
exactly the tokens of one (oled.model.parallel)."""

from __future__ import annotations

import json
import os
import socket
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from oled.model.parallel import ParallelError, Split, check_host, in_turn, join
from oled.offload.budget import Budget
from oled.policies import anchor_policies
from oled.recipe.schema import RuntimeSection
from oled.runtime import build_runtime

PROMPTS = ["Once upon a time", "The king said", "What is the sea?"]
DECODE = dict(max_new_tokens=24, threshold=0.9, block_length=8)


def test_each_process_holds_a_contiguous_share() -> None:
    splits = [Split(r, 4, 32) for r in range(4)]
    assert [list(s.owned) for s in splits] == [list(range(8 * r, 8 * r + 8)) for r in range(4)]
    rows = torch.stack([s.rows() for s in splits])  # [world, E]
    assert ((rows >= 0).sum(0) == 1).all(), "every expert held by exactly one process"
    assert rows[1, 8:16].tolist() == list(range(8)) and (rows[1, :8] == -1).all()


def test_bad_splits_are_named() -> None:
    with pytest.raises(ParallelError, match="32 experts per layer do not split evenly over 3"):
        Split(0, 3, 32)
    RuntimeSection(devices=2, budget={"expert_fraction": 0.5})  # offloaded on each device


def test_several_devices_need_several_processes(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ParallelError, match="needs 2 processes: `oled run` starts them"):
        join(2, "cpu")


def _join_two(rank: int, port: int, device: str = "cpu") -> None:
    """Join a group of 2 as process `rank` (gloo on the CPU, NCCL on CUDA)."""
    os.environ |= {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    join(2, device)


def _take_turns(rank: int, port: int, out: str) -> None:
    """Process `rank` of 2: three blocks in turn, each stamped on entry and exit."""
    import time

    _join_two(rank, port)
    for block in range(3):
        with in_turn():
            start = time.monotonic()
            time.sleep(0.2 if rank == 0 else 0.05)  # the first is slow: the second waits
            stamps = (block, rank, start, time.monotonic())
        Path(f"{out}.{rank}.{block}").write_text(json.dumps(stamps))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_processes_take_turns(tmp_path) -> None:
    """`in_turn`: the block runs in one process after another, in rank order, every time."""
    out = tmp_path / "turns"
    mp.spawn(_take_turns, args=(_free_port(), str(out)), nprocs=2, join=True)
    stamps = sorted(json.loads(f.read_text()) for f in tmp_path.glob("turns.*"))  # by block
    for first, second in zip(stamps[::2], stamps[1::2], strict=True):
        assert (first[1], second[1]) == (0, 1)
        assert first[3] <= second[2]  # the second starts once the first is done
    with in_turn():  # one process without a group: the block runs
        pass


def _decode_one_of_two(
    rank: int,
    port: int,
    out: str,
    anchor: str | None = None,
    fraction: float = 1.0,
    ahead: str | None = None,
    device: str = "cpu",
) -> None:
    """Process `rank` of 2: the tiny default's answers, written by rank 0, with every expert
    of its share resident, or offloaded at `fraction` of its share with the policies of
    `anchor` (and copies ahead from `ahead`); each rank writes its engine's figures to
    `out`.RANK."""
    _join_two(rank, port, device)
    torch.set_num_threads(1)
    rt = build_runtime(devices=2, **_settings(device, anchor, fraction, ahead))
    assert rt.checkpoint.experts.num_experts == rt.config.num_experts // 2
    answers, figures = [], []
    for p in PROMPTS:
        answers.append(rt.generate(p, **DECODE).token_ids)
        summary = rt.offload_summary() or {}
        figures.append({k: summary.get(k) for k in FIGURES})
    if rank == 0:
        Path(out).write_text(json.dumps(answers))
    engine = rt.engine
    experts = engine.planner.num_experts if engine is not None else None
    Path(f"{out}.{rank}").write_text(json.dumps({"experts": experts, "figures": figures}))
    torch.distributed.destroy_process_group()


FIGURES = ("hits", "misses", "cpu_experts", "predicted_hits")  # each rank's, per prompt


DEVICES = {"cpu": ("float32", "cpu-ci"), "cuda": ("bfloat16", "h200")}  # dtype, cost profile


def _settings(
    device: str, anchor: str | None, fraction: float = 1.0, ahead: str | None = None
) -> dict:
    """build_runtime's settings on `device`: every expert resident (`anchor` None), or an
    anchor's policies at `fraction` of the experts, with 2 experts per layer copied ahead
    from `ahead` (router, previous; None: none)."""
    dtype, cost = DEVICES[device]
    settings = {"device": device, "dtype": dtype, "cpu_threads": 1}
    if anchor is None:
        return settings
    copies = {} if ahead is None else {"prefetch": 2, "ahead_from": ahead}
    budget = Budget(expert_fraction=fraction)
    return settings | {"budget": budget, "cost": cost, **copies, **anchor_policies(anchor)}


@cache
def _one_process(
    anchor: str | None = None, fraction: float = 1.0, device: str = "cpu"
) -> list[list[int]]:
    """The tiny default's answers from one process (every expert, or offloaded)."""
    one = build_runtime(**_settings(device, anchor, fraction))
    return [one.generate(p, **DECODE).token_ids for p in PROMPTS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_decode_the_tokens_of_one(tmp_path) -> None:
    """Each process holds half of every layer's experts; the all-reduced pairs give exactly
    the single process's answers."""
    out = tmp_path / "answers.json"
    mp.spawn(_decode_one_of_two, args=(_free_port(), str(out)), nprocs=2, join=True)
    assert json.loads(out.read_text()) == _one_process()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("anchor", "fraction", "ahead"),
    [
        ("lru", 0.25, None),
        ("lru", 0.5, None),
        ("oled", 0.25, None),
        ("oled", 0.5, None),
        ("hybrimoe", 0.25, None),
        ("lru", 0.25, "router"),
        ("oled", 0.25, "previous"),
    ],
)
def test_two_offloading_processes_decode_the_tokens_of_one(
    tmp_path, anchor, fraction, ahead
) -> None:
    """Each process offloads its half of every layer's experts at `fraction` of that half,
    planned by its own policies over its own experts (copying ahead from the next layer's
    router or from the forward before): exactly the single process's answers (offloaded and
    resident alike), each process with misses of its own."""
    out = tmp_path / "answers.json"
    args = (_free_port(), str(out), anchor, fraction, ahead)
    mp.spawn(_decode_one_of_two, args=args, nprocs=2, join=True)
    assert json.loads(out.read_text()) == _one_process(anchor, fraction) == _one_process()
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["experts"] == 16  # the planner knows its share alone
        figures = rank["figures"]
        assert all(f["misses"] > 0 for f in figures)
        assert all(f["hits"] + f["misses"] > 0 for f in figures)
    if anchor == "hybrimoe":  # its makespan split computes some misses on the CPU
        assert sum(f["cpu_experts"] for r in ranks for f in r["figures"]) > 0
    if ahead == "router":  # some copies ahead were needed by the forward
        assert sum(f["predicted_hits"] for r in ranks for f in r["figures"]) > 0


RECIPE = """[model]
path = "builtin:tiny"

[runtime]
device = "cpu"
dtype = "float32"
devices = {devices}
{budget}
[decoding]
block_length = 32
threshold = 0.95
max_new_tokens = 24

[workload]
prompts = "builtin:short"

[tracking]
mlflow = false
"""


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_two_offloading_gpus_decode_the_tokens_of_one(tmp_path, fraction) -> None:
    """Two GPUs (NCCL), each offloading its half at `fraction` with LRU copying every miss,
    the layers' passes replayed as CUDA graph pieces around the host decision and the
    all-reduce: exactly one GPU's answers, offloaded and resident alike."""
    out = tmp_path / "answers.json"
    args = (_free_port(), str(out), "lru", fraction, None, "cuda")
    mp.spawn(_decode_one_of_two, args=args, nprocs=2, join=True)
    one = _one_process("lru", fraction, "cuda")
    assert json.loads(out.read_text()) == one == _one_process(device="cuda")
    for rank in (0, 1):
        figures = json.loads(Path(f"{out}.{rank}").read_text())["figures"]
        assert all(f["misses"] > 0 and f["cpu_experts"] == 0 for f in figures)


OFFLOADED = 'budget = { expert_fraction = 0.5 }\ncost = "cpu-ci"\n'


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["", OFFLOADED], ids=["resident", "offloaded"])
def test_oled_run_starts_a_process_per_device(tmp_path, budget) -> None:
    """`oled run` with runtime.devices = 2 starts two processes itself; the first reports
    once, with the single process's forwards and answers equal to the resident ones, every
    expert resident or half of each share offloaded."""
    import subprocess
    import sys

    reports = {}
    for devices in (1, 2):
        folder = tmp_path / str(devices)
        folder.mkdir()
        (folder / "r.toml").write_text(RECIPE.format(devices=devices, budget=budget))
        env = {**os.environ, "OLED_HOME": str(tmp_path / "home"), "COLUMNS": "120"}
        cmd = [sys.executable, "-m", "oled.cli", "run", "r.toml"]
        done = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("tokens / s (end to end)") == 1  # one report, by rank 0
        (report,) = (folder / "reports").glob("*/report.json")
        reports[devices] = json.loads(report.read_text())["generations"]
    for key in ("tokens", "iterations", "tokens_per_forward", "agreed"):
        assert [g[key] for g in reports[2]] == [g[key] for g in reports[1]], key


def test_a_host_with_too_few_gpus_is_named(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ParallelError, match=r"devices = 2, but this host has 1 GPU"):
        check_host(2, "cuda")
    check_host(2, "cpu")  # CPU processes: any number


def test_oled_run_names_a_split_that_cannot_be_before_starting_processes(tmp_path) -> None:
    from typer.testing import CliRunner

    from oled.cli import app

    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(devices=3, budget=""))
    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2
    assert "32 experts per layer do not split evenly over 3 devices" in result.output
    assert "torch.distributed" not in result.output  # refused before any process started
    recipe.write_text(RECIPE.format(devices=2, budget="budget = { expert_budget = 2 }"))
    result = CliRunner().invoke(app, ["run", str(recipe)])
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert "budget of 2 slots is below one per MoE layer (3)" in said
    assert "the budget is per device, over its share of 16 experts per layer" in said
    assert "torch.distributed" not in result.output


def test_forwards_replay_as_graphs_only_over_executors_that_can() -> None:
    """The resident split all-reduces between layers and has no static pieces: it runs
    eagerly on CUDA rather than fail at its first graphed forward; the offload engine (pieces
    between host decisions) and the resident executor (whole forwards) replay."""
    from oled.model.experts import ResidentExperts
    from oled.model.parallel import ShardedExperts
    from oled.offload.engine import OffloadEngine
    from oled.runtime import graphable

    assert graphable(ResidentExperts) and graphable(OffloadEngine)
    assert not graphable(ShardedExperts)
