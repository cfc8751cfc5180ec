"""Copies on the offload engine's hot path: expert rows between weight tables, and whole
tensors between the device and pinned host memory (the routing, the slot maps).

A table pair is an expert's (or a slot's) w13 [S, 2I, H] and w2 [S, H, I] tables. On CUDA the
row copies of a launch go to the CUDA runtime in one cudaMemcpyBatchAsync call (CUDA 12.8 and
later), else one cudaMemcpyAsync per row and table (about 4 µs of host time each on an H200
machine); through torch's copy_ one costs 6.5-9 µs there (operator dispatch, a pinned-memory
check and an event for the host allocator), which the host path of a layer with many misses
pays dozens of times (docs/performance-history.md, runs 8 and 12). Where the runtime library
cannot be found, or off CUDA, torch's `_foreach_copy_` does it.
The sources are pinned expert tables that live as long as the engine, so no allocator event is
needed to keep them alive.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeAlias

import numpy as np
import torch
from torch import Tensor

Indices: TypeAlias = "np.ndarray | Sequence[int]"  # expert or slot indices: an int array or list
RuntimeFunction: TypeAlias = Callable[..., int]  # a CUDA runtime function: its error code

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


_batching = True


def use_batches(on: bool) -> None:
    """Launch a copy's rows in one batched call where the runtime has it (True, the default)
    or one call per row and table (False: for comparisons)."""
    global _batching
    _batching = on


def batching() -> bool:
    """Whether copies of several rows launch in one batched call (`use_batches`)."""
    return _batching


def launch(
    src: Rows, dst: Rows, rows: Indices, into: Indices, stream: torch.cuda.Stream | None
) -> None:
    """Copy src rows `rows` into dst rows `into` (both tables; int arrays or lists), on
    `stream` (None: at once)."""
    memcpy = _runtime_for(stream)
    if memcpy is None:
        _torch_copies(src, dst, list(rows), list(into), stream)
        return
    assert stream is not None  # _runtime_for: no runtime function without a stream
    handle = ctypes.c_void_p(stream.cuda_stream)
    batch = runtime_memcpy_batch() if _batching and len(rows) > 1 else None
    if batch is not None and stream.cuda_stream:  # not on the legacy default stream (0)
        # one call: about as long as two single copies' launches
        check(batch(src, dst, rows, into, handle), "cudaMemcpyBatchAsync")
        return
    kind = _DEVICE_TO_DEVICE if src.on_cuda else _HOST_TO_DEVICE
    for t in (0, 1):
        s_base, d_base, size = src.base[t], dst.base[t], src.size[t]
        for r, i in zip(rows, into, strict=True):
            check(memcpy(d_base + int(i) * size, s_base + int(r) * size, size, kind, handle))


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
    assert stream is not None  # _runtime_for: no runtime function without a stream
    kind = _DEVICE_TO_DEVICE if src.is_cuda and dst.is_cuda else _HOST_TO_DEVICE
    kind = _DEVICE_TO_HOST if src.is_cuda and not dst.is_cuda else kind
    handle = ctypes.c_void_p(stream.cuda_stream)
    check(memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes, kind, handle))


def _runtime_for(stream: torch.cuda.Stream | None) -> RuntimeFunction | None:
    """The runtime's cudaMemcpyAsync for a stream of the current device, else None."""
    if stream is None or stream.device_index != torch.cuda.current_device():
        return None
    return runtime_memcpy()


def check(err: int, call: str = "cudaMemcpyAsync") -> None:
    """Raise for a CUDA runtime error code, naming the call and the runtime's message."""
    if err:
        raise RuntimeError(f"{call} failed: {_error_string(err)}")


def _torch_copies(
    src: Rows, dst: Rows, rows: Sequence[int], into: Sequence[int], stream: torch.cuda.Stream | None
) -> None:
    (s13, s2), (d13, d2) = src.views, dst.views
    targets = [d13[i] for i in into] + [d2[i] for i in into]
    sources = [s13[r] for r in rows] + [s2[r] for r in rows]
    if stream is None:
        torch._foreach_copy_(targets, sources)
        return
    with torch.cuda.stream(stream):
        torch._foreach_copy_(targets, sources, non_blocking=True)


@cache
def runtime_memcpy() -> RuntimeFunction | None:
    """cudaMemcpyAsync of the CUDA runtime this torch loaded (ctypes), or None."""
    p = ctypes.c_void_p
    return runtime_function("cudaMemcpyAsync", p, p, ctypes.c_size_t, ctypes.c_int, p)


def runtime_function(name: str, *argtypes: type) -> RuntimeFunction | None:
    """The CUDA runtime's function `name` with these argument types, returning its error code
    (ctypes), or None without the runtime or the function."""
    address = runtime_entry(name)
    return None if address is None else ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(address)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (CUDA 12.8+)."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _MemLocation),
        ("dst_loc_hint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_SRC_ACCESS_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources read in stream order


class _BatchCopy:
    """cudaMemcpyBatchAsync over the rows of both tables: its CUDA 13 form, or CUDA 12.8-12.9's
    with a failure index."""

    def __init__(self, fn: Any, fail_index: bool) -> None:  # fn: a ctypes function of the runtime
        self.fn = fn
        self.failed_at = ctypes.c_size_t(0)
        self.fail = [ctypes.byref(self.failed_at)] if fail_index else []
        self.attributes = _MemcpyAttributes(src_access_order=_SRC_ACCESS_STREAM)
        self.attrs = ctypes.byref(self.attributes)  # one set for every copy
        self.attr_index = (ctypes.c_size_t * 1)(0)

    def __call__(
        self, src: Rows, dst: Rows, rows: Indices, into: Indices, handle: ctypes.c_void_p
    ) -> int:
        # plain ints and ctypes arrays: a handful of numpy calls would cost more on this path
        rows, into = [int(r) for r in rows], [int(i) for i in into]  # [N]
        (s13, s2), (d13, d2), (z13, z2) = src.base, dst.base, src.size
        pairs = ctypes.c_uint64 * (2 * len(rows))  # [2N]: the w13 rows, then the w2 rows
        srcs = pairs(*[s13 + r * z13 for r in rows], *[s2 + r * z2 for r in rows])
        dsts = pairs(*[d13 + i * z13 for i in into], *[d2 + i * z2 for i in into])
        sizes = pairs(*[z13] * len(rows), *[z2] * len(rows))
        return self.fn(
            dsts, srcs, sizes, len(sizes), self.attrs, self.attr_index, 1, *self.fail, handle
        )


@cache
def runtime_memcpy_batch() -> _BatchCopy | None:
    """cudaMemcpyBatchAsync of the CUDA runtime this torch loaded (12.8 or later), or None."""
    found = _runtime_library()
    if found is None or not hasattr(found[0], "cudaMemcpyBatchAsync"):
        return None
    version = ctypes.c_int(0)
    if found[0].cudaRuntimeGetVersion(ctypes.byref(version)) or version.value < 12080:
        return None
    fn = found[0].cudaMemcpyBatchAsync
    fail_index = version.value < 13000  # CUDA 13 dropped the failure-index argument
    p, n = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [p, p, p, n, p, p, n, *([p] if fail_index else []), p]
    fn.restype = ctypes.c_int
    return _BatchCopy(fn, fail_index)


def runtime_entry(name: str) -> int | None:
    """The address of the CUDA runtime's function `name` (for calls from C), or None."""
    found = _runtime_library()
    if found is None:
        return None
    for symbol in (name, f"{name}_v2"):  # CUDA 13 keeps some v2 functions under their v2 name
        fn = getattr(found[0], symbol, None)
        if fn is not None:
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


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
