"""Recording a runtime's routing while it decodes: the Trace of its prompts, or of a replay."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from oled.decoding.observers import DecodeObserver, IterationInfo
from oled.offload.predict import NextLayerRouting
from oled.progress import track

if TYPE_CHECKING:
    from oled.decoding.config import DecodeConfig
    from oled.decoding.follow import Trajectory
    from oled.model.model import MoE
    from oled.runtime import Runtime
    from oled.trace.format import Trace
    from oled.trace.recorder import TraceRecorder


class _StepRecorder(DecodeObserver):
    """Hands every iteration's token states to the trace recorder."""

    def __init__(self, recorder: TraceRecorder) -> None:
        self.recorder = recorder

    def on_generation_start(self, prompt_length: int) -> None:
        self.recorder.new_prompt()

    def on_iteration(self, info: IterationInfo) -> None:
        from oled.offload.engine import step_context

        self.recorder.record_step(step_context(info))


RANKS = 16  # the router's best experts recorded per row (the top-k and those just below)


def recording(
    runtime: Runtime, ranks: int = 0, *, ahead: bool = False
) -> tuple[TraceRecorder, DecodeObserver, Callable[[], None]]:
    """A recorder for `runtime`'s model and the hooks that feed it; with `ranks` > 0 also each
    row's `ranks` best experts by the router's selection score, and their scores; with `ahead`
    also the next layer's routing predicted from each layer's router input (NextLayerRouting).

    Returns (recorder, observer, remove): pass `observer` to `Runtime.stream`; call `remove()`
    to detach the hooks.
    """
    from oled.trace.recorder import TraceRecorder

    cfg = runtime.config
    recorder = TraceRecorder(
        num_moe_layers=cfg.num_moe_layers,
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        expert_bytes=runtime.checkpoint.experts.expert_bytes,
        hidden_size=cfg.hidden_size,
        model_path=str(runtime.checkpoint.path),
    )

    def hook(layer: int, ids: Tensor, weights: Tensor) -> None:
        recorder.record_routing(layer, ids.cpu().numpy(), weights.float().cpu().numpy())

    removers = [runtime.model.add_routing_hook(hook)]
    ranks = min(ranks, cfg.num_experts)
    blocks = runtime.model.moe_blocks
    quiet = _Quiet()
    if ranks:
        removers += [_rank_hook(block, recorder, ranks, quiet) for block in blocks]
    if ahead:
        predict = NextLayerRouting(runtime.model)
        removers += [_ahead_hook(block, recorder, predict, quiet) for block in blocks[:-1]]

    def remove() -> None:
        for r in removers:
            r()

    return recorder, _StepRecorder(recorder), remove


class _Quiet:
    """Set while a hook runs another layer's router, whose own hooks then stay silent."""

    on = False


def _rank_hook(
    block: MoE, recorder: TraceRecorder, ranks: int, quiet: _Quiet
) -> Callable[[], None]:
    """A forward hook on `block`'s router that hands its `ranks` best experts to `recorder`."""
    from oled.model.layers import router_logits

    gate = block.gate

    def hook(_module: object, inputs: tuple[Tensor, ...], _out: object) -> None:
        if quiet.on:
            return
        scores = torch.sigmoid(router_logits(inputs[0], gate.weight))  # [T, E]
        best = (scores + gate.expert_bias.float()).topk(ranks, dim=-1).indices  # [T, C]
        best_scores = scores.gather(1, best)  # [T, C]
        recorder.record_ranking(block.moe_index, best.cpu().numpy(), best_scores.cpu().numpy())

    return gate.register_forward_hook(hook).remove


def _ahead_hook(
    block: MoE, recorder: TraceRecorder, predict: NextLayerRouting, quiet: _Quiet
) -> Callable[[], None]:
    """A forward hook on `block`'s router that hands `recorder` the next layer's routing of
    the same router input, as the engine predicts it to copy ahead."""

    def hook(_module: object, inputs: tuple[Tensor, ...], _out: object) -> None:
        if quiet.on:
            return
        quiet.on = True
        try:
            ids = predict(block.moe_index, inputs[0])  # [T, K] of MoE layer moe_index + 1
        finally:
            quiet.on = False
        recorder.record_ahead(block.moe_index, ids.cpu().numpy())

    return block.gate.register_forward_hook(hook).remove


def record(
    runtime: Runtime,
    prompt_ids: list[list[int]],
    *,
    decode: DecodeConfig | None = None,
    follow: Trajectory | None = None,
    progress: bool = False,
    ranks: int = RANKS,
) -> Trace:
    """Decode each prompt with `runtime` (its decode settings unless `decode`; committing
    `follow`'s tokens if given), recording per forward and MoE layer the routing, the
    router's `ranks` best experts with their scores and the next layer's routing as the
    engine predicts it from this layer's router input: the Trace.
    `progress`: a bar per prompt on a terminal (oled.progress.track)."""
    recorder, observer, remove = recording(runtime, ranks, ahead=True)
    try:
        for ids in track(prompt_ids, "recording", show=progress):
            for _ in runtime.stream(ids, decode=decode, observers=[observer], follow=follow):
                pass
    finally:
        remove()
    return recorder.build()


def record_replay(
    runtime: Runtime, trace: Trace, prompts: Sequence[int] | None = None, *, progress: bool = False
) -> Trace:
    """Replay `trace`'s prompts (indices; all by default) on `runtime` (Runtime.replay),
    recording what the runtime routed, committed and reported: the Trace (the replayed one,
    row for row, with weights at the recorder's precision); `progress` as in `record`."""
    recorder, observer, remove = recording(runtime)
    try:
        indices = range(len(runtime.routing_replay(trace))) if prompts is None else prompts
        for index in track(indices, "recording", show=progress):
            runtime.replay(trace, index, observers=[observer])
    finally:
        remove()
    return recorder.build()


def record_trace(
    runtime: Runtime, prompt_ids: list[list[int]], out: Path, *, progress: bool = False
) -> Path:
    """`record` the prompts' routing into the trace file `out`."""
    record(runtime, prompt_ids, progress=progress).save(out)
    return out
