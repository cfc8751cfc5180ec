"""Planner invariants (hypothesis) and slot bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oled.policies.allocation import AdaptiveAllocation, UniformAllocation
from oled.policies.base import CostModel, Load, StepContext
from oled.policies.compensation import (
    BatchThreshold,
    CooperativeCompensation,
    CpuOnly,
    IntervalRefresh,
    MakespanCompensation,
    Resident,
    StaticHot,
    TransferOnly,
)
from oled.policies.planner import STAGE_ROUNDS, Planner
from oled.policies.retention import (
    ConfidenceRetention,
    LFURetention,
    LRURetention,
    ScoreEMARetention,
)
from oled.token_states import TOKEN_MASKED

RETENTIONS = [ConfidenceRetention, LRURetention, LFURetention, ScoreEMARetention]
COMPENSATIONS = [
    CooperativeCompensation,
    MakespanCompensation,
    BatchThreshold,
    TransferOnly,
    CpuOnly,
    IntervalRefresh,
    StaticHot,
    Resident,
]
COST = CostModel.profile("h200")


def make(
    ret=LRURetention,
    comp=TransferOnly,
    *,
    layers=3,
    experts=16,
    k=2,
    slots=12,
    stage=2,
    alloc=None,
    prefetch=0,
) -> Planner:
    return Planner.for_model(
        layers,
        experts,
        k,
        slots,
        stage_capacity=stage,
        cost=COST,
        allocation=alloc or UniformAllocation(),
        retention=ret(),
        compensation=comp(),
        prefetch_limit=prefetch,
    )


def ctx_for(t: int, step: int, block: int = 0, seed: int = 0) -> StepContext:
    rng = np.random.default_rng(seed + step)
    return StepContext(
        block=block,
        iteration=step,
        step=step,
        token_state=rng.integers(0, 3, t).astype(np.int8),
        confidence=rng.random(t).astype(np.float32),
    )


def check_plan(planner: Planner, plan, ids: np.ndarray, before: np.ndarray) -> None:
    """Invariants of one plan against the cache state before it."""
    cache = planner.caches[plan.layer]
    cache.check()
    needed = np.unique(ids)
    assert (cache.expert_in >= 0).sum() <= cache.capacity
    # every miss gets exactly one decision; hits are exactly the needed experts cached before
    assert set(plan.hits) == {e for e in needed if before[e] >= 0}
    assert set(plan.misses) == set(needed) - set(plan.hits)
    copied = plan.copy_experts[np.isin(plan.copy_experts, needed)]
    decided = np.concatenate([copied, plan.stage_experts, plan.cpu_experts])
    assert sorted(decided.tolist()) == sorted(plan.misses.tolist())
    assert set(plan.gpu_experts) == set(plan.hits) | set(copied)
    # victims were cached before and are not needed this step
    for v in plan.evicted:
        assert before[v] >= 0 and v not in needed
        assert cache.slot_of[v] < 0
    # needed experts cached before stay cached
    assert (cache.slot_of[plan.hits] >= 0).all()
    assert (plan.slot_of[plan.gpu_experts] >= 0).all()
    assert (cache.slot_of[plan.copy_experts] == plan.copy_slots).all()
    # staged experts go through the stage in rounds; without a stage they go to the CPU
    if not planner.stage_capacity:
        assert len(plan.stage_experts) == 0
    cap = max(1, planner.stage_capacity)
    rounds = np.arange(len(plan.stage_experts)) // cap
    # round r in its part of the stage (r % STAGE_ROUNDS): rounds next to each other share no slot
    part = plan.stage_slots // cap
    assert (plan.stage_slots < max(1, planner.stage_rows)).all()
    assert (part == rounds % STAGE_ROUNDS).all()
    for r in np.unique(rounds):  # one expert per stage slot within a round
        assert len(set(plan.stage_slots[rounds == r])) == (rounds == r).sum()


@settings(max_examples=40, deadline=None)
@given(
    ret=st.sampled_from(RETENTIONS),
    comp=st.sampled_from(COMPENSATIONS),
    slots=st.integers(3, 48),
    stage=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_plan_invariants(ret, comp, slots, stage, seed) -> None:
    rng = np.random.default_rng(seed)
    planner = make(ret, comp, slots=slots, stage=stage, alloc=AdaptiveAllocation())
    for step in range(12):
        if step % 4 == 0 and step:
            planner.end_block()
            for c in planner.caches:
                c.check()
        planner.begin_step(step=step, block=step // 4)
        t = int(rng.integers(1, 6))
        for layer in range(3):
            ids = rng.integers(0, 16, (t, 2))
            w = rng.random((t, 2)).astype(np.float32)
            before = planner.caches[layer].slot_of.copy()
            load = Load(copy_queue_ms=float(rng.random()), cpu_queue_ms=float(rng.random()))
            check_plan(planner, planner.plan(layer, ids, w, load), ids, before)
            planner.observe(layer, ids, w, ctx_for(t, step))
    assert sum(planner.capacities) <= slots
    assert min(planner.capacities) >= 1


def test_capacity_one_many_misses_go_through_the_stage_in_rounds() -> None:
    planner = make(comp=TransferOnly, slots=3, stage=2)
    ids = np.array([[0, 1], [2, 3], [4, 5]])
    plan = planner.plan(0, ids, np.ones((3, 2), np.float32), Load())
    assert len(plan.copy_experts) == 1 and len(plan.stage_experts) == 5
    assert len(plan.cpu_experts) == 0  # a copy decision is never turned into a CPU expert
    assert list(plan.stage_slots) == [0, 1, 2, 3, 0]  # rounds alternate between the parts


def test_without_a_stage_overflow_goes_to_the_cpu() -> None:
    planner = make(comp=TransferOnly, slots=3, stage=0)
    ids = np.array([[0, 1], [2, 3], [4, 5]])
    plan = planner.plan(0, ids, np.ones((3, 2), np.float32), Load())
    assert len(plan.copy_experts) == 1 and len(plan.stage_experts) == 0
    assert len(plan.cpu_experts) == 5


def test_budget_below_minimum_raises() -> None:
    with pytest.raises(ValueError, match="minimum of 3"):
        make(slots=2)


def test_resident_prefilled_all_hits() -> None:
    planner = make(comp=Resident, slots=48)
    assert planner.capacities == [16, 16, 16]
    plan = planner.plan(1, np.arange(16).reshape(8, 2), np.ones((8, 2), np.float32))
    assert len(plan.hits) == 16 and len(plan.misses) == 0


def test_full_capacity_warm_fill_then_hits() -> None:
    planner = make(comp=TransferOnly, slots=48)
    ids = np.arange(16).reshape(8, 2)
    first = planner.plan(0, ids, np.ones((8, 2), np.float32))
    assert len(first.copy_experts) == 16 and len(first.evicted) == 0
    second = planner.plan(0, ids, np.ones((8, 2), np.float32))
    assert len(second.hits) == 16


def test_end_block_resize_keeps_slot_maps_consistent() -> None:
    planner = make(comp=TransferOnly, alloc=AdaptiveAllocation(floor_fraction=0.0), slots=24)
    rng = np.random.default_rng(0)
    for _ in range(4):
        for layer in range(3):
            n = 12 if layer == 0 else 3  # layer 0 has a much larger working set
            ids = rng.permutation(16)[:n].reshape(-1, 1).repeat(2, axis=1)
            planner.plan(layer, ids, np.ones(ids.shape, np.float32))
    resizes = planner.end_block()
    assert resizes is not None
    assert planner.capacities[0] > planner.capacities[1]
    for r in resizes:
        cache = planner.caches[r.layer]
        cache.check()
        assert cache.capacity == r.capacity
        assert (r.keep[:, 1] < r.capacity).all()
        assert len(set(r.keep[:, 1].tolist())) == len(r.keep)


def test_plan_marks_masked_observation() -> None:
    # smoke: observe advances the step used for recency
    planner = make()
    ids = np.array([[0, 1]])
    planner.plan(0, ids, np.ones((1, 2), np.float32))
    ctx = StepContext(
        block=0,
        iteration=0,
        step=0,
        token_state=np.array([TOKEN_MASKED], np.int8),
        confidence=np.array([0.1], np.float32),
    )
    planner.observe(0, ids, np.ones((1, 2), np.float32), ctx)
    assert planner.step == 1


@settings(max_examples=60, deadline=None)
@given(
    ret=st.sampled_from(RETENTIONS),
    limit=st.integers(1, 6),
    seed=st.integers(0, 10_000),
)
def test_prefetch_copies_only_what_the_prediction_names_and_keeps_it(ret, limit, seed) -> None:
    rng = np.random.default_rng(seed)
    planner = make(ret, experts=16, k=2, slots=3 * 5, prefetch=limit)  # 5 slots per layer
    for step in range(6):
        planner.begin_step(step=step, block=0)
        for layer in range(3):
            planner.plan(layer, rng.integers(0, 16, (3, 2)), rng.random((3, 2), np.float32))
        predicted = rng.integers(0, 16, (3, 2))  # [T, K] for layer 1
        cache = planner.caches[1]
        before = cache.slot_of.copy()
        experts, slots = planner.prefetch(1, predicted)
        cache.check()
        named = np.unique(predicted)
        assert len(experts) <= limit and len(experts) == len(slots)
        assert np.isin(experts, named).all() and (before[experts] < 0).all()
        assert (cache.slot_of[experts] == slots).all()
        # a cached expert the prediction names is never evicted for another
        kept = named[before[named] >= 0]
        assert (cache.slot_of[kept] == before[kept]).all()
        # the next plan of the layer counts the ones it needs
        ids = rng.integers(0, 16, (3, 2))
        hits_before = planner.stats.predicted_hits[1]
        plan = planner.plan(1, ids, rng.random((3, 2), np.float32))
        assert plan.predicted_hits == np.isin(experts, ids).sum()
        assert planner.stats.predicted_hits[1] == hits_before + plan.predicted_hits
    assert planner.stats.predicted[1] <= planner.stats.copies[1]


def test_prefetch_takes_the_most_predicted_tokens_first() -> None:
    planner = make(experts=16, k=2, slots=3 * 8, prefetch=2)
    predicted = np.array([[5, 9], [9, 3], [9, 5], [7, 1]])  # 9 thrice, 5 twice
    experts, _ = planner.prefetch(2, predicted)
    assert experts.tolist() == [9, 5]
    assert planner.prefetch(2, predicted)[0].tolist() == [1, 3]  # 9 and 5 are cached now


def test_prefetch_off_and_negative_limit() -> None:
    assert make().prefetch_limit == 0
    with pytest.raises(ValueError, match="prefetch_limit"):
        make(prefetch=-1)


def test_copies_ahead_stop_where_predictions_miss_and_resume_where_they_hit() -> None:
    planner = make(experts=16, k=2, slots=3 * 8, prefetch=4)  # 8 slots: two of the 4 sets
    sets = np.arange(16).reshape(4, 2, 2)  # [set, T, K]: the layer needs set step % 4
    copied = []
    for step in range(40):
        planner.begin_step(step=step, block=0)
        need = sets[step % 4]
        predicted = sets[(step + 1) % 4] if step < 20 else need  # wrong, then right
        if planner.predicts(1):
            copied.append((step, len(planner.prefetch(1, predicted)[0])))
        planner.plan(1, need, np.ones((2, 2), np.float32))
    gate = planner.ahead
    off = [step for step, _ in copied if 8 <= step < 20]
    assert off and all(step % gate.probe == 0 for step in off), "a missing layer kept predicting"
    assert all(n == 0 for step, n in copied if 8 <= step < 20)
    assert gate.copies(1) and any(n > 0 for step, n in copied if step >= 25)
    assert planner.stats.predicted_hits[1] > 0


def test_a_layer_without_spare_link_time_scores_its_prediction_and_stops_predicting() -> None:
    """With no room on the link (the limit the spare time leaves is 0) nothing is copied, yet
    the prediction is scored, so a wrong one still closes the layer's gate; and the layer is
    predicted again only every `probe`-th forward until a prediction finds room."""
    planner = make(experts=16, k=2, slots=3 * 8, prefetch=4)
    gate, w = planner.ahead, np.ones((2, 2), np.float32)
    asked = []
    for step in range(1, 17):
        planner.begin_step(step=step, block=0)
        if planner.predicts(1):
            asked.append(step)
            wrong = np.array([[8, 9], [10, 11]])  # never needed
            assert not len(planner._copy_ahead(1, np.bincount(wrong.ravel(), minlength=16), 0)[0])
        planner.plan(1, np.array([[0, 1], [2, 3]]), w)
    assert asked == [1, 8, 16]  # the first, then the probes
    assert gate.use[1] == pytest.approx(0.8**3) and not gate.room[1]  # scored three times
    planner.begin_step(step=17, block=0)
    assert len(planner.prefetch(1, np.array([[4, 5], [6, 7]]))[0])  # no spare-time bound
    assert gate.room[1] and planner.predicts(1)


def test_copies_ahead_from_the_forward_before() -> None:
    """ahead_from "previous": layer 0's plan copies ahead into layer 1 what layer 1 routed the
    forward before and its cache lacks, never in a generation's first forward, and never by
    evicting an expert that forward routed."""
    planner = Planner.for_model(
        2,
        16,
        2,
        2 * 4,  # 4 slots per layer
        stage_capacity=2,
        cost=COST,
        allocation=UniformAllocation(),
        retention=LFURetention(),
        compensation=CpuOnly(),  # misses run on the CPU: the cache keeps what it holds
        prefetch_limit=8,
        ahead_from="previous",
    )
    planner.prefill(1, np.array([0, 1, 2, 3]))
    w = np.ones((2, 2), np.float32)
    first = [np.array([[4, 5], [6, 7]]), np.array([[0, 1], [8, 9]])]  # [layer] ids [T, K]
    planner.begin_step(step=0, block=0)
    assert [len(planner.plan(i, ids, w).ahead_experts) for i, ids in enumerate(first)] == [0, 0]
    planner.begin_step(step=1, block=0)
    plan = planner.plan(0, first[0], w)
    # layer 1 routed 0, 1, 8, 9: 8 and 9 go into the slots of 2 and 3 (0 and 1 stay)
    assert plan.ahead_layer == 1 and sorted(plan.ahead_experts.tolist()) == [8, 9]
    cache = planner.caches[1]
    assert (cache.slot_of[plan.ahead_experts] == plan.ahead_slots).all()
    assert (cache.slot_of[[0, 1]] >= 0).all() and (cache.slot_of[[2, 3]] < 0).all()
    after = planner.plan(1, first[1], w)
    assert after.predicted_hits == 2 and len(after.misses) == 0
    assert planner.stats.predicted.tolist() == [0, 2]
    planner.begin_step(step=0, block=1)  # a new generation: nothing routed before it
    assert not len(planner.plan(0, first[0], w).ahead_experts)


def test_copies_ahead_fit_the_link_s_spare_time() -> None:
    """spare_copies: the copies that end before the next layer's demand copies start."""
    planner = make(prefetch=64)
    c = COST
    plan = planner.plan(0, np.array([[0, 1]]), np.ones((1, 2), np.float32))  # two misses
    copy_end = c.copy_ms(2)
    gpu_end = max(c.gpu_ms(0), copy_end) + c.gpu_ms(2)
    spare = gpu_end + c.layer_ms - copy_end - c.copy_fixed_ms
    assert planner.spare_copies(plan) == int(spare // c.copy_ms_per_expert) > 0
    hits = planner.plan(0, np.array([[0, 1]]), np.ones((1, 2), np.float32))  # all hits
    want = int((c.gpu_ms(2) + c.layer_ms - c.copy_fixed_ms) // c.copy_ms_per_expert)
    assert planner.spare_copies(hits) == want


def test_unknown_ahead_source() -> None:
    with pytest.raises(ValueError, match="unknown ahead_from 'next'"):
        Planner.for_model(
            2,
            16,
            2,
            8,
            stage_capacity=2,
            cost=COST,
            ahead_from="next",  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("compiled", [False, True])
def test_lru_recency_carries_across_generations(compiled: bool) -> None:
    # a generation's late forwards must not look newer than the next generation's first ones
    planner = Planner.for_model(
        1, 8, 1, 2, stage_capacity=2, cost=COST, allocation=UniformAllocation(),
        retention=LRURetention(), compensation=TransferOnly(), compiled=compiled,
    )  # fmt: skip
    w = np.ones((1, 1), np.float32)
    for step, expert in enumerate([0, 0, 0, 1]):  # generation 1: expert 1 used last, at step 3
        planner.begin_step(step=step, block=0)
        planner.plan(0, np.array([[expert]]), w)
    planner.begin_step(step=0, block=0)  # generation 2
    planner.plan(0, np.array([[0]]), w)  # expert 0 is now the most recent
    planner.begin_step(step=1, block=0)
    plan = planner.plan(0, np.array([[2]]), w)
    assert plan.evicted.tolist() == [1]
    assert planner.clock == 5
