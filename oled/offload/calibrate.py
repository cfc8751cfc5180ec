"""A micro-benchmark that fits the cost model to this machine once, stored per machine key."""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from oled import kernels
from oled.model.experts import ExpertStore, expert_pairs, expert_rows
from oled.offload.copies import Rows, launch
from oled.policies.base import CostModel

_PATHS = "rows-3"  # the engine's copy and CPU-expert paths: a new one measures again


def machine_parts(store: ExpertStore, device: torch.device) -> dict[str, str]:
    """What the measured costs depend on: the machine, torch, the expert shape and dtype, where
    the experts live, the kernels and the engine's paths (a change in any measures again)."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": str(torch.get_num_threads()),
        "torch": torch.__version__,
        "expert shape": str(tuple(store.w13[0].shape[1:])),
        "dtype": str(store.w13[0].dtype).removeprefix("torch."),
        "pinned": str(store.pinned),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "kernels": kernels.describe(device),
        "paths": _PATHS,
    }


def machine_key(parts: dict[str, str]) -> str:
    """A short digest of `machine_parts` (the file name of its calibration)."""
    return hashlib.sha1("|".join(parts.values()).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Calibration:
    """A cost model measured once on this machine, the key it is stored under and when."""

    cost: CostModel
    parts: dict[str, str]
    measured: str  # UTC, ISO 8601
    file: Path

    def describe(self) -> dict[str, Any]:
        """For reports: where the decisions' costs come from, and the costs."""
        return {
            "source": "calibrated",
            "file": str(self.file),
            "measured": self.measured,
            "key": machine_key(self.parts),
            **self.parts,
            **asdict(self.cost),
        }

    def to_json(self) -> str:
        data = {"key": self.parts, "measured": self.measured, "cost": asdict(self.cost)}
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def read(cls, file: Path) -> Calibration:
        """A stored calibration (ValueError, KeyError, TypeError when not one)."""
        data = json.loads(file.read_text())
        cost = CostModel.from_json(json.dumps(data["cost"]))
        return cls(cost=cost, parts=dict(data["key"]), measured=data["measured"], file=file)


def stored_calibrations(cache_dir: Path) -> list[Calibration]:
    """The calibrations stored under `cache_dir`, newest first (unreadable files skipped)."""
    out = []
    for file in sorted(cache_dir.glob("cost-*.json")):
        try:
            out.append(Calibration.read(file))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda c: c.measured, reverse=True)


def calibrated_cost(store: ExpertStore, device: torch.device, cache_dir: Path) -> Calibration:
    """The stored cost model for this machine and expert shape, measured on first use and
    reused after: the decisions it drives are the same on every run here."""
    parts = machine_parts(store, device)
    file = cache_dir / f"cost-{machine_key(parts)}.json"
    if file.exists():
        try:
            return Calibration.read(file)
        except (ValueError, KeyError, TypeError):
            pass  # stale format: measure again
    measured = datetime.now(timezone.utc).isoformat(timespec="seconds")
    calibration = Calibration(measure(store, device), parts, measured, file)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(calibration.to_json())
    tmp.replace(file)  # whole or not at all: a process killed mid-write leaves no half file
    return calibration


def _timed(fn: Callable[[], object], device: torch.device, repeat: int = 5) -> float:
    """Median milliseconds of fn() (synchronised)."""
    fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - t0))
    return float(np.median(times))


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return max(float(intercept), 0.0), max(float(slope), 1e-6)


def measure(store: ExpertStore, device: torch.device) -> CostModel:
    """Copy time per expert, CPU expert time against tokens, grouped GEMM against experts."""
    w13, w2 = store.w13[0], store.w2[0]
    e = w13.shape[0]
    n = min(8, e)
    slot13 = torch.empty((n, *w13.shape[1:]), dtype=w13.dtype, device=device)
    slot2 = torch.empty((n, *w2.shape[1:]), dtype=w2.dtype, device=device)

    src, dst = Rows.of(w13, w2), Rows.of(slot13, slot2)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def copy(count: int) -> Callable[[], None]:
        return lambda: launch(src, dst, list(range(count)), list(range(count)), stream)

    one, many = _timed(copy(1), device), _timed(copy(n), device)
    copy_per = max((many - one) / max(1, n - 1), 1e-4)
    cpu_fixed, cpu_per_token = _cpu_path_costs(w13, w2, device)
    table13, table2 = w13.to(device), w2.to(device)
    gpu_experts = [1, min(8, e), e]
    top_k = min(8, e)
    gpu_ms = [_expert_time(table13, table2, 32, top_k, device, experts=k) for k in gpu_experts]
    gpu_fixed, gpu_per = _line(gpu_experts, gpu_ms)
    return CostModel(
        copy_ms_per_expert=copy_per,
        copy_fixed_ms=max(one - copy_per, 0.0),
        cpu_fixed_ms=cpu_fixed,
        cpu_ms_per_token=cpu_per_token,
        gpu_fixed_ms=gpu_fixed,
        gpu_ms_per_expert=gpu_per,
        expert_bytes=store.expert_bytes,
    )


def _cpu_path_costs(w13: Tensor, w2: Tensor, device: torch.device) -> tuple[float, float]:
    """Per-expert CPU cost as the engine pays it: activations to host, the CPU experts'
    GEMMs over the host table and their rows back to the device. Fitted as (fixed, per token)
    for one expert, with the layer's fixed overhead shared out over a typical handful of CPU
    experts.
    """
    h = w2.shape[1]
    t, k = 32, min(8, w13.shape[0])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=gen).to(device=device, dtype=w13.dtype)
    weights = torch.rand(t, k, generator=gen)

    def layer(n_experts: int, tokens_each: int) -> Callable[[], list[Tensor]]:
        ids = torch.full((t, k), -1, dtype=torch.long)
        for e in range(n_experts):  # expert e gets `tokens_each` (token, expert) pairs
            ids.view(-1)[e * tokens_each : (e + 1) * tokens_each] = e

        def run() -> list[Tensor]:
            parts = expert_rows(x.to("cpu"), ids, weights, w13, w2)
            return [part.to(device) for part in parts]

        return run

    fixed_ms = _timed(layer(1, 1), device)
    few = _timed(layer(4, 4), device) / 4
    many = _timed(layer(4, 32), device) / 4
    per_token = max((many - few) / 28, 1e-4)
    return max(few - 4 * per_token, fixed_ms / 4), per_token


def _expert_time(
    w13: Tensor, w2: Tensor, tokens: int, k: int, device: torch.device, experts: int = 1
) -> float:
    """Milliseconds of expert_pairs with `tokens` tokens spread over `experts` experts, top-k."""
    h = w2.shape[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, h, generator=gen).to(device=device, dtype=w13.dtype)
    ids = torch.randint(0, experts, (tokens, k), generator=gen).to(device)
    weights = torch.rand(tokens, k, generator=gen).to(device)
    return _timed(lambda: expert_pairs(x, ids, weights, w13, w2), device)
