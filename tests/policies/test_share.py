"""One device's share of the experts planned alone (oled.policies.share): the share's ids, and
planners over the shares that see of the routing what one planner over all experts sees."""

from __future__ import annotations

import numpy as np
import pytest

from oled.policies.allocation import UniformAllocation
from oled.policies.base import CostModel, StepContext
from oled.policies.compensation import TransferOnly
from oled.policies.planner import Planner
from oled.policies.retention import ConfidenceRetention
from oled.policies.share import SharePlanner, share_ids
from oled.token_states import TOKEN_COMMITTED, TOKEN_FIXED, TOKEN_MASKED

L, E, K, T = 2, 32, 4, 40  # 40 rows: the 8 before the last block of 32 are prefix rows


def test_share_ids_name_the_contiguous_share_and_the_others() -> None:
    ids = share_ids(32, 4, 1)  # [E]
    assert ids[8:16].tolist() == list(range(8))
    assert (np.delete(ids, np.s_[8:16]) == 8).all()  # the others' experts: id E/N


def _planner(kind: type[Planner], experts: int, compiled: bool | None) -> Planner:
    """Every expert of `experts` cached (no eviction), confidence retention."""
    return kind.for_model(
        L,
        experts,
        K,
        L * experts,
        stage_capacity=8,
        cost=CostModel.profile("cpu-ci"),
        allocation=UniformAllocation(),
        retention=ConfidenceRetention(),
        compensation=TransferOnly(),
        compiled=compiled,
    )


def _forward(rng: np.random.Generator, step: int) -> tuple[np.ndarray, np.ndarray, StepContext]:
    """A forward's routing (ids [T, K] distinct per row, weights [T, K]) and context."""
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)  # [T, K]
    weights = rng.random((T, K)).astype(np.float32)  # [T, K]
    states = np.array([TOKEN_FIXED, TOKEN_MASKED, TOKEN_COMMITTED], np.int8)
    ctx = StepContext(
        block=0,
        iteration=step,
        step=step,
        token_state=states[rng.integers(0, 3, T)],
        confidence=rng.random(T).astype(np.float32),
    )
    return ids, weights, ctx


@pytest.mark.parametrize("compiled", [False, None])
def test_shares_see_what_one_planner_sees_of_their_experts(compiled: bool | None) -> None:
    """Two share planners over halves of the experts: together the one planner's requests and
    misses, none of the other share's pairs among them, and each expert's evidence (weighted
    by its tokens' rows, the prefix rows included) that of the one planner."""
    rng = np.random.default_rng(0)
    one = _planner(Planner, E, compiled)
    shares = [_planner(SharePlanner, E // 2, compiled) for _ in range(2)]
    local = [share_ids(E, 2, rank) for rank in range(2)]  # [E] each
    for step in range(3):
        ids, weights, ctx = _forward(rng, step)
        for layer in range(L):
            plans = [
                p.plan(layer, ids_of[ids], weights) for p, ids_of in zip(shares, local, strict=True)
            ]
            whole = one.plan(layer, ids, weights)
            misses = [rank * (E // 2) + p.misses for rank, p in enumerate(plans)]
            assert sorted(np.concatenate(misses).tolist()) == sorted(whole.misses.tolist())
        for layer in range(L):
            one.observe(layer, ids, weights, ctx)
            for p, ids_of in zip(shares, local, strict=True):
                p.observe(layer, ids_of[ids], weights, ctx)
    for name in ("requests", "hits", "misses"):
        assert (
            sum(getattr(p.stats, name) for p in shares).tolist()
            == getattr(one.stats, name).tolist()
        )
    retention = one.retention
    assert isinstance(retention, ConfidenceRetention)
    for rank, p in enumerate(shares):
        mine = slice(rank * (E // 2), (rank + 1) * (E // 2))
        assert isinstance(p.retention, ConfidenceRetention)
        np.testing.assert_allclose(p.retention.stable, retention.stable[:, mine], rtol=1e-12)
        np.testing.assert_allclose(p.retention.masked, retention.masked[:, mine], rtol=1e-12)


def test_miss_curves_of_whole_layers_do_not_plan_a_share() -> None:
    """Curves fitted over a whole layer's experts plan the whole layer, not a device's share:
    the error says so."""
    from oled.policies.allocation import CurvesAllocation
    from oled.policies.curves import MissCurves

    allocation = CurvesAllocation()
    allocation.curves = MissCurves(np.zeros((L, E + 1), np.int64), {"trace": "t"})
    assert sum(allocation.allocate(total_slots=L * E, num_layers=L, num_experts=E, stats=None))
    with pytest.raises(ValueError, match=r"one of 2 devices' shares: curves of whole layers"):
        allocation.allocate(total_slots=L * E // 2, num_layers=L, num_experts=E // 2, stats=None)
