"""Helpers shared by the kernel tests."""

from __future__ import annotations

import torch


def assert_within_one_ulp(
    out: torch.Tensor, ref: torch.Tensor, *, max_fraction: float = 1.0
) -> None:
    """Equal dtype and shape; elements differ by at most one unit in the last place, and only a
    max_fraction of them (a sum in another order than torch's, or the CPU's vectorised exp,
    which is not expf)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    larger = torch.maximum(out.float().abs(), ref.float().abs())  # one ulp across a binade
    ulp = torch.finfo(ref.dtype).eps * larger.clamp_min(torch.finfo(ref.dtype).tiny)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= ulp * 1.01).all()), f"max diff {diff.max().item()}"
    assert (out != ref).float().mean().item() <= max_fraction
