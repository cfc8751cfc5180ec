"""Routing replay: run a checkpoint on a recorded trace's routing, schedule and confidences.

A routing trace (oled.trace.format, `oled trace record`) holds per forward ("step") and MoE layer
the expert ids and gate weights of every row the forward ran (pending prefix rows first, then the
block's rows), and per row the token state and confidence after that forward. A replay runs the
same forwards on any checkpoint of the same routing geometry (MoE layers, experts, top-k), at its
own sizes:

- every MoE layer's routing is the trace's (`RoutingOverride`: the router still runs, so its cost
  stays in the timing, but its output is replaced), for the offload engine, the resident
  executor, the routing hooks and CUDA graphs alike;
- the decoder commits what the trace committed (a `ReplayTrajectory`, through `follow`);
- the confidences that the observers (the offload policies) see are the trace's;
- each prompt has the traced length (seeded token ids) and decodes the traced blocks and
  forwards exactly.

The trace is duck-typed (a `Trace`, or a namespace with its `meta` alone where only the
geometry is checked): arrays `ids` [L, R, K], `weights`
[L, R, K], `token_state` [R], `confidence` [R], `row_offsets` [S + 1], `block`, `iteration`,
`step` [S] and `meta.num_moe_layers`, `meta.num_experts`, `meta.top_k`. A prompt starts where
`step` goes back to 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from oled.decoding.config import DecodeConfig
from oled.decoding.follow import Trajectory
from oled.decoding.observers import BatchPart, DecodeObserver, IterationInfo
from oled.model.config import ModelConfig
from oled.model.model import LLaDA2Model, RoutingOverride
from oled.model.tokenizer import Tokenizer
from oled.token_states import TOKEN_COMMITTED, TOKEN_FIXED, TOKEN_MASKED


class TracedGeometry(Protocol):
    """A trace's routing geometry (its `meta`)."""

    @property
    def num_moe_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...


class RoutingTrace(Protocol):
    """What a replay reads of a routing trace (the module docstring lists the shapes)."""

    @property
    def meta(self) -> TracedGeometry: ...
    @property
    def ids(self) -> np.ndarray: ...
    @property
    def weights(self) -> np.ndarray: ...
    @property
    def token_state(self) -> np.ndarray: ...
    @property
    def confidence(self) -> np.ndarray: ...
    @property
    def row_offsets(self) -> np.ndarray: ...
    @property
    def block(self) -> np.ndarray: ...
    @property
    def iteration(self) -> np.ndarray: ...
    @property
    def step(self) -> np.ndarray: ...


@dataclass(frozen=True)
class ReplayPrompt:
    """One traced generation: its forwards are trace steps first_step .. first_step + steps."""

    index: int
    first_step: int
    steps: int
    prompt_length: int
    block_length: int
    blocks: int

    @property
    def first(self) -> int:
        """Absolute position of its first decoded block."""
        return (self.prompt_length // self.block_length) * self.block_length

    @property
    def max_new_tokens(self) -> int:
        """Every position of its blocks after the prompt: the traced blocks, exactly."""
        return self.first + self.blocks * self.block_length - self.prompt_length


class ReplayTrajectory(Trajectory):
    """A trace's schedule as a followed generation: per forward the committed block positions
    [S, L] bool, one fixed token id at every commit, and the block rows' confidences [S, L].
    Its tokens are nobody's choice, so the followers' agreement is not counted."""

    agreement = False

    def __init__(
        self,
        commits: Tensor,
        confidence: Tensor,
        token: int,
        traced: ReplayPrompt | None = None,
    ) -> None:
        super().__init__()
        self.traced = traced  # the trace's generation it schedules
        self.commits, self.confidence = commits, confidence  # [S, L] bool, [S, L] fp32
        self.forced = torch.full(commits.shape, token, dtype=torch.long)  # [S, L]
        self.steps = list(zip(self.commits, self.forced, strict=True))

    def on_generation_start(self, prompt_length: int) -> None:
        """Not a recorder: the schedule stays."""

    def on_iteration(self, info: IterationInfo) -> None:
        """Not a recorder."""

    def to(self, device: torch.device) -> ReplayTrajectory:
        """The same schedule with its tensors on `device` (so following it copies nothing)."""
        self.commits, self.confidence = self.commits.to(device), self.confidence.to(device)
        self.forced = self.forced.to(device)
        self.steps = list(zip(self.commits, self.forced, strict=True))
        return self

    def confidence_at(self, step: int, device: torch.device) -> Tensor:
        return self.confidence[step].to(device)


def geometry(meta: TracedGeometry | ModelConfig) -> tuple[int, int, int]:
    """(MoE layers, experts, top-k) of a trace's or a model config's routing."""
    top_k = meta.top_k if hasattr(meta, "top_k") else meta.num_experts_per_tok
    return int(meta.num_moe_layers), int(meta.num_experts), int(top_k)


def _shape(g: tuple[int, int, int]) -> str:
    return f"{g[0]} MoE layers x {g[1]} experts, top-{g[2]}"


def check_geometry(trace: RoutingTrace, config: ModelConfig) -> None:
    """ValueError (one line, both shapes) unless the model routes like the trace."""
    traced, model = geometry(trace.meta), geometry(config)
    if traced != model:
        raise ValueError(
            f"the trace's routing geometry ({_shape(traced)}) does not match the model's "
            f"({_shape(model)})"
        )


def select_prompts(spec: str | None, count: int) -> list[int]:
    """Prompt indices of a selection: None or "all" (every one), "I", "A:B" (Python slice, either
    end optional) or a comma-separated list of those."""
    if spec is None or spec.strip() in ("", "all"):
        return list(range(count))
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if ":" in part:
                lo, _, hi = part.partition(":")
                out += range(count)[slice(int(lo) if lo else None, int(hi) if hi else None)]
                continue
            i = int(part)
        except ValueError:
            raise ValueError(f"prompt selection {spec!r}: expected I, A:B or a list") from None
        if not -count <= i < count:
            raise ValueError(f"prompt selection {spec!r}: the trace holds {count} prompts")
        out.append(i % count)
    if not out:
        raise ValueError(f"prompt selection {spec!r} selects none of the {count} prompts")
    return out


def split_prompts(trace: RoutingTrace, block_length: int = 32) -> list[ReplayPrompt]:
    """The traced generations, checked to be replayable. The block length comes from the trace
    (the rows of a block's later forwards, or half those of a later block's first forward);
    `block_length` only where no forward tells it (every prompt one block, one forward)."""
    step = np.asarray(trace.step, np.int64)
    block = np.asarray(trace.block, np.int64)
    iteration = np.asarray(trace.iteration, np.int64)
    offsets = np.asarray(trace.row_offsets, np.int64)
    state = np.asarray(trace.token_state)
    n = len(step)
    if n == 0:
        raise ValueError("the trace holds no forwards")
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(state):
        raise ValueError("the trace's row_offsets do not cover its rows")
    rows = np.diff(offsets)  # [S]
    bl = _block_length(rows, block, iteration, block_length)
    starts = np.flatnonzero(step == 0)
    if not len(starts) or starts[0] != 0:
        raise ValueError("the trace does not start with a prompt's first forward (step 0)")
    ends = np.append(starts[1:], n)
    # forwards within a prompt: the next iteration of the block, or the next block's first
    same = (block[1:] == block[:-1]) & (iteration[1:] == iteration[:-1] + 1)
    following = (block[1:] == block[:-1] + 1) & (iteration[1:] == 0)
    continues = np.append(step[1:] == step[:-1] + 1, False)
    ordered = np.append(same | following, False)
    # every later forward: bl rows; a later block's first: its finished predecessor too
    expected = np.where(iteration > 0, bl, 2 * bl)
    # a block ends exactly when its rows have no mask left after the forward
    masked = np.concatenate([[0], np.cumsum(state == TOKEN_MASKED)])
    open_after = masked[offsets[1:]] - masked[offsets[1:] - np.minimum(rows, bl)] > 0  # [S]
    block_ends = np.append(~same, True)
    prompts = []
    for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        where = f"prompt {i} (trace forwards {a}..{b - 1})"
        if not (continues[a : b - 1].all() and ordered[a : b - 1].all()):
            raise ValueError(
                f"{where}: its forwards do not run block by block, iteration by iteration"
            )
        if block[a] != 0 or iteration[a] != 0:
            raise ValueError(f"{where}: the first forward is not block 0, iteration 0")
        later = np.arange(a + 1, b)
        bad = later[rows[later] != expected[later]]
        if len(bad):
            raise ValueError(
                f"{where}: forward {bad[0]} ran {rows[bad[0]]} rows, not "
                f"{expected[bad[0]]} (block length {bl})"
            )
        if (open_after[a:b] == block_ends[a:b]).any():
            raise ValueError(f"{where}: a block ends with masked positions, or goes on without")
        first = int(rows[a]) - bl
        if first < 0 or first % bl:
            raise ValueError(
                f"{where}: its prompt forward ran {rows[a]} rows, not a multiple "
                f"of the block length {bl}"
            )
        head = state[offsets[a] + first : offsets[a + 1]]  # the first block's rows
        fixed = int((head == TOKEN_FIXED).sum())
        if not (head[:fixed] == TOKEN_FIXED).all() or first + fixed == 0:
            raise ValueError(f"{where}: no prompt before the masked positions of its first block")
        prompts.append(
            ReplayPrompt(
                index=i,
                first_step=a,
                steps=b - a,
                prompt_length=first + fixed,
                block_length=bl,
                blocks=int(block[b - 1]) + 1,
            )
        )
    return prompts


def _block_length(rows: np.ndarray, block: np.ndarray, iteration: np.ndarray, fallback: int) -> int:
    found = set(rows[iteration > 0].tolist())
    firsts = rows[(iteration == 0) & (block > 0)]
    found |= {r / 2 for r in firsts.tolist()}
    if len(found) > 1 or any(v != int(v) or v < 1 for v in found):
        raise ValueError(
            f"the trace's forwards do not share one block length (rows suggest {sorted(found)})"
        )
    return int(found.pop()) if found else fallback


def random_ids(length: int, vocab_size: int, exclude: Collection[int], seed: int) -> list[int]:
    """`length` seeded token ids below `vocab_size`, none of `exclude`."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while len(out) < length:
        draw = torch.randint(0, vocab_size, (2 * (length - len(out)) + 8,), generator=gen)
        out += [i for i in draw.tolist() if i not in exclude][: length - len(out)]
    return out


class RoutingReplay(DecodeObserver):
    """A trace, ready to replay one of its prompts at a time on a model of its routing geometry.

    `bind(model)` makes the model's `RoutingOverride` (device buffers for the largest forward
    of the trace) and pinned host staging; as a decode observer, before each forward it converts
    that forward's routing into the staging and sends it up in one copy per tensor, and after it
    checks that the forward ran the traced rows. `Runtime.replay` drives it.
    """

    def __init__(self, trace: RoutingTrace, *, block_length: int = 32, seed: int = 0) -> None:
        self.trace = trace
        self.prompts = split_prompts(trace, block_length)
        self.seed = seed
        self.geometry = geometry(trace.meta)
        self.max_rows = int(np.diff(np.asarray(trace.row_offsets)).max())
        self.model: LLaDA2Model | None = None
        self.override: RoutingOverride | None = None
        self._ids_host = torch.empty(0, dtype=torch.long)  # pinned staging, made by `bind`
        self._weights_host = torch.empty(0, dtype=torch.float32)
        self._loaded: torch.cuda.Event | None = None  # the last copy out of the staging
        self._prompt: ReplayPrompt | None = None
        self._spans: list[tuple[int, int]] = []  # trace rows of the forward being replayed
        # per prompt (and model): its seeded ids and its schedule on the model's device
        self._ready: dict[tuple, tuple[list[int], ReplayTrajectory]] = {}
        self.warned = False  # said that the trace records no prediction

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def capacity(self) -> int:
        """Rows of the largest forward replayed: the trace's largest."""
        return self.max_rows

    def check(self, config: ModelConfig) -> None:
        """ValueError unless a model of `config` routes like the trace."""
        check_geometry(self.trace, config)

    def bind(self, model: LLaDA2Model) -> RoutingOverride:
        """The model's override buffers (made once per model) and the host staging."""
        if self.model is model and self.override is not None:
            return self.override
        self.check(model.config)
        layers, _, k = self.geometry
        device = model.lm_head.weight.device
        rows = self.capacity
        self.override = RoutingOverride(layers=layers, top_k=k, rows=rows, device=device)
        size = layers * rows * k
        pin = device.type == "cuda"
        self._ids_host = torch.empty(size, dtype=torch.long, pin_memory=pin)
        self._weights_host = torch.empty(size, dtype=torch.float32, pin_memory=pin)
        self._loaded = torch.cuda.Event() if pin else None
        self.model = model
        return self.override

    def prompt_ids(self, index: int, *, vocab_size: int, exclude: Collection[int]) -> list[int]:
        """Seeded token ids of the traced prompt's length (seed + index), none of `exclude`."""
        length = self.prompts[index].prompt_length
        return random_ids(length, vocab_size, exclude, self.seed + index)

    def decode_config(self, index: int, base: DecodeConfig) -> DecodeConfig:
        """`base` with the traced block length and the length that decodes its blocks."""
        p = self.prompts[index]
        return replace(
            base, block_length=p.block_length, max_new_tokens=p.max_new_tokens, use_cache=True
        )

    def trajectory(self, index: int, token: int) -> ReplayTrajectory:
        """The traced commits (of `token`) and confidences of a prompt, per forward."""
        p, t = self.prompts[index], self.trace
        bl = p.block_length
        ends = np.asarray(t.row_offsets[p.first_step + 1 : p.first_step + p.steps + 1], np.int64)
        rows = ends[:, None] - bl + np.arange(bl)  # [S, L]: the block's rows of each forward
        commits = np.asarray(t.token_state)[rows] == TOKEN_COMMITTED
        confidence = np.asarray(t.confidence, np.float32)[rows]
        return ReplayTrajectory(
            torch.from_numpy(commits), torch.from_numpy(confidence), token, traced=p
        )

    def prepare(
        self, index: int, *, model: LLaDA2Model, base: DecodeConfig, exclude: Collection[int]
    ) -> tuple[list[int], DecodeConfig, ReplayTrajectory]:
        """Bind to `model` and get prompt `index` ready: (prompt ids, decode config, schedule);
        the observer then replays that prompt's forwards."""
        if not -len(self.prompts) <= index < len(self.prompts):
            raise ValueError(f"prompt {index}: the trace holds {len(self.prompts)} prompts")
        index %= len(self.prompts)
        self.bind(model)
        vocab = model.config.vocab_size
        device = model.lm_head.weight.device
        key = (index, vocab, tuple(sorted(exclude)), device)
        if key not in self._ready:  # made once: every replay of the prompt follows the same
            ids = self.prompt_ids(index, vocab_size=vocab, exclude=exclude)
            follow = self.trajectory(index, commit_token(vocab, exclude)).to(device)
            follow.prompt = tuple(ids)
            self._ready[key] = ids, follow
        ids, follow = self._ready[key]
        self._prompt = self.prompts[index]
        return list(ids), self.decode_config(index, base), follow

    # -- decode observer --------------------------------------------------------------------------

    def on_iteration_start(self, block: int, iteration: int, step: int) -> None:
        """Send this forward's traced routing to the override's buffers."""
        p = self._prompt
        if p is None or self.override is None:
            raise RuntimeError("RoutingReplay: no prompt prepared (use Runtime.replay)")
        span = self._span(p, step)
        s, t = p.first_step + step, self.trace
        if (int(t.block[s]), int(t.iteration[s])) != (block, iteration):
            raise ValueError(
                f"prompt {p.index}, forward {step}: block {block} iteration {iteration}, the "
                f"trace's is block {t.block[s]} iteration {t.iteration[s]}"
            )
        self._load([span])

    def _span(self, p: ReplayPrompt, step: int, rows: int | None = None) -> tuple[int, int]:
        """The trace rows a:b of prompt `p`'s forward `step`; ValueError past its traced
        forwards, or for a forward of `rows` rows where the trace ran others."""
        if step >= p.steps:
            raise ValueError(f"prompt {p.index} has {p.steps} traced forwards; this is {step + 1}")
        s = p.first_step + step
        a, b = int(self.trace.row_offsets[s]), int(self.trace.row_offsets[s + 1])
        if rows is not None and rows != b - a:
            raise ValueError(
                f"prompt {p.index}, forward {step} runs {rows} rows, the trace {b - a}"
            )
        return a, b

    def _load(self, spans: Sequence[tuple[int, int]]) -> None:
        """Send the traced routing of these trace row spans, side by side, to the override's
        buffers in one copy per tensor (after the staging's last copy is done)."""
        assert self.override is not None  # bound
        self._spans = list(spans)
        layers, _, k = self.geometry
        rows = sum(b - a for a, b in spans)
        n = layers * rows * k
        if self._loaded is not None:  # the staging's last copy must be done before refilling
            self._loaded.synchronize()
        ids = self._ids_host[:n].view(layers, rows, k)
        weights = self._weights_host[:n].view(layers, rows, k)
        at = 0
        for a, b in spans:
            ids[:, at : at + b - a] = torch.from_numpy(np.asarray(self.trace.ids[:, a:b]))
            weights[:, at : at + b - a] = torch.from_numpy(np.asarray(self.trace.weights[:, a:b]))
            at += b - a
        self.override.load(ids, weights)
        if self._loaded is not None:
            self._loaded.record()

    def on_iteration(self, info: IterationInfo) -> None:
        if self._prompt is not None:
            self._span(self._prompt, info.step, info.forward_tokens)

    def on_generation_end(self) -> None:
        self._prompt = None

    # -- the traced next-layer prediction -------------------------------------------------------

    @property
    def predicts(self) -> bool:
        """Whether the trace records the next layer's predicted routing (ahead_ids)."""
        return getattr(self.trace, "ahead_ids", None) is not None

    def predicted(self, layer: int, rows: int) -> np.ndarray:
        """The ids [T, K] int64 that MoE layer `layer` + 1's router gave layer `layer`'s router
        input in the forward being replayed, as the trace recorded them."""
        ahead = getattr(self.trace, "ahead_ids", None)
        if ahead is None or not self._spans:
            raise RuntimeError("RoutingReplay: no recorded prediction for this forward")
        traced = sum(b - a for a, b in self._spans)
        if traced != rows:
            raise ValueError(f"forward of {rows} rows, the trace's {traced}: not the traced one")
        return np.concatenate([np.asarray(ahead[layer, a:b], np.int64) for a, b in self._spans])


class BatchReplay(RoutingReplay):
    """A trace, ready to replay several of its prompts at once in a batch decoder
    (oled.decoding.batch): each stream follows one prompt's `ReplayTrajectory` (from
    `prepare`), and before each batched forward this observer sends every stream's traced
    routing of its step, side by side in the forward's row order, to an override with room for
    `max_batch` of the trace's largest forwards. `Runtime.replay_batch` drives it."""

    def __init__(
        self, trace: RoutingTrace, *, max_batch: int, block_length: int = 32, seed: int = 0
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        super().__init__(trace, block_length=block_length, seed=seed)
        self.max_batch = max_batch

    @property
    def capacity(self) -> int:
        """Rows of the largest batched forward: `max_batch` of the trace's largest."""
        return self.max_batch * self.max_rows

    def on_iteration_start(self, block: int, iteration: int, step: int) -> None:
        """Batched forwards load in `on_batch_start`."""

    def on_batch_start(self, step: int, parts: list[BatchPart]) -> None:
        """Send the forward's traced routing: each stream's traced forward at its step, in
        row order. ValueError for a stream that follows no prompt of this trace, or runs
        other rows than its traced forward."""
        if self.override is None:
            raise RuntimeError("BatchReplay: not bound to a model (use Runtime.replay_batch)")
        spans = []
        for part in parts:
            traced = getattr(part.follow, "traced", None)
            if not isinstance(traced, ReplayPrompt) or self.prompts[traced.index] != traced:
                raise ValueError("a stream of a batched replay follows no prompt of its trace")
            spans.append(self._span(traced, part.step, part.rows))
        self._load(spans)

    def on_iteration(self, info: IterationInfo) -> None:
        """Batched forwards are checked in `on_batch_start`."""

    def on_generation_end(self) -> None:
        self._spans = []


class ReplayWarning(UserWarning):
    """A replay that cannot follow the trace in full (said once per trace)."""


Predictor = Callable[[int, Tensor], "Tensor | np.ndarray"]  # the engine's next-layer ids


def traced_prediction(replay: RoutingReplay, own: Predictor) -> Predictor:
    """The next-layer prediction for an engine that predicts with its model's routers (`own`)
    while it replays: the trace's (TracedPrediction), or `own` with a ReplayWarning, once per
    trace, where the trace records none."""
    if replay.predicts:
        return TracedPrediction(replay)
    if not replay.warned:
        replay.warned = True
        warnings.warn(
            "the trace records no next-layer prediction (record it again: traces of format 3 "
            "do); copies ahead follow this model's routers, which route otherwise than the "
            "trace",
            ReplayWarning,
            stacklevel=3,
        )
    return own


class TracedPrediction:
    """The engine's next-layer prediction during a replay (oled.offload.predict): the one that
    the trace recorded for the traced model, not the replaying model's routers (which route
    otherwise). Known on the host (`on_host`)."""

    on_host = True

    def __init__(self, replay: RoutingReplay) -> None:
        self.replay = replay

    def __call__(self, layer: int, x: Tensor) -> np.ndarray:
        """Traced ids [T, K] of MoE layer `layer` + 1 for router input x [T, H]."""
        return self.replay.predicted(layer, x.shape[0])


def commit_token(vocab_size: int, exclude: Collection[int]) -> int:
    """The token id that replays commit: the lowest id that is no special token."""
    skip = set(exclude)
    return next(i for i in range(vocab_size) if i not in skip)


def special_ids(tokenizer: Tokenizer) -> Sequence[int]:
    """Ids that a replay's prompt and commits avoid: mask, EOS and the stop ids."""
    return sorted({tokenizer.mask_id, tokenizer.eos_id, *tokenizer.stop_ids})
