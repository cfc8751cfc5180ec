"""The GPU budget: how many expert slots the device holds, decided before any weight is loaded.

`Budget` is declared here once, with its ranges: a recipe's `runtime.budget` is this object, and
it reaches `total_slots` as it is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from oled.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

SLOT_KINDS = ("expert_fraction", "expert_budget", "slots_per_layer")  # counts, not memory
KV_TOKENS = 4096  # prefix KV the memory budget reserves room for
ACTIVATION_RESERVE = 512 << 20  # logits of a block, routing buffers, allocator slack
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_size(text: str) -> int:
    """Bytes in a size such as `"24GiB"` or `"500 MB"`."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. '24GiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class Budget(BaseModel):
    """How much GPU memory experts may use, exactly one of: every expert resident; a fraction
    of all experts; a number of expert slots (all MoE layers together); slots per MoE layer; a
    whole-device memory budget (a size such as "24GiB", or bytes); or `auto` (the free
    memory). With runtime.devices > 1 it is each device's budget, over its share of every
    layer's experts. A recipe's `runtime.budget` table is this object; each range is declared here,
    once. `Budget("expert_fraction", 0.25)` is `Budget(expert_fraction=0.25)`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    expert_fraction: float | None = Field(default=None, gt=0, le=1)
    expert_budget: int | None = Field(default=None, ge=1)  # slots of all MoE layers together
    slots_per_layer: int | None = Field(default=None, ge=1)
    gpu_memory: str | float | None = None  # a size ("24GiB") or bytes
    auto: Literal[True] | None = None
    resident: Literal[True] | None = None

    def __init__(self, kind: str | None = None, value: Any = None, /, **fields: Any) -> None:
        if kind is not None:
            fields[kind] = True if value is None else value
        super().__init__(**fields)

    @field_validator("gpu_memory")
    @classmethod
    def _size(cls, value: str | float | None) -> str | float | None:
        size = parse_size(value) if isinstance(value, str) else value
        if size is not None and size <= 0:
            raise ValueError(f"must be positive (got {value!r})")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> Budget:
        chosen = [k for k, v in self.model_dump().items() if v is not None]
        if len(chosen) != 1:
            names = ", ".join(type(self).model_fields)
            raise ValueError(f"set exactly one of {names} (got {len(chosen)})")
        return self

    @property
    def kind(self) -> str:
        """The one field that is set."""
        ((kind, _),) = self.model_dump(exclude_none=True).items()
        return kind

    @property
    def value(self) -> float:
        """The set field's value: bytes for `gpu_memory`; 0 for `auto` and `resident`."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return parse_size(value)
        return 0 if value is True else value


def non_expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every weight except the routed experts (router weights kept in fp32)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    attn += cfg.num_attention_heads * cfg.head_dim * h + 2 * cfg.head_dim + 2 * h
    dense = 3 * h * cfg.intermediate_size
    shared = 3 * h * cfg.shared_intermediate_size
    size = dtype.itemsize
    total = (2 * v * h + h) * size + cfg.num_hidden_layers * attn * size
    total += cfg.first_k_dense_replace * dense * size
    total += cfg.num_moe_layers * (shared * size + (h + 1) * cfg.num_experts * 4)
    return total


def kv_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    size = dtype.itemsize
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * tokens * size


def expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.expert_params() * dtype.itemsize


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def total_slots(
    budget: Budget,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    kv_tokens: int = KV_TOKENS,
    scratch_experts: int = 0,
    experts: int | None = None,
) -> int | None:
    """Expert slots for all MoE layers together; None when every expert stays resident.
    `scratch_experts`: room for that many experts beside the slots (the stage's rounds and the
    landing buffer of encoded transfers). `experts`: the experts per layer this device holds
    (its share when several devices split them; the model's by default): a fraction or a
    count of slots is of that share, and a memory budget is this device's.

    Raises ValueError, stating the minimum, when the budget cannot hold one slot per MoE layer.
    """
    layers, experts = cfg.num_moe_layers, experts or cfg.num_experts
    if budget.kind == "resident":
        return None
    if budget.kind in SLOT_KINDS:
        slots = count_slots(budget, layers, experts)
    else:
        memory = budget.value if budget.kind == "gpu_memory" else free_memory(device)
        slots = _slots_in_memory(int(memory), cfg, dtype, kv_tokens, scratch_experts)
    fitted = fit_slots(
        slots,
        layers,
        experts,
        lambda: _too_small(budget, cfg, dtype, kv_tokens, scratch_experts, slots, experts),
    )
    return None if fitted == layers * experts else fitted


def count_slots(budget: Budget, layers: int, experts: int) -> int:
    """The slots of a budget given as a count (SLOT_KINDS) for a model's shape, before the
    minimum (`fit_slots`); ValueError for the kinds that need device memory to size."""
    if budget.kind == "expert_fraction":
        return round(budget.value * layers * experts)
    if budget.kind == "expert_budget":
        return int(budget.value)
    if budget.kind == "slots_per_layer":
        return int(budget.value) * layers
    raise ValueError(f"a {budget.kind} budget is sized from device memory, not counted")


def fit_slots(slots: int, layers: int, experts: int, too_small: Callable[[], str]) -> int:
    """`slots`, at most every expert: the one check of the budget's minimum, one slot per MoE
    layer (ValueError with `too_small()` below it)."""
    if slots < layers:
        raise ValueError(too_small())
    return min(slots, layers * experts)


def shape_slots(budget: Budget, layers: int, experts: int) -> int:
    """Total slots of a count budget for a model's shape without a device (the simulator):
    at most every expert; ValueError below one slot per MoE layer or for a memory budget."""
    if budget.kind not in SLOT_KINDS:
        kinds = f"{', '.join(SLOT_KINDS[:-1])} or {SLOT_KINDS[-1]}"
        raise ValueError(f"a {budget.kind} budget needs a device to size: give {kinds}")
    slots = count_slots(budget, layers, experts)
    return fit_slots(
        slots,
        layers,
        experts,
        lambda: f"budget of {slots} slots is below one per MoE layer ({layers})",
    )


def free_memory(device: torch.device) -> int:
    """Free device memory in bytes (CUDA), or host memory for a CPU device."""
    if device.type == "cuda":
        import torch  # the budget is declared without torch (recipes validate it)

        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return int(host_available() * 0.5)


def host_available() -> int:
    """Host memory that can be had now, in bytes: Linux's MemAvailable (free pages and the
    page cache that can be dropped, such as a checkpoint's read pages), else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _fixed_bytes(cfg: ModelConfig, dtype: torch.dtype, kv_tokens: int, scratch_experts: int) -> int:
    return (
        non_expert_bytes(cfg, dtype)
        + kv_bytes(cfg, dtype, kv_tokens)
        + ACTIVATION_RESERVE
        + scratch_experts * expert_bytes(cfg, dtype)
    )


def _slots_in_memory(
    memory: int, cfg: ModelConfig, dtype: torch.dtype, kv_tokens: int, scratch_experts: int
) -> int:
    return max(0, (memory - _fixed_bytes(cfg, dtype, kv_tokens, scratch_experts))) // expert_bytes(
        cfg, dtype
    )


def minimum_bytes(
    cfg: ModelConfig, dtype: torch.dtype, kv_tokens: int, scratch_experts: int
) -> int:
    """The smallest device budget that runs: fixed parts plus one expert slot per MoE layer."""
    return _fixed_bytes(cfg, dtype, kv_tokens, scratch_experts) + cfg.num_moe_layers * expert_bytes(
        cfg, dtype
    )


def _too_small(
    budget: Budget,
    cfg: ModelConfig,
    dtype: torch.dtype,
    kv_tokens: int,
    scratch_experts: int,
    slots: int,
    experts: int,
) -> str:
    need = minimum_bytes(cfg, dtype, kv_tokens, scratch_experts)
    share = "" if experts == cfg.num_experts else f" (per device, over its {experts} experts)"
    what = {
        "expert_fraction": f"expert_fraction {budget.value} gives {slots} slots",
        "expert_budget": f"expert_budget {int(budget.value)} slots",
        "slots_per_layer": f"slots_per_layer {int(budget.value)} gives {slots} slots",
        "gpu_memory": f"gpu_memory {gib(budget.value)} holds {slots} expert slots",
        "auto": f"the free device memory holds {slots} expert slots",
    }[budget.kind]
    return (
        f"budget too small: {what}{share}, but the model needs at least {cfg.num_moe_layers} "
        f"(one per MoE layer). Minimum device memory: {gib(need)} = non-expert weights "
        f"{gib(non_expert_bytes(cfg, dtype))} + KV cache for {kv_tokens} tokens "
        f"{gib(kv_bytes(cfg, dtype, kv_tokens))} + activations {gib(ACTIVATION_RESERVE)} + "
        f"{cfg.num_moe_layers + scratch_experts} experts of {gib(expert_bytes(cfg, dtype))}"
    )
