"""Checkpoints in the LLaDA2 layout: config.json, safetensors (sharded or single), tokenizer.

Non-expert weights go into the model on the compute device; routed experts go into an
ExpertStore in host memory, read once per tensor from the memory-mapped shards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from oled.model.config import ModelConfig
from oled.model.experts import ExpertStore
from oled.model.model import LLaDA2Model
from oled.model.tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
EXPERT_PREFIX = "model.layers.{layer}.mlp.experts.{expert}."


class CheckpointError(ValueError):
    """A checkpoint that is missing a file or a tensor, or holds a tensor of the wrong shape."""


def expert_tensor_names(layer: int, expert: int) -> tuple[str, str, str]:
    p = EXPERT_PREFIX.format(layer=layer, expert=expert)
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a checkpoint with its shape, routed experts included."""
    model = _skeleton(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            g, u, d = expert_tensor_names(layer, e)
            shapes[g], shapes[u], shapes[d] = (i, h), (i, h), (h, i)
    return shapes


def _skeleton(cfg: ModelConfig) -> LLaDA2Model:
    with torch.device("meta"):
        return LLaDA2Model(cfg)


class ShardReader:
    """Name -> tensor over the checkpoint's safetensors files, memory-mapped, opened once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = ExitStack()
        index = path / INDEX
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err})") from None
        elif (path / SINGLE).exists():
            with safe_open(path / SINGLE, framework="pt") as f:
                weight_map = {name: SINGLE for name in f.keys()}
        else:
            raise CheckpointError(f"{path}: neither {INDEX} nor {SINGLE} found")
        self.index_name = INDEX if index.exists() else SINGLE
        self.weight_map = weight_map
        self._files: dict[str, object] = {}

    def _file(self, shard: str):
        if shard not in self._files:
            file = self.path / shard
            if not file.exists():
                raise CheckpointError(f"{file}: shard named in {self.index_name} is missing")
            self._files[shard] = self._stack.enter_context(safe_open(file, framework="pt"))
        return self._files[shard]

    def get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.path / self.index_name}: tensor {name!r} is missing")
        tensor = self._file(shard).get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{self.path / shard}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"expected {list(shape)}"
            )
        return tensor

    def close(self) -> None:
        self._stack.close()


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model without routed experts, the experts, the tokenizer."""

    path: Path
    config: ModelConfig
    model: LLaDA2Model
    experts: ExpertStore
    tokenizer: Tokenizer


def load_checkpoint(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    pin_experts: bool = False,
    progress: bool = False,
) -> Checkpoint:
    """Load config, tokenizer, non-expert weights (on `device`) and experts (host, maybe pinned)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    cfg = ModelConfig.from_json(path)
    tokenizer = Tokenizer.from_dir(path)
    reader = ShardReader(path)
    try:
        model = _load_dense(reader, cfg, device, dtype)
        experts = _load_experts(reader, cfg, dtype, pin_experts, progress)
    finally:
        reader.close()
    return Checkpoint(path=path, config=cfg, model=model, experts=experts, tokenizer=tokenizer)


def _load_dense(reader: ShardReader, cfg: ModelConfig, device, dtype) -> LLaDA2Model:
    model = _skeleton(cfg)
    state = {}
    for name, ref in model.state_dict().items():
        keep_fp32 = name.endswith("mlp.gate.weight") or name.endswith("expert_bias")
        target = torch.float32 if keep_fp32 else dtype
        state[name] = reader.get(name, tuple(ref.shape)).to(device=device, dtype=target)
    model.load_state_dict(state, assign=True)
    return model.eval()


def _load_experts(reader: ShardReader, cfg: ModelConfig, dtype, pin: bool, progress: bool):
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    store = ExpertStore.empty(
        layers=cfg.num_moe_layers, experts=cfg.num_experts, hidden=h, inter=i, dtype=dtype, pin=pin
    )
    for m, layer in enumerate(_progress(cfg.moe_layers, progress, "loading experts")):
        for e in range(cfg.num_experts):
            g, u, d = expert_tensor_names(layer, e)
            store.w13[m][e, :i] = reader.get(g, (i, h))
            store.w13[m][e, i:] = reader.get(u, (i, h))
            store.w2[m][e] = reader.get(d, (h, i))
    return store


def _progress(items: list[int], show: bool, what: str) -> Iterator[int]:
    if not show:
        yield from items
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(what, total=len(items))
        for item in items:
            yield item
            bar.advance(task)


def save_checkpoint(
    path: str | Path,
    *,
    config: ModelConfig,
    tensors: Iterator[tuple[str, Tensor]],
    tokenizer: Tokenizer,
    shard_bytes: int | None = 2 << 30,
) -> Path:
    """Write config, tokenizer and tensors (streamed, so a 30 GiB model is never whole in memory).

    shard_bytes=None writes a single model.safetensors; otherwise shards plus the index.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.to_json(path / "config.json")
    tokenizer.save(path)
    shard: dict[str, Tensor] = {}
    size = 0
    weight_map: dict[str, int] = {}
    written: list[str] = []

    def flush() -> None:
        nonlocal shard, size
        if not shard:
            return
        name = f"shard-{len(written):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        written.append(name)
        shard, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard_bytes is not None and size and size + nbytes > shard_bytes:
            flush()
        shard[name] = tensor
        weight_map[name] = len(written)
        size += nbytes
    flush()
    if shard_bytes is None:
        (path / written[0]).rename(path / SINGLE)
        return path
    total = len(written)
    names = {}
    for i, old in enumerate(written):
        new = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        (path / old).rename(path / new)
        names[i] = new
    index = {
        "metadata": {"total_size": sum((path / n).stat().st_size for n in names.values())},
        "weight_map": {name: names[i] for name, i in sorted(weight_map.items())},
    }
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return path
