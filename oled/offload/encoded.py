"""Encoded expert copies: the host keeps every expert also encoded (oled.model.codec), a miss
copies the encoded rows, and the device decodes them into the slot.

The encoded rows land in a small landing buffer on the device, LANDING experts a round, in
PARTS parts taken in turn; each round's rows are then decoded on a stream of their own (the
decoder's), straight into the destination rows (a layer's slot table or the stage), while the
next round lands in the other part. A round waits on the copy stream for the decode that last
read its part (`decoded`), and its decode waits for its landing (`landed`): the copy stream
never waits for a decode of the round before. The decoder is one Triton launch over a
descriptor of (source, destination) offsets, captured once per part as a CUDA graph over that
part's descriptor buffer, so the engine's Python path and drive.c (oled.offload.driver) launch
the same graphs and wait on the same events after sending the descriptor from a pinned ring on
the copy stream. The ring is taken in order within an iteration (its index picks the part) and
is free again once the engine has synchronised its streams (`reset`); a path that finds it full
synchronises the copy stream first (Python) or declines (C).

Encoding happens once, when the runtime is built (oled.runtime.build_runtime), on the device
where there is one (seconds for LLaDA2.0-mini's 30 GB of experts) and on the CPU otherwise,
layer by layer under a progress bar; nothing is cached on disk. The host then holds both the
bf16 experts (CPU experts compute from them) and the encoded ones.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from oled import kernels
from oled.model import codec
from oled.model.experts import ExpertStore
from oled.offload.budget import host_available
from oled.offload.copies import Indices, Rows, launch, transfer
from oled.progress import track

LANDING = 16  # experts per landing round
PARTS = 2  # landing rounds in flight: one decodes while the next lands
LANDING_ROWS = PARTS * LANDING  # experts the landing buffer holds (part p: from p LANDING)
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
        self.graphs: list[torch.cuda.CUDAGraph] = []  # the decoder of each part
        self.stream: torch.cuda.Stream | None = None  # the decoder's
        if self.cuda:
            self.ring = torch.zeros(RING, self.stride, dtype=torch.int64, pin_memory=True)
            self.desc = torch.zeros(PARTS, self.stride, dtype=torch.int64, device=device)
            self.stream = torch.cuda.Stream(device)
            self.graphs = [self._capture(part) for part in range(PARTS)]
            # per part: after its landing (copy stream), after its decode (decoder's stream)
            self.landed = [self._event(torch.cuda.current_stream(device)) for _ in range(PARTS)]
            self.decoded = [self._event(self.stream) for _ in range(PARTS)]
        self._drive: tuple[np.ndarray, np.ndarray] | None = None  # what drive.c reads

    def _landing(self, which: int) -> Tensor:
        shape = (LANDING_ROWS, self.row_bytes[which])
        return torch.empty(shape, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event recorded once (so that it has a handle for drive.c)."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @property
    def ratio(self) -> float:
        """Encoded bytes per bf16 byte of an expert (the rows as copied, padding included)."""
        return self.expert_bytes / (2 * sum(self.n))

    def _capture(self, part: int) -> torch.cuda.CUDAGraph:
        """The decoder over part `part`'s descriptor buffer as a CUDA graph (compiled and run
        once on an empty list first)."""
        from oled.kernels.codec import decode_listed
        from oled.kernels.codec_format import CHUNK

        tag = codec.TAGS[self.codec]
        chunks = -(-max(self.n) // CHUNK)

        def run() -> None:
            decode_listed(tag, self.desc[part], self.land13, 2 * LANDING, chunks)

        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            self.desc[part].zero_()
            run()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
        return graph

    def drive_fields(self) -> dict[str, object]:
        """drive.c's fields for launching these copies from C (oled.offload.driver.Drive; the
        arrays they point to, made on the first call, live as long as this object)."""
        if self.stream is None:
            raise RuntimeError("encoded copies launch from C only on CUDA")
        if self._drive is None:  # each part's graph; its events [2, PARTS]: landed, decoded
            self._drive = (
                np.array([g.raw_cuda_graph_exec() for g in self.graphs], np.int64),
                np.array([e.cuda_event for e in (*self.landed, *self.decoded)], np.uint64),
            )
        execs, events = self._drive
        return {
            "decoder": self.stream.cuda_stream,
            "decode_execs": execs.ctypes.data,
            "land_events": events.ctypes.data,
            "land13": self.land13.data_ptr(),
            "land2": self.land2.data_ptr(),
            "land_rows": LANDING,
            "desc_host": self.ring.data_ptr(),
            "desc_dev": self.desc.data_ptr(),
            "desc_stride": self.stride,
            "desc_cap": RING,
            "desc_used": self.used.ctypes.data,
        }

    def launch(
        self,
        layer: int,
        experts: Indices,
        slots: Indices,
        dst: Rows,
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Copy the layer's `experts` into rows `slots` of `dst` (bf16 tables): landed on
        `stream` and decoded on the decoder's (`self.stream`: complete there), or at once on the
        CPU (`stream` None)."""
        ids, rows = np.asarray(experts, np.int64), np.asarray(slots, np.int64)
        for lo in range(0, len(ids), LANDING):
            part, into = ids[lo : lo + LANDING], rows[lo : lo + LANDING]
            if stream is None:
                launch(self.rows[layer], self.landing, part, np.arange(len(part)), None)
                self._decode_here(into, dst)
            else:
                self._round(layer, stream, part, into, dst)

    def _round(
        self, layer: int, copy: torch.cuda.Stream, experts: np.ndarray, slots: np.ndarray, dst: Rows
    ) -> None:
        """One landing round: on `copy`, wait until the part's last decode is done, send the
        descriptor for rows `slots` of `dst`, land the encoded `experts`; on the decoder's
        stream, decode once they have landed."""
        decoder = self.stream
        assert decoder is not None  # a copy stream means CUDA, where the decoder has its own
        if self.used[0] >= RING:  # every earlier descriptor has been read once this returns
            copy.synchronize()
            self.used[0] = 0
        i = int(self.used[0])
        self.used[0] += 1
        p, k = i % PARTS, len(slots)
        q = self.ring[i].numpy()
        q[: 1 + 4 * k] = self._descriptor(p, slots, dst)
        copy.wait_event(self.decoded[p])
        transfer(self.desc[p, : 1 + 4 * k], self.ring[i, : 1 + 4 * k], copy)
        launch(self.rows[layer], self.landing, experts, p * LANDING + np.arange(k), copy)
        self.landed[p].record(copy)
        decoder.wait_event(self.landed[p])
        with torch.cuda.stream(decoder):
            self.graphs[p].replay()
        self.decoded[p].record(decoder)

    def _descriptor(self, part: int, slots: np.ndarray, dst: Rows) -> np.ndarray:
        """The decoder's list [1 + 4k] for part `part`'s first k landed rows -> rows `slots`
        of `dst`: the count, then (source, destination) offsets from the landing base, the
        w13 rows, then the w2 rows."""
        k, base = len(slots), self.land13.data_ptr()
        q = np.empty(1 + 4 * k, np.int64)
        q[0] = 2 * k
        landed = part * LANDING + np.arange(k)
        for t, (table, dst_base, dst_size) in enumerate(
            ((self.land13, dst.base[0], dst.size[0]), (self.land2, dst.base[1], dst.size[1]))
        ):
            at = 1 + 2 * k * t + 2 * np.arange(k)
            q[at] = table.data_ptr() + landed * self.row_bytes[t] - base
            q[at + 1] = dst_base + slots * dst_size - base
        return q

    def _decode_here(self, slots: np.ndarray, dst: Rows) -> None:
        """Decode the landed rows into rows `slots` of `dst` with the reference decoder."""
        k = len(slots)
        with kernels.serial():
            for t, landed in enumerate((self.land13, self.land2)):
                decoded = codec.decode(landed[:k], self.n[t])  # [k, n] bf16
                for j, slot in enumerate(slots):
                    dst.views[t][int(slot)].copy_(decoded[j].view(self.shapes[t]))

    def synchronize(self) -> None:
        """Wait until every decode issued so far is done."""
        if self.stream is not None:
            self.stream.synchronize()

    def reset(self) -> None:
        """The engine's streams and the decoder's are idle: every descriptor has been read."""
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
    counts: list[list[Tensor | None]] = [[None, None] for _ in layers]
    if codec_name == "lossless":
        for layer in track(layers, f"counting {what}", show=progress):
            for t in (0, 1):
                counts[layer][t] = codec.exponent_counts(tables[t][layer], work, GROUP)
    sizes = [  # bytes per encoded row, w13 and w2: one size across layers
        max(
            codec.encoded_size(tables[t][0].shape[1:], codec_name, counts[layer][t], GROUP)
            for layer in layers
        )
        for t in (0, 1)
    ]
    check_host_memory(store.num_layers * store.num_experts * sum(sizes), codec_name)
    out: tuple[list[Tensor], list[Tensor]] = ([], [])
    for layer in track(layers, f"encoding {what}", show=progress):
        for t in (0, 1):
            host = torch.zeros(store.num_experts, sizes[t], dtype=torch.uint8, pin_memory=pin)
            for lo in range(0, store.num_experts, GROUP):
                part = tables[t][layer][lo : lo + GROUP].to(work, non_blocking=True)
                c = counts[layer][t]
                known = None if c is None else c[lo : lo + GROUP]
                rows = codec.encode(part, codec_name, counts=known, size=sizes[t], group=GROUP)
                host[lo : lo + GROUP].copy_(rows)  # straight into the pinned table
            out[t].append(host)
    return out


def check_host_memory(need: int, codec_name: str, available: int | None = None) -> None:
    """ValueError, before any encoded table is allocated, when host memory cannot hold the
    encoded experts beside the bf16 ones (`available`: bytes that can be had, the system's
    MemAvailable by default)."""
    if available is None:
        available = host_available()
    if need > available:
        raise ValueError(
            f"transfer {codec_name!r} keeps the experts encoded in host memory as well: "
            f"{need / 2**30:.1f} GiB needed, {available / 2**30:.1f} GiB available; "
            'free memory or use transfer = "plain"'
        )
