"""CUDA graphs for the decoder's forwards: the same kernels, without the launch overhead.

A cached forward has static shapes once its token count, start position and logits offset are
fixed, so it is captured once per such key and replayed from then on. Its inputs are copied into
a static token buffer, and the KV cache is one persistent buffer that every generation reuses,
so a graph's addresses stay valid. The graphs run exactly the eager kernels in the same order,
so a graphed forward gives the eager forward's logits bit for bit.

Two shapes of capture, chosen by the expert executor:

- whole: an executor that needs no host decision (`ResidentExperts`, `graph_safe = True`) is
  captured inside one graph per key;
- pieces: an executor that decides on the host per MoE layer (the offload engine) gets one graph
  per stretch between two routings (attention, routing, the previous layer's combine, ...). The
  engine runs its decision eagerly between the pieces and replays its own graphs for the
  expert computation (`PiecewiseExecutor`).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar, cast

import torch
from torch import Tensor
from torch.types import Device

from oled.model.experts import combine
from oled.model.model import (
    BatchRows,
    ExpertExecutor,
    ForwardSteps,
    KVCache,
    LLaDA2Model,
    MoERequest,
    drive,
)

T = TypeVar("T")
# A forward's steps over its static tokens and, for a batched forward, its static rows.
MakeSteps = Callable[[Tensor, BatchRows | None], ForwardSteps]


class PiecewiseExecutor(Protocol):
    """An executor that decides on the host per layer, between replayed graph pieces."""

    def static_request(self, layer: int, tokens: int) -> MoERequest:
        """Static buffers that the graph piece ending at this MoE layer fills."""
        ...

    def static_pairs(self, layer: int, tokens: int) -> Tensor:
        """The static [T, K, H] fp32 buffer that `run_static` leaves the layer's pairs in."""
        ...

    def run_static(self, layer: int, tokens: int) -> None:
        """Decide and compute the layer from its static request into its static pairs, in the
        current stream's order."""
        ...


class Graphs:
    """CUDA graphs by key, captured on first use into one shared memory pool."""

    def __init__(
        self, *, max_graphs: int = 4096, on_drop: Callable[[Hashable], None] | None = None
    ) -> None:
        """`on_drop(key)` is told of every graph dropped (evicted or by `drop`)."""
        self.on_drop = on_drop
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.graphs: OrderedDict[Hashable, torch.cuda.CUDAGraph] = OrderedDict()
        self.max_graphs = max_graphs
        self.captures = 0

    def run(self, key: Hashable, fn: Callable[[], object]) -> None:
        """Replay the graph of `key`, capturing `fn` first if there is none."""
        graph = self.graphs.get(key)
        if graph is None:
            graph, _ = self.capture(fn)
            self.put(key, graph)
        graph.replay()

    def capture(self, fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
        """Capture `fn` (not run) on the capture stream; the graph and fn's result."""
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)
        self.captures += 1
        return graph, out

    def put(self, key: Hashable, graph: torch.cuda.CUDAGraph) -> None:
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self._forget(next(iter(self.graphs)))

    def drop(self, keep: Callable[[Hashable], bool] = lambda key: False) -> None:
        """Forget every graph whose key `keep` rejects (all of them by default)."""
        for key in [k for k in self.graphs if not keep(k)]:
            self._forget(key)
        if not self.graphs:  # torch frees a pool with its last graph: never capture into it again
            self.pool = torch.cuda.graph_pool_handle()

    def _forget(self, key: Hashable) -> None:
        if self.on_drop is not None:
            self.on_drop(key)
        del self.graphs[key]


@dataclass
class _Captured:
    tokens: Tensor  # [B, T] static input
    rows: BatchRows | None  # static rows of a batched forward
    logits: Tensor  # [B, T - logits_from, V] static output
    pieces: list[torch.cuda.CUDAGraph]  # one graph (whole) or one per stretch (pieces)
    layers: list[int]  # MoE layer answered after pieces[i] (pieces mode)
    source: BatchRows | None = None  # the rows that `rows` holds a copy of


class EagerForward:
    """The plain forward: a fresh KV cache per generation, the model's own executor.

    `exact_batches`: a batched forward attends per sequence over exactly its own keys
    (BatchRows.spans), as the torch path needs for a batch to round as single requests do;
    False lays the rows out as the graphed forward does (padded query blocks), so a profile
    sees the graphs' kernels.
    """

    def __init__(self, model: LLaDA2Model, *, exact_batches: bool = True) -> None:
        self.model = model
        self.exact_batches = exact_batches

    def new_cache(self, total: int, device: Device) -> KVCache:
        return self._kv(1, total, device)

    def new_batch_cache(self, slots: int, total: int, device: Device) -> KVCache:
        """A cache of `slots` sequences of up to `total` positions (batched decoding)."""
        return self._kv(slots, total, device)

    def _kv(self, slots: int, total: int, device: Device) -> KVCache:
        dtype = self.model.model.word_embeddings.weight.dtype
        return KVCache(self.model.config, max_len=total, batch=slots, dtype=dtype, device=device)

    def batch(
        self, tokens: Tensor, *, rows: BatchRows, cache: KVCache, block_length: int
    ) -> Tensor:
        """A batched forward (oled.decoding.batch): logits [1, R, V] of `rows.logit_rows`."""
        return self.model(tokens, cache=cache, block_length=block_length, rows=rows)

    def __call__(
        self,
        tokens: Tensor,
        *,
        start: int,
        cache: KVCache | None,
        block_length: int,
        logits_from: int,
    ) -> Tensor:
        return self.model(
            tokens, start=start, cache=cache, block_length=block_length, logits_from=logits_from
        )


class GraphedForward(EagerForward):
    """Cached forwards replayed as CUDA graphs over one persistent KV cache.

    The first forward of the runtime runs eagerly (it initialises libraries and kernels); after
    that each new (tokens, start, block, logits offset, routing override) key is captured once
    (a routing replay's graphs read its override's buffers: oled.model.model.RoutingOverride).
    A prompt's prefill (more than two blocks of tokens), forwards without a cache, and forwards
    while routing hooks are attached (trace recording) run eagerly. A key whose capture fails
    runs eagerly once and is captured again next time (a Triton kernel's first launch loads its code, which a capture
    forbids; the eager run loads it); after a second failure everything runs eagerly.
    """

    def __init__(
        self, model: LLaDA2Model, executor: ExpertExecutor, *, max_keys: int = 256
    ) -> None:
        super().__init__(model, exact_batches=False)
        self.whole = executor.graph_safe
        # asked for pieces only when not graph-safe, which then makes it a PiecewiseExecutor
        self.executor = cast(PiecewiseExecutor, executor)
        self.graphs = Graphs()
        self.captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self.max_keys = max_keys
        self.cache: KVCache | None = None
        self.batch_cache: KVCache | None = None
        self.warm = False
        self.failed: str | None = None
        self.retried: set[tuple] = set()
        self.replays = 0

    def new_cache(self, total: int, device: Device) -> KVCache:
        """The persistent cache, grown (and every graph dropped) when `total` does not fit."""
        if self.cache is None or self.cache.max_len < total:
            size = max(total, 2 * self.cache.max_len) if self.cache else total
            self.captured.clear()
            self.graphs = Graphs()  # the old pool went with its last graph
            self.cache = None  # free the old buffers first
            self.cache = self._kv(1, size, device)
        self.cache.length = 0
        return self.cache

    def new_batch_cache(self, slots: int, total: int, device: Device) -> KVCache:
        """A fresh batch cache (the graphs of the previous one's forwards are dropped)."""
        self.batch_cache = None
        for key in [k for k in self.captured if k[0] == "batch"]:
            del self.captured[key]
        if not self.captured:  # torch freed the pool with its last graph: a new one
            self.graphs = Graphs()
        self.batch_cache = self._kv(slots, total, device)
        return self.batch_cache

    def __call__(
        self,
        tokens: Tensor,
        *,
        start: int,
        cache: KVCache | None,
        block_length: int,
        logits_from: int,
    ) -> Tensor:
        eager = (
            cache is None
            or cache is not self.cache
            or tokens.shape[1] > 2 * block_length  # a prompt's prefill: once, not worth a graph
        )
        key = (tuple(tokens.shape), start, block_length, logits_from, self.model.routing_key)

        def steps(static: Tensor, _rows: BatchRows | None) -> ForwardSteps:
            return self.model.steps(
                static,
                start=start,
                cache=self.cache,
                block_length=block_length,
                logits_from=logits_from,
            )

        logits = None if eager else self._try_graphed(key, tokens, None, steps)
        self.warm = self.warm or cache is not None
        if logits is not None:
            return logits
        return super().__call__(
            tokens, start=start, cache=cache, block_length=block_length, logits_from=logits_from
        )

    def batch(
        self, tokens: Tensor, *, rows: BatchRows, cache: KVCache, block_length: int
    ) -> Tensor:
        """A batched forward, replayed as graphs keyed by its shapes (rows.shape): the
        positions, slots and lengths are inputs. Forwards with a prompt's prefill (a stream of
        more than two blocks of rows) run eagerly."""
        eager = cache is not self.batch_cache or rows.queries.shape[1] > 2 * block_length
        key = ("batch", rows.shape, block_length, self.model.routing_key)

        def steps(static: Tensor, static_rows: BatchRows | None) -> ForwardSteps:
            return self.model.steps(
                static, cache=cache, block_length=block_length, rows=static_rows
            )

        logits = None if eager else self._try_graphed(key, tokens, rows, steps)
        self.warm = True
        if logits is not None:
            return logits
        return super().batch(tokens, rows=rows, cache=cache, block_length=block_length)

    def _try_graphed(
        self, key: tuple, tokens: Tensor, rows: BatchRows | None, steps: MakeSteps
    ) -> Tensor | None:
        """The key's graphs replayed (captured first if new), or None where the forward runs
        eagerly: graphs failed, routing hooks attached (trace recording), the first forward,
        or a capture that failed (retried once, then eager for good)."""
        if self.failed or self._hooked() or not self.warm:
            return None
        try:
            return self._graphed(key, tokens, rows, steps)
        except RuntimeError as err:
            if key in self.retried:  # an op this torch cannot capture: eager from now on
                self.failed = f"CUDA graph capture failed, running eagerly: {err}"
                warnings.warn(self.failed, stacklevel=2)
            self.retried.add(key)
            return None

    def _graphed(
        self, key: tuple, tokens: Tensor, rows: BatchRows | None, steps: MakeSteps
    ) -> Tensor:
        """Replay the key's graphs (captured first if new); the logits [B, T', V]."""
        entry = self.captured.get(key)
        if entry is None:
            entry = self._capture(tokens, rows, steps)
            self.captured[key] = entry
            while len(self.captured) > self.max_keys:
                self.captured.popitem(last=False)
        else:
            self.captured.move_to_end(key)
            entry.tokens.copy_(tokens)
            # both or neither: the same key; rows are never changed once built, so the rows
            # copied last need no copy again (a batch keeps its rows while it does not change)
            if rows is not None and entry.rows is not None and rows is not entry.source:
                entry.rows.copy_(rows)
                entry.source = rows
        self._replay(entry)
        return entry.logits

    def _hooked(self) -> bool:
        return any(block.hooks for block in self.model.moe_blocks)

    def _replay(self, entry: _Captured) -> None:
        self.replays += 1
        entry.pieces[0].replay()
        for graph, layer in zip(entry.pieces[1:], entry.layers, strict=True):
            self.executor.run_static(layer, entry.tokens.numel())
            graph.replay()

    def _capture(self, tokens: Tensor, rows: BatchRows | None, make_steps: MakeSteps) -> _Captured:
        """Capture the forward `make_steps(static tokens, static rows)` as graphs."""
        static = tokens.clone()
        static_rows = None if rows is None else BatchRows.clone(rows)
        steps = make_steps(static, static_rows)
        if self.whole:
            graph, out = self.graphs.capture(lambda: drive(steps, self.model.execute))
            return _Captured(static, static_rows, out, [graph], [], rows)
        dtype = self.model.model.word_embeddings.weight.dtype
        t = static.numel()
        pieces: list[torch.cuda.CUDAGraph] = []
        layers: list[int] = []
        logits: Tensor | None = None
        while logits is None:
            previous = layers[-1] if layers else None
            graph, (request, logits) = self.graphs.capture(
                partial(self._piece, steps, previous, dtype, t)
            )
            pieces.append(graph)
            if request is not None:
                layers.append(request.layer)
        return _Captured(static, static_rows, logits, pieces, layers, rows)

    def _piece(
        self, steps: ForwardSteps, previous: int | None, dtype: torch.dtype, t: int
    ) -> tuple[MoERequest | None, Tensor | None]:
        """One stretch of the forward: from the previous MoE layer's pairs (static) to the
        next routing, whose results go into the executor's static request; (request, None), or
        (None, logits) for the last stretch."""
        try:
            if previous is None:
                request = next(steps)
            else:
                pairs = self.executor.static_pairs(previous, t)  # [T, K, H]
                request = steps.send(combine(pairs, dtype))
        except StopIteration as done:
            return None, done.value
        static = self.executor.static_request(request.layer, t)
        static.x.copy_(request.x)
        static.ids.copy_(request.ids)
        static.weights.copy_(request.weights)
        return request, None
