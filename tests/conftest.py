"""Shared fixtures: tiny checkpoints made by the project itself, never downloaded, and small
real policy components that tests register under their own names."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run through its interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from oled import registry as reg
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


@pytest.fixture(scope="session")
def mask_wins_dir(tmp_path_factory) -> Path:
    """A tiny checkpoint whose top prediction everywhere is the mask token itself: every word
    embedding carries +1000 in dimension 0, which survives to the final norm, and the mask's
    lm_head row reads only that dimension."""
    from safetensors.torch import load_file, save_file

    from oled.model.tokenizer import Tokenizer

    path = init_checkpoint(
        tmp_path_factory.mktemp("maskwins"), preset="tiny", seed=0, shard_bytes=None
    )
    mask = Tokenizer.from_dir(path).mask_id
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.word_embeddings.weight"][:, 0] += 1000
    tensors["lm_head.weight"][mask] = 0
    tensors["lm_head.weight"][mask, 0] = 100
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as a runtime chooses beside busy neighbours: a loaded CI machine
    then slows a calibration's rounds without pushing them out of their bounds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test starts from the same global random state, whichever tests ran before it."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _oled_home(tmp_path_factory, monkeypatch):
    """Built-in models go to a per-session directory, not the user's cache."""
    monkeypatch.setenv("OLED_HOME", str(tmp_path_factory.getbasetemp() / "oled-home"))


# The slowest suites (`-m "not slow"` leaves them out): Triton's interpreter running the fused
# kernels on a CPU, terminals and HTTP servers started as processes, training runs, a
# PostgreSQL server, long batched generations.
SLOW = (
    "tests/kernels/",
    "tests/chat/",
    "tests/serve/",
    "tests/train/",
    "test_tune_postgres.py",
    "tests/decoding/test_batch.py",  # long generations, each one alone and in batches
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(part in item.nodeid for part in SLOW):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class KeepRecent:
    """Keeps the most recently used experts (test retention)."""

    def __init__(self, *, threshold: float = 0.5, window: int = 4, name: str = "keep") -> None:
        self.threshold = threshold
        self.window = window
        self.name = name


class EvenSplit:
    """Splits the budget evenly over layers (test allocation)."""

    def __init__(self, *, minimum: int = 1) -> None:
        self.minimum = minimum


class AlwaysCopy:
    """Copies every miss (test compensation)."""

    def __init__(self, *, max_inflight: int = 8) -> None:
        self.max_inflight = max_inflight


TEST_COMPONENTS = {
    "retention": {"keep_recent": KeepRecent},
    "allocation": {"even_split": EvenSplit},
    "compensation": {"always_copy": AlwaysCopy},
}


@pytest.fixture
def components() -> Iterator[dict]:
    """Registers the test components for one test."""
    for kind, entries in TEST_COMPONENTS.items():
        for name, target in entries.items():
            reg.register(kind, name, target)
    yield TEST_COMPONENTS
    for kind, entries in TEST_COMPONENTS.items():
        for name in entries:
            reg.registry(kind).unregister(name)


RECIPE = """\
[model]
path = "builtin:tiny"

[runtime]
device = "cpu"
dtype = "float32"
budget = { expert_fraction = 0.5 }

[decoding]
max_new_tokens = 8

[policy.allocation]
kind = "even_split"

[policy.retention]
kind = "keep_recent"
threshold = 0.7

[policy.compensation]
kind = "always_copy"

[workload]
prompts = "builtin:short"
warmup = 0
repeats = 1
agreement = false  # the synthetic runtimes of the tracking tests have no reference
"""


@pytest.fixture
def recipe_file(tmp_path, components):
    """A valid recipe using the test components."""
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE)
    return path


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory) -> Path:
    """A routing trace recorded on the trained default model (`builtin:tiny`: 3 MoE layers x
    32 experts, top-4, like the tiny preset at other sizes) in blocks of 8: two chat prompts
    and a 16-token prompt that ends on a block boundary; at threshold 0.5 some forwards commit
    several tokens and some blocks finish in one forward."""
    from oled.decoding import DecodeConfig
    from oled.runtime import load_runtime
    from oled.trace.record import record
    from oled.trace.replay import random_ids, special_ids

    rt = load_runtime("builtin:tiny", device="cpu", dtype="float32")
    prompts = [rt.prompt_ids(p, chat=True) for p in ("What is the capital of France?", "Hi")]
    prompts.append(random_ids(16, rt.config.vocab_size, special_ids(rt.tokenizer), seed=3))
    decode = DecodeConfig(block_length=8, max_new_tokens=12, threshold=0.5)
    path = tmp_path_factory.mktemp("trace") / "default.oledtrace"
    record(rt, prompts, decode=decode).save(path)
    return path
