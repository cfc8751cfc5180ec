"""Server counters, written out in the Prometheus text format (version 0.0.4) by hand."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in pairs)
    return "{" + inner + "}"


class Metrics:
    """Thread-safe counters for requests, tokens, latency and offload figures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        self._gauges: dict[str, float] = {}
        self._latency: list[int] = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0
        self._latency_count = 0

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        with self._lock:
            self._counters[(name, tuple(sorted(labels.items())))] += value

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name] = value

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._counters[(name, tuple(sorted(labels.items())))]

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self._latency[i] += 1
            self._latency_sum += seconds
            self._latency_count += 1

    def record_generation(self, stats: dict[str, Any], finish: str, seconds: float) -> None:
        """One finished (or cancelled) generation: tokens, forwards, latency, offload."""
        self.inc("oled_generations_total", finish_reason=finish)
        self.inc("oled_prompt_tokens_total", stats.get("prompt_tokens", 0))
        self.inc("oled_completion_tokens_total", stats.get("tokens", 0))
        self.inc("oled_forwards_total", stats.get("iterations", 0))
        self.inc("oled_decode_seconds_total", stats.get("seconds", 0.0))
        self.observe_latency(seconds)
        offload = stats.get("offload") or {}
        if "hit_rate" in offload:
            self.set("oled_expert_hit_rate", float(offload["hit_rate"]))
        for key in ("hits", "misses", "copies", "copy_bytes", "cpu_experts"):
            if key in offload:
                self.inc(f"oled_expert_{key}_total", float(offload[key]))

    def render(self) -> str:
        """The Prometheus exposition text."""
        with self._lock:
            lines: list[str] = []
            seen: set[str] = set()
            for (name, labels), value in sorted(self._counters.items()):
                if name not in seen:
                    lines.append(f"# TYPE {name} counter")
                    seen.add(name)
                lines.append(f"{name}{_labels(labels)} {value:g}")
            for name, value in sorted(self._gauges.items()):
                lines += [f"# TYPE {name} gauge", f"{name} {value:g}"]
            lines += self._render_latency()
        return "\n".join(lines) + "\n"

    def _render_latency(self) -> list[str]:
        name = "oled_request_latency_seconds"
        lines = [f"# TYPE {name} histogram"]
        for bound, count in zip(LATENCY_BUCKETS, self._latency, strict=True):
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {count}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self._latency_count}')
        lines.append(f"{name}_sum {self._latency_sum:g}")
        lines.append(f"{name}_count {self._latency_count}")
        return lines
