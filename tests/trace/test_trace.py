"""Trace format round trip, recorder, simulator and the Belady bound."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from oled.policies import ANCHORS, anchor_policies
from oled.policies.allocation import AdaptiveAllocation, UniformAllocation
from oled.policies.base import CostModel, StepContext
from oled.policies.compensation import (
    CooperativeCompensation,
    CpuOnly,
    TransferOnly,
)
from oled.policies.retention import (
    ConfidenceRetention,
    LFURetention,
    LRURetention,
    ScoreEMARetention,
)
from oled.token_states import TOKEN_FIXED, TOKEN_MASKED
from oled.trace.format import Trace
from oled.trace.recorder import TraceRecorder
from oled.trace.simulate import (
    ClairvoyantRetention,
    SimResult,
    belady_bypass,
    belady_layer,
    requests,
    simulate,
)
from oled.trace.synthetic import synthetic_trace

COST = CostModel.profile("h200")


@pytest.fixture(scope="module")
def small() -> Trace:
    return synthetic_trace(num_layers=4, num_experts=64, blocks=3, block_length=16, seed=3)


def test_save_load_round_trip(tmp_path, small: Trace) -> None:
    path = tmp_path / "t.oledtrace"
    small.save(path)
    back = Trace.load(path)
    assert back.meta == small.meta
    for name in ("ids", "weights", "token_state", "confidence", "row_offsets", "block", "step"):
        assert np.array_equal(getattr(back, name), getattr(small, name)), name
    (c1, r1), (c2, r2) = next(iter(back)), next(iter(small))
    assert c1.step == c2.step and np.array_equal(r1[2][0], r2[2][0])


def test_load_rejects_non_trace(tmp_path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="notes.txt"):
        Trace.load(bad)
    from safetensors.numpy import save_file

    other = tmp_path / "weights.safetensors"
    save_file({"x": np.zeros(2, np.float32)}, str(other))
    with pytest.raises(ValueError, match="weights.safetensors"):
        Trace.load(other)


def test_recorder_builds_trace(tmp_path) -> None:
    rec = TraceRecorder(num_moe_layers=2, num_experts=8, top_k=2, first_moe_layer=1, hidden_size=4)
    rec.new_prompt()
    rng = np.random.default_rng(0)
    for step, t in enumerate([5, 3]):
        for layer in (1, 2):
            rec.record_routing(layer, rng.integers(0, 8, (t, 2)), rng.random((t, 2)))
        state = np.full(t, TOKEN_MASKED, np.int8)
        state[0] = TOKEN_FIXED
        rec.record_step(StepContext(0, step, step, state, np.full(t, 0.5, np.float32)))
    trace = rec.build()
    assert trace.num_steps == 2 and trace.ids.shape == (2, 8, 2)
    assert trace.meta.prompt_count == 1 and trace.meta.hidden_size == 4
    trace.save(tmp_path / "r.oledtrace")
    ctx, routing = list(Trace.load(tmp_path / "r.oledtrace"))[1]
    assert len(ctx.token_state) == 3 and routing[1][0].shape == (3, 2)
    with pytest.raises(ValueError, match="no routing recorded"):
        rec.record_routing(1, np.zeros((1, 2)), np.zeros((1, 2)))
        rec.record_step(StepContext(0, 0, 2, np.zeros(1, np.int8), np.ones(1, np.float32)))


def brute_force_bound(experts: np.ndarray, capacity: int) -> int:
    """Max hits by exhaustive search over keep/evict/bypass choices (tiny inputs)."""
    from functools import cache

    seq = tuple(experts.tolist())

    @cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(seq):
            return 0
        e = seq[i]
        if e in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {e}))
        else:
            options += [best(i + 1, (cache - {v}) | {e}) for v in cache]
        return max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_belady_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts = rng.integers(0, 5, 14)
    steps = np.arange(14)
    for cap in (1, 2, 3):
        assert belady_layer(experts, steps, cap) == brute_force_bound(experts, cap)


def random_trace(seed: int) -> Trace:
    return synthetic_trace(
        num_layers=3,
        num_experts=32,
        blocks=2,
        block_length=8,
        drift=1.0,
        block_drift=1.0,
        skew=0.0,
        seed=seed,
    )


@pytest.mark.parametrize("trace_kind", ["random", "structured"])
@pytest.mark.parametrize("slots", [4, 12])
def test_belady_bounds_every_policy(trace_kind: str, slots: int, small: Trace) -> None:
    trace = random_trace(1) if trace_kind == "random" else small
    layers = trace.meta.num_moe_layers
    for name in ANCHORS:
        if name == "fiddler":
            continue  # a profile prefill starts warm; the bound is cold-start
        res = simulate(
            trace,
            **anchor_policies(name),
            cost=COST,
            total_slots=slots * layers,
            stage_capacity=2,
        )
        bound = belady_bypass(trace, res.capacity_history)
        assert res.hit_rate <= bound + 1e-12, (name, res.hit_rate, bound)


@pytest.mark.parametrize("trace_kind", ["random", "structured"])
@pytest.mark.parametrize("extra", [0, 4, 16])
def test_clairvoyant_retention_bounds_every_retention_that_caches_each_miss(
    trace_kind: str, extra: int, small: Trace
) -> None:
    # where a layer holds every expert a forward needs (no miss overflows to the stage)
    trace = random_trace(2) if trace_kind == "random" else small
    L = trace.meta.num_moe_layers
    slots = extra + max(np.bincount(requests(trace, layer)[1]).max() for layer in range(L))

    def misses(retention) -> int:
        res = simulate(
            trace,
            allocation=UniformAllocation(),
            retention=retention,
            compensation=TransferOnly(),
            cost=COST,
            total_slots=slots * L,
            stage_capacity=2,
        )
        return sum(res.stats["requests"]) - sum(res.stats["hits"])

    least = misses(ClairvoyantRetention(trace))
    kinds = (LRURetention, LFURetention, ScoreEMARetention, ConfidenceRetention)
    others = [misses(kind()) for kind in kinds]
    assert least <= min(others), (least, others)
    requested = sum(len(requests(trace, layer)[0]) for layer in range(L))
    bypass = requested * (1 - belady_bypass(trace, [slots] * L))
    assert least >= round(bypass)  # a cache that may bypass misses no more


def test_requests_are_distinct_per_step(small: Trace) -> None:
    experts, steps = requests(small, 0)
    pairs = set(zip(steps.tolist(), experts.tolist(), strict=True))
    assert len(pairs) == len(experts)


def test_simulator_reports(small: Trace) -> None:
    res = simulate(
        small,
        allocation=UniformAllocation(),
        retention=LRURetention(),
        compensation=CpuOnly(),
        cost=COST,
        total_slots=4 * 8,
    )
    assert res.hit_rate == 0.0 and res.cpu_share == pytest.approx(1.0)
    assert res.copies == 0 and res.stall_ms == 0.0
    full = simulate(
        small,
        allocation=UniformAllocation(),
        retention=LRURetention(),
        compensation=TransferOnly(),
        cost=COST,
        total_slots=4 * 64,
    )
    assert full.hit_rate > 0.5 and full.cpu_share == 0.0
    assert full.ms_per_iteration < res.ms_per_iteration
    assert len(full.hit_rate_per_layer) == 4
    assert full.to_dict()["iterations"] == small.num_steps


def _repeating_trace(ids_of_step: list[np.ndarray], steps: list[int], layers: int = 1) -> Trace:
    """`layers` layers alike; forward i routes its 2 tokens to ids_of_step[i] [2, 2] (step:
    steps[i])."""
    from oled.trace.format import TraceMeta

    n = len(ids_of_step)
    ids = np.stack(ids_of_step).reshape(1, 2 * n, 2).astype(np.int16)  # [1, R, K]
    ids = np.repeat(ids, layers, axis=0)  # [L, R, K]
    return Trace(
        meta=TraceMeta(num_moe_layers=layers, num_experts=16, top_k=2),
        ids=ids,
        weights=np.ones(ids.shape, np.float32),
        token_state=np.full(2 * n, TOKEN_MASKED, np.int8),
        confidence=np.zeros(2 * n, np.float32),
        row_offsets=np.arange(n + 1) * 2,
        block=np.zeros(n, np.int32),
        iteration=np.array(steps, np.int32),
        step=np.array(steps, np.int32),
    )


def test_simulator_counts_the_misses_routed_the_forward_before() -> None:
    """A cache of 2 slots under 4 experts routed again each forward: every later miss was
    routed the forward before; fresh experts each forward: none was; a generation's first
    forward is not counted."""
    same = np.array([[0, 1], [2, 3]])
    policies = dict(
        allocation=UniformAllocation(),
        retention=LRURetention(),
        compensation=TransferOnly(),
        cost=COST,
        total_slots=2,
    )
    again = simulate(_repeating_trace([same] * 4, [0, 1, 2, 3]), **policies)
    assert again.copies + again.staged > 4 and again.misses_routed_before == 1.0
    fresh = [same + 4 * (i % 4) for i in range(4)]
    assert simulate(_repeating_trace(fresh, [0, 1, 2, 3]), **policies).misses_routed_before == 0
    # two generations: the second's first forward routes what the first's last did, uncounted
    two = simulate(_repeating_trace([same, same + 4, same + 4, same + 4], [0, 1, 0, 1]), **policies)
    # counted: the 1st's step 1 (4 misses, none routed before), the 2nd's (2 of 4 cached: 2
    # misses, both routed before)
    assert two.misses_routed_before == pytest.approx(2 / 6)


def test_simulator_replays_copies_ahead_from_the_forward_before() -> None:
    """With CPU-only misses the cache fills only by copies ahead: from the second forward on,
    layer 1 finds what it routed the forward before, copied during layer 0 on spare link time
    (hidden: no stall); without them nothing is copied; transfer-only copies stall."""
    same = np.array([[0, 1], [2, 3]])
    trace = _repeating_trace([same] * 4, [0, 1, 2, 3], layers=2)
    policies = dict(
        allocation=UniformAllocation(), retention=LRURetention(), cost=COST, total_slots=2 * 4
    )
    ahead = simulate(
        trace, compensation=CpuOnly(), prefetch_limit=8, ahead_from="previous", **policies
    )
    assert ahead.stats["predicted"] == [0, 4] and ahead.stats["predicted_hits"] == [0, 4]
    assert ahead.stats["hits"] == [0, 3 * 4]  # layer 1, forwards 1-3
    assert ahead.copy_ms_per_iteration > 0 and ahead.stall_ms == 0
    assert ahead.hidden_copy_share == 1.0
    none = simulate(trace, compensation=CpuOnly(), **policies)
    assert none.copies == 0 and none.copy_ms_per_iteration == 0 and sum(none.stats["hits"]) == 0
    assert none.ms_per_iteration > ahead.ms_per_iteration
    assert ahead.ahead_source == "previous" and none.ahead_source == "none"
    assert ahead.ahead_per_iteration == ahead.ahead_used_per_iteration == 4 / 4
    # a trace that records no prediction: the router's copies none, and says so
    router = simulate(trace, compensation=CpuOnly(), prefetch_limit=8, **policies)
    assert router.copies == 0 and router.ahead_per_iteration == 0
    assert router.ahead_source == "none (the trace records no prediction)"
    demand = simulate(trace, compensation=TransferOnly(), **policies)
    assert demand.stall_ms > 0 and 0 <= demand.hidden_copy_share < 1


def _predicted(trace: Trace, ahead: np.ndarray | None = None) -> Trace:
    """`trace` with its next-layer prediction recorded: `ahead` [L - 1, R, K], or the next
    layer's own routing (an exact prediction)."""
    from dataclasses import replace

    return replace(trace, ahead_ids=trace.ids[1:].copy() if ahead is None else ahead)


def test_simulator_replays_the_router_s_recorded_prediction() -> None:
    """Fresh experts every forward, 4 slots a layer, every miss copied: with an exact
    prediction layer 1's experts are copied during layer 0 on spare link time (the 4 it
    names a forward), and layer 1 then hits them all without waiting; the same copies, but
    the forward is shorter and more of the link's time hidden; two devices copy ahead each
    its share's."""
    routed = [np.array([[0, 1], [2, 3]]) + 4 * i for i in range(4)]
    trace = _predicted(_repeating_trace(routed, [0, 1, 2, 3], layers=2))

    def fresh() -> dict:
        return dict(
            allocation=UniformAllocation(), retention=LRURetention(), compensation=TransferOnly()
        )

    policies = dict(**fresh(), cost=COST, total_slots=2 * 4)
    demand = simulate(trace, **policies)
    assert demand.stats["misses"] == [16, 16] and demand.ahead_source == "none"
    ahead = simulate(trace, prefetch_limit=16, **policies)
    assert ahead.ahead_source == "router (recorded)"
    assert ahead.stats["predicted"] == [0, 16] and ahead.stats["predicted_hits"] == [0, 16]
    assert ahead.stats["misses"] == [16, 0] and ahead.stats["hits"] == [0, 16]
    assert ahead.ahead_per_iteration == ahead.ahead_used_per_iteration == 4
    assert ahead.copies == demand.copies == 32  # the same copies, layer 1's a layer early
    assert ahead.copy_ms_per_iteration == pytest.approx(demand.copy_ms_per_iteration)
    assert ahead.stall_ms < demand.stall_ms
    assert ahead.ms_per_iteration < demand.ms_per_iteration
    assert ahead.hidden_copy_share > demand.hidden_copy_share
    split = simulate(trace, prefetch_limit=16, devices=2, fresh_policies=fresh, **policies)
    assert split.stats["predicted"] == split.stats["predicted_hits"] == [0, 16]
    assert [d["misses"] for d in split.per_device] == [8, 8]  # layer 0's only
    # without the prediction recorded: none, and the result says so
    plain = simulate(
        _repeating_trace(routed, [0, 1, 2, 3], layers=2), prefetch_limit=16, **policies
    )
    assert plain.ahead_source == "none (the trace records no prediction)"
    assert plain.stats == demand.stats and plain.ahead_per_iteration == 0


def test_simulator_stops_copying_a_prediction_that_does_not_pay() -> None:
    """A prediction of experts never routed (12, 13): copied (2 a forward) until its use falls
    below CopyAhead's min_use (0.8^4 < 0.5 after 4 forwards), then only scored; none is
    used."""
    same = np.array([[0, 1], [2, 3]])
    trace = _repeating_trace([same + 4 * (i % 2) for i in range(8)], list(range(8)), layers=2)
    wrong = np.broadcast_to(np.array([12, 13], np.int16), (1, 16, 2)).copy()
    res = simulate(
        _predicted(trace, wrong),
        allocation=UniformAllocation(),
        retention=LRURetention(),
        compensation=TransferOnly(),
        cost=COST,
        total_slots=2 * 4,
        prefetch_limit=16,
    )
    assert res.stats["predicted"] == [0, 2 * 4] and res.stats["predicted_hits"] == [0, 0]
    assert res.ahead_used_per_iteration == 0 and res.stats["misses"][1] == 8 * 4


def test_simulator_replays_a_recorded_trace_s_prediction(trace_file: Path) -> None:
    """The recorded trace of the built-in model: copies ahead from its prediction, some of
    them used, under the same budget as without."""
    trace = Trace.load(trace_file)
    assert trace.ahead_ids is not None
    settings = {"cost": COST, "total_slots": 3 * 16, **anchor_policies("oled")}
    plain = simulate(trace, **settings)
    ahead = simulate(trace, prefetch_limit=16, **settings)
    assert ahead.ahead_source == "router (recorded)"
    assert 0 < ahead.ahead_used_per_iteration <= ahead.ahead_per_iteration
    assert sum(ahead.stats["predicted"]) == round(ahead.ahead_per_iteration * trace.num_steps)
    assert sum(ahead.capacities) == sum(plain.capacities) and plain.ahead_per_iteration == 0


def test_simulator_runtime_bound() -> None:
    trace = synthetic_trace(num_layers=19, blocks=32, seed=0)
    assert trace.num_steps >= 500
    t0 = time.perf_counter()
    simulate(
        trace,
        allocation=AdaptiveAllocation(),
        retention=ConfidenceRetention(),
        compensation=CooperativeCompensation(),
        cost=COST,
        total_slots=19 * 64,
    )
    t1 = time.perf_counter()
    belady_bypass(trace, [64] * 19)
    t2 = time.perf_counter()
    assert t1 - t0 < 15 and t2 - t1 < 15, (t1 - t0, t2 - t1)


def test_planner_bench_replays_a_trace(tmp_path, small: Trace) -> None:
    """tools/bench_planner.py --trace: µs per decode plan for every anchor configuration."""
    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "small.oledtrace"
    small.save(path)
    out = subprocess.run(
        [
            sys.executable,
            str(root / "tools" / "bench_planner.py"),
            "--trace",
            str(path),
            "--slots-per-layer",
            "8",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    ).stdout
    assert f"{small.num_steps} forwards x 4 MoE layers, 64 experts" in out
    for anchor in ANCHORS:
        for planner in ("python", "compiled"):
            found = re.search(rf"^  {anchor}\s+{planner}\s+([\d.]+) us per decode plan$", out, re.M)
            assert found and float(found.group(1)) > 0, out


def test_prompt_starts_and_ids_round_trip_as_uint8(tmp_path):
    from oled.trace.synthetic import synthetic_trace

    a = synthetic_trace(num_layers=3, num_experts=256, top_k=4, blocks=2, seed=1)
    b = synthetic_trace(num_layers=3, num_experts=256, top_k=4, blocks=1, seed=2)
    both = Trace(
        meta=a.meta,
        ids=np.concatenate([a.ids, b.ids], 1),
        weights=np.concatenate([a.weights, b.weights], 1),
        token_state=np.concatenate([a.token_state, b.token_state]),
        confidence=np.concatenate([a.confidence, b.confidence]),
        row_offsets=np.concatenate([a.row_offsets, a.row_offsets[-1] + b.row_offsets[1:]]),
        block=np.concatenate([a.block, b.block]),
        iteration=np.concatenate([a.iteration, b.iteration]),
        step=np.concatenate([a.step, b.step]),
    )
    assert list(both.prompt_starts) == [0, a.num_steps]
    path = tmp_path / "t.oledtrace"
    both.save(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        assert f.get_tensor("ids").dtype == np.uint8  # 256 experts fit in a byte on disk
    loaded = Trace.load(path)
    assert loaded.ids.dtype == np.int16 and np.array_equal(loaded.ids, both.ids)


def test_a_recorded_trace_ranks_the_router_s_best_experts(trace_file, tmp_path) -> None:
    """Each row's 16 best experts by the router's selection score, with their sigmoid scores:
    the routed experts are among them, and their scores are proportional to the gate weights
    (the top-k normalised and scaled), to the 1/255 steps the file keeps."""
    trace = Trace.load(trace_file)
    layers, rows, k = trace.ids.shape
    assert trace.ranks == 16 and trace.ranked_ids.shape == (layers, rows, 16)
    scores = trace.ranked_scores
    assert scores.min() >= 0 and scores.max() <= 1
    ranked = trace.ranked_ids.astype(np.int64)
    routed = trace.ids.astype(np.int64)
    where = ranked[:, :, None, :] == routed[:, :, :, None]  # [L, R, K, C]
    found = where.any(-1)  # [L, R, K]
    assert found.mean() > 0.95
    full = found.all(-1)  # rows whose routed experts are all ranked
    routed_scores = (where * scores[:, :, None, :]).sum(-1)[full]  # [N, K]
    weights = trace.weights.astype(np.float32)[full]
    clear = (routed_scores > 0.05).all(-1)  # scores far above the 1/255 steps
    assert clear.mean() > 0.5
    ratio = weights[clear] / routed_scores[clear]  # scale / sum, per row
    spread = ratio.std(-1) / ratio.mean(-1)
    assert np.quantile(spread, 0.99) < 0.03
    ctx_ranking = trace.ranking(1)
    assert ctx_ranking is not None and ctx_ranking[0][0].shape[1] == 16
    trace.save(tmp_path / "again.oledtrace")
    again = Trace.load(tmp_path / "again.oledtrace")
    assert np.array_equal(again.ranked_ids, trace.ranked_ids)
    assert np.array_equal(again.ranked_scores, trace.ranked_scores)


def test_a_compressed_trace_reads_as_the_plain_one(trace_file, tmp_path) -> None:
    from oled.trace.format import prompt_count, read_meta

    trace = Trace.load(trace_file)
    trace.save(tmp_path / "z.oledtrace", compress=True)
    assert (tmp_path / "z.oledtrace").stat().st_size < trace_file.stat().st_size
    again = Trace.load(tmp_path / "z.oledtrace")
    for name in ("ids", "weights", "token_state", "confidence", "row_offsets", "ranked_ids"):
        assert np.array_equal(getattr(again, name), getattr(trace, name)), name
    assert read_meta(tmp_path / "z.oledtrace") == trace.meta
    assert prompt_count(tmp_path / "z.oledtrace") == trace.meta.prompt_count


def _split(trace: Trace, fraction: float, devices: int, anchor: str = "lru") -> SimResult:
    """`anchor`'s simulation with `devices` devices, each at `fraction` of its share."""
    m = trace.meta
    share = m.num_experts // devices
    return simulate(
        trace,
        **anchor_policies(anchor),
        cost=COST,
        total_slots=round(fraction * m.num_moe_layers * share),
        devices=devices,
    )


def test_devices_of_a_simulation_miss_their_own_experts(trace_file: Path) -> None:
    """Two devices with every expert of their share cached miss each of their experts once,
    counted from the trace directly; together they miss what one device misses."""
    trace = Trace.load(trace_file)
    m = trace.meta
    res = _split(trace, 1.0, 2)
    owner = np.arange(m.num_experts) // (m.num_experts // 2)  # [E] device of each expert
    distinct = [np.unique(trace.ids[layer]) for layer in range(m.num_moe_layers)]
    first = [sum(int((owner[e] == d).sum()) for e in distinct) for d in (0, 1)]
    assert [d["misses"] for d in res.per_device] == first
    assert sum(first) == sum(res.stats["misses"]) == sum(_split(trace, 1.0, 1).stats["misses"])


def test_devices_of_a_simulation_have_policies_of_their_own(trace_file: Path) -> None:
    """Policies that cannot be copied for the second device are named; fresh ones serve."""
    trace = Trace.load(trace_file)
    settings = {"cost": COST, "total_slots": 3 * 8, "devices": 2}
    with pytest.raises(ValueError, match=r"StaticHot cannot be copied .* give fresh_policies"):
        simulate(trace, **anchor_policies("fiddler"), **settings)
    res = simulate(
        trace,
        **anchor_policies("fiddler"),
        fresh_policies=lambda: anchor_policies("fiddler"),
        **settings,
    )
    assert len(res.per_device) == 2 and res.iterations == trace.num_steps


@pytest.mark.parametrize("anchor", ["lru", "oled"])
def test_devices_of_a_simulation_share_the_requests(trace_file: Path, anchor: str) -> None:
    """At half of each share: the devices' requests are one device's, their misses the
    total, the forward the slowest device's with an all-reduce per MoE layer."""
    trace = Trace.load(trace_file)
    m = trace.meta
    one, two = _split(trace, 0.5, 1, anchor), _split(trace, 0.5, 2, anchor)
    assert sum(d["requests"] for d in two.per_device) == sum(one.stats["requests"])
    assert sum(d["misses"] for d in two.per_device) == sum(two.stats["misses"])
    assert sum(two.capacities) == sum(one.capacities)
    assert one.per_device == [] and one.allreduce_ms_per_iteration == 0.0
    rows = np.diff(trace.row_offsets)  # [S] routed rows per forward
    nbytes = rows * m.top_k * m.hidden_size * 4  # [S] one layer's pairs, fp32
    per_forward = [m.num_moe_layers * COST.allreduce_ms(int(b), 2) for b in nbytes]
    assert two.allreduce_ms_per_iteration == pytest.approx(np.mean(per_forward))
    assert two.ms_per_iteration >= two.allreduce_ms_per_iteration > 0


def test_a_recorded_trace_holds_the_next_layer_s_predicted_routing(tmp_path) -> None:
    """Each layer but the last records the top-k that the next layer's router gives its router
    input (what the engine copies ahead from), row for row; it survives a save."""
    import torch

    from oled.decoding import DecodeConfig
    from oled.offload.predict import NextLayerRouting
    from oled.runtime import load_runtime
    from oled.trace.record import record

    rt = load_runtime("builtin:tiny", device="cpu", dtype="float32")
    blocks = rt.model.moe_blocks
    inputs: list[list[torch.Tensor]] = [[] for _ in blocks]  # per layer, per forward [T, H]

    def capturing(layer: int, route):  # noqa: ANN001, ANN202
        def wrapped(x: torch.Tensor):  # noqa: ANN202
            inputs[layer].append(x.reshape(-1, x.shape[-1]).detach().clone())
            return route(x)

        return wrapped

    for i, b in enumerate(blocks):
        b.route = capturing(i, b.route)  # the router input of every forward
    prompt = rt.prompt_ids("What is the capital of France?", chat=True)
    trace = record(rt, [prompt], decode=DecodeConfig(block_length=8, max_new_tokens=8))
    for b in blocks:
        del b.route
    layers, rows, k = trace.ids.shape
    assert trace.ahead_ids is not None and trace.ahead_ids.shape == (layers - 1, rows, k)
    predict = NextLayerRouting(rt.model)
    for layer in range(layers - 1):
        calls = inputs[layer]
        assert [len(x) for x in calls] == np.diff(trace.row_offsets).tolist()
        want = torch.cat([predict(layer, x) for x in calls]).numpy()  # [R, K]
        assert np.array_equal(trace.ahead_ids[layer], want)
    per_step = [trace.ahead(s) for s in range(trace.num_steps)]
    assert np.array_equal(np.concatenate([a[0] for a in per_step]), trace.ahead_ids[0])
    trace.save(tmp_path / "again.oledtrace", compress=True)
    again = Trace.load(tmp_path / "again.oledtrace")
    assert np.array_equal(again.ahead_ids, trace.ahead_ids)
