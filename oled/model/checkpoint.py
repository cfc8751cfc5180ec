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
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.types import Device

from oled.model.config import ModelConfig
from oled.model.experts import ExpertStore
from oled.model.model import LLaDA2Model
from oled.model.tokenizer import Tokenizer
from oled.progress import track

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
    tied = model.tied_names()  # not stored: the reference code saves the tensor once
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            g, u, d = expert_tensor_names(layer, e)
            shapes[g], shapes[u], shapes[d] = (i, h), (i, h), (h, i)
    return shapes


def _skeleton(cfg: ModelConfig) -> LLaDA2Model:
    with torch.device("meta"):
        return LLaDA2Model(cfg)


MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header's size


def shard_header(file: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensors (name -> dtype, shape, data_offsets) from its header, with
    the file's size checked against the end of the last tensor's data, reading no weight; a
    CheckpointError naming the file when it is missing, not safetensors or cut short."""
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little")
            raw = f.read(length) if len(head) == 8 and 2 <= length <= MAX_HEADER else b""
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such file") from None
    except OSError as err:
        raise CheckpointError(f"{file}: cannot read ({err.strerror or err})") from None
    if not raw:
        raise CheckpointError(f"{file}: not a safetensors file (no header at its start)")
    if len(raw) < length:
        raise _truncated(file, size, 8 + length)
    try:
        tensors = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        raise CheckpointError(f"{file}: not a safetensors file (malformed header)") from None
    if size < 8 + length + end:
        raise _truncated(file, size, 8 + length + end)
    return tensors


def _truncated(file: Path, size: int, needed: int) -> CheckpointError:
    return CheckpointError(f"{file}: truncated: {size} bytes, its header describes {needed}")


def _wrong_shape(file: Path, name: str, shape: Any, expected: tuple[int, ...]) -> CheckpointError:
    return CheckpointError(
        f"{file}: tensor {name!r} has shape {list(shape)}, expected {list(expected)}"
    )


class ShardReader:
    """Name -> tensor over the checkpoint's safetensors files, memory-mapped, opened once; each
    shard's header and size are checked first (shard_header)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = ExitStack()
        self._files: dict[str, safe_open] = {}
        self._headers: dict[str, dict[str, dict[str, Any]]] = {}
        index = path / INDEX
        if index.exists():
            self.index_name = INDEX
            try:
                weight_map: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: not a safetensors index ({err})") from None
        elif (path / SINGLE).exists():
            self.index_name = SINGLE
            weight_map = dict.fromkeys(self.header(SINGLE), SINGLE)
        else:
            raise CheckpointError(f"{path}: neither {INDEX} nor {SINGLE} found")
        self.weight_map = weight_map

    @property
    def shards(self) -> list[str]:
        """The files the weights are in, in order."""
        return sorted(set(self.weight_map.values()))

    def header(self, shard: str) -> dict[str, dict[str, Any]]:
        """The tensors in `shard`'s header, checked (shard_header); read once."""
        if shard not in self._headers:
            file = self.path / shard
            if not file.exists():
                raise CheckpointError(f"{file}: shard named in {self.index_name} is missing")
            self._headers[shard] = shard_header(file)
        return self._headers[shard]

    def _file(self, shard: str) -> safe_open:
        if shard not in self._files:
            self.header(shard)
            try:
                opened = safe_open(self.path / shard, framework="pt")
            except Exception as err:  # safetensors raises its own error type
                raise CheckpointError(f"{self.path / shard}: cannot open: {err}") from None
            self._files[shard] = self._stack.enter_context(opened)
        return self._files[shard]

    def _entry(self, name: str) -> tuple[str, dict[str, Any]]:
        """The shard that holds `name` and its header entry; a CheckpointError when the index
        or the shard lacks it."""
        shard = self.weight_map.get(name)
        found = self.header(shard).get(name) if shard is not None else None
        if shard is None or found is None:
            where = self.path / (shard or self.index_name)
            raise CheckpointError(f"{where}: tensor {name!r} is missing")
        return shard, found

    def get(self, name: str, shape: tuple[int, ...]) -> Tensor:
        shard, _ = self._entry(name)
        tensor = self._file(shard).get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise _wrong_shape(self.path / shard, name, tensor.shape, shape)
        return tensor

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every shard's header and size, and every tensor of `shapes` where the index says
        with its shape, reading no weight; else a CheckpointError naming the file."""
        for shard in self.shards:
            self.header(shard)
        for name, shape in shapes.items():
            shard, found = self._entry(name)
            if tuple(found.get("shape", ())) != shape:
                raise _wrong_shape(self.path / shard, name, found.get("shape", ()), shape)

    def close(self) -> None:
        self._stack.close()


def check_shards(path: Path, cfg: ModelConfig) -> tuple[int, int]:
    """The checkpoint's shards checked against `cfg` without reading a weight
    (ShardReader.check): how many there are and their bytes."""
    reader = ShardReader(path)
    reader.check(expected_shapes(cfg))
    return len(reader.shards), sum((path / shard).stat().st_size for shard in reader.shards)


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
    experts: range | None = None,
    experts_on_device: bool = False,
) -> Checkpoint:
    """Load config, tokenizer, non-expert weights (on `device`) and experts (host, maybe pinned;
    on `device` with `experts_on_device`): every layer's experts in `experts` (None: all), row
    i of the store holding expert experts[i] (one process's share when several split them,
    oled.model.parallel)."""
    path = Path(path)
    if not path.is_dir():
        why = "not a directory" if path.exists() else "no such checkpoint directory"
        raise CheckpointError(f"{path}: {why}")
    cfg = ModelConfig.from_json(path)
    tokenizer = Tokenizer.from_dir(path)
    reader = ShardReader(path)
    try:
        model = _load_dense(reader, cfg, device, dtype)
        share = range(cfg.num_experts) if experts is None else experts
        where = torch.device(device) if experts_on_device else "cpu"
        store = _load_experts(reader, cfg, dtype, pin_experts, progress, share, where)
    finally:
        reader.close()
    return Checkpoint(path=path, config=cfg, model=model, experts=store, tokenizer=tokenizer)


def _load_dense(
    reader: ShardReader, cfg: ModelConfig, device: Device, dtype: torch.dtype
) -> LLaDA2Model:
    model = _skeleton(cfg)
    tied = model.tied_names()  # read through the tensor they are tied to
    state: dict[str, Tensor] = {}
    for name, ref in model.state_dict().items():
        if name in tied:
            continue
        tensor = reader.get(name, tuple(ref.shape)).to(dtype)
        if name.endswith("mlp.gate.weight") or name.endswith("expert_bias"):
            # the router runs in fp32 on values rounded to the model dtype, as the reference
            # loader leaves them (it casts the F32-stored expert_bias buffer to a bf16 model's)
            tensor = tensor.float()
        state[name] = tensor.to(device)
    missing, unexpected = model.load_state_dict(state, assign=True, strict=False)
    if set(missing) != tied or unexpected:
        raise CheckpointError(f"{reader.path}: tensors missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def _load_experts(
    reader: ShardReader,
    cfg: ModelConfig,
    dtype: torch.dtype,
    pin: bool,
    progress: bool,
    share: range,
    device: torch.device | str,
) -> ExpertStore:
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    layers, n = cfg.num_moe_layers, len(share)
    store = ExpertStore.empty(
        layers=layers, experts=n, hidden=h, inter=i, dtype=dtype, pin=pin, device=device
    )
    for m, layer in enumerate(track(cfg.moe_layers, "loading experts", show=progress)):
        for row, e in enumerate(share):
            g, u, d = expert_tensor_names(layer, e)
            store.w13[m][row, :i] = reader.get(g, (i, h))
            store.w13[m][row, i:] = reader.get(u, (i, h))
            store.w2[m][row] = reader.get(d, (h, i))
    return store


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
