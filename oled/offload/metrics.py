"""Per-layer, per-iteration counters and timings of the offload engine."""

from __future__ import annotations

import numpy as np

FIELDS = (
    "hits",
    "misses",
    "copies",
    "copy_bytes",
    "staged",
    "cpu_experts",
    "cpu_tokens",
    "gpu_experts",
    "stall_ms",
    "copy_ms",
    "cpu_ms",
    "cpu_model_ms",
    "sync_ms",
    "plan_ms",
    "launch_ms",
    "pass_ms",
    "host_ms",
    "calls",
    "predicted",
    "predicted_hits",
)
INDEX = {name: i for i, name in enumerate(FIELDS)}  # a field's column


class EngineMetrics:
    """Totals per MoE layer, plus one row of layer sums per iteration.

    hits / misses count distinct experts needed by a layer in a forward; copies include
    prefetches; stall_ms is the time the compute stream waited for copies (CUDA events);
    copy_ms the copy stream's busy time; cpu_ms the host's CPU-expert time (cpu_model_ms the
    cost model's time for the same experts, before any compensation policy's factor); sync_ms the wait
    for the routing to reach the host (the layer's one sync, which also waits for the GPU work
    queued before it); host_ms the host decision path after it (planning, launching copies,
    compute and CPU experts), and of it plan_ms the planner's part (the policies' decisions),
    launch_ms launching the copies (into the cache and a layer ahead), pass_ms launching the
    expert passes (staged rounds with their copies included); the rest sends the slot maps
    and hands the CPU its experts; calls the layer calls; predicted the copies made a layer
    ahead from the predicted routing (also in copies, counted for the layer they fill),
    predicted_hits those the layer then needed.

    `summary` gives the figures over all forwards, and apart for the generation's first forward
    ("prompt": it runs the prompt's tokens, so it misses most experts) and the rest ("decode").
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.reset()

    def reset(self) -> None:
        # plain float lists: `add` runs on the host path of every layer call
        self._layers = [[0.0] * len(FIELDS) for _ in range(self.num_layers)]  # [L][F]
        self.iterations: list[list[float]] = []  # each [F]: sums over layers
        self._current = [0.0] * len(FIELDS)

    @property
    def layer(self) -> np.ndarray:
        """[L, F] totals per layer."""
        return np.array(self._layers, np.float64)

    def add(self, layer: int, **values: float) -> None:
        row, current = self._layers[layer], self._current
        for name, value in values.items():
            i = INDEX[name]
            row[i] += value
            current[i] += value

    def add_layers(self, values: np.ndarray) -> None:
        """Add per-layer values [L, F] (FIELDS' columns)."""
        self._layers = (np.asarray(self._layers) + values).tolist()
        self._current = (np.asarray(self._current) + values.sum(axis=0)).tolist()

    def end_iteration(self) -> None:
        self.iterations.append(self._current)
        self._current = [0.0] * len(FIELDS)

    def total(self, name: str) -> float:
        return float(self.layer[:, FIELDS.index(name)].sum())

    def summary(self) -> dict:
        """Run totals with their rates, per-layer figures, per-iteration sums, and the same
        totals and rates for the prompt forward and the decode iterations (JSON-friendly)."""
        layer = self.layer  # [L, F]
        out = with_rates(dict(zip(FIELDS, layer.sum(axis=0).tolist(), strict=True)))
        out["per_layer"] = [
            {name: float(layer[m, i]) for i, name in enumerate(FIELDS)}
            | {"hit_rate": _rate(layer[m])}
            for m in range(self.num_layers)
        ]
        out["per_iteration"] = [dict(zip(FIELDS, row, strict=True)) for row in self.iterations]
        prompt, decode = self.iterations[:1], self.iterations[1:]
        out["prompt"] = _part(prompt)
        out["decode"] = _part(decode)
        return out


def with_rates(totals: dict) -> dict:
    """Totals (FIELDS) plus hit_rate, cpu_share and microseconds per layer call of the host
    path and its parts (host, sync, plan, launch, pass)."""
    out = dict(totals)
    requests = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / requests if requests else 1.0
    experts = out["gpu_experts"] + out["cpu_experts"]
    out["cpu_share"] = out["cpu_experts"] / experts if experts else 0.0
    calls = max(1.0, out["calls"])
    for name in ("host", "sync", "plan", "launch", "pass"):
        out[f"{name}_us_per_layer"] = 1000 * out[f"{name}_ms"] / calls
    return out


def _part(rows: list[list[float]]) -> dict:
    """Totals and rates over some iterations' rows, with their count."""
    totals = np.array(rows, np.float64).reshape(-1, len(FIELDS)).sum(axis=0)
    return with_rates(dict(zip(FIELDS, totals.tolist(), strict=True))) | {"iterations": len(rows)}


def _rate(row: np.ndarray) -> float:
    hits, misses = row[FIELDS.index("hits")], row[FIELDS.index("misses")]
    return float(hits / (hits + misses)) if hits + misses else 1.0
