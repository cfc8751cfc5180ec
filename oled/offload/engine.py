"""The offload engine: per-layer expert slot caches on the device, copies on their own stream,
CPU experts on the host while the device works, all computing exactly the function of the
all-resident model.

Per MoE layer call (the host decision path): routing ids and weights go to the host in one transfer
(the layer's one device-to-host sync; with copies ahead, the next layer's predicted routing goes
with them), the planner decides hits, copies, staged copies and CPU experts, copies are launched on
the copy stream, then the copies ahead into the next layer's cache (oled.offload.predict), the CPU
experts' activations start for pinned host memory, hits are computed by a grouped GEMM over the slot
table, the copied experts after their copy event; once all of that is queued, the host computes the
CPU experts, and their results are added into the same [T, K, H] pair buffer before the top-k sum,
so the summation order never depends on where a pair was computed.

The order of a layer call's runtime calls is oled.offload.launches', which the Python path below
runs on the engine's streams. Static layer calls (the GPU passes captured as CUDA graphs) launch
from C where they can (oled.offload.driver): the planner's C code plans and issues the same
runtime calls in the same order; the Python path is the reference and captures the graphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from oled.decoding.observers import (
    BatchIterationInfo,
    BlockInfo,
    DecodeObserver,
    IterationInfo,
)
from oled.model.experts import ExpertStore, combine, expert_pairs
from oled.model.graphs import Graphs
from oled.model.model import MoERequest
from oled.model.stages import annotating, stage
from oled.offload.copies import Indices, Rows, launch, transfer
from oled.offload.driver import LayerDriver, RawEvent, unavailable
from oled.offload.encoded import EncodedCopies
from oled.offload.host_experts import HostExperts
from oled.offload.launches import Launcher, launch_inputs, launch_passes, timed_copies
from oled.offload.metrics import INDEX, EngineMetrics
from oled.policies.base import StepContext
from oled.policies.planner import HIT, STAGED, LayerPlan, Planner, Resize
from oled.token_states import TOKEN_COMMITTED, TOKEN_FIXED, TOKEN_MASKED


class OffloadEngine(DecodeObserver):
    """An expert executor over fixed per-layer slot tables, driven by a Planner."""

    graph_safe = False  # it decides on the host between layers (ExpertExecutor)

    def __init__(
        self,
        *,
        store: ExpertStore,
        device: torch.device,
        planner: Planner,
        predict: Callable[[int, Tensor], Tensor | np.ndarray] | None = None,
        driver: bool | None = None,
        encoded: EncodedCopies | None = None,
    ) -> None:
        """`predict(layer, x)`: the next MoE layer's likely ids [T, K] from layer's router input
        x [T, H] (oled.offload.predict: NextLayerRouting, or RecordedRouting on the host);
        used when the planner prefetches. `driver`: launch static layer calls from C
        (oled.offload.driver) where possible (None), always (True: an error where it cannot),
        or never (False). `encoded`: this store's experts encoded for the link
        (oled.offload.encoded: misses cross it as encoded rows); None: plain bf16 rows."""
        self.store, self.device, self.planner = store, device, planner
        self.encoded = encoded
        # the bytes one expert's copy moves over the link
        self.expert_bytes = self.encoded.expert_bytes if self.encoded else store.expert_bytes
        self.predict = predict if planner.prefetch_limit else None
        self.cuda = device.type == "cuda"
        self.num_experts = store.num_experts
        dtype = store.w13[0].dtype
        self._slot_shape = (store.w13[0].shape[1:], store.w2[0].shape[1:])
        self.w13 = [self._table(c, 0, dtype) for c in planner.capacities]
        self.w2 = [self._table(c, 1, dtype) for c in planner.capacities]
        stage = planner.stage_rows  # STAGE_ROUNDS rounds of stage_capacity experts
        self.stage_w13, self.stage_w2 = self._table(stage, 0, dtype), self._table(stage, 1, dtype)
        # views and addresses per expert / slot, made once (the hot path copies by row): each
        # layer's expert sources on the host and its cache tables, and the stage's tables
        self.src_rows = (
            self.encoded.rows
            if self.encoded
            else [Rows.of(a, b) for a, b in zip(store.w13, store.w2, strict=True)]
        )
        self.cache_rows = [Rows.of(a, b) for a, b in zip(self.w13, self.w2, strict=True)]
        self.stage_rows = Rows.of(self.stage_w13, self.stage_w2)
        layers = store.num_layers
        rows = planner.slot_map_rows
        # the layers' expert -> slot maps [L, rows, E] int64 (pinned), and their device copy
        self.maps_host = torch.full((layers, rows, self.num_experts), -1, dtype=torch.long)
        if self.cuda:
            self.maps_host = self.maps_host.pin_memory()
        self.maps_dev = torch.full((layers, rows, self.num_experts), -1, device=device)
        planner.attach_maps(self.maps_host.numpy())  # plans write the maps straight into it
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        # where copies are complete: the copy stream, or the decoder's for encoded copies
        self.finish_stream = self.copy_stream
        if self.encoded is not None and self.cuda:
            self.finish_stream = self.encoded.stream
        self._stage_free: torch.cuda.Event | None = None
        self.metrics = EngineMetrics(layers)
        self._routing: list[tuple[np.ndarray, np.ndarray] | None] = [None] * layers
        # timed event pairs: (layer, start, end, whether a copy's or a stall's)
        self._events: list[tuple[int, torch.cuda.Event, torch.cuda.Event, bool]] = []
        self._timing = _EventPool()
        self._compute: torch.cuda.Stream | None = None  # the current layer call's stream
        self._routing_host: dict[tuple[int, int], tuple[Tensor, ...]] = {}  # pinned, per shape
        self._x_host: dict[tuple[int, ...], Tensor] = {}  # pinned CPU-expert activations
        self.host = HostExperts(device)  # the CPU experts' rows, and their way back
        self._static_io: dict[tuple[int, int], tuple[MoERequest, Tensor]] = {}
        self._predicted: dict[tuple[int, int], Tensor] = {}  # static predicted ids [T, K]
        self._ahead: list[torch.cuda.Event | None] = [None] * layers  # copies ahead, per layer
        # the GPU passes of static layer calls
        self.graphs = Graphs(on_drop=self._dropped) if self.cuda else None
        self.driver = self._driver(driver)
        self._prefill()

    def _driver(self, wanted: bool | None) -> LayerDriver | None:
        if wanted is False:
            return None
        why = unavailable(self)
        if why is not None:
            if wanted:
                raise RuntimeError(f"layer calls cannot launch from C: {why}")
            return None
        return LayerDriver(self)

    def _dropped(self, key: Hashable) -> None:
        if self.driver is not None and isinstance(key, tuple):  # keys: (layer, tokens, what)
            self.driver.forget(key)

    def _table(self, rows: int, which: int, dtype: torch.dtype) -> Tensor:
        return torch.empty((rows, *self._slot_shape[which]), dtype=dtype, device=self.device)

    def _prefill(self) -> None:
        """Copy whatever the planner placed at construction (static placements, warm caches)."""
        for layer, cache in enumerate(self.planner.caches):
            experts = cache.cached()
            if len(experts):
                slots = cache.slot_of[experts].astype(np.int64)
                self._launch_copies(layer, experts, slots, self.cache_rows[layer])
        if self.finish_stream is not None:  # on CUDA
            torch.cuda.current_stream(self.device).wait_stream(self.finish_stream)

    # -- the hot path ---------------------------------------------------------------------------

    def __call__(self, layer: int, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """x [T, H], ids [T, K], weights [T, K] fp32 -> routed expert sum [T, H] in x.dtype."""
        pairs = self.gather(self._layer(layer, MoERequest(layer, x, ids, weights), None))
        with stage("combine"):
            return combine(pairs, x.dtype)

    def static_request(self, layer: int, tokens: int) -> MoERequest:
        return self._static(layer, tokens)[0]

    def static_pairs(self, layer: int, tokens: int) -> Tensor:
        return self._static(layer, tokens)[1]

    def run_static(self, layer: int, tokens: int) -> None:
        """The layer from its static request into its static pairs; the GPU passes replay as
        CUDA graphs (oled.model.graphs), the host decision and any CPU or staged experts run
        eagerly between them."""
        request, pairs = self._static(layer, tokens)
        self.gather(self._layer(layer, request, pairs))

    def gather(self, pairs: Tensor) -> Tensor:
        """Every pair [T, K, H] fp32 of the layer, where other executors computed some (here:
        all are; oled.offload.shard sums the shares of several devices)."""
        return pairs

    def local_ids(self, ids: np.ndarray) -> np.ndarray:
        """Routing ids [T, K] as this engine's expert ids (here: the model's; a share's in
        oled.offload.shard)."""
        return ids

    def slots(self, slot_map: Tensor, ids: Tensor) -> Tensor:
        """[T, K] int64: the slot of each pair (routing `ids` [T, K] on the device) in a slot
        map [E] (-1: not in this table)."""
        return slot_map[ids]

    def _static(self, layer: int, tokens: int) -> tuple[MoERequest, Tensor]:
        """Static request buffers and pairs buffer [T, K, H] fp32 of (layer, tokens)."""
        key = (layer, tokens)
        if key not in self._static_io:
            h = self.store.w13[0].shape[2]
            k = self.planner.top_k
            dev, dtype = self.device, self.store.w13[0].dtype
            request = MoERequest(
                layer,
                torch.zeros(tokens, h, dtype=dtype, device=dev),
                torch.zeros(tokens, k, dtype=torch.long, device=dev),
                torch.zeros(tokens, k, dtype=torch.float32, device=dev),
            )
            pairs = torch.zeros(tokens, k, h, dtype=torch.float32, device=dev)
            self._static_io[key] = (request, pairs)
        return self._static_io[key]

    def _layer(self, layer: int, r: MoERequest, into: Tensor | None) -> Tensor:
        """The host decision and every expert pass of one layer: pairs [T, K, H] fp32, written
        into `into` (static, GPU passes as graphs) or a new tensor (eager)."""
        t0 = time.perf_counter()
        # the stream this layer computes on, looked up once (each lookup costs the hot path)
        self._compute = torch.cuda.current_stream(self.device) if self.cuda else None
        with stage("routing to host"):
            predicted = self._predict(r, into is not None)  # [T, K] of layer + 1, or None
            ids_np, w_np, next_np = self._routing_to_host(r, predicted)  # [T, K] each
            ids_np = self.local_ids(ids_np)
            next_np = None if next_np is None else self.local_ids(next_np)
        t1 = time.perf_counter()  # the layer's one sync is over
        self._routing[layer] = (ids_np, w_np)
        with stage("host decision"):
            plan = self._plan(layer, ids_np, w_np, into)
            if plan is None:  # planned and launched from C
                assert into is not None  # only static calls launch from C
                return self._driven(layer, r, ids_np, w_np, into, (t0, t1))
            t2 = time.perf_counter()
            call = _PythonLaunch(self, r, into, next_np, plan)
            ready, cpu_ready = launch_inputs(call, layer, plan)  # copies first: the longest path
            cpu_job = self._cpu_job(layer, call.x_host, ids_np, w_np, plan, cpu_ready)
        t4 = time.perf_counter()
        with stage("grouped GEMM"):
            if self.driver is not None and len(plan.stage_experts):
                assert self.copy_stream is not None  # a driver means CUDA
                self.driver.release_stage(self.copy_stream)  # the stage's users launched from C
            launch_passes(call, layer, plan, ready)  # into call.pairs [T, K, H] fp32
            self._stage_free = call.stage_free
        self._account(layer, plan, (t0, t1, t2, call.launched, t4, time.perf_counter()))
        pairs = call.pairs
        assert pairs is not None  # made or written by the hits' pass
        if cpu_job is not None:
            with stage("CPU experts"):
                self._cpu_pairs(cpu_job, pairs, t2)
        return pairs

    def _plan(
        self, layer: int, ids_np: np.ndarray, w_np: np.ndarray, into: Tensor | None
    ) -> LayerPlan | None:
        """The layer's plan; None when drive.c planned and launched the call (static calls,
        with a driver, while not profiling). The planner's `Load` is empty: the layer's passes
        wait for its copies, the next layer's routing sync waits for those passes, and CPU
        experts are computed within the call, so nothing is queued when a layer is planned."""
        if into is None or self.driver is None or annotating():
            return self.planner.plan(layer, ids_np, w_np)
        if self._stage_free is not None:  # C's launches wait for the stage's users
            self.driver.take_stage(self._stage_free)
            self._stage_free = None
        assert self._compute is not None  # a driver means CUDA
        if self.driver.run(layer, self._compute, ids_np, w_np):
            return None
        return self.driver.plan.unpack(layer)  # a pass not captured yet

    def _driven(
        self,
        layer: int,
        r: MoERequest,
        ids_np: np.ndarray,
        w_np: np.ndarray,
        into: Tensor,
        stamps: tuple[float, float],
    ) -> Tensor:
        """After a call launched from C: the host's part (CPU experts) and the host timings;
        the pairs in `into`."""
        t0, t1 = stamps
        driver = self.driver
        assert driver is not None  # it launched the call
        job, ready = None, driver.cpu_ready()
        if ready is not None:  # CPU experts: their activations are on the way
            plan = driver.plan.unpack(layer)
            job = self._cpu_job(layer, self.pinned_activations(r.x), ids_np, w_np, plan, ready)
        t5 = time.perf_counter()
        self.metrics.add(layer, sync_ms=1000 * (t1 - t0), host_ms=1000 * (t5 - t1))
        if job is not None:
            with stage("CPU experts"):
                self._cpu_pairs(job, into, t1)
        return into

    def _routing_to_host(
        self, r: MoERequest, predicted: Tensor | np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The layer's one sync: ids [T, K] int64, weights [T, K] fp32 and the next layer's
        predicted ids [T, K] int64 (None without; passed through when already on the host) as
        numpy arrays of their own. On CUDA they go straight into pinned buffers (one copy
        each, no kernels)."""
        ids, weights = r.ids.to(torch.long).contiguous(), r.weights.float().contiguous()
        if not isinstance(predicted, Tensor):
            ids_np, w_np = self._to_host([ids, weights])
            return ids_np, w_np, predicted
        ids_np, w_np, predicted_np = self._to_host([ids, weights, predicted])
        return ids_np, w_np, predicted_np

    def _to_host(self, sources: list[Tensor]) -> list[np.ndarray]:
        """Device tensors [T, K] as numpy arrays of their own, after one sync (through
        pinned buffers on CUDA, kept per shape)."""
        if not self.cuda:
            return [a.numpy().copy() for a in sources]
        key = (sources[0].shape[0], len(sources))
        if key not in self._routing_host:
            self._routing_host[key] = tuple(
                torch.empty(a.shape, dtype=a.dtype, pin_memory=True) for a in sources
            )
        buffers = self._routing_host[key]  # (tokens, 2): pinned_routing's
        compute = self._compute
        assert compute is not None  # _layer's stream on CUDA
        for host, dev in zip(buffers, sources, strict=True):
            transfer(host, dev, compute)
        compute.synchronize()
        return [host.numpy().copy() for host in buffers]

    def pinned_routing(self, tokens: int) -> tuple[Tensor, Tensor]:
        """The pinned buffers that a layer call's routing of `tokens` tokens comes back in: ids
        [T, K] int64, weights [T, K] fp32 (those of `_to_host`)."""
        key, k = (tokens, 2), self.planner.top_k
        if key not in self._routing_host:
            self._routing_host[key] = (
                torch.empty(tokens, k, dtype=torch.long, pin_memory=True),
                torch.empty(tokens, k, dtype=torch.float32, pin_memory=True),
            )
        ids, weights = self._routing_host[key]
        return ids, weights

    def _predict(self, r: MoERequest, static: bool) -> Tensor | np.ndarray | None:
        """The next layer's predicted ids [T, K] int64 on the device, queued before the sync;
        None when not prefetching, at the last layer, or when the planner has no use for it
        (oled.policies.planner.CopyAhead); on the host when the predictor has it there. In the
        static path the prediction replays as a CUDA graph from its second call (the first
        loads the router's kernels)."""
        predict, graphs = self.predict, self.graphs
        if predict is None or r.layer + 1 >= len(self.w13):
            return None
        if not self.planner.predicts(r.layer + 1):
            return None
        if getattr(predict, "on_host", False):  # already known (RecordedRouting)
            return predict(r.layer, r.x)
        if not static or graphs is None:
            return _on_device(predict(r.layer, r.x)).to(torch.long)
        key = (r.layer, r.x.shape[0])
        out = self._predicted.get(key)
        if out is None:
            out = self._predicted[key] = _on_device(predict(r.layer, r.x)).to(torch.long)
            return out
        graphs.run((*key, "predict"), lambda: out.copy_(_on_device(predict(r.layer, r.x))))
        return out

    def _pass(
        self,
        r: MoERequest,
        row: int,
        maps: Tensor,
        tables: tuple[Tensor, Tensor],
        into: Tensor | None,
        static: bool,
    ) -> Tensor:
        """The pairs of the experts that maps[row] places in `tables` (w13, w2): a new tensor
        when `into` is None, else written (row HIT) or added (later rows) into `into`; a CUDA
        graph replay when `static` (r and `into` are the layer's static buffers)."""

        def compute() -> Tensor:
            slots = self.slots(maps[row], r.ids)  # [T, K]
            pairs = expert_pairs(r.x, slots, r.weights, *tables)  # [T, K, H] fp32
            if into is None:
                return pairs
            return into.copy_(pairs) if row == HIT else into.add_(pairs)

        if not static:
            return compute()
        graphs = self.graphs
        assert graphs is not None and into is not None  # static: graphs and the static pairs
        key = (r.layer, r.x.shape[0], row)
        graphs.run(key, compute)
        if self.driver is not None:  # launches from C replay it from now on
            self.driver.learn(key, graphs.graphs[key])
        return into

    def _copy_ahead(
        self, rt: Launcher, layer: int, predicted: np.ndarray, after: LayerPlan
    ) -> None:
        """Copy into `layer`'s cache what its predicted routing [T, K] names and the cache lacks
        (Planner.prefetch, on the link's spare time behind `after`, the current layer's plan),
        after the current layer's copies (through that call's `rt`); `layer`'s passes wait for
        them."""
        self._copy_planned(rt, layer, *self.planner.prefetch(layer, predicted, after))

    def _copy_planned(
        self, rt: Launcher, layer: int, experts: np.ndarray, slots: np.ndarray
    ) -> None:
        """Copies ahead into `layer`'s cache slots, placed there by the planner; `layer`'s
        passes wait for them (the copy stream is in order: the last event covers them all)."""
        if not len(experts):
            return
        self._ahead[layer] = timed_copies(rt, layer, experts, slots, stage=False)
        n = len(experts)
        self.metrics.add(layer, copies=n, copy_bytes=n * self.expert_bytes, predicted=n)

    def _launch_copies(self, layer: int, experts: Indices, slots: Indices, rows: Rows) -> None:
        """One copy per tensor of each expert, host (pinned) -> slot rows of `rows` (a w13
        table and its w2 table), on the copy stream (oled.offload.copies)."""
        with stage("copies"):
            if self.encoded is not None:
                self.encoded.launch(layer, experts, slots, rows, self.copy_stream)
            else:
                launch(self.src_rows[layer], rows, experts, slots, self.copy_stream)

    def _cpu_job(
        self,
        layer: int,
        x_host: Tensor,
        ids_np: np.ndarray,
        w_np: np.ndarray,
        plan: LayerPlan,
        copied: torch.cuda.Event | RawEvent | None,
    ) -> CpuJob | None:
        """This layer's CPU experts over activations `x_host` [T, H]: on their way to pinned host
        memory (sent by launch_inputs or from C) until the `copied` event, or on the CPU the
        layer's x itself (`copied` None)."""
        if not len(plan.cpu_experts):
            return None
        on_cpu = np.zeros(self.num_experts + 1, bool)  # + 1: others' pairs (local_ids)
        on_cpu[plan.cpu_experts] = True
        slots = torch.from_numpy(np.where(on_cpu[ids_np], ids_np, -1))  # [T, K]
        return CpuJob(layer, x_host, slots, torch.from_numpy(w_np), copied, plan.cpu_tokens)

    def pinned_activations(self, x: Tensor) -> Tensor:
        """The pinned host buffer for CPU experts' activations of x's shape (one per shape: a
        layer's job is done before the next one starts)."""
        x_host = self._x_host.get(x.shape)
        if x_host is None:
            x_host = self._x_host[x.shape] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return x_host

    def _cpu_pairs(self, job: CpuJob, pairs: Tensor, t_plan: float) -> None:
        """Compute a job's experts on the host (the device's work of the layer is queued) and
        add their weighted outputs into `pairs` (zero at the CPU's pairs); the policy learns
        the time from the plan (`t_plan`) to the result."""
        t0 = time.perf_counter()
        if job.copied is not None:
            job.copied.synchronize()
        store = self.store
        index, rows = self.host.rows(  # [N] into the T*K pairs, [N, H] fp32
            job.x, job.slots, job.weights, store.w13[job.layer], store.w2[job.layer]
        )
        done = time.perf_counter()
        modeled = self.planner.observe_cpu(job.layer, job.tokens, 1000 * (done - t_plan))
        self.metrics.add(job.layer, cpu_ms=1000 * (done - t0), cpu_model_ms=modeled)
        self.host.add(pairs, index, rows)

    def _account(self, layer: int, plan: LayerPlan, stamps: tuple[float, ...]) -> None:
        """Count the layer's plan and time its host path from the clock's `stamps`: start,
        routing on the host, planned, copies launched, CPU job and maps sent, passes
        launched."""
        t0, t1, t2, t3, t4, t5 = stamps
        n_copy = len(plan.copy_experts) + len(plan.stage_experts)
        self.metrics.add(
            layer,
            hits=len(plan.hits),
            misses=len(plan.misses),
            copies=n_copy,
            copy_bytes=n_copy * self.expert_bytes,
            staged=len(plan.stage_experts),
            cpu_experts=len(plan.cpu_experts),
            cpu_tokens=int(plan.cpu_tokens.sum()),
            gpu_experts=len(plan.gpu_experts) + len(plan.stage_experts),
            predicted_hits=plan.predicted_hits,
            sync_ms=1000 * (t1 - t0),
            plan_ms=1000 * (t2 - t1),
            launch_ms=1000 * (t3 - t2),
            pass_ms=1000 * (t5 - t4),
            host_ms=1000 * (t5 - t1),
            calls=1,
        )

    # -- observer hooks -------------------------------------------------------------------------

    def on_generation_start(self, prompt_length: int) -> None:
        self.metrics.reset()
        if self.driver is not None:
            self.driver.take_counts()

    def on_iteration_start(self, block: int, iteration: int, step: int) -> None:
        self.planner.begin_step(step=step, block=block)

    def on_iteration(self, info: IterationInfo) -> None:
        """Hand the forward's routing and token states to the policies; collect timings."""
        self._observed(step_context(info))

    def on_batch_iteration(self, info: BatchIterationInfo) -> None:
        """As `on_iteration`, for a batched forward: every stream's rows in order."""
        self._observed(batch_context(info))

    def _observed(self, ctx: StepContext) -> None:
        for layer, routing in enumerate(self._routing):
            if routing is not None:
                self.planner.observe(layer, routing[0], routing[1], ctx)
        self._routing = [None] * len(self._routing)
        self._collect_events()
        if self.driver is not None:  # the counts of the calls launched from C
            counts = self.driver.take_counts()  # [L, FIELDS]
            counts[:, INDEX["copy_bytes"]] = counts[:, INDEX["copies"]] * self.expert_bytes
            self.metrics.add_layers(counts)
        self.metrics.end_iteration()

    def on_block_end(self, info: BlockInfo) -> None:
        for resize in self.planner.end_block() or []:
            self._resize(resize)

    def _resize(self, r: Resize) -> None:
        """Give a layer a slot table of the new capacity, moving the kept experts over (the
        layer's graphs, which hold the old table's address, are dropped)."""
        if self.graphs is not None:
            self.graphs.drop(keep=lambda key: not (isinstance(key, tuple) and key[0] == r.layer))
        for tables, which in ((self.w13, 0), (self.w2, 1)):
            old = tables[r.layer]
            new = self._table(r.capacity, which, old.dtype)
            if len(r.keep):
                keep = torch.from_numpy(r.keep.astype(np.int64)).to(self.device)
                new[keep[:, 1]] = old[keep[:, 0]]
            tables[r.layer] = new
        self.cache_rows[r.layer] = Rows.of(self.w13[r.layer], self.w2[r.layer])
        if self.driver is not None:
            self.driver.bind_tables(r.layer)

    def _collect_events(self) -> None:
        driver = self.driver
        driven = driver is not None and driver.pending
        if not self._events and not driven:  # any recorded were CPU jobs', waited for already
            self._timing.recycle()
            return
        copy, finish = self.copy_stream, self.finish_stream
        assert copy is not None and finish is not None  # events are recorded on CUDA only
        torch.cuda.current_stream(self.device).synchronize()
        copy.synchronize()
        if finish is not copy:  # the decoder's (encoded copies)
            finish.synchronize()
        if driver is not None and driven:
            driver.collect_events()
        for layer, start, end, copied in self._events:
            ms = start.elapsed_time(end)
            self.metrics.add(layer, **({"copy_ms": ms} if copied else {"stall_ms": ms}))
        self._events.clear()
        self._stage_free = None  # both streams are idle: the stage is free
        self._ahead = [None] * len(self._ahead)
        if self.encoded is not None:
            self.encoded.reset()
        self._timing.recycle()


class _PythonLaunch:
    """The engine's side of one layer call launched from Python (launches.Launcher): the
    engine's streams, timing events and tables; the request and its pairs [T, K, H] fp32."""

    __slots__ = (
        "engine",
        "r",
        "pairs",
        "static",
        "next_np",
        "plan",
        "compute",
        "copy",
        "finish",
        "stage_capacity",
        "ahead",
        "stage_free",
        "maps",
        "x_host",
        "launched",
    )

    def __init__(
        self,
        engine: OffloadEngine,
        r: MoERequest,
        into: Tensor | None,
        next_np: np.ndarray | None,
        plan: LayerPlan,
    ) -> None:
        """`into`: the static pairs (the passes replay as graphs) or None (eager: the hits'
        pass makes the pairs); `next_np`: the next layer's predicted ids [T, K] (copies ahead)
        or None; `plan`: the layer's plan (with the copies ahead it planned, if any)."""
        self.engine = e = engine
        self.r, self.pairs, self.next_np, self.plan = r, into, next_np, plan
        self.static = into is not None and e.graphs is not None
        self.compute, self.copy, self.finish = e._compute, e.copy_stream, e.finish_stream
        self.stage_capacity = e.planner.stage_capacity
        self.ahead, e._ahead[r.layer] = e._ahead[r.layer], None
        self.stage_free = e._stage_free  # the engine takes it back after the passes
        self.maps: Tensor | None = None  # the layer's slot maps on the device [rows, E]
        self.x_host = r.x  # [T, H]; pinned once the activations are sent on CUDA
        self.launched = 0.0  # the clock once the copies (and the copies ahead) are issued

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        return self.engine._timing.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def timed(
        self, layer: int, start: torch.cuda.Event | None, end: torch.cuda.Event | None, copy: bool
    ) -> None:
        if start is not None:  # read in on_iteration (without streams nothing is timed)
            assert end is not None  # recorded on streams as well
            self.engine._events.append((layer, start, end, copy))

    def copy_rows(self, layer: int, experts: np.ndarray, slots: np.ndarray, stage: bool) -> None:
        e = self.engine
        e._launch_copies(layer, experts, slots, e.stage_rows if stage else e.cache_rows[layer])

    def copies_issued(self, layer: int) -> None:
        if self.next_np is not None:
            self.engine._copy_ahead(self, layer + 1, self.next_np, self.plan)
        p = self.plan
        if len(p.ahead_experts):  # planned from the forward before (ahead_from "previous")
            self.engine._copy_planned(self, p.ahead_layer, p.ahead_experts, p.ahead_slots)
        self.launched = time.perf_counter()

    def activations(self) -> None:
        e, x = self.engine, self.r.x
        if e.cuda:  # else the CPU experts read x itself
            self.x_host = e.pinned_activations(x)
            self.x_host.copy_(x, non_blocking=True)

    def send_maps(self, layer: int, rows: int) -> None:
        """The rows the plan wrote into the pinned maps (rows HIT, COPIED, STAGED + round;
        oled.policies.planner.write_maps), in one copy."""
        self.maps = self.engine.maps_dev[layer]
        transfer(self.maps[:rows], self.engine.maps_host[layer, :rows], self.compute)

    def run_pass(self, row: int) -> None:
        e, layer = self.engine, self.r.layer
        tables = (e.stage_w13, e.stage_w2) if row >= STAGED else (e.w13[layer], e.w2[layer])
        assert self.maps is not None  # send_maps comes first
        self.pairs = e._pass(self.r, row, self.maps, tables, self.pairs, self.static)


@dataclass
class CpuJob:
    """A layer's CPU experts: activations x [T, H] (pinned host memory when serving a GPU; ready
    after the `copied` event), slots [T, K] (the expert id at the CPU's pairs, else -1), routing
    weights [T, K] fp32, tokens per CPU expert."""

    layer: int
    x: Tensor
    slots: Tensor
    weights: Tensor
    copied: torch.cuda.Event | RawEvent | None
    tokens: np.ndarray


class _EventPool:
    """Timing events, reused once an iteration's have been read (creating one per record
    costs the hot path)."""

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []
        self._used: list[torch.cuda.Event] = []

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event recorded on `stream` (None without a stream)."""
        if stream is None:
            return None
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self._used.append(event)
        return event

    def recycle(self) -> None:
        """Make every recorded event reusable (only after both streams are synchronised)."""
        self._free += self._used
        self._used.clear()


def _on_device(ids: Tensor | np.ndarray) -> Tensor:
    """A prediction of a predictor not `on_host`: a tensor on the device."""
    assert isinstance(ids, Tensor)
    return ids


def batch_context(info: BatchIterationInfo) -> StepContext:
    """The rows of a batched forward: each stream's `step_context` rows, side by side, with
    the pending prefix rows named."""
    parts = [step_context(row) for row in info.rows]
    prefix = np.concatenate(
        [np.arange(row.forward_tokens) < row.forward_tokens - len(row.masked) for row in info.rows]
    )
    return StepContext(
        block=info.block,
        iteration=0,
        step=info.step,
        token_state=np.concatenate([c.token_state for c in parts]),
        confidence=np.concatenate([c.confidence for c in parts]),
        prefix=prefix,
    )


def step_context(info: IterationInfo) -> StepContext:
    """Token states and confidences of every routed row of a forward (pending prefix rows first)."""
    block_len = info.masked.shape[0]
    prefix = info.forward_tokens - block_len
    state = np.full(info.forward_tokens, TOKEN_FIXED, np.int8)
    conf = np.ones(info.forward_tokens, np.float32)
    masked = info.masked.cpu().numpy()
    committed = info.committed.cpu().numpy()
    state[prefix:][masked & ~committed] = TOKEN_MASKED
    state[prefix:][committed] = TOKEN_COMMITTED
    conf[prefix:] = info.confidence.float().cpu().numpy()
    return StepContext(
        block=info.block,
        iteration=info.iteration,
        step=info.step,
        token_state=state,
        confidence=conf,
    )
