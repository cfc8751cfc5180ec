"""Copies on the offload engine's hot path: expert rows between weight tables, and whole
tensors between the device and pinned host memory (the routing, the slot maps).

A table pair is an expert's (or a slot's) w13 [S, 2I, H] and w2 [S, H, I] tables. On CUDA each
row copy goes to the CUDA runtime's cudaMemcpyAsync directly (about 4 µs of host time each on
an H200 machine); through torch's copy_ one costs 6.5-9 µs there (operator dispatch, a
pinned-memory check and an event for the host allocator), which the host path of a layer with
many misses pays dozens of times (docs/performance.md, run 8). Where the runtime library cannot
be found, or off CUDA, torch's `_foreach_copy_` does it.
The sources are pinned expert tables that live as long as the engine, so no allocator event is
needed to keep them alive.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice
_DEVICE_TO_HOST = 2  # cudaMemcpyDeviceToHost
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


@dataclass(frozen=True)
class Rows:
    """A w13 table and its w2 table, addressed by row: one view per row, base addresses and
    bytes per row (tables are contiguous)."""

    views: tuple[tuple[Tensor, ...], tuple[Tensor, ...]]
    base: tuple[int, int]
    size: tuple[int, int]
    on_cuda: bool

    @classmethod
    def of(cls, w13: Tensor, w2: Tensor) -> Rows:
        for t in (w13, w2):
            if not t.is_contiguous():
                raise ValueError("expert tables must be contiguous")
        size = (w13[0].nbytes if len(w13) else 0, w2[0].nbytes if len(w2) else 0)
        return cls(
            views=(w13.unbind(0), w2.unbind(0)),
            base=(w13.data_ptr(), w2.data_ptr()),
            size=size,
            on_cuda=w13.is_cuda,
        )


def launch(
    src: Rows, dst: Rows, rows: list[int], into: list[int], stream: torch.cuda.Stream | None
) -> None:
    """Copy src rows `rows` into dst rows `into` (both tables), on `stream` (None: at once)."""
    memcpy = _runtime_for(stream)
    if memcpy is None:
        _torch_copies(src, dst, rows, into, stream)
        return
    kind = _DEVICE_TO_DEVICE if src.on_cuda else _HOST_TO_DEVICE
    handle = ctypes.c_void_p(stream.cuda_stream)
    for t in (0, 1):
        s_base, d_base, size = src.base[t], dst.base[t], src.size[t]
        for r, i in zip(rows, into, strict=True):
            _check(memcpy(d_base + i * size, s_base + r * size, size, kind, handle))


def transfer(dst: Tensor, src: Tensor, stream: torch.cuda.Stream | None) -> None:
    """dst <- src, both contiguous, one on the device and one pinned on the host (or both on
    the device), on `stream`; without a stream (no CUDA) a plain copy."""
    memcpy = _runtime_for(stream)
    if memcpy is None:
        if stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return
    kind = _DEVICE_TO_DEVICE if src.is_cuda and dst.is_cuda else _HOST_TO_DEVICE
    kind = _DEVICE_TO_HOST if src.is_cuda and not dst.is_cuda else kind
    handle = ctypes.c_void_p(stream.cuda_stream)
    _check(memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes, kind, handle))


def _runtime_for(stream: torch.cuda.Stream | None):
    """The runtime's cudaMemcpyAsync for a stream of the current device, else None."""
    if stream is None or stream.device_index != torch.cuda.current_device():
        return None
    return runtime_memcpy()


def _check(err: int) -> None:
    if err:
        raise RuntimeError(f"cudaMemcpyAsync failed: {_error_string(err)}")


def _torch_copies(src: Rows, dst: Rows, rows, into, stream) -> None:
    (s13, s2), (d13, d2) = src.views, dst.views
    targets = [d13[i] for i in into] + [d2[i] for i in into]
    sources = [s13[r] for r in rows] + [s2[r] for r in rows]
    if stream is None:
        torch._foreach_copy_(targets, sources)
        return
    with torch.cuda.stream(stream):
        torch._foreach_copy_(targets, sources, non_blocking=True)


@cache
def runtime_memcpy():
    """cudaMemcpyAsync of the CUDA runtime this torch loaded (ctypes), or None."""
    found = _runtime_library()
    if found is None:
        return None
    fn = found[0].cudaMemcpyAsync
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
    ]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn


def runtime_library() -> str | None:
    """Path of the CUDA runtime library the copies call, or None (torch's copies then)."""
    found = _runtime_library()
    return None if found is None else found[1]


@cache
def _runtime_library() -> tuple[ctypes.CDLL, str] | None:
    """The libcudart mapped into this process (torch loads it with CUDA) and its path."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cudaMemcpyAsync  # noqa: B018 - the symbol must exist
            return lib, path
        except (OSError, AttributeError):
            continue
    return None


def _error_string(err: int) -> str:
    found = _runtime_library()
    if found is None:
        return f"error {err}"
    lib = found[0]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    return f"{lib.cudaGetErrorString(err).decode()} ({err})"
