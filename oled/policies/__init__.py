"""Offload policies: allocation, retention, compensation (device-free)."""


def with_oled_defaults(*, allocation=None, retention=None, compensation=None) -> dict:
    """The given policies, OLED's own (adaptive, confidence, cooperative) where one is None."""
    from oled.policies.allocation import AdaptiveAllocation
    from oled.policies.compensation import CooperativeCompensation
    from oled.policies.retention import ConfidenceRetention

    return {
        "allocation": allocation or AdaptiveAllocation(),
        "retention": retention or ConfidenceRetention(),
        "compensation": compensation or CooperativeCompensation(),
    }
