"""Offload policies: allocation, retention, compensation (device-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from oled.policies.base import AllocationPolicy, CompensationPolicy, RetentionPolicy


class Policies(TypedDict):
    """A planner's three policies, each under the keyword that takes it."""

    allocation: AllocationPolicy
    retention: RetentionPolicy
    compensation: CompensationPolicy


def with_oled_defaults(
    *,
    allocation: AllocationPolicy | None = None,
    retention: RetentionPolicy | None = None,
    compensation: CompensationPolicy | None = None,
) -> Policies:
    """The given policies, OLED's own (adaptive, confidence, cooperative) where one is None."""
    from oled.policies.allocation import AdaptiveAllocation
    from oled.policies.compensation import CooperativeCompensation
    from oled.policies.retention import ConfidenceRetention

    return {
        "allocation": allocation or AdaptiveAllocation(),
        "retention": retention or ConfidenceRetention(),
        "compensation": compensation or CooperativeCompensation(),
    }


# What each anchor system is made of, as registry names (allocation, retention, compensation).
# The shipped recipes, `oled simulate --baselines` and the GPU benchmark all use this table.
ANCHORS: dict[str, tuple[str, str, str]] = {
    "lru": ("uniform", "lru", "transfer_only"),  # mixtral-offloading
    "lfu": ("uniform", "lfu", "transfer_only"),  # MoE-Infinity
    "hybrimoe": ("uniform", "score_ema", "makespan"),
    "tide": ("uniform", "lru", "interval_refresh"),
    "fiddler": ("uniform", "lfu", "static_hot"),  # Fiddler, kTransformers
    "llamacpp": ("uniform", "lru", "batch_threshold"),
    "oled": ("adaptive", "confidence", "cooperative"),
}


def anchor_policies(name: str) -> dict:
    """Fresh policy objects of one anchor: {"allocation": ..., "retention": ..., "compensation": ...}."""
    from oled import registry

    if name not in ANCHORS:
        hint = registry.suggest(name, ANCHORS)
        raise ValueError(f"unknown anchor {name!r}{hint}; choose from {', '.join(ANCHORS)}")
    kinds = ("allocation", "retention", "compensation")
    return {
        kind: registry.registry(kind).build(n) for kind, n in zip(kinds, ANCHORS[name], strict=True)
    }
