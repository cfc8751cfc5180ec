"""A layer's CPU experts beside a GPU, as the offload engine pays for them: their rows computed
on the host (their pairs grouped and computed in C) into pinned buffers kept between calls, then
added into the layer's pairs on the device. The cost calibration times this same path."""

from __future__ import annotations

import torch
from torch import Tensor

from oled.kernels import cpu
from oled.model.experts import expert_rows


class HostExperts:
    """CPU experts of the layers of one device: `rows` on the host, `add` them on the device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.space = cpu.Space(pinned=self.cuda)
        self._sent = torch.cuda.Event() if self.cuda else None

    def rows(
        self, x: Tensor, slots: Tensor, weights: Tensor, w13: Tensor, w2: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(index [N] into the T*K pairs, rows [N, H] fp32) of the pairs at `slots` [T, K] (an
        expert of the host tables w13/w2, or -1); x [T, H] and weights [T, K] fp32 on the host.
        Beside a GPU the outputs are the pinned buffers' views (valid until the next call)."""
        with torch.inference_mode():
            return expert_rows(x, slots, weights, w13, w2, native=self.cuda, space=self.space)

    def add(self, pairs: Tensor, index: Tensor, rows: Tensor) -> None:
        """pairs [T, K, H] fp32 on the device += rows at index, on the current stream (copies
        from pinned memory, so without a sync); the next `rows` waits until they are sent."""
        flat = pairs.view(-1, pairs.shape[-1])  # [T*K, H]
        if not self.cuda:
            flat.index_add_(0, index, rows)
            return
        if not rows.is_pinned():  # torch's path: rows of its own
            index, rows = index.pin_memory(), rows.pin_memory()
        dev = self.device
        flat.index_add_(0, index.to(dev, non_blocking=True), rows.to(dev, non_blocking=True))
        assert self._sent is not None
        self._sent.record(torch.cuda.current_stream(dev))
        self.space.busy = self._sent
