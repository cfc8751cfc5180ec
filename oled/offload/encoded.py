"""Encoded expert copies: the host keeps every expert also encoded (oled.model.codec), a miss
copies the encoded rows, and the device decodes them into the slot.

The encoded rows land in a small landing buffer on the device, LANDING experts at a time; each
round's rows are then decoded on the copy stream, straight into the destination rows (a layer's
slot table or the stage), before the next round lands. The decoder is one Triton launch over a
descriptor of (source, destination) offsets, captured once as a CUDA graph, so the engine's
Python path and drive.c (oled.offload.driver) launch the same graph after sending the
descriptor from a pinned ring. The ring is taken in order within an iteration and is free again
once the engine has synchronised its streams (`reset`); a path that finds it full synchronises
the copy stream first (Python) or declines (C).

Encoding happens once, when the runtime is built (oled.runtime.build_runtime), on the device
where there is one (seconds for LLaDA2.0-mini's 30 GB of experts) and on the CPU otherwise,
layer by layer under a progress bar; nothing is cached on disk. The host then holds both the
bf16 experts (CPU experts compute from them) and the encoded ones.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from oled import kernels
from oled.model import codec
from oled.model.experts import ExpertStore
from oled.offload.copies import Rows, launch, transfer
from oled.progress import track

LANDING = 16  # experts per landing round
RING = 4096  # descriptor rounds per iteration before the ring is waited for
GROUP = 8  # experts encoded together (bounded memory: about 1 GB for LLaDA2.0-mini)


class EncodedCopies:
    """One engine's encoded host tables, landing buffer, descriptors and decoder."""

    def __init__(
        self, store: ExpertStore, codec_name: str, device: torch.device, progress: bool = False
    ) -> None:
        codec.check_codec(codec_name, store.w13[0].dtype)
        self.codec, self.device = codec_name, device
        self.cuda = device.type == "cuda"
        self.n = (store.w13[0][0].numel(), store.w2[0][0].numel())  # weights per row
        if any(n % 8 for n in self.n):  # the decoder writes whole 16-byte vectors
            raise ValueError(f"transfer {codec_name!r} needs experts of a multiple of 8 weights")
        self.shapes = (tuple(store.w13[0].shape[1:]), tuple(store.w2[0].shape[1:]))
        self.w13, self.w2 = _encode_store(store, codec_name, device, progress)
        self.rows = [Rows.of(a, b) for a, b in zip(self.w13, self.w2, strict=True)]
        self.row_bytes = self.rows[0].size  # (w13, w2) encoded bytes per expert
        self.expert_bytes = sum(self.row_bytes)
        land = (self._landing(0), self._landing(1))
        self.land13, self.land2 = land
        self.landing = Rows.of(*land)
        self.stride = 1 + 4 * LANDING  # int64 per descriptor: count, then (src, dst) pairs
        self.used = np.zeros(1, np.int64)  # descriptors taken since the last reset (C too)
        self.graph: torch.cuda.CUDAGraph | None = None
        if self.cuda:
            self.ring = torch.zeros(RING, self.stride, dtype=torch.int64, pin_memory=True)
            self.desc = torch.zeros(self.stride, dtype=torch.int64, device=device)
            self.graph = self._capture()

    def _landing(self, which: int) -> Tensor:
        return torch.empty(LANDING, self.row_bytes[which], dtype=torch.uint8, device=self.device)

    @property
    def ratio(self) -> float:
        """Encoded bytes per bf16 byte of an expert (the rows as copied, padding included)."""
        return self.expert_bytes / (2 * sum(self.n))

    def _capture(self) -> torch.cuda.CUDAGraph:
        """The decoder over the descriptor buffer as a CUDA graph (compiled and run once on an
        empty list first)."""
        from oled.kernels.codec import decode_listed

        tag = codec.FP8 if self.codec == "fp8" else codec.LOSSLESS
        chunks = -(-max(self.n) // codec.CHUNK)

        def run() -> None:
            decode_listed(tag, self.desc, self.land13, 2 * LANDING, chunks)

        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            self.desc.zero_()
            run()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
        return graph

    def drive_fields(self) -> dict[str, int]:
        """drive.c's fields for launching these copies from C (oled.offload.driver.Drive)."""
        return {
            "decode_exec": self.graph.raw_cuda_graph_exec(),
            "land13": self.land13.data_ptr(), "land2": self.land2.data_ptr(),
            "land_rows": LANDING, "desc_host": self.ring.data_ptr(),
            "desc_dev": self.desc.data_ptr(), "desc_stride": self.stride, "desc_cap": RING,
            "desc_used": self.used.ctypes.data,
        }  # fmt: skip

    def launch(
        self, layer: int, experts, slots, dst: Rows, stream: torch.cuda.Stream | None
    ) -> None:
        """Copy the layer's `experts` into rows `slots` of `dst` (bf16 tables), decoding on
        `stream` (None: at once, on the CPU)."""
        experts, slots = np.asarray(experts, np.int64), np.asarray(slots, np.int64)
        for lo in range(0, len(experts), LANDING):
            part, into = experts[lo : lo + LANDING], slots[lo : lo + LANDING]
            launch(self.rows[layer], self.landing, part, np.arange(len(part)), stream)
            if stream is None:
                self._decode_here(into, dst)
            else:
                self._decode_on(stream, into, dst)

    def _decode_on(self, stream: torch.cuda.Stream, slots: np.ndarray, dst: Rows) -> None:
        """The decoder's descriptor for rows `slots` of `dst`, sent and decoded on `stream`."""
        if self.used[0] >= RING:  # every earlier descriptor has been read once this returns
            stream.synchronize()
            self.used[0] = 0
        q = self.ring[int(self.used[0])].numpy()
        self.used[0] += 1
        k, base = len(slots), self.land13.data_ptr()
        q[0] = 2 * k
        for t, (landed, size, dst_base, dst_size) in enumerate(
            ((self.land13, self.row_bytes[0], dst.base[0], dst.size[0]),
             (self.land2, self.row_bytes[1], dst.base[1], dst.size[1]))
        ):  # fmt: skip
            at = 1 + 2 * k * t + 2 * np.arange(k)
            q[at] = landed.data_ptr() + np.arange(k) * size - base
            q[at + 1] = dst_base + slots * dst_size - base
        transfer(self.desc[: 1 + 4 * k], self.ring[int(self.used[0]) - 1, : 1 + 4 * k], stream)
        with torch.cuda.stream(stream):
            self.graph.replay()

    def _decode_here(self, slots: np.ndarray, dst: Rows) -> None:
        """Decode the landed rows into rows `slots` of `dst` with the reference decoder."""
        k = len(slots)
        with kernels.serial():
            for t, landed in enumerate((self.land13, self.land2)):
                decoded = codec.decode(landed[:k], self.n[t])  # [k, n] bf16
                for j, slot in enumerate(slots):
                    dst.views[t][int(slot)].copy_(decoded[j].view(self.shapes[t]))

    def reset(self) -> None:
        """Both streams are idle: every descriptor has been read."""
        self.used[0] = 0


def _encode_store(
    store: ExpertStore, codec_name: str, device: torch.device, progress: bool
) -> tuple[list[Tensor], list[Tensor]]:
    """Every layer's tables encoded, on the host (pinned when serving CUDA), padded to one row
    size per table across layers (the copies address rows by one size)."""
    work = device if device.type == "cuda" else torch.device("cpu")
    pin = device.type == "cuda"
    what = f"experts ({codec.describe(codec_name)})"
    layers, tables = range(store.num_layers), (store.w13, store.w2)
    # the exponent counts [E, 256] of every layer's tables (lossless), counted once
    counts = [[None, None] for _ in layers]
    if codec_name == "lossless":
        for layer in track(layers, f"counting {what}", show=progress):
            for t in (0, 1):
                counts[layer][t] = codec.exponent_counts(tables[t][layer], work, GROUP)
    sizes = [  # bytes per encoded row, w13 and w2: one size across layers
        max(codec.encoded_size(tables[t][0].shape[1:], codec_name, counts[layer][t], GROUP)
            for layer in layers)
        for t in (0, 1)
    ]  # fmt: skip
    check_host_memory(store.num_layers * store.num_experts * sum(sizes), codec_name)
    out: tuple[list[Tensor], list[Tensor]] = ([], [])
    for layer in track(layers, f"encoding {what}", show=progress):
        for t in (0, 1):
            host = torch.zeros(store.num_experts, sizes[t], dtype=torch.uint8, pin_memory=pin)
            for lo in range(0, store.num_experts, GROUP):
                part = tables[t][layer][lo : lo + GROUP].to(work, non_blocking=True)
                known = None if counts[layer][t] is None else counts[layer][t][lo : lo + GROUP]
                rows = codec.encode(part, codec_name, counts=known, size=sizes[t], group=GROUP)
                host[lo : lo + GROUP].copy_(rows)  # straight into the pinned table
            out[t].append(host)
    return out


def check_host_memory(need: int, codec_name: str, available: int | None = None) -> None:
    """ValueError, before any encoded table is allocated, when host memory cannot hold the
    encoded experts beside the bf16 ones (`available`: free bytes, the system's by default)."""
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    if need > available:
        raise ValueError(
            f"transfer {codec_name!r} keeps the experts encoded in host memory as well: "
            f"{need / 2**30:.1f} GiB needed, {available / 2**30:.1f} GiB free; "
            'free memory or use transfer = "plain"'
        )
