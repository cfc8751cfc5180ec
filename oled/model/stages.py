"""Named stages of a forward for the profiler (`oled bench --profile`); free while off.

The forward, the expert executors and the decoder mark their stages with `stage(name)`. While
`annotate(True)` holds, each stage is a profiler range, so every kernel and copy it launches can
be attributed to it (oled.bench.stage_breakdown); otherwise `stage` is an empty context.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

STAGES = (
    "embedding",
    "attention",
    "routing",
    "routing to host",
    "host decision",
    "copies",
    "grouped GEMM",
    "CPU experts",
    "combine",
    "shared expert",
    "dense MLP",
    "lm head",
    "decode step",
)
_on = False


def stage(name: str) -> AbstractContextManager[object]:
    """A profiler range `name` while annotating, else a no-op context."""
    return torch.profiler.record_function(name) if _on else nullcontext()


def annotating() -> bool:
    """Whether stages are profiler ranges now."""
    return _on


def annotate(on: bool) -> None:
    """Mark stages as profiler ranges (True) or not (False, the default)."""
    global _on
    _on = on
