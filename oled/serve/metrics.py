"""The server's Prometheus metrics (prometheus-client), in a registry of each app's own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
OFFLOAD_COUNTERS = {
    "hits": "Expert lookups found in the GPU slot cache",
    "misses": "Expert lookups not in the GPU slot cache",
    "copies": "Experts copied from host memory to the GPU",
    "copy_bytes": "Bytes of experts copied from host memory to the GPU",
    "cpu_experts": "Expert passes computed on the CPU",
}


class Metrics:
    """Requests, generations, tokens, latency and the offload engine's figures (thread-safe).

    The offload metrics appear once the engine reports them (never when every expert is
    resident)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "oled_http_requests",
            "HTTP responses by route and status",
            ["route", "status"],
            registry=r,
        )
        self.generations = Counter(
            "oled_generations",
            "Generations by finish reason (stop, length, cancelled, error)",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "oled_prompt_tokens", "Prompt tokens of finished generations", registry=r
        )
        self.completion_tokens = Counter(
            "oled_completion_tokens",
            "Completion tokens returned (usage.completion_tokens)",
            registry=r,
        )
        self.forwards = Counter(
            "oled_forwards",
            "Denoising iterations of finished generations (a batched forward counts once for "
            "each generation in it; oled_batch_size_count counts forwards)",
            registry=r,
        )
        self.decode_seconds = Counter(
            "oled_decode_seconds",
            "Seconds spent decoding finished generations (a batched forward counts for each "
            "generation in it)",
            registry=r,
        )
        self.disconnects = Counter(
            "oled_client_disconnects",
            "Requests whose client went away before the generation ended",
            registry=r,
        )
        self.latency = Histogram(
            "oled_request_latency_seconds",
            "Seconds from a generation's arrival to its end",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "oled_batch_size",
            "Generations decoded together, per model forward",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.load_seconds = Gauge(
            "oled_model_load_seconds", "Seconds the model took to load", registry=r
        )
        self._lock = threading.Lock()
        self._offload: dict[str, Counter] = {}
        self._hit_rate: Gauge | None = None

    def watch(
        self,
        *,
        ready: Callable[[], bool],
        queue_depth: Callable[[], int],
        batch_size: Callable[[], int],
    ) -> None:
        """Gauges read when scraped: whether the model is ready, requests waiting, requests
        being decoded."""
        Gauge(
            "oled_model_ready",
            "1 once the model is loaded and serving, else 0",
            registry=self.registry,
        ).set_function(lambda: float(ready()))
        Gauge(
            "oled_queue_depth", "Requests waiting for the decoding worker", registry=self.registry
        ).set_function(queue_depth)
        Gauge(
            "oled_batch_requests", "Requests being decoded together", registry=self.registry
        ).set_function(batch_size)

    def record_generation(
        self,
        stats: dict[str, Any],
        *,
        finish: str,
        prompt_tokens: int,
        completion_tokens: int,
        seconds: float,
    ) -> None:
        """One finished generation: its tokens, forwards, latency and offload figures."""
        self.generations.labels(finish_reason=finish).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.forwards.inc(stats.get("iterations", 0))
        self.decode_seconds.inc(stats.get("seconds", 0.0))
        self.latency.observe(seconds)
        self._record_offload(stats.get("offload") or {})

    def _record_offload(self, offload: dict[str, Any]) -> None:
        with self._lock:
            if "hit_rate" in offload:
                if self._hit_rate is None:
                    self._hit_rate = Gauge(
                        "oled_expert_hit_rate",
                        "GPU slot-cache hit rate of the last generation",
                        registry=self.registry,
                    )
                self._hit_rate.set(float(offload["hit_rate"]))
            for key in OFFLOAD_COUNTERS.keys() & offload.keys():
                if key not in self._offload:
                    self._offload[key] = Counter(
                        f"oled_expert_{key}", OFFLOAD_COUNTERS[key], registry=self.registry
                    )
                self._offload[key].inc(float(offload[key]))

    def render(self) -> bytes:
        """The Prometheus exposition text."""
        return generate_latest(self.registry)
