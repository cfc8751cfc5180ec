"""The offload engine's static layer calls launched from C (drive.c, built here into one library
with the planner's plan.c): after the routing sync one call plans the layer and issues every CUDA
runtime call of it (copies, timing events, waits, slot maps, the passes' graph launches), in
the order of the engine's Python path (oled.offload.launches), so the host path of a layer
costs one ctypes call instead of dozens of Python-level launches (docs/performance-history.md,
run 13).

Used for a layer call when the planner runs compiled, no copies ahead are made, the call's
passes have been captured as CUDA graphs (the engine's Python path captures them on their
first calls) and the stage profiler is off; otherwise the call declines after planning and the
engine launches in Python, with the same plan. The tokens are the same either way: the same
kernels run on the same data in the same stream order.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from oled.clib import Library, NativeUnavailable
from oled.offload.copies import (
    RuntimeFunction,
    batching,
    check,
    runtime_entry,
    runtime_function,
    runtime_memcpy_batch,
)
from oled.offload.drive_state import CALL, COUNTS, DRIVE, DRIVE_PART
from oled.policies import native

if TYPE_CHECKING:
    from oled.offload.engine import OffloadEngine
    from oled.policies.native import CompiledPlan

_p = ctypes.c_void_p
_i = ctypes.c_int64

EVENTS = 4096  # timing events in the pool: an iteration uses 4-10 a layer
RUNTIME = (
    "cudaMemcpyAsync",
    "cudaEventRecord",
    "cudaStreamWaitEvent",
    "cudaGraphLaunch",
    "cudaEventCreate",
    "cudaEventElapsedTime",
    "cudaEventSynchronize",
    "cudaEventDestroy",
)
Drive, Call = DRIVE.ctype, CALL.ctype  # the ctypes mirrors


def _declare(lib: ctypes.CDLL) -> None:
    """drive.c's entry points' signatures, and plan.c's (built in)."""
    native.declare(lib)
    lib.oled_layer.restype = _i
    lib.oled_layer.argtypes = [_p, _p, _i, _i, _i, _i, ctypes.c_double, _i]
    lib.oled_collect.restype = _i
    lib.oled_collect.argtypes = [_p]


LIBRARY = Library(
    "drive",
    (Path(__file__).parent / "drive.c", native.SOURCE),
    (native.PLAN, DRIVE_PART),
    includes=(native.INCLUDE,),
    declare=_declare,
)


def library() -> ctypes.CDLL:
    """drive.c built with plan.c (once per source and machine), loaded and both contracts
    checked; NativeUnavailable when it cannot be had, a ContractError when a contract does
    not hold."""
    return LIBRARY.load()


def unsupported() -> str | None:
    """Why layer calls cannot launch from C on this machine (None when they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        library()
    except NativeUnavailable as e:
        return str(e)
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return f"torch {torch.__version__} has no CUDAGraph.raw_cuda_graph_exec"
    missing = [name for name in RUNTIME if runtime_entry(name) is None]
    if missing:
        return f"the CUDA runtime lacks {', '.join(missing)}"
    return None


def unavailable(engine: OffloadEngine) -> str | None:
    """Why the engine's static layer calls cannot launch from C (None when they can)."""
    if not engine.cuda:
        return "not on CUDA"
    if engine.planner.native is None:
        return "the planner does not run compiled"
    if engine.planner.prefetch_limit:
        return "copies ahead are launched from Python"
    if engine.device.index not in (None, torch.cuda.current_device()):
        return "the engine's device is not the current device"
    return unsupported()


class LayerDriver:
    """drive.c over one engine's tables, streams and slot maps."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = e = engine
        self.lib = library()
        self.plan: CompiledPlan = _compiled(e)
        L, E = e.store.num_layers, e.num_experts
        self.counts = np.zeros((L, len(COUNTS.entries)), np.float64)  # [L, metrics' FIELDS]
        self.events = (ctypes.c_void_p * EVENTS)()
        self.log = np.zeros((2 * EVENTS, 4), np.int64)
        self.batch_args = [(ctypes.c_void_p * (2 * E + 2))() for _ in range(2)]
        self.batch_sizes = (ctypes.c_size_t * (2 * E + 2))()
        self._tables = [np.zeros(L, np.int64) for _ in range(4)]  # src13, src2, cache13, cache2
        d = self.drive = self._drive()
        d.src13, d.src2, d.cache13, d.cache2 = (t.ctypes.data for t in self._tables)
        for layer in range(L):
            self.bind_tables(layer)
        self.use_batches(batching())
        self.ref = ctypes.byref(d)
        self.calls: dict[tuple[int, int], tuple[Any, np.ndarray, object]] = {}
        self._sync = _runtime("cudaEventSynchronize", _p)
        self._wait = _runtime("cudaStreamWaitEvent", _p, _p, ctypes.c_uint)
        # the pool's events go with the driver, or at exit while the runtime is still loaded
        weakref.finalize(self, _destroy, self.events, _runtime("cudaEventDestroy", _p))
        self._stream = 0
        self._layer = self.lib.oled_layer
        self.launched = 0  # layer calls launched from C

    def _drive(self) -> Any:
        """The Drive over the runtime's entry points, the engine's streams, stage and slot maps,
        the plan's buffers and the driver's own."""
        e, plan = self.engine, self.plan
        assert e.copy_stream is not None  # `unavailable`: the driver is made on CUDA only
        return Drive(
            memcpy_async=runtime_entry("cudaMemcpyAsync"),
            record=runtime_entry("cudaEventRecord"),
            wait=runtime_entry("cudaStreamWaitEvent"),
            launch=runtime_entry("cudaGraphLaunch"),
            create=runtime_entry("cudaEventCreate"),
            elapsed=runtime_entry("cudaEventElapsedTime"),
            copy=e.copy_stream.cuda_stream,
            stage13=e.stage_rows.base[0],
            stage2=e.stage_rows.base[1],
            size13=e.src_rows[0].size[0],
            size2=e.src_rows[0].size[1],
            stage_capacity=e.planner.stage_capacity,
            bind=ctypes.addressof(plan.bind),
            out=plan.out.ctypes.data,
            maps_host=e.maps_host.data_ptr(),
            maps_dev=e.maps_dev.data_ptr(),
            map_rows=e.maps_host.shape[1],
            num_experts=e.num_experts,
            events=ctypes.addressof(self.events),
            n_events=EVENTS,
            log=self.log.ctypes.data,
            log_cap=len(self.log),
            counts=self.counts.ctypes.data,
            srcs=ctypes.addressof(self.batch_args[0]),
            dsts=ctypes.addressof(self.batch_args[1]),
            sizes=ctypes.addressof(self.batch_sizes),
            plain13=e.cache_rows[0].size[0],
            plain2=e.cache_rows[0].size[1],
            **(e.encoded.drive_fields() if e.encoded is not None else {}),
        )

    def use_batches(self, on: bool) -> None:
        """Launch a copy of two or more experts in one cudaMemcpyBatchAsync call where the
        runtime has it (True), or one cudaMemcpyAsync per expert and table (False)."""
        batch = runtime_memcpy_batch() if on else None
        d = self.drive
        if batch is None:
            d.memcpy_batch, d.batch_min = None, 0
            return
        d.memcpy_batch = ctypes.cast(batch.fn, ctypes.c_void_p).value
        d.batch_attrs = ctypes.addressof(batch.attributes)  # one set for every copy
        d.batch_abi, d.batch_min = (12 if batch.fail else 13), 2

    def bind_tables(self, layer: int) -> None:
        """Point at the layer's expert sources and cache tables (after construction and
        resizes)."""
        e = self.engine
        src, cache = e.src_rows[layer].base, e.cache_rows[layer].base
        for table, address in zip(self._tables, (*src, *cache), strict=True):
            table[layer] = address

    def run(
        self, layer: int, stream: torch.cuda.Stream, ids: np.ndarray, weights: np.ndarray
    ) -> int:
        """Plan the layer's static call (routing ids, weights [T, K], also in the engine's
        pinned buffers, which drive.c reads) and launch it on `stream`: 1 when launched, 0
        when only planned (the engine launches; the plan is in `self.plan.unpack`)."""
        call = self.calls.get((layer, len(ids)))
        if call is None:
            call = self._call(layer, len(ids))
        if stream.cuda_stream != self._stream:
            self.drive.compute = self._stream = stream.cuda_stream
        p = self.plan.planner
        rc = self._layer(
            self.ref, call[2], layer, p.step, p.clock, p.block, self.plan.slowdown(), p.gpu_only
        )
        if rc == -3:  # the routing does not fit: planned alone (reserved with the call, so rare)
            self.plan.run(layer, ids, weights, None)
            return 0
        if rc == -2:
            check(self.drive.error, f"layer {layer}: a CUDA runtime call")
        self.plan.finish(layer, rc, ids)
        self.launched += rc
        return rc

    def _call(self, layer: int, tokens: int) -> tuple[Any, np.ndarray, object]:
        """The key's Call: no graphs yet, the static activations and their pinned copy."""
        e = self.engine
        x = e.static_request(layer, tokens).x  # [T, H]
        x_host = e.pinned_activations(x)
        ids, weights = e.pinned_routing(tokens)  # [T, K] each
        self.plan.reserve(ids.numel())
        execs = np.zeros(e.planner.slot_map_rows, np.int64)
        call = Call(
            execs=execs.ctypes.data,
            n_execs=len(execs),
            ids_host=ids.data_ptr(),
            w_host=weights.data_ptr(),
            pairs=ids.numel(),
            x_dev=x.data_ptr(),
            x_host=x_host.data_ptr(),
            x_bytes=x.nbytes,
        )
        entry = self.calls[(layer, tokens)] = (call, execs, ctypes.byref(call))
        return entry

    def learn(self, key: tuple[int, int, int], graph: torch.cuda.CUDAGraph) -> None:
        """A pass graph of key (layer, tokens, row) captured by the engine's Python path."""
        layer, tokens, row = key
        entry = self.calls.get((layer, tokens)) or self._call(layer, tokens)
        if row < len(entry[1]):
            entry[1][row] = graph.raw_cuda_graph_exec()

    def forget(self, key: tuple[int, int, int | str]) -> None:
        """The graph of key (layer, tokens, row) is gone."""
        entry = self.calls.get(key[:2])
        if entry is not None and isinstance(key[2], int) and key[2] < len(entry[1]):
            entry[1][key[2]] = 0

    def cpu_ready(self) -> RawEvent | None:
        """The event after the last launched call's CPU-expert activations (None: the call
        has no CPU experts)."""
        handle = self.drive.cpu_ready
        return RawEvent(handle, self._sync) if handle else None

    def take_stage(self, stage_free: torch.cuda.Event | None) -> None:
        """Launches from C wait for the stage's users that the Python path recorded."""
        if stage_free is not None:
            self.drive.stage_free = stage_free.cuda_event

    def release_stage(self, copy_stream: torch.cuda.Stream) -> None:
        """The copy stream waits for the stage's users that launches from C recorded (before
        the Python path copies into the stage)."""
        if self.drive.stage_free:
            check(
                self._wait(copy_stream.cuda_stream, self.drive.stage_free, 0), "cudaStreamWaitEvent"
            )
            self.drive.stage_free = None

    @property
    def pending(self) -> bool:
        """Whether events were recorded or the stage's users handed over since the last
        `collect_events`."""
        return bool(self.drive.used or self.drive.stage_free)

    def collect_events(self) -> None:
        """Once both streams are idle: the logged copy and stall times into the counts; the
        event pool and the stage free again."""
        if self.lib.oled_collect(self.ref) == -2:
            check(self.drive.error, "cudaEventElapsedTime")

    def take_counts(self) -> np.ndarray:
        """The launched calls' counts and times since the last take [L, metrics' FIELDS]."""
        counts = self.counts.copy()
        self.counts[:] = 0
        return counts


class RawEvent:
    """A runtime event recorded from C, waited for by the host."""

    def __init__(self, handle: int, sync: RuntimeFunction) -> None:
        self.handle, self._sync = handle, sync

    def synchronize(self) -> None:
        check(self._sync(self.handle), "cudaEventSynchronize")


def _compiled(engine: OffloadEngine) -> CompiledPlan:
    """The engine's compiled plan, which drive.c plans with."""
    if engine.planner.native is None:
        raise RuntimeError("layer calls launch from C only for a planner that runs compiled")
    return engine.planner.native


def _runtime(name: str, *argtypes: type) -> RuntimeFunction:
    """The CUDA runtime's function `name` (`unsupported` has found every one the driver
    calls)."""
    fn = runtime_function(name, *argtypes)
    if fn is None:
        raise RuntimeError(f"the CUDA runtime lacks {name}")
    return fn


def _destroy(events: Any, destroy: RuntimeFunction) -> None:  # events: a ctypes array
    for event in events:
        if event:
            destroy(event)  # its answer ignored: nothing to do about a failure here
