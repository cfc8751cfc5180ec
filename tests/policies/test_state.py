"""The plan state is allocated once: policies hold views of it, nothing replaces its arrays,
and the compiled planner points at exactly those arrays."""

from __future__ import annotations

import numpy as np
import pytest

from oled.policies import compensation as C
from oled.policies import retention as R
from oled.policies.allocation import AdaptiveAllocation
from oled.policies.base import CostModel, StepContext
from oled.policies.planner import Planner
from oled.policies.state import ARRAYS, PlanState

L, E = 3, 16


def planner(retention, compensation, compiled: bool | None = None) -> Planner:
    return Planner.for_model(
        L,
        E,
        2,
        L * 4,
        stage_capacity=2,
        cost=CostModel.profile("h200"),
        allocation=AdaptiveAllocation(),
        retention=retention,
        compensation=compensation,
        compiled=compiled,
    )


def test_the_state_allocates_every_described_array_once_and_refuses_replacing_one() -> None:
    state = PlanState(num_layers=L, num_experts=E)
    assert set(state.arrays) == {a.name for a in ARRAYS}
    assert state.slot_of.shape == (L, E) and (state.slot_of == -1).all()
    assert state.counters.shape == (L, 12)
    with pytest.raises(AttributeError, match="allocated once"):
        state.slot_of = np.zeros((L, E), np.int32)
    with pytest.raises(AttributeError):
        state.no_such_array  # noqa: B018


@pytest.mark.parametrize(
    ("retention", "compensation", "arrays"),
    [
        (R.LRURetention(), C.TransferOnly(), {"priority": "priority"}),
        (
            R.ConfidenceRetention(),
            C.StaticHot(learn_blocks=1),
            {
                "score": "priority",
                "masked": "masked",
                "stable": "stable",
                "current": "current",
                "block": "last_block",
                "learned": "learned",
                "loaded": "loaded",
                "seen": "seen",
            },
        ),
    ],
)
def test_policies_hold_views_of_the_planners_state_through_resets(
    retention, compensation, arrays
) -> None:
    p = planner(retention, compensation)
    for attr, name in arrays.items():
        policy = retention if hasattr(retention, attr) else compensation
        assert getattr(policy, attr) is p.state.arrays[name], attr
        with pytest.raises(AttributeError, match="view of the plan state"):
            setattr(policy, attr, np.zeros(1))
    retention.reset(num_layers=L, num_experts=E)  # refilled in place, never replaced
    compensation.reset(num_layers=L, num_experts=E)
    for attr, name in arrays.items():
        policy = retention if hasattr(retention, attr) else compensation
        assert getattr(policy, attr) is p.state.arrays[name], attr


def test_a_policy_used_alone_gets_a_state_of_its_own() -> None:
    lru = R.LRURetention()
    lru.reset(num_layers=2, num_experts=4)
    assert lru.priority.shape == (2, 4) and (lru.priority == -1).all()


def test_the_compiled_planner_points_at_the_state_and_resizes_stay_in_it() -> None:
    p = planner(R.ConfidenceRetention(), C.CooperativeCompensation(), compiled=True)
    addresses = p.state.addresses()
    for name, at in addresses.items():
        assert getattr(p.native.bind, name) == at, name
    rng = np.random.default_rng(0)
    block = 0
    for step in range(24):  # plans, observations and block-boundary resizes
        for layer in range(L):
            ids = rng.integers(0, E // (layer + 1), size=(6, 2))
            weights = rng.random((6, 2)).astype(np.float32)
            p.plan(layer, ids, weights)
            ctx = StepContext(
                block=block,
                iteration=step % 4,
                step=step,
                token_state=np.ones(6, np.int8),
                confidence=np.full(6, 0.5, np.float32),
            )
            p.observe(layer, ids, weights, ctx)
        if step % 4 == 3:
            block += 1
            p.end_block()
    assert p.state.addresses() == addresses
    for name, at in addresses.items():
        assert getattr(p.native.bind, name) == at, name
    for cache in p.caches:
        cache.check()
        assert np.shares_memory(cache.slot_of, p.state.slot_of)
    assert list(p.state.capacity) == p.capacities
    assert p.stats.plans.tolist() == [24] * L


@pytest.mark.parametrize(
    ("retention", "compensation"),
    [
        (R.LFURetention(decay=0.9, per_token=True), C.BatchThreshold(min_tokens=3)),
        (R.ScoreEMARetention(alpha=0.6), C.IntervalRefresh(interval=3, min_tokens=2)),
        (R.ConfidenceRetention(now_weight=0.7), C.CooperativeCompensation(horizon=2)),
        (R.LRURetention(), C.StaticHot(learn_blocks=2)),
    ],
)
def test_each_kinds_parameters_reach_its_block_of_the_bind(retention, compensation) -> None:
    """A built-in policy's `compiled_as` names the attributes plan.c reads; the compiled
    planner copies each into the policy's own block of the Bind, by name."""
    p = planner(retention, compensation, compiled=True)
    for policy in (retention, compensation):
        kind = type(policy).compiled_as
        for name in kind.params:
            block = getattr(p.native.bind, kind.c_name)
            assert getattr(block, name) == getattr(policy, name), (kind.c_name, name)
    assert p.native.bind.ret_kind == type(retention).compiled_as.value
    assert p.native.bind.comp_kind == type(compensation).compiled_as.value


def test_a_fractional_whole_number_parameter_plans_in_python() -> None:
    p = planner(R.LRURetention(), C.IntervalRefresh(interval=2.5))
    assert not p.compiled
