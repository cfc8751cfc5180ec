"""Characteristic behaviour of each policy component."""

from __future__ import annotations

import inspect
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oled.policies import allocation, compensation, retention
from oled.policies.allocation import AdaptiveAllocation, UniformAllocation
from oled.policies.base import CostModel, LayerStats, Load, StepContext, lowest
from oled.policies.compensation import (
    BatchThreshold,
    CooperativeCompensation,
    CpuOnly,
    IntervalRefresh,
    MakespanCompensation,
    StaticHot,
    TransferOnly,
    best_split,
    copying_all_is_best,
)
from oled.policies.planner import Planner
from oled.policies.retention import ConfidenceRetention, LFURetention, LRURetention
from oled.token_states import TOKEN_COMMITTED, TOKEN_FIXED, TOKEN_MASKED

COST = CostModel.profile("h200")


def planner(ret, comp, *, experts=16, slots=4, layers=1) -> Planner:
    return Planner.for_model(
        layers,
        experts,
        1,
        slots,
        stage_capacity=0,
        cost=COST,
        allocation=UniformAllocation(),
        retention=ret,
        compensation=comp,
    )


def col(*experts: int) -> np.ndarray:
    return np.array(experts).reshape(-1, 1)


def ones(ids: np.ndarray) -> np.ndarray:
    return np.ones(ids.shape, np.float32)


def test_lru_evicts_least_recent() -> None:
    p = planner(LRURetention(), TransferOnly(), slots=3)
    for step, e in enumerate([0, 1, 2]):
        p.begin_step(step=step, block=0)
        p.plan(0, col(e), ones(col(e)))
    p.begin_step(step=3, block=0)
    p.plan(0, col(0), ones(col(0)))  # 0 is recent now; 1 is the LRU
    p.begin_step(step=4, block=0)
    plan = p.plan(0, col(3), ones(col(3)))
    assert plan.evicted.tolist() == [1]


def test_lfu_evicts_least_frequent() -> None:
    p = planner(LFURetention(), TransferOnly(), slots=2)
    for step, e in enumerate([0, 0, 0, 1, 1, 1, 1]):
        p.begin_step(step=step, block=0)
        p.plan(0, col(e), ones(col(e)))
    plan = p.plan(0, col(2), ones(col(2)))
    assert plan.evicted.tolist() == [0]


def test_batch_threshold_splits_at_min_tokens() -> None:
    comp = BatchThreshold(min_tokens=32)
    tokens = np.array([31, 32, 33, 1])
    out = comp.decide(
        layer=0, experts=np.arange(4), tokens=tokens, reuse=np.zeros(4), load=Load(), cost=COST
    )
    assert out.tolist() == [False, True, True, False]


def test_transfer_and_cpu_only() -> None:
    kw = dict(layer=0, experts=np.arange(3), tokens=np.ones(3), reuse=np.zeros(3), load=Load())
    assert TransferOnly().decide(**kw, cost=COST).all()
    assert not CpuOnly().decide(**kw, cost=COST).any()


def test_interval_refresh_loads_top_experts_every_n() -> None:
    p = planner(LRURetention(), IntervalRefresh(interval=3), slots=2)
    ids = col(5, 5, 5, 7, 7, 9)  # tokens: 5 -> 3, 7 -> 2, 9 -> 1
    copies = []
    for step in range(6):
        p.begin_step(step=step, block=0)
        plan = p.plan(0, ids, ones(ids))
        copies.append(sorted(plan.copy_experts.tolist()))
        if step == 0:
            assert plan.cpu_experts.tolist() == [9]
    assert copies[0] == [5, 7]
    assert copies[1] == copies[2] == copies[4] == []
    ids2 = col(1, 1, 2)
    p.begin_step(step=6, block=0)
    plan = p.plan(0, ids2, ones(ids2))
    assert sorted(plan.copy_experts.tolist()) == [1, 2]
    p.begin_step(step=7, block=0)
    plan = p.plan(0, col(3), ones(col(3)))
    assert plan.cpu_experts.tolist() == [3] and len(plan.copy_experts) == 0


def test_static_hot_from_counts_and_learned() -> None:
    counts = [[0, 5, 1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    p = planner(LRURetention(), StaticHot(counts=counts), slots=2)
    assert sorted(p.caches[0].cached().tolist()) == [1, 3]
    plan = p.plan(0, col(2, 3), ones(col(2, 3)))
    assert plan.hits.tolist() == [3] and plan.cpu_experts.tolist() == [2]

    p = planner(LRURetention(), StaticHot(learn_blocks=1), slots=2)
    for step, e in enumerate([4, 4, 6, 4, 6, 8]):
        p.begin_step(step=step, block=0)
        plan = p.plan(0, col(e), ones(col(e)))
        assert len(plan.copy_experts) == 0
    p.begin_step(step=6, block=1)
    p.plan(0, col(8), ones(col(8)))
    assert sorted(p.caches[0].cached().tolist()) == [4, 6]


def test_confidence_retention_prefers_low_confidence_masked() -> None:
    ret = ConfidenceRetention()
    p = planner(ret, TransferOnly(), slots=2, experts=8)
    ids = col(0, 1)  # token 0 -> expert 0 (masked, low conf), token 1 -> expert 1 (committed)
    p.plan(0, ids, ones(ids))
    ctx = StepContext(
        block=0,
        iteration=0,
        step=0,
        token_state=np.array([TOKEN_MASKED, TOKEN_COMMITTED], np.int8),
        confidence=np.array([0.1, 0.99], np.float32),
    )
    p.observe(0, ids, ones(ids), ctx)
    plan = p.plan(0, col(2), ones(col(2)))
    assert plan.evicted.tolist() == [1]
    assert ret.reuse(0, np.array([0]))[0] > ret.reuse(0, np.array([1]))[0]


def test_confidence_retention_block_boundary_keeps_masked_evidence() -> None:
    ret = ConfidenceRetention()
    ret.reset(num_layers=1, num_experts=4)
    ids, w = col(0, 1), np.ones((2, 1), np.float32)
    state = np.array([TOKEN_MASKED, TOKEN_FIXED], np.int8)
    conf = np.array([0.2, 1.0], np.float32)
    ret.observe(0, ids, w, StepContext(0, 0, 0, state, conf))
    before = ret.score[0].copy()
    ret.observe(0, col(3, 3), w, StepContext(1, 0, 1, state, conf))
    # the masked expert 0 decays only by `decay`; the fixed expert 1 also by `block_carry`
    assert ret.score[0, 0] == pytest.approx(before[0] * ret.decay * ret.masked_carry)
    assert ret.score[0, 1] == pytest.approx(before[1] * ret.decay * ret.block_carry)


def test_cooperative_prefers_cpu_when_copy_queue_is_busy() -> None:
    comp = CooperativeCompensation()
    kw = dict(layer=0, experts=np.arange(4), tokens=np.full(4, 2), reuse=np.zeros(4), cost=COST)
    idle = comp.decide(**kw, load=Load())
    busy = comp.decide(**kw, load=Load(copy_queue_ms=50.0))
    assert idle.sum() >= 1 and busy.sum() == 0


def test_cooperative_copies_high_reuse_misses() -> None:
    comp = CooperativeCompensation()
    kw = dict(layer=0, experts=np.arange(2), tokens=np.full(2, 1), load=Load(), cost=COST)
    out = comp.decide(**kw, reuse=np.array([1.0, 0.0]))
    assert out[0] or not out[1]
    assert comp.decide(**kw, reuse=np.ones(2)).sum() >= comp.decide(**kw, reuse=np.zeros(2)).sum()


def test_cooperative_learns_measured_cpu_cost() -> None:
    """Live adaptation (opt-in): CPU experts measured 10x slower than modelled send fewer
    misses to the CPU after, and reset forgets it; the default, learn_rate 0, keeps the prior
    (the decisions follow the cost model only)."""
    kw = dict(layer=0, experts=np.arange(8), tokens=np.full(8, 2), reuse=np.zeros(8), cost=COST)
    load = Load(copy_queue_ms=4.0)
    comp = CooperativeCompensation(learn_rate=0.2)
    assert comp.adaptive and not CooperativeCompensation().adaptive
    before = int((~comp.decide(**kw, load=load)).sum())
    for _ in range(30):
        comp.observe_cpu(layer=0, modeled_ms=1.0, measured_ms=10.0)
    assert comp.slowdown == pytest.approx(10.0, rel=1e-2)
    after = int((~comp.decide(**kw, load=load)).sum())
    assert before > after
    comp.reset(num_layers=1, num_experts=8)
    assert comp.slowdown == comp.cpu_slowdown
    fixed = CooperativeCompensation()
    fixed.observe_cpu(layer=0, modeled_ms=1.0, measured_ms=10.0)
    assert fixed.slowdown == fixed.cpu_slowdown
    with pytest.raises(ValueError, match="learn_rate"):
        CooperativeCompensation(learn_rate=2.0)


def test_makespan_balances_queues() -> None:
    out = MakespanCompensation().decide(
        layer=0,
        experts=np.arange(10),
        tokens=np.full(10, 4),
        reuse=np.zeros(10),
        load=Load(),
        cost=COST,
    )
    assert 0 < out.sum() < 10


def _brute_split(cpu_cost, order, load, cost, future) -> np.ndarray:
    """best_split by its definition: every k in turn, the first minimum."""
    n = len(order)
    objs = []
    for k in range(n + 1):
        copy_t = load.copy_queue_ms + (cost.copy_fixed_ms + k * cost.copy_ms_per_expert if k else 0)
        rest = order[k:]
        call = cost.cpu_call_ms if len(rest) else 0.0  # once for a layer's CPU experts
        obj = max(copy_t, load.cpu_queue_ms + call + cpu_cost[rest].sum()) + future[rest].sum()
        objs.append(obj)
    out = np.zeros(n, bool)
    out[order[: int(np.argmin(objs))]] = True
    return out


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 12),
    cpu=st.floats(0.01, 3.0),
    spread=st.floats(0.0, 2.0),
    copy_queue=st.floats(0.0, 5.0),
    cpu_queue=st.floats(0.0, 5.0),
    call=st.sampled_from([0.0, 0.05, 0.5, 2.0]),
    seed=st.integers(0, 1000),
)
def test_best_split_matches_its_definition(
    n, cpu, spread, copy_queue, cpu_queue, call, seed
) -> None:
    """The cumulative-sum evaluation, the layer's CPU call paid once when any expert is left
    on the CPU, and the shortcut taken when no CPU expert can beat copying all."""
    cost = replace(COST, cpu_call_ms=call)
    rng = np.random.default_rng(seed)
    cpu_cost = cpu + spread * rng.random(n)
    order = rng.permutation(n)
    future = 0.1 * rng.random(n)
    load = Load(copy_queue_ms=copy_queue, cpu_queue_ms=cpu_queue)
    got = best_split(cpu_cost=cpu_cost, order=order, load=load, cost=cost, future=future)
    want = _brute_split(cpu_cost, order, load, cost, future)
    assert np.array_equal(got, want)
    if copying_all_is_best(cpu_cost, load, cost):  # the policies' shortcut agrees
        assert want.all()


def test_a_costly_cpu_call_keeps_a_few_misses_off_the_cpu() -> None:
    """Two misses behind a busy link go to the CPU when a call is free, and are copied when
    the layer's call costs more than they would save."""
    cpu_cost, order = np.array([0.3, 0.3]), np.arange(2)
    load = Load(copy_queue_ms=1.0)
    free = best_split(cpu_cost=cpu_cost, order=order, load=load, cost=COST)
    costly = best_split(
        cpu_cost=cpu_cost, order=order, load=load, cost=replace(COST, cpu_call_ms=1.0)
    )
    assert not free.all() and costly.all()


def stats(ws: list[float], reuse: list[float]) -> LayerStats:
    n = len(ws)
    return LayerStats(np.array(ws, float), np.array(reuse, float), np.ones(n, np.int64))


def test_adaptive_gives_more_slots_to_larger_working_set() -> None:
    a = AdaptiveAllocation()
    caps = a.allocate(
        total_slots=96, num_layers=3, num_experts=64, stats=stats([60, 20, 20], [0.8] * 3)
    )
    assert caps[0] > caps[1] and sum(caps) <= 96
    assert a.allocate(total_slots=96, num_layers=3, num_experts=64, stats=None) == [32, 32, 32]


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 20),
    experts=st.integers(1, 64),
    extra=st.integers(0, 2000),
    ws=st.lists(st.floats(0, 300), min_size=20, max_size=20),
    reuse=st.lists(st.floats(0, 1), min_size=20, max_size=20),
)
def test_allocations_fit_budget(layers, experts, extra, ws, reuse) -> None:
    total = layers + extra
    s = stats(ws[:layers], reuse[:layers])
    for a in (UniformAllocation(), AdaptiveAllocation()):
        caps = a.allocate(total_slots=total, num_layers=layers, num_experts=experts, stats=s)
        assert len(caps) == layers and sum(caps) <= total
        assert min(caps) >= 1 and max(caps) <= experts
        assert sum(caps) == min(total, layers * experts)  # no slot wasted


def test_experts_of_many_tokens_are_priced_on_their_own_line() -> None:
    """Above `cpu_few_tokens` (torch's products, not the C kernel) a measured line of its own
    prices a CPU expert, and the splits send fewer of those experts to the CPU; without one the
    few-token line holds for every count."""
    few = replace(CostModel.profile("h200"), cpu_many_ms_per_token=0.0)
    many = replace(few, cpu_many_fixed_ms=0.1, cpu_many_ms_per_token=0.02)
    counts = np.array([1, 8, 9, 32])
    assert np.allclose(few.cpu_ms(counts), few.cpu_fixed_ms + few.cpu_ms_per_token * counts)
    assert np.allclose(many.cpu_ms(counts)[:2], few.cpu_ms(counts)[:2])
    assert np.allclose(many.cpu_ms(counts)[2:], [0.1 + 0.02 * 9, 0.1 + 0.02 * 32])
    tokens = np.array([32] * 6 + [2] * 6)  # a prompt's experts beside a decode's
    for comp in (MakespanCompensation(), CooperativeCompensation()):
        on_cpu = [
            ~comp.decide(
                layer=0,
                experts=np.arange(12),
                tokens=tokens,
                reuse=np.zeros(12),
                load=Load(copy_queue_ms=0.5),
                cost=cost,
            )
            for cost in (few, many)
        ]
        assert on_cpu[0][:6].sum() == 1 and on_cpu[1][:6].sum() == 0  # the 32-token experts


def test_cost_profiles() -> None:
    c = CostModel.profile("h200")
    assert 0.1 < c.copy_ms(1) < 0.2
    assert c.cpu_ms(1) < c.cpu_ms(64) and c.gpu_ms(8) < c.gpu_ms(256)
    # the C kernel's CPU path as the engine calibrated it on an H200 machine (run 37)
    assert abs(c.cpu_ms(8) - 0.128) < 0.01 and abs(c.gpu_ms(128) - 0.30) < 0.05
    assert abs(c.cpu_ms(32) - 0.51) < 0.01  # torch's products above 8 tokens
    assert c.cpu_call_ms == pytest.approx(0.248)
    assert CostModel.from_json(c.to_json()) == c
    assert CostModel.profile("cpu-ci").copy_ms(0) == 0.0
    with pytest.raises(ValueError, match="did you mean 'h200'"):
        CostModel.profile("h20")


@pytest.mark.parametrize("module", [allocation, retention, compensation])
def test_constructors_are_registry_friendly(module) -> None:
    from oled.policies.base import AllocationPolicy, CompensationPolicy, RetentionPolicy

    bases = (AllocationPolicy, RetentionPolicy, CompensationPolicy)
    classes = [
        c
        for _, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, bases)
        and c not in bases
        and not c.__name__.startswith("_")
        and c.__module__ == module.__name__
    ]
    assert classes
    for cls in classes:
        assert cls.__doc__ and cls.__doc__.strip().splitlines()[0]
        for name, p in inspect.signature(cls.__init__).parameters.items():
            if name == "self":
                continue
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, (cls, name)
            assert p.default is not inspect.Parameter.empty, (cls, name)
            assert p.annotation is not inspect.Parameter.empty, (cls, name)
        cls()  # every component builds with defaults


@settings(max_examples=80, deadline=None)
@given(levels=st.integers(1, 5), n=st.integers(0, 70), seed=st.integers(0, 10_000))
def test_lowest_breaks_ties_by_expert_id_whatever_the_candidate_order(levels, n, seed) -> None:
    """Victims are the n candidates of lowest (priority, id), in that order: with few distinct
    priorities most choices are ties, and a partition would settle them by its own order."""
    rng = np.random.default_rng(seed)
    priority = rng.integers(0, levels, 64).astype(np.float64)
    candidates = rng.permutation(64)[: int(rng.integers(0, 65))]
    expected = sorted(candidates.tolist(), key=lambda e: (priority[e], e))[:n]
    assert lowest(priority, candidates, n).tolist() == expected
    assert lowest(priority, rng.permutation(candidates), n).tolist() == expected
