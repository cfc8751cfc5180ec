"""A few training steps of a tiny model on the CPU, through the command line's flags."""

from __future__ import annotations

import json
import math

import torch

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
