"""Next-layer routing prediction: which experts MoE layer l + 1 will likely need, known while
layer l is still being computed, so that their copies can start a layer early.

The residual stream changes little from one layer to the next, so layer l + 1's router applied
to layer l's router input routes much like layer l + 1 will. Layer l's router input is
RMSNorm_l(h) = h / rms(h) * w_l; multiplied by w_{l+1} / w_l it is exactly RMSNorm_{l+1}(h),
layer l + 1's norm of the residual before layer l's MoE output is added. The prediction only
decides what is copied ahead; every layer still computes from its own routing.

`RecordedRouting` is the bound for experiments: the next layer's true routing, read from a
trace of the same generation (a perfect prediction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from oled.decoding.observers import DecodeObserver
from oled.model.model import DecoderLayer, LLaDA2Model

if TYPE_CHECKING:  # a trace is read, never made, here (oled.trace sits above oled.offload)
    from oled.trace.format import Trace


class NextLayerRouting:
    """predict(layer, x): expert ids [T, K] that MoE layer `layer` + 1 would route `x` to, where
    x [T, H] is MoE layer `layer`'s router input."""

    def __init__(self, model: LLaDA2Model) -> None:
        first = model.config.first_k_dense_replace
        norms = [_post_norm(layer) for layer in model.model.layers[first:]]  # [H] each
        self.routers = [block.gate for block in model.moe_blocks]
        self.rescale = [_ratio(a, b) for a, b in zip(norms[:-1], norms[1:], strict=True)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @torch.inference_mode()
    def __call__(self, layer: int, x: Tensor) -> Tensor:
        """x [T, H] of MoE layer `layer` (< num_layers - 1) -> predicted ids [T, K] of the next."""
        scale = self.rescale[layer]
        if scale is not None:
            x = x * scale  # [T, H]: the next layer's norm of the same residual
        return self.routers[layer + 1](x)[0]


class RecordedRouting(DecodeObserver):
    """A perfect prediction, for experiments: the next layer's routing as a trace of the same
    generation recorded it. Valid for generations that repeat the traced one forward for
    forward (the same prompt, following its trajectory: oled.decoding.follow) where every
    expert runs on the device (bit for bit the traced routing). Attach it as a decode observer
    of the runtime: it counts the forwards. Its predictions are on the host (`on_host`)."""

    on_host = True

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.step = 0

    def on_iteration_start(self, block: int, iteration: int, step: int) -> None:
        self.step = step

    def __call__(self, layer: int, x: Tensor) -> np.ndarray:
        """The traced ids [T, K] of MoE layer `layer` + 1 in the current forward."""
        t = self.trace
        if self.step >= t.num_steps:
            raise ValueError(f"the trace holds {t.num_steps} forwards; this is forward {self.step}")
        a, b = t.row_offsets[self.step], t.row_offsets[self.step + 1]
        if b - a != x.shape[0]:
            raise ValueError(
                f"forward {self.step} routes {x.shape[0]} tokens, the trace {b - a}: not the "
                "traced generation"
            )
        return t.ids[layer + 1, a:b].astype(np.int64)  # [T, K]


def _post_norm(layer: nn.Module) -> Tensor:
    """The weight [H] of a decoder layer's norm before its MLP (the MoE's router input)."""
    assert isinstance(layer, DecoderLayer)  # a model's layers are all DecoderLayers
    return layer.post_attention_layernorm.weight


def _ratio(w: Tensor, w_next: Tensor) -> Tensor | None:
    """w_next / w [H] elementwise (0 where w is 0), or None when the norms are equal."""
    if torch.equal(w, w_next):
        return None
    ratio = torch.where(w != 0, w_next.float() / w.float(), torch.zeros_like(w, dtype=torch.float))
    return ratio.to(w.dtype)
