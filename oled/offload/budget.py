"""The GPU budget: how many expert slots the device holds, decided before any weight is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

from oled.model.config import ModelConfig

BudgetKind = Literal[
    "resident", "expert_fraction", "expert_budget", "slots_per_layer", "gpu_memory", "auto"
]
SLOT_KINDS = ("expert_fraction", "expert_budget", "slots_per_layer")  # counts, not memory
KV_TOKENS = 4096  # prefix KV the memory budget reserves room for
ACTIVATION_RESERVE = 512 << 20  # logits of a block, routing buffers, allocator slack


@dataclass(frozen=True)
class Budget:
    """One of: every expert resident; a fraction of all experts; a number of expert slots (all
    MoE layers together); slots per MoE layer; a whole-device memory budget in bytes; or `auto`
    (the free memory)."""

    kind: BudgetKind = "resident"
    value: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in get_args(BudgetKind):
            raise ValueError(f"unknown budget {self.kind!r}; choose from {get_args(BudgetKind)}")
        if self.kind == "expert_fraction" and not (self.value and 0 < self.value <= 1):
            raise ValueError(f"expert_fraction must be in (0, 1], got {self.value}")
        if self.kind in ("expert_budget", "slots_per_layer", "gpu_memory") and not (
            self.value and self.value > 0
        ):
            raise ValueError(f"{self.kind} must be positive, got {self.value}")


def non_expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every weight except the routed experts (router weights kept in fp32)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    attn += cfg.num_attention_heads * cfg.head_dim * h + 2 * cfg.head_dim + 2 * h
    dense = 3 * h * cfg.intermediate_size
    shared = 3 * h * cfg.shared_intermediate_size
    size = torch.finfo(dtype).bits // 8
    total = (2 * v * h + h) * size + cfg.num_hidden_layers * attn * size
    total += cfg.first_k_dense_replace * dense * size
    total += cfg.num_moe_layers * (shared * size + (h + 1) * cfg.num_experts * 4)
    return total


def kv_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int) -> int:
    size = torch.finfo(dtype).bits // 8
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * tokens * size


def expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return cfg.expert_params() * (torch.finfo(dtype).bits // 8)


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
) -> int | None:
    """Expert slots for all MoE layers together; None when every expert stays resident.
    `scratch_experts`: room for that many experts beside the slots (the stage's rounds and the
    landing buffer of encoded transfers).

    Raises ValueError, stating the minimum, when the budget cannot hold one slot per MoE layer.
    """
    layers, experts = cfg.num_moe_layers, cfg.num_experts
    if budget.kind == "resident":
        return None
    if budget.kind in SLOT_KINDS:
        slots = count_slots(budget, layers, experts)
    else:
        memory = budget.value if budget.kind == "gpu_memory" else free_memory(device)
        slots = _slots_in_memory(int(memory), cfg, dtype, kv_tokens, scratch_experts)
    if slots >= layers * experts:
        return None
    if slots < layers:
        raise ValueError(_too_small(budget, cfg, dtype, kv_tokens, scratch_experts, slots))
    return slots


def count_slots(budget: Budget, layers: int, experts: int) -> int:
    """The slots of a budget given as a count (SLOT_KINDS) for a model's shape, before the
    checks of `total_slots`; ValueError for the kinds that need device memory to size."""
    if budget.kind == "expert_fraction":
        return round(budget.value * layers * experts)
    if budget.kind == "expert_budget":
        return int(budget.value)
    if budget.kind == "slots_per_layer":
        return int(budget.value) * layers
    raise ValueError(f"a {budget.kind} budget is sized from device memory, not counted")


def shape_slots(budget: Budget, layers: int, experts: int) -> int:
    """Total slots of a count budget for a model's shape without a device (the simulator):
    at most every expert; ValueError below one slot per MoE layer or for a memory budget."""
    if budget.kind not in SLOT_KINDS:
        kinds = f"{', '.join(SLOT_KINDS[:-1])} or {SLOT_KINDS[-1]}"
        raise ValueError(f"a {budget.kind} budget needs a device to size: give {kinds}")
    slots = count_slots(budget, layers, experts)
    if slots < layers:
        raise ValueError(f"budget of {slots} slots is below one per MoE layer ({layers})")
    return min(slots, layers * experts)


def free_memory(device: torch.device) -> int:
    """Free device memory in bytes (CUDA), or host memory for a CPU device."""
    if device.type == "cuda":
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


def _fixed_bytes(cfg, dtype, kv_tokens, scratch_experts) -> int:
    return (
        non_expert_bytes(cfg, dtype)
        + kv_bytes(cfg, dtype, kv_tokens)
        + ACTIVATION_RESERVE
        + scratch_experts * expert_bytes(cfg, dtype)
    )


def _slots_in_memory(memory: int, cfg, dtype, kv_tokens, scratch_experts) -> int:
    return max(0, (memory - _fixed_bytes(cfg, dtype, kv_tokens, scratch_experts))) // expert_bytes(
        cfg, dtype
    )


def minimum_bytes(cfg: ModelConfig, dtype, kv_tokens: int, scratch_experts: int) -> int:
    """The smallest device budget that runs: fixed parts plus one expert slot per MoE layer."""
    return _fixed_bytes(cfg, dtype, kv_tokens, scratch_experts) + cfg.num_moe_layers * expert_bytes(
        cfg, dtype
    )


def _too_small(budget, cfg, dtype, kv_tokens, scratch_experts, slots) -> str:
    need = minimum_bytes(cfg, dtype, kv_tokens, scratch_experts)
    what = {
        "expert_fraction": f"expert_fraction {budget.value} gives {slots} slots",
        "expert_budget": f"expert_budget {int(budget.value)} slots",
        "slots_per_layer": f"slots_per_layer {int(budget.value)} gives {slots} slots",
        "gpu_memory": f"gpu_memory {gib(budget.value)} holds {slots} expert slots",
        "auto": f"the free device memory holds {slots} expert slots",
    }[budget.kind]
    return (
        f"budget too small: {what}, but the model needs at least {cfg.num_moe_layers} "
        f"(one per MoE layer). Minimum device memory: {gib(need)} = non-expert weights "
        f"{gib(non_expert_bytes(cfg, dtype))} + KV cache for {kv_tokens} tokens "
        f"{gib(kv_bytes(cfg, dtype, kv_tokens))} + activations {gib(ACTIVATION_RESERVE)} + "
        f"{cfg.num_moe_layers + scratch_experts} experts of {gib(expert_bytes(cfg, dtype))}"
    )
