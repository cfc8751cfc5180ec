"""A few training steps of a tiny model on the CPU, through the command line's flags."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oled.model.checkpoint import load_checkpoint
from oled.train import main

TINY = {
    "hidden": 32,
    "layers": 2,
    "heads": 2,
    "kv-heads": 1,
    "head-dim": 16,
    "intermediate": 32,
    "experts": 4,
    "top-k": 2,
    "groups": 2,
    "topk-group": 1,
    "moe-intermediate": 16,
    "bpe-vocab": 300,
    "vocab-size": 600,
    "blocks": 2,
    "batch": 4,
    "warmup": 1,
}


def test_trains_a_tiny_model_into_a_loadable_checkpoint(train_cache, tmp_path):
    out = tmp_path / "run"
    flags = [f"--{k}={v}" for k, v in TINY.items()]
    threads = str(torch.get_num_threads())  # the run sets it for the process
    main(
        [
            *flags,
            "--device",
            "cpu",
            "--threads",
            threads,
            "--minutes",
            "0",
            "--max-steps",
            "3",
            "--eval-every",
            "2",
            "--eval-batches",
            "1",
            "--cache",
            str(train_cache),
            "--out",
            str(out),
        ]
    )
    history = json.loads((out / "history.json").read_text())
    assert [row["step"] for row in history] == [2, 3]
    for row in history:
        assert all(math.isfinite(row[k]) for k in ("train_loss", "train_ce", "val_loss"))
    record = json.loads((out / "train_config.json").read_text())
    assert record["steps"] == 3 and record["final"] == history[-1]
    assert "done: 3 steps" in (out / "train.log").read_text()
    ckpt = load_checkpoint(out / "checkpoint")
    assert ckpt.config.num_experts == 4 and ckpt.config.num_hidden_layers == 2
    assert ckpt.tokenizer.mask_id == 600 - 289


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        out |= load_file(shard)
    return out


def _train(cache, out, *extra: str) -> None:
    flags = [f"--{k}={v}" for k, v in TINY.items()]
    common = ["--device", "cpu", "--threads", "1", "--minutes", "0", "--max-steps", "4"]
    main(
        [*flags, *common, "--eval-every", "2", "--eval-batches", "1"]
        + ["--cache", str(cache), "--out", str(out), *extra]
    )


def test_a_stopped_run_resumes_step_for_step(train_cache, tmp_path):
    threads = torch.get_num_threads()
    try:
        _train(train_cache, tmp_path / "straight")
        _train(train_cache, tmp_path / "stopped", "--stop-step", "3")
        stopped = tmp_path / "stopped"
        assert "stopped at step 3 of 4" in (stopped / "train.log").read_text()
        assert (stopped / "state.pt").exists()
        _train(train_cache, stopped, "--resume")
    finally:
        torch.set_num_threads(threads)
    assert "resumed at step 3 of 4" in (stopped / "train.log").read_text()
    a, b = (_tensors(d / "checkpoint") for d in (tmp_path / "straight", stopped))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    history = [
        json.loads((d / "history.json").read_text()) for d in (tmp_path / "straight", stopped)
    ]
    untimed = [[{k: v for k, v in row.items() if k != "minutes"} for row in h] for h in history]
    assert untimed[0] == untimed[1]


def test_resume_refuses_a_state_saved_with_other_flags(train_cache, tmp_path):
    threads = torch.get_num_threads()
    try:
        _train(train_cache, tmp_path, "--stop-step", "1")
        with pytest.raises(ValueError, match="other flags .*lr: 0.002 then, 0.001 now"):
            _train(train_cache, tmp_path, "--resume", "--lr", "0.001")
    finally:
        torch.set_num_threads(threads)
