"""Per-layer, per-iteration counters and timings of the offload engine."""

from __future__ import annotations

import numpy as np

FIELDS = (
    "hits", "misses", "copies", "copy_bytes", "staged", "cpu_experts", "cpu_tokens",
    "gpu_experts", "stall_ms", "copy_ms", "cpu_ms", "sync_ms", "host_ms",
)  # fmt: skip
_INDEX = {name: i for i, name in enumerate(FIELDS)}


class EngineMetrics:
    """Totals per MoE layer, plus one row of layer sums per iteration.

    hits / misses count distinct experts needed by a layer in a forward; copies include
    prefetches; stall_ms is the time the compute stream waited for copies (CUDA events);
    copy_ms the copy stream's busy time; cpu_ms the CPU workers' expert time; sync_ms the wait
    for the routing to reach the host (the layer's one sync, which also waits for the GPU work
    queued before it); host_ms the host decision path after it (planning, launching copies,
    compute and CPU experts).
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.reset()

    def reset(self) -> None:
        self.layer = np.zeros((self.num_layers, len(FIELDS)), np.float64)  # [L, F]
        self.iterations: list[np.ndarray] = []  # each [F]: sums over layers
        self._current = np.zeros(len(FIELDS), np.float64)
        self.layer_calls = 0

    def add(self, layer: int, **values: float) -> None:
        for name, value in values.items():
            i = _INDEX[name]
            self.layer[layer, i] += value
            self._current[i] += value

    def end_iteration(self) -> None:
        self.iterations.append(self._current)
        self._current = np.zeros(len(FIELDS), np.float64)

    def total(self, name: str) -> float:
        return float(self.layer[:, FIELDS.index(name)].sum())

    def summary(self) -> dict:
        """Run totals and per-layer figures (JSON-friendly)."""
        out: dict = {name: self.total(name) for name in FIELDS}
        requests = out["hits"] + out["misses"]
        out["hit_rate"] = out["hits"] / requests if requests else 1.0
        experts = out["gpu_experts"] + out["cpu_experts"]
        out["cpu_share"] = out["cpu_experts"] / experts if experts else 0.0
        out["host_us_per_layer"] = 1000 * out["host_ms"] / max(1, self.layer_calls)
        out["sync_us_per_layer"] = 1000 * out["sync_ms"] / max(1, self.layer_calls)
        out["per_layer"] = [
            {name: float(self.layer[m, i]) for i, name in enumerate(FIELDS)}
            | {"hit_rate": _rate(self.layer[m])}
            for m in range(self.num_layers)
        ]
        out["per_iteration"] = [
            {name: float(row[i]) for i, name in enumerate(FIELDS)} for row in self.iterations
        ]
        return out


def _rate(row: np.ndarray) -> float:
    hits, misses = row[FIELDS.index("hits")], row[FIELDS.index("misses")]
    return float(hits / (hits + misses)) if hits + misses else 1.0
