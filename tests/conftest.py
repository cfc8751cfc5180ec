"""Shared fixtures: tiny checkpoints made by the project itself, never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oled.model.presets import init_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny preset, seed 0, written in small shards (so the index is exercised)."""
    return init_checkpoint(
        tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0, shard_bytes=2 << 20
    )


@pytest.fixture(scope="session")
def tiny_single_dir(tmp_path_factory) -> Path:
    """The same weights as one model.safetensors."""
    return init_checkpoint(
        tmp_path_factory.mktemp("tiny1"), preset="tiny", seed=0, shard_bytes=None
    )


@pytest.fixture(autouse=True)
def _oled_home(tmp_path_factory, monkeypatch):
    """Built-in models go to a per-session directory, not the user's cache."""
    monkeypatch.setenv("OLED_HOME", str(tmp_path_factory.getbasetemp() / "oled-home"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
