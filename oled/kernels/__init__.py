"""Fused Triton kernels for CUDA devices; torch code stays the reference.

The model's hot stages (RMSNorm, q/k norm + rotary + KV write, routing, the routed experts, a
batched forward's attention) each have a torch version in `oled.model` and a fused Triton version
here (`norm`, `route`, `moe`, `attention`).
`use(mode)` picks for the whole process: "auto" (the default) takes the fused kernels for CUDA
tensors wherever triton imports, "triton" insists on them (an error where they cannot run),
"torch" never takes them. They serve inference only: training (gradients, autocast) keeps the
torch path. Every GPU path of a runtime (all-resident, slot table, staged rounds) goes through
the same kernels, so offloaded and resident runs still give the same tokens bit for bit; the
fused and the torch versions agree to rounding (tests/kernels states the tolerances).

Under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors) mode "triton" also runs them on
the CPU: that is how the tests check the fused model without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading

import torch
from torch import Tensor

MODES = ("auto", "triton", "torch")
_mode = "auto"
_interpreter = threading.Lock()


def use(mode: str) -> None:
    """Choose the kernels for the whole process: "auto", "triton" or "torch"."""
    global _mode
    _mode = _known(mode)


def _known(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown kernels {mode!r}; choose from {', '.join(MODES)}")
    return mode


def mode() -> str:
    """The kernels chosen by `use`."""
    return _mode


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (CUDA builds of torch bring it)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as none
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def serial() -> contextlib.AbstractContextManager:
    """One kernel at a time under the interpreter (its launch state is global; the CPU-expert
    worker thread launches beside the main thread); free on a GPU."""
    return _interpreter if interpreting() else contextlib.nullcontext()


def on_device(t: Tensor) -> contextlib.AbstractContextManager:
    """Launches on `t`'s CUDA device (Triton launches on the current one); free on the CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def fused(t: Tensor) -> bool:
    """Whether the fused kernels compute a stage whose input is `t`: inference only (not when
    `t` needs gradients, nor under autocast, as in training)."""
    if not picks(t.device) or (t.requires_grad and torch.is_grad_enabled()):
        return False
    return t.device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(t.device.type)


def picks(device: torch.device) -> bool:
    """Whether inference on `device` runs the fused kernels."""
    if _mode == "torch" or not triton_available():
        return False
    return device.type == "cuda" or (_mode == "triton" and interpreting())


def check(mode: str, device: torch.device) -> None:
    """Fail early where `mode` cannot run on `device`."""
    if _known(mode) != "triton" or interpreting():
        return
    if device.type != "cuda":
        raise ValueError(f"kernels 'triton' need a CUDA device (this runtime is on {device})")
    if not triton_available():
        raise ValueError("kernels 'triton' need the triton package (CUDA builds of torch bring it)")


def describe(device: torch.device) -> str:
    """The kernels inference on `device` runs: "triton" or "torch" (for reports)."""
    return "triton" if picks(device) else "torch"
