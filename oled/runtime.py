"""A loaded model ready to decode: checkpoint + expert executor + decoder, on one device.

`build(spec)` is the one way from a spec to a runtime. A spec is a `RuntimeSpec`: every command
turns its input into a recipe (oled.recipe.command_recipe: flags over the recipe over the
schema's defaults), whose spec is `RuntimeSpec.of(recipe)`; `build_runtime(...)` and
`load_runtime(...)` make one from keyword arguments, for library use, with the schema's
defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oled import kernels as fused_kernels
from oled.decoding import BlockDecoder, BlockInfo, DecodeConfig, DecodeObserver, GenerationStats
from oled.decoding.batch import BatchDecoder
from oled.decoding.follow import Trajectory
from oled.model.checkpoint import Checkpoint, load_checkpoint
from oled.model.codec import check_codec
from oled.model.config import ModelConfig, builtin_name
from oled.model.config import shipped_default as shipped_default  # where tests and tools look
from oled.model.experts import ResidentExperts
from oled.model.graphs import EagerForward, GraphedForward
from oled.model.model import ExpertExecutor
from oled.model.parallel import ShardedExperts, Split, check_host, in_turn, join
from oled.model.presets import builtin_checkpoint
from oled.offload.budget import KV_TOKENS, SLOT_KINDS, shape_slots, total_slots
from oled.offload.encoded import LANDING_ROWS, EncodedCopies
from oled.offload.engine import OffloadEngine
from oled.offload.predict import NextLayerRouting
from oled.offload.shard import ShardedEngine
from oled.paths import cache_home
from oled.policies.base import AllocationPolicy, CompensationPolicy, CostModel, RetentionPolicy
from oled.policies.planner import STAGE_ROUNDS, AheadFrom, Planner
from oled.policies.share import SharePlanner
from oled.recipe import DEFAULT_MODEL, Recipe, RuntimeSection
from oled.recipe.schema import RUNTIME
from oled.threads import MONITOR, ThreadChoice, choose, env_threads, visible_cpus
from oled.trace.replay import BatchReplay, RoutingReplay, special_ids, traced_prediction

if TYPE_CHECKING:
    from oled.model.model import LLaDA2Model
    from oled.model.tokenizer import Tokenizer
    from oled.trace.replay import RoutingTrace

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}
RESIDENT_SUMMARY = {
    "resident": True,
    "hit_rate": 1.0,
    "hits": 0.0,
    "misses": 0.0,
    "copies": 0.0,
    "copy_bytes": 0.0,
    "cpu_experts": 0.0,
    "gpu_experts": 0.0,
    "cpu_share": 0.0,
    "stall_ms": 0.0,
    "per_layer": [],
}


def resolve_model(spec: str) -> Path:
    """A checkpoint directory for a path or `builtin:NAME` (oled.model.config.BUILTIN_MODELS).

    `builtin:tiny` is the trained default model shipped in the package (docs/default-model.md);
    the other built-ins are random-initialised checkpoints made on first use (seed 0).
    """
    name = builtin_name(spec)
    return Path(spec).expanduser() if name is None else builtin_checkpoint(name)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def pick_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class Generation:
    """One finished answer."""

    text: str
    token_ids: list[int]
    stats: GenerationStats


REFERENCE_LOGITS = 8  # a reference keeps each position's 8 largest logits (Agreement)
_DEFAULT_THREADS: int | None = None  # torch's count before any runtime of this process set it
_AUTO: ThreadChoice | None = None  # this process's own choice, made once


def cpu_threads(configured: int | None = None) -> ThreadChoice:
    """Choose torch's intra-op threads and set them (oled.threads.choose): `configured`
    (runtime.cpu_threads) or OMP_NUM_THREADS when set; else the choice this process made for
    its first such runtime, torch's own count (a caller's torch.set_num_threads caps it) less
    the cores that other processes kept busy then. Made once, it holds for the process, so
    every generation of a process computes with the same threads (a CPU GEMM's summation
    order follows the thread count: the resident reference and an offloaded run agree)."""
    global _DEFAULT_THREADS, _AUTO
    if _DEFAULT_THREADS is None:
        _DEFAULT_THREADS = torch.get_num_threads()
    if _AUTO is not None and configured is None and env_threads() is None:
        choice = _AUTO
    else:
        cores = len(visible_cpus())
        choice = choose(
            cpu_threads=configured, default=_DEFAULT_THREADS, others=MONITOR.others(), cores=cores
        )
        if not choice.fixed:
            _AUTO = choice
    if torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    return choice


class Runtime:
    """Model, tokenizer and expert execution on one device; decodes prompts."""

    def __init__(
        self,
        *,
        checkpoint: Checkpoint,
        device: torch.device,
        executor: ExpertExecutor,
        decode: DecodeConfig,
        observers: Sequence[DecodeObserver] = (),
        graphs: bool = True,
        kernels: str = "auto",
        costs: dict[str, Any] | None = None,
        threads: ThreadChoice | None = None,
        prefill_chunk: int = 0,
    ) -> None:
        fused_kernels.check(kernels, device)
        self.costs = costs  # where the decisions' cost model comes from, and its figures
        self.threads = threads  # the intra-op threads chosen (None: left as torch had them)
        fused_kernels.use(kernels)
        self.kernels = kernels
        self.checkpoint = checkpoint
        self.device = device
        self.executor = executor
        self.decode = decode
        self.prefill_chunk = prefill_chunk  # a batch's prompt rows per forward (0: all at once)
        self.observers = list(observers)
        checkpoint.model.set_executor(executor)
        self.last_stats = GenerationStats()
        self._replay: RoutingReplay | None = None  # the last trace replayed
        self.forward = (
            GraphedForward(checkpoint.model, executor)
            if graphs and device.type == "cuda" and graphable(executor)
            else EagerForward(checkpoint.model)
        )

    def decisions(self) -> dict[str, Any] | None:
        """How the offload decisions are made, for reports (None when every expert is
        resident): the cost model's source and figures, and whether a policy adapts live."""
        if self.engine is None:
            return None
        threads = self.threads.describe() if self.threads is not None else None
        return {"adaptive": self.engine.planner.adaptive, "costs": self.costs, "threads": threads}

    @property
    def engine(self) -> OffloadEngine | None:
        """The offload engine that executes the experts; None when every expert is resident."""
        return self.executor if isinstance(self.executor, OffloadEngine) else None

    @property
    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.tokenizer

    @property
    def config(self) -> ModelConfig:
        return self.checkpoint.config

    @property
    def model(self) -> LLaDA2Model:
        return self.checkpoint.model

    def prompt_ids(self, prompt: str | Sequence[dict[str, str]], *, chat: bool) -> list[int]:
        """Token ids of a plain prompt, or of a chat rendered in LLaDA2's format."""
        if not isinstance(prompt, str):
            return self.tokenizer.encode(self.tokenizer.render_chat(prompt))
        if chat:
            return self.tokenizer.encode(
                self.tokenizer.render_chat([{"role": "user", "content": prompt}])
            )
        return self.tokenizer.encode(prompt)

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        decode: DecodeConfig | None = None,
        observers: Sequence[DecodeObserver] = (),
        cancelled: Callable[[], bool] = lambda: False,
        follow: Trajectory | None = None,
    ) -> Iterator[BlockInfo]:
        """Yield each finished block; `last_stats` is complete once the iterator ends. With
        `follow`, commit what that recorded generation committed (oled.decoding.follow)."""
        fused_kernels.use(self.kernels)
        decoder = BlockDecoder(
            self.model,
            mask_id=self.tokenizer.mask_id,
            stop_ids=self.tokenizer.stop_ids,
            observers=[*self.observers, *observers],
            forward=self.forward,
        )
        self.last_stats = decoder.stats
        try:
            blocks = decoder.stream(
                prompt_ids, decode or self.decode, cancelled=cancelled, follow=follow
            )
            for block in blocks:
                self.last_stats = decoder.stats
                yield block
        finally:
            self.last_stats = decoder.stats

    def batch_decoder(
        self,
        max_batch: int,
        *,
        block_length: int | None = None,
        prefill_chunk: int | None = None,
        first: Sequence[DecodeObserver] = (),
    ) -> BatchDecoder:
        """A decoder of up to `max_batch` generations at once (oled.decoding.batch) on this
        runtime's forwards (graphed on CUDA), experts and observers (after `first`); its
        streams use block length `block_length` (the decode config's by default) and a joining
        prompt enters in chunks of `prefill_chunk` tokens a forward (runtime.prefill_chunk by
        default; 0: in one forward)."""
        fused_kernels.use(self.kernels)
        return BatchDecoder(
            self.model,
            mask_id=self.tokenizer.mask_id,
            stop_ids=self.tokenizer.stop_ids,
            observers=[*first, *self.observers],
            forward=self.forward,
            max_batch=max_batch,
            block_length=block_length or self.decode.block_length,
            prefill_chunk=self.prefill_chunk if prefill_chunk is None else prefill_chunk,
        )

    def routing_replay(self, trace: RoutingTrace | RoutingReplay) -> RoutingReplay:
        """A trace (oled.trace.format.Trace) ready to replay on this model (the last one is
        kept, with its device buffers); ValueError naming both shapes unless the model has the
        trace's routing geometry."""
        if isinstance(trace, RoutingReplay):
            source = trace
        elif self._replay is not None and self._replay.trace is trace:
            source = self._replay
        else:
            source = RoutingReplay(trace, block_length=self.decode.block_length)
        source.check(self.config)
        source.bind(self.model)
        self._replay = source
        return source

    def replay_stream(
        self,
        trace: RoutingTrace | RoutingReplay,
        prompt_index: int = 0,
        *,
        observers: Sequence[DecodeObserver] = (),
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[BlockInfo]:
        """Replay prompt `prompt_index` of a routing trace (oled.trace.replay): a seeded
        prompt of the traced length, every MoE layer's routing replaced by the trace's (the
        routers still run), the traced commits and confidences, the traced blocks and forwards;
        yields each finished block like `stream`."""
        source = self.routing_replay(trace)
        ids, decode, follow = self.replay_request(source, prompt_index)
        with self._replaying(source):
            yield from self.stream(
                ids,
                decode=decode,
                observers=[source, *observers],
                cancelled=cancelled,
                follow=follow,
            )

    def replay_request(
        self, source: RoutingReplay, prompt_index: int
    ) -> tuple[list[int], DecodeConfig, Trajectory]:
        """Traced prompt `prompt_index` of `source`, ready to decode: (prompt ids, decode
        config, the traced schedule to follow)."""
        exclude = special_ids(self.tokenizer)
        return source.prepare(prompt_index, model=self.model, base=self.decode, exclude=exclude)

    @contextlib.contextmanager
    def replay_batch(
        self, trace: RoutingTrace, max_batch: int
    ) -> Iterator[tuple[BatchDecoder, BatchReplay]]:
        """A batch decoder (`batch_decoder`) that replays up to `max_batch` of the trace's
        prompts at once, and its source: add prompt i as `dec.add(ids, decode, follow=follow)`
        with `ids, decode, follow = replay_request(source, i)`. Every batched forward runs its
        streams' traced routing side by side (the routers still run), and each stream commits
        its traced commits with their confidences (oled.trace.replay.BatchReplay); prompts
        enter in one forward, as traced. The model routes by its routers again on exit."""
        source = BatchReplay(trace, max_batch=max_batch, block_length=self.decode.block_length)
        source.check(self.config)
        source.bind(self.model)
        bl = source.prompts[0].block_length
        dec = self.batch_decoder(max_batch, block_length=bl, prefill_chunk=0, first=[source])
        with self._replaying(source):
            yield dec, source

    @contextlib.contextmanager
    def _replaying(self, source: RoutingReplay) -> Iterator[None]:
        """The model routes by `source`'s override, and the offload engine predicts the next
        layer's routing from the trace (when it predicts with routers); undone on exit."""
        self.model.set_routing_override(source.override)
        engine = self.engine
        own = engine.predict if engine is not None else None
        if engine is not None and isinstance(own, NextLayerRouting):
            engine.predict = traced_prediction(source, own)
        try:
            yield
        finally:
            self.model.set_routing_override(None)
            if engine is not None:
                engine.predict = own

    def replay(
        self,
        trace: RoutingTrace | RoutingReplay,
        prompt_index: int = 0,
        *,
        observers: Sequence[DecodeObserver] = (),
    ) -> dict:
        """Replay one traced generation (`replay_stream`); its statistics (`stats`)."""
        for _ in self.replay_stream(trace, prompt_index, observers=observers):
            pass
        return self.stats()

    def offload_summary(self) -> dict | None:
        """The offload engine's figures for the last generation; None when all are resident."""
        return self.engine.metrics.summary() if self.engine is not None else None

    def stats(self) -> dict:
        """The last generation's decoding statistics and, when offloading, the engine's."""
        return self.last_stats.to_dict() | (self.offload_summary() or RESIDENT_SUMMARY)

    def generate(
        self,
        prompt: str | Sequence[dict[str, str]],
        *,
        chat: bool = True,
        decode: DecodeConfig | None = None,
        follow: Trajectory | None = None,
        observers: Sequence[DecodeObserver] = (),
        **overrides: Any,
    ) -> Generation:
        """Decode a whole answer; keyword overrides replace fields of the decode config. With
        `follow`, commit what that recorded generation committed (see `reference`)."""
        cfg = replace(decode or self.decode, **overrides)
        ids: list[int] = []
        prompt_ids = self.prompt_ids(prompt, chat=chat)
        for block in self.stream(prompt_ids, decode=cfg, observers=observers, follow=follow):
            ids += block.new_tokens
        return Generation(text=self.tokenizer.decode(ids), token_ids=ids, stats=self.last_stats)

    def reference(
        self,
        prompt: str | Sequence[dict[str, str]],
        *,
        chat: bool = True,
        decode: DecodeConfig | None = None,
        **overrides: Any,
    ) -> Trajectory:
        """The commits of a generation of `prompt` with every expert computed on the device:
        the all-resident model's tokens, bit for bit, whatever the policies and budget. Runs
        that follow it (`generate(..., follow=)`) do the same work, so runs with CPU experts
        (which agree with the device only to a tolerance) compare like for like."""
        cfg = replace(decode or self.decode, **overrides)
        return self.reference_ids(self.prompt_ids(prompt, chat=chat), cfg)

    def reference_ids(self, ids: Sequence[int], decode: DecodeConfig) -> Trajectory:
        """`reference` of prompt token ids."""
        trajectory = Trajectory(top_logits=REFERENCE_LOGITS)
        engine = self.engine
        on_device = engine.planner.all_on_device() if engine else contextlib.nullcontext()
        with on_device:
            for _ in self.stream(ids, decode=decode, observers=[trajectory]):
                pass
        trajectory.prompt = tuple(ids)
        return trajectory


def check(recipe: Recipe) -> None:
    """Fail now, before any weight loads, on a spec that cannot run here: a device torch does
    not see, kernels that cannot run on it, a transfer its dtype cannot take, a model without
    a readable config."""
    fused_kernels.check(recipe.runtime.kernels, pick_device(recipe.runtime.device))
    check_codec(recipe.runtime.transfer, pick_dtype(recipe.runtime.dtype))
    ModelConfig.from_json(resolve_model(recipe.model.path))


@dataclass(frozen=True, kw_only=True)
class RuntimeSpec:
    """Everything a runtime is built from, typed: a recipe's model, its validated `[runtime]`
    section (device, precision, the budget, how experts move; each range checked where the
    schema declares it) and decoding, the policy objects (None: OLED's own), and what only a
    library caller gives: a cost model object instead of `runtime.cost`'s, `driver`
    (OffloadEngine's), the KV tokens the memory budget reserves."""

    model: str = DEFAULT_MODEL
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    allocation: AllocationPolicy | None = None
    retention: RetentionPolicy | None = None
    compensation: CompensationPolicy | None = None
    cost: CostModel | None = None
    driver: bool | None = None
    kv_tokens: int = KV_TOKENS

    @classmethod
    def of(cls, recipe: Recipe) -> RuntimeSpec:
        """A recipe's spec (its policies built; none when every expert is resident)."""
        resident = recipe.runtime.budget.kind == "resident"
        policies = {} if resident else recipe.policy.build()
        return cls(
            model=recipe.model.path,
            runtime=recipe.runtime,
            decode=recipe.decoding.config(),
            **policies,
        )

    @property
    def cost_model(self) -> CostModel | str:
        """The cost model given, else the name `runtime.cost` gives (resolve_cost)."""
        return self.cost if self.cost is not None else self.runtime.cost


def build(spec: RuntimeSpec | Recipe, *, progress: bool = False) -> Runtime:
    """The runtime a spec (or a recipe's, RuntimeSpec.of) describes: the one construction.

    The budget is checked against the config before any weight is read, so a budget that is too
    small fails at once with the minimum it needs. On CUDA, forwards replay as CUDA graphs
    unless `runtime.cuda_graphs` is False (the same tokens either way), and the hot stages run
    as fused Triton kernels unless `runtime.kernels` is "torch" (oled.kernels).
    `runtime.prefetch` > 0 copies up to that many experts per MoE layer a layer ahead, from the
    next layer's predicted routing (oled.offload.predict) or, with `runtime.ahead_from`
    "previous", from what the next layer routed the forward before, on the link's spare time.
    `runtime.planner` "auto" plans compiled where it can (oled.policies.native), "compiled"
    insists on it, "python" keeps the Python planner: the same decisions either way. `driver`
    launches graphed layer calls from C where possible (None), insists (True) or never does
    (False; oled.offload.driver): the same tokens either way. `runtime.transfer` says how
    misses cross the link (oled.model.codec): "plain" bf16 rows, "lossless" encoded rows (the
    same tokens, fewer bytes), "fp8" or "int4" (lossy: about a half or a quarter of the bytes,
    other tokens). `runtime.devices` > 1: this process is one of that many, each holding a
    share of the experts (oled.model.parallel), all resident or offloaded with the budget
    applied to each device over its share (oled.offload.shard).
    """
    spec = spec if isinstance(spec, RuntimeSpec) else RuntimeSpec.of(spec)
    rt = spec.runtime
    threads = cpu_threads(rt.cpu_threads)
    dev, torch_dtype = pick_device(rt.device), pick_dtype(rt.dtype)
    settings: dict[str, Any] = {
        "decode": spec.decode,
        "graphs": rt.cuda_graphs,
        "kernels": rt.kernels,
        "threads": threads,
        "prefill_chunk": rt.prefill_chunk,
    }
    check_codec(rt.transfer, torch_dtype)
    fused_kernels.check(rt.kernels, dev)
    fused_kernels.use(rt.kernels)  # the cost calibration below already times these kernels
    if rt.devices > 1:
        return _build_split(spec, dev, torch_dtype, settings, progress)
    path = resolve_model(spec.model)
    slots = _slots(spec, ModelConfig.from_json(path), dev, torch_dtype)
    ckpt = load_checkpoint(
        path,
        device=dev,
        dtype=torch_dtype,
        progress=progress,
        pin_experts=dev.type == "cuda" and slots is not None,  # pinned only if they stay on host
    )
    if slots is None:
        executor = ResidentExperts(ckpt.experts, dev)
        return Runtime(checkpoint=ckpt, device=dev, executor=executor, **settings)
    return _offloaded(spec, ckpt, dev, slots, settings, progress)


def _slots(
    spec: RuntimeSpec, cfg: ModelConfig, dev: torch.device, dtype: torch.dtype, share: int = 0
) -> int | None:
    """The expert slots of the spec's budget on this device (None: every expert resident),
    over its `share` of each layer's experts when several devices split them (0: all)."""
    rt = spec.runtime
    scratch = STAGE_ROUNDS * rt.stage_capacity + (LANDING_ROWS if rt.transfer != "plain" else 0)
    return total_slots(
        rt.budget,
        cfg,
        dtype=dtype,
        device=dev,
        kv_tokens=spec.kv_tokens,
        scratch_experts=scratch,
        experts=share or None,
    )


def _offloaded(
    spec: RuntimeSpec,
    ckpt: Checkpoint,
    dev: torch.device,
    slots: int,
    settings: dict[str, Any],
    progress: bool,
    split: Split | None = None,
) -> Runtime:
    """The runtime whose engine offloads the checkpoint's experts (`split`'s share of them)
    into `slots` slots."""
    rt = spec.runtime
    encoded = None
    if rt.transfer != "plain":
        encoded = EncodedCopies(ckpt.experts, rt.transfer, dev, progress)
    # several devices: one process at a time measures the machine (runtime.cost "calibrate")
    with in_turn() if split is not None else contextlib.nullcontext():
        cost, costs = decision_cost(spec.cost_model, ckpt, dev, encoded, settings["threads"])
    planner = make_planner(
        ckpt,
        dev,
        slots,
        stage_capacity=rt.stage_capacity,
        allocation=spec.allocation,
        retention=spec.retention,
        compensation=spec.compensation,
        cost=cost,
        prefetch=rt.prefetch,
        ahead_from=rt.ahead_from,
        planner=rt.planner,
        share=split is not None,
    )
    engine = make_engine(ckpt, dev, planner, driver=spec.driver, encoded=encoded, split=split)
    return Runtime(
        checkpoint=ckpt, device=dev, executor=engine, observers=[engine], costs=costs, **settings
    )


def check_split(model: str, rt: RuntimeSection) -> tuple[Path, int]:
    """(the model's checkpoint directory, its experts per layer), once this host and the model
    allow `rt.devices` processes (enough GPUs; experts that split evenly; a counted budget of
    at least one slot per layer on each device's share): a ValueError naming what does not."""
    check_host(rt.devices, rt.device)
    path = resolve_model(model)
    cfg = ModelConfig.from_json(path)
    split = Split(0, rt.devices, cfg.num_experts)
    if rt.budget.kind in SLOT_KINDS:  # counted slots: checked before any process starts
        try:
            shape_slots(rt.budget, cfg.num_moe_layers, split.per)
        except ValueError as exc:
            raise ValueError(
                f"{exc}: with runtime.devices = {rt.devices} the budget is per device, over "
                f"its share of {split.per} experts per layer"
            ) from None
    return path, cfg.num_experts


def _build_split(
    spec: RuntimeSpec,
    dev: torch.device,
    dtype: torch.dtype,
    settings: dict[str, Any],
    progress: bool,
) -> Runtime:
    """This process's runtime of `runtime.devices` that split the experts: its share resident,
    or offloaded within the budget over its share."""
    rt = spec.runtime
    path, experts = check_split(spec.model, rt)
    rank, local = join(rt.devices, dev.type)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    split = Split(rank, rt.devices, experts)
    slots = _slots(spec, ModelConfig.from_json(path), dev, dtype, share=split.per)
    ckpt = load_checkpoint(
        path,
        device=dev,
        dtype=dtype,
        progress=progress and rank == 0,
        pin_experts=dev.type == "cuda" and slots is not None,  # pinned only if they stay on host
        experts=split.owned,
        experts_on_device=slots is None,  # never the whole share in host memory as well
    )
    if slots is not None:
        return _offloaded(spec, ckpt, dev, slots, settings, progress and rank == 0, split)
    return Runtime(
        checkpoint=ckpt,
        device=dev,
        executor=ShardedExperts(ckpt.experts, dev, split),
        **settings,
    )


def build_runtime(
    *,
    model: str = DEFAULT_MODEL,
    decode: DecodeConfig | None = None,
    progress: bool = False,
    graphs: bool | None = None,
    cost: CostModel | str | None = None,
    allocation: AllocationPolicy | None = None,
    retention: RetentionPolicy | None = None,
    compensation: CompensationPolicy | None = None,
    driver: bool | None = None,
    kv_tokens: int = KV_TOKENS,
    **runtime: Any,
) -> Runtime:
    """`build` from keyword arguments, for library use: `runtime` holds keys of a recipe's
    `[runtime]` section (device, dtype, budget: an oled.offload.budget.Budget, stage_capacity,
    prefetch, cpu_threads, kernels, planner, transfer), validated by it, with its defaults
    for those left out or None; `graphs` is `cuda_graphs`; `cost` a profile name, "calibrate"
    or a CostModel; missing policies get OLED's (RuntimeSpec)."""
    if graphs is not None:
        runtime["cuda_graphs"] = graphs
    if isinstance(cost, str):
        runtime["cost"] = cost
    section = RuntimeSection(**{k: v for k, v in runtime.items() if v is not None})
    spec = RuntimeSpec(
        model=model,
        runtime=section,
        decode=decode or DecodeConfig(),
        allocation=allocation,
        retention=retention,
        compensation=compensation,
        cost=cost if isinstance(cost, CostModel) else None,
        driver=driver,
        kv_tokens=kv_tokens,
    )
    return build(spec, progress=progress)


def decision_cost(
    cost: CostModel | str,
    ckpt: Checkpoint,
    dev: torch.device,
    encoded: EncodedCopies | None,
    threads: ThreadChoice | None = None,
) -> tuple[CostModel, dict[str, Any]]:
    """The cost model the decisions use (`resolve_cost`), its copies priced by the bytes they
    move (`encoded`: the encoded share of an expert's bytes, CostModel.for_transfer; None:
    plain rows), and its description for reports (with the transfer and its share)."""
    cost, costs = resolve_cost(cost, ckpt, dev, threads)
    if encoded is None:
        return cost, costs
    cost = cost.for_transfer(encoded.ratio)
    return cost, costs | asdict(cost) | {"transfer": encoded.codec, "copy_share": encoded.ratio}


def make_engine(
    ckpt: Checkpoint,
    dev: torch.device,
    planner: Planner,
    *,
    driver: bool | None = None,
    encoded: EncodedCopies | None = None,
    split: Split | None = None,
) -> OffloadEngine:
    """The offload engine over the checkpoint's experts, with the next layer's routing
    predicted from the model's routers when the planner prefetches; `driver`, `encoded`:
    see OffloadEngine (give the planner the `decision_cost` of the same `encoded`); `split`:
    the checkpoint holds this share of the experts (oled.offload.shard, planned by a
    make_planner(share=True); its layer calls launch from Python)."""
    routers = planner.prefetch_limit and planner.ahead_from == "router"
    predict = NextLayerRouting(ckpt.model) if routers else None
    kind = OffloadEngine if split is None else partial(ShardedEngine, split=split)
    return kind(
        store=ckpt.experts,
        device=dev,
        planner=planner,
        predict=predict,
        driver=driver,
        encoded=encoded,
    )


def graphable(executor: ExpertExecutor) -> bool:
    """Whether forwards over `executor` can replay as CUDA graphs: whole forwards (no host
    decision), or pieces between the layers' host decisions (a PiecewiseExecutor). The
    resident split's all-reduce between layers is neither yet, so it runs eagerly."""
    return executor.graph_safe or hasattr(executor, "run_static")


PLANNER_MODES = {"auto": None, "compiled": True, "python": False}


def make_planner(
    ckpt: Checkpoint,
    dev: torch.device,
    slots: int,
    *,
    stage_capacity: int = RUNTIME.stage_capacity,
    allocation: AllocationPolicy | None = None,
    retention: RetentionPolicy | None = None,
    compensation: CompensationPolicy | None = None,
    cost: CostModel | str = RUNTIME.cost,
    prefetch: int = RUNTIME.prefetch,
    ahead_from: AheadFrom = RUNTIME.ahead_from,
    planner: str = RUNTIME.planner,
    share: bool = False,
) -> Planner:
    """A planner of `slots` expert slots over the checkpoint's experts with the given
    policies; OLED's own where one is not given; compiled or in Python as `planner` says
    ("auto", "compiled", "python"); `share`: the checkpoint holds one device's share of the
    experts, planned in that share's ids (oled.policies.share)."""
    if planner not in PLANNER_MODES:
        raise ValueError(f"unknown planner {planner!r}: choose from {', '.join(PLANNER_MODES)}")
    cfg = ckpt.config
    kind = SharePlanner if share else Planner
    return kind.for_model(
        cfg.num_moe_layers,
        ckpt.experts.num_experts,
        cfg.num_experts_per_tok,
        slots,
        stage_capacity=stage_capacity,
        cost=resolve_cost(cost, ckpt, dev)[0],
        allocation=allocation,
        retention=retention,
        compensation=compensation,
        prefetch_limit=prefetch,
        ahead_from=ahead_from,
        compiled=PLANNER_MODES[planner],
    )


def resolve_cost(
    cost: CostModel | str,
    ckpt: Checkpoint,
    dev: torch.device,
    threads: ThreadChoice | None = None,
) -> tuple[CostModel, dict[str, Any]]:
    """The cost model that `runtime.cost` names ("calibrate": this machine's, measured on a
    quiet machine and stored under cache_home()/cost, keyed by the configured threads of
    `threads`; else a profile), or the one given, and its description for reports."""
    if isinstance(cost, CostModel):
        return cost, {"source": "given", **asdict(cost)}
    if cost == "calibrate":
        from oled.offload.calibrate import calibrated_cost

        if threads is None:  # the configured count, whatever the load lets run now
            cores = len(visible_cpus())
            most = _DEFAULT_THREADS or torch.get_num_threads()
            threads = choose(cpu_threads=None, default=most, others=None, cores=cores)
        calibration = calibrated_cost(
            ckpt.experts,
            dev,
            cache_home() / "cost",
            threads=threads.configured,
            others=threads.others,
        )
        return calibration.cost, calibration.describe()
    profile = CostModel.profile(cost)
    return profile, {"source": f"profile {cost}", **asdict(profile)}


def load_runtime(model: str = DEFAULT_MODEL, **settings: Any) -> Runtime:
    """All experts resident on the device: the simplest runtime and the reference; `settings`:
    build_runtime's (device, dtype, decode, progress, graphs, kernels)."""
    return build_runtime(model=model, budget=None, **settings)


OFFLOAD_KEYS = (
    "hit_rate",
    "hits",
    "misses",
    "copies",
    "copy_bytes",
    "cpu_experts",
    "gpu_experts",
    "cpu_share",
    "stall_ms",
)


def offload_stats(rt: Runtime) -> dict[str, float] | None:
    """The offload engine's headline figures for the last generation; None when resident."""
    summary = rt.offload_summary()
    if summary is None:
        return None
    return {k: float(summary[k]) for k in OFFLOAD_KEYS if k in summary}


def stats_dict(rt: Runtime, stats: GenerationStats | None = None) -> dict[str, Any]:
    """A generation's figures (the last one's by default) without per-iteration lists, with
    the offload engine's (for reports and the API)."""
    stats = stats if stats is not None else rt.last_stats
    out = {k: v for k, v in stats.to_dict().items() if k != "iteration_ms"}
    out["offload"] = offload_stats(rt)
    return out
