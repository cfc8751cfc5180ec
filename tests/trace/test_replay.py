"""Routing replay: a checkpoint of the trace's routing geometry runs the trace's routing,
commits and confidences, so that recording the replay gives the trace back."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from oled.decoding.observers import DecodeObserver
from oled.model.presets import init_checkpoint
from oled.offload.budget import Budget
from oled.runtime import Runtime, build_runtime, load_runtime
from oled.trace.format import Trace
from oled.trace.record import record_replay
from oled.trace.replay import (
    ReplayPrompt,
    RoutingReplay,
    check_geometry,
    select_prompts,
    split_prompts,
)

FIELDS = (
    "ids",
    "weights",
    "token_state",
    "confidence",
    "row_offsets",
    "block",
    "iteration",
    "step",
)


def prompts_of(trace: Trace, chosen: list[int]) -> Trace:
    """The trace of some of its prompts."""
    bounds = np.append(np.flatnonzero(trace.step == 0), trace.num_steps)
    steps = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in chosen])
    rows = np.concatenate(
        [np.arange(trace.row_offsets[s], trace.row_offsets[s + 1]) for s in steps]
    )
    lengths = np.diff(trace.row_offsets)[steps]
    return replace(
        trace,
        ids=trace.ids[:, rows],
        weights=trace.weights[:, rows],
        token_state=trace.token_state[rows],
        confidence=trace.confidence[rows],
        row_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        block=trace.block[steps],
        iteration=trace.iteration[steps],
        step=trace.step[steps],
    )


def assert_same_trace(again: Trace, trace: Trace) -> None:
    for name in FIELDS:
        a, b = getattr(again, name), getattr(trace, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.array_equal(a, b), name


def offloaded(model_dir, budget: Budget, **runtime) -> Runtime:
    """The checkpoint at `model_dir` offloaded on the CPU (fp32, the CI cost profile)."""
    return build_runtime(
        model=str(model_dir), device="cpu", dtype="float32", cost="cpu-ci", budget=budget, **runtime
    )


@pytest.fixture(scope="module")
def trace(trace_file) -> Trace:
    return Trace.load(trace_file)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """The tiny preset with another seed: the trace's routing geometry, other sizes (hidden
    128 against 256, vocabulary 1024 against 8704)."""
    return init_checkpoint(tmp_path_factory.mktemp("tiny-seed1"), preset="tiny", seed=1)


def test_the_trace_splits_into_its_prompts(trace):
    prompts = split_prompts(trace)
    assert [p.prompt_length for p in prompts] == [19, 13, 16]
    assert all(p.block_length == 8 for p in prompts)
    assert [p.steps for p in prompts] == [13, 12, 16]
    assert sum(p.steps for p in prompts) == trace.num_steps
    assert [p.blocks for p in prompts] == [2, 3, 2]
    # 16 tokens end on a block boundary: the first decoded block is all masked
    assert prompts[2].first == 16 and prompts[2].max_new_tokens == 16
    assert prompts[1].first == 8 and prompts[1].max_new_tokens == 3 * 8 - 5


def test_replay_on_the_recording_checkpoint_records_the_trace_again(trace):
    rt = load_runtime("builtin:tiny", device="cpu", dtype="float32")
    assert_same_trace(record_replay(rt, trace), trace)
    stats = rt.stats()
    assert stats["iterations"] == 16 and stats["blocks"] == 2 and stats["prompt_tokens"] == 16
    assert stats["finish_reason"] == "length" and stats["tokens"] == 16


def test_replay_offloaded_on_another_checkpoint_records_the_trace_again(trace, other_dir):
    """Another seed and hidden size, a quarter of the experts on the device, OLED's policies
    (confidence-guided retention): the same routing, schedule and confidences."""
    rt = offloaded(other_dir, Budget("expert_fraction", 0.25), stage_capacity=2)
    seen = []
    real = rt.executor.planner.observe

    def observe(layer, ids, weights, ctx):  # what the policies are shown
        seen.append((layer, ids.copy(), ctx.confidence.copy(), ctx.step))
        return real(layer, ids, weights, ctx)

    rt.executor.planner.observe = observe
    again = record_replay(rt, trace)
    assert_same_trace(again, trace)
    assert rt.offload_summary()["misses"] > 0
    for layer, ids, confidence, step in seen[:5]:  # prompt 0's forwards
        a, b = trace.row_offsets[step], trace.row_offsets[step + 1]
        assert np.array_equal(ids, trace.ids[layer, a:b])
        assert np.array_equal(confidence, trace.confidence[a:b])
    # the model's own routing again after the replay
    assert rt.model.routing_key is None
    rt.generate("Hello", max_new_tokens=8, block_length=8)


def test_selected_prompts_and_cpu_experts(trace, tiny_dir):
    rt = offloaded(tiny_dir, Budget("expert_budget", 3), stage_capacity=1)
    again = record_replay(rt, trace, [1])
    assert_same_trace(again, prompts_of(trace, [1]))
    assert rt.stats()["cpu_experts"] + rt.stats()["copies"] > 0
    assert rt.replay(trace, -1)["iterations"] == 16  # negative: from the end


def test_a_geometry_mismatch_is_one_clear_line(trace):
    wider = replace(trace, meta=replace(trace.meta, num_experts=64, top_k=6))
    rt = load_runtime("builtin:tiny", device="cpu", dtype="float32")
    with pytest.raises(ValueError) as err:
        rt.replay(wider, 0)
    message = str(err.value)
    assert "\n" not in message
    assert "trace's routing geometry (3 MoE layers x 64 experts, top-6)" in message
    assert "the model's (3 MoE layers x 32 experts, top-4)" in message


def test_check_geometry_names_both_shapes():
    meta = SimpleNamespace(num_moe_layers=19, num_experts=256, top_k=8)
    config = SimpleNamespace(num_moe_layers=19, num_experts=256, num_experts_per_tok=8)
    check_geometry(SimpleNamespace(meta=meta), config)
    config.num_experts = 128
    with pytest.raises(ValueError, match="256 experts.*128 experts"):
        check_geometry(SimpleNamespace(meta=meta), config)


def test_select_prompts():
    assert select_prompts(None, 5) == [0, 1, 2, 3, 4]
    assert select_prompts("all", 3) == [0, 1, 2]
    assert select_prompts("1:3", 5) == [1, 2]
    assert select_prompts(":2, 4", 5) == [0, 1, 4]
    assert select_prompts("-1", 5) == [4]
    for bad in ("5", "x", "3:3"):
        with pytest.raises(ValueError, match="prompt selection"):
            select_prompts(bad, 5)


def test_an_unreplayable_trace_is_refused(trace):
    cut = prompts_of(trace, [0])
    cut.step = cut.step[1:]  # no prompt forward first
    cut.block, cut.iteration = cut.block[1:], cut.iteration[1:]
    a = cut.row_offsets[1]
    cut.row_offsets = cut.row_offsets[1:] - a
    cut.token_state, cut.confidence = cut.token_state[a:], cut.confidence[a:]
    cut.ids, cut.weights = cut.ids[:, a:], cut.weights[:, a:]
    with pytest.raises(ValueError, match="step 0"):
        split_prompts(cut)
    open_block = prompts_of(trace, [0])
    open_block.token_state = open_block.token_state.copy()
    open_block.token_state[open_block.row_offsets[4] : open_block.row_offsets[5]] = 1  # masked
    with pytest.raises(ValueError, match="masked"):
        split_prompts(open_block)


def test_block_length_comes_from_the_trace_or_the_hint():
    one = SimpleNamespace(
        step=np.array([0]),
        block=np.array([0]),
        iteration=np.array([0]),
        row_offsets=np.array([0, 24]),
        token_state=np.array([0] * 19 + [2] * 5, np.int8),
    )
    assert split_prompts(one, 8) == [ReplayPrompt(0, 0, 1, 19, 8, 1)]
    assert split_prompts(one, 12)[0].prompt_length == 12 + 7
    with pytest.raises(ValueError, match="multiple of the block length"):
        split_prompts(one, 7)


def test_replay_source_is_kept_per_trace(trace):
    rt = load_runtime("builtin:tiny", device="cpu", dtype="float32")
    source = rt.routing_replay(trace)
    assert isinstance(source, RoutingReplay) and rt.routing_replay(trace) is source
    assert len(source) == 3 and source.override.capacity == 24
    key = source.override.key
    rt.model.set_routing_override(source.override)
    assert rt.model.routing_key == key
    rt.model.set_routing_override(None)
    assert rt.model.routing_key is None


@pytest.mark.gpu
@pytest.mark.parametrize("offloaded", [False, True])
def test_graphed_replay_runs_the_traced_routing(trace, other_dir, offloaded, monkeypatch):
    """On CUDA, forwards replayed as graphs (whole forwards when resident, pieces around each
    MoE layer when offloading) use the trace's routing: the same logits as eager forwards bit
    for bit, the traced ids shown to the policies; after the replay the model routes itself
    again (its graphs are keyed apart)."""
    from oled.decoding import decoder
    from oled.policies import compensation as C
    from oled.policies import retention as R

    logits: list = []
    real = decoder._confidence

    def confidence(x, temperature, gen):
        logits.append(x.float().cpu().clone())
        return real(x, temperature, gen)

    monkeypatch.setattr(decoder, "_confidence", confidence)

    def runtime(graphs: bool):
        if not offloaded:
            return load_runtime(str(other_dir), device="cuda", dtype="bfloat16", graphs=graphs)
        return build_runtime(
            model=str(other_dir),
            device="cuda",
            dtype="bfloat16",
            cost="h200",
            graphs=graphs,
            budget=Budget("expert_fraction", 0.25),
            retention=R.LRURetention(),
            compensation=C.TransferOnly(),
        )

    def replays(rt) -> list:
        logits.clear()
        for _ in range(2):  # the second pass replays the graphs the first captured
            for index in range(3):
                rt.replay(trace, index)
        out = list(logits)
        logits.clear()
        out.append(rt.generate("Hello there", max_new_tokens=16, block_length=8).token_ids)
        return out

    eager = replays(runtime(False))
    rt = runtime(True)
    seen = []
    if offloaded:
        observe = rt.executor.planner.observe

        def watch(layer, ids, weights, ctx):
            seen.append((layer, ids.copy(), ctx.step))
            return observe(layer, ids, weights, ctx)

        rt.executor.planner.observe = watch
    graphed = replays(rt)
    assert rt.forward.replays > 0
    assert len(graphed) == len(eager) and graphed[-1] == eager[-1]
    for a, b in zip(graphed[:-1], eager[:-1], strict=True):
        assert torch.equal(a, b)
    for layer, ids, step in seen[: 3 * 13]:  # prompt 0's forwards
        a, b = trace.row_offsets[step], trace.row_offsets[step + 1]
        assert np.array_equal(ids, trace.ids[layer, a:b])


def _copying_ahead(model_dir) -> Runtime:
    """The model offloaded at half its experts, copying up to 8 experts a layer ahead from the
    next layer's predicted routing."""
    return offloaded(model_dir, Budget("expert_fraction", 0.5), prefetch=8)


def test_a_replay_copies_ahead_from_the_traced_prediction(trace, other_dir):
    """The engine predicts from what the trace recorded of the traced model's routers, not
    from the replaying model's (which route otherwise), then predicts on its own again."""
    from oled.offload.predict import NextLayerRouting

    rt = _copying_ahead(other_dir)
    engine = rt.engine
    asked: list[tuple[int, np.ndarray]] = []
    real = engine.planner.prefetch

    def prefetch(layer, ids, after=None):  # what the engine copies ahead from
        asked.append((layer, ids.copy()))
        return real(layer, ids, after)

    engine.planner.prefetch = prefetch
    rt.replay(trace, 0)
    first = split_prompts(trace)[0]
    recorded = {}  # (layer, rows of a forward) -> the traced prediction
    for s in range(first.first_step, first.first_step + first.steps):
        for layer, ids in enumerate(trace.ahead(s)):
            recorded.setdefault((layer + 1, len(ids)), []).append(ids)
    assert len(asked) > len(recorded)
    for layer, ids in asked:
        assert any(np.array_equal(ids, r) for r in recorded[(layer, len(ids))])
    assert isinstance(engine.predict, NextLayerRouting)


def test_a_trace_without_a_prediction_says_so_once(trace, other_dir):
    from oled.trace.replay import ReplayWarning

    rt = _copying_ahead(other_dir)
    old = replace(trace, ahead_ids=None)
    with pytest.warns(ReplayWarning, match="records no next-layer prediction"):
        rt.replay(old, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.replay(old, 1)
    assert rt.offload_summary()["hits"] > 0


def _batch_replay(rt: Runtime, trace: Trace, chosen: list[int], max_batch: int, passes: int = 1):
    """Replay `chosen` prompts in one batch, each joining a forward after the last (`passes`
    times, in one batch decoder); every stream, and per forward its streams' trace rows and
    what the planner was shown."""
    seen: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    real = rt.executor.planner.observe

    def observe(layer, ids, weights, ctx):
        seen.append((layer, ids.copy(), ctx.token_state.copy(), ctx.confidence.copy()))
        return real(layer, ids, weights, ctx)

    rt.executor.planner.observe = observe
    streams, spans = [], []  # per forward: each stream's trace rows, in row order
    with rt.replay_batch(trace, max_batch) as (dec, source):

        class Rows(DecodeObserver):
            def on_batch_start(self, step, parts):
                rows = []
                for part in parts:
                    s = part.follow.traced.first_step + part.step
                    rows.append((int(trace.row_offsets[s]), int(trace.row_offsets[s + 1])))
                spans.append(rows)

        dec.observers.append(Rows())
        for _ in range(passes):
            waiting = [rt.replay_request(source, i) for i in chosen]
            while waiting or dec.busy:
                if waiting:
                    ids, decode, follow = waiting.pop(0)
                    streams.append(dec.add(ids, decode, follow=follow))
                dec.step()
    rt.executor.planner.observe = real
    return streams, spans, seen


def test_a_batch_replays_several_prompts_side_by_side(trace, other_dir):
    """Three prompts decoded together, joining a forward apart: each batched forward runs
    every stream's traced routing side by side, and the policies see the traced token states
    and confidences; each stream decodes its traced forwards and blocks."""
    rt = offloaded(other_dir, Budget("expert_fraction", 0.25), stage_capacity=2)
    streams, spans, seen = _batch_replay(rt, trace, [0, 1, 2], max_batch=3)
    prompts = split_prompts(trace)
    assert [s.stats.iterations for s in streams] == [p.steps for p in prompts]
    assert [s.stats.blocks for s in streams] == [p.blocks for p in prompts]
    token = rt.replay_request(RoutingReplay(trace), 0)[2].forced[0, 0].item()
    for s, p in zip(streams, prompts, strict=True):
        assert s.generated == [token] * p.max_new_tokens
    assert max(len(rows) for rows in spans) == 3  # all three at once at some point
    layers = trace.meta.num_moe_layers
    assert len(seen) == layers * len(spans)
    for f, rows in enumerate(spans):
        for layer, ids, state, confidence in seen[f * layers : (f + 1) * layers]:
            assert np.array_equal(ids, np.concatenate([trace.ids[layer, a:b] for a, b in rows]))
            assert np.array_equal(state, np.concatenate([trace.token_state[a:b] for a, b in rows]))
            assert np.array_equal(
                confidence, np.concatenate([trace.confidence[a:b] for a, b in rows])
            )
    assert rt.offload_summary()["misses"] > 0
    assert rt.model.routing_key is None  # the routers' own routing again


def test_a_batch_replay_refuses_what_the_trace_did_not_run(trace, tiny_dir):
    rt = offloaded(tiny_dir, Budget("expert_fraction", 0.5))
    with rt.replay_batch(trace, 2) as (dec, source):
        ids, decode, follow = rt.replay_request(source, 0)
        dec.add(ids[:-8], decode, follow=follow)  # a block shorter than traced
        with pytest.raises(ValueError, match="runs 16 rows, the trace 24"):
            dec.step()
    with rt.replay_batch(trace, 2) as (dec, source):
        dec.add(*rt.replay_request(source, 0)[:2])  # follows nothing
        with pytest.raises(ValueError, match="follows no prompt of its trace"):
            dec.step()
    chunked = rt.batch_decoder(2, block_length=8, prefill_chunk=8)
    with pytest.raises(ValueError, match="prefill_chunk 0"):
        chunked.add(*rt.replay_request(RoutingReplay(trace), 0)[:2], follow=follow)


@pytest.mark.gpu
def test_a_graphed_batch_replay_runs_every_streams_traced_routing(trace, other_dir):
    """On CUDA with graphs, offloaded: the second pass replays the first pass's graphs, and
    every batched forward's routing is still its streams' traced routing side by side."""
    from oled.policies import compensation as C
    from oled.policies import retention as R

    rt = build_runtime(
        model=str(other_dir),
        device="cuda",
        dtype="bfloat16",
        cost="h200",
        budget=Budget("expert_fraction", 0.25),
        retention=R.LFURetention(),
        compensation=C.TransferOnly(),
    )
    streams, spans, seen = _batch_replay(rt, trace, [0, 1, 2], max_batch=3, passes=2)
    assert rt.forward.replays > 0
    prompts = split_prompts(trace)
    assert [s.stats.iterations for s in streams] == [p.steps for p in prompts] * 2
    layers = trace.meta.num_moe_layers
    assert len(seen) == layers * len(spans)
    for f, rows in enumerate(spans):
        for layer, ids, _, confidence in seen[f * layers : (f + 1) * layers]:
            assert np.array_equal(ids, np.concatenate([trace.ids[layer, a:b] for a, b in rows]))
            assert np.array_equal(
                confidence, np.concatenate([trace.confidence[a:b] for a, b in rows])
            )
