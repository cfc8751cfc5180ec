"""Miss curves: the split by marginal gain, its fit on a trace, and the recipe component."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from oled.policies.allocation import CurvesAllocation, StackAllocation, uniform_split
from oled.policies.base import CostModel
from oled.policies.curves import MissCurves, split
from oled.recipe import RecipeError, load_recipe
from oled.trace.curves import fit_curves
from oled.trace.format import Trace
from oled.trace.simulate import simulate


def _total(curves: np.ndarray, caps: list[int]) -> int:
    return int(sum(curves[layer, c] for layer, c in enumerate(caps)))


@pytest.mark.parametrize("seed", range(5))
def test_split_is_the_least_misses_allocation(seed: int) -> None:
    """Against every allocation of 3 layers x 6 experts: the least total, all slots used."""
    rng = np.random.default_rng(seed)
    drops = rng.integers(0, 20, (3, 6))
    curves = np.concatenate([np.full((3, 1), 200), 200 - np.cumsum(drops, 1)], 1)  # [3, 7]
    for total in range(3, 19):
        caps = split(curves, total)
        assert sum(caps) == total and all(1 <= c <= 6 for c in caps)
        best = min(
            _total(curves, list(a))
            for a in itertools.product(range(1, 7), repeat=3)
            if sum(a) == total
        )
        assert _total(curves, caps) == best
        assert best <= _total(curves, uniform_split(total, 3, 6))


def test_split_refuses_fewer_slots_than_layers() -> None:
    with pytest.raises(ValueError, match="2 slots is below the minimum of 3"):
        split(np.zeros((3, 5), np.int64), 2)


def test_fitted_curves_count_what_the_simulator_counts(trace_file, tmp_path) -> None:
    """The fit's misses at c slots per layer are the simulator's; its split never misses more
    than the equal split on that trace, and CurvesAllocation gives that split."""
    from oled.policies.compensation import TransferOnly
    from oled.policies.retention import LFURetention

    trace = Trace.load(trace_file)
    L, E = trace.meta.num_moe_layers, trace.meta.num_experts
    curves = fit_curves(trace, LFURetention, source={"trace": "t"})
    assert curves.misses.shape == (L, E + 1)

    def misses(allocation: object, total: int) -> tuple[int, list[int]]:
        res = simulate(
            trace,
            allocation=allocation,
            retention=LFURetention(),
            compensation=TransferOnly(),
            cost=CostModel.profile("h200"),
            total_slots=total,
        )
        return int(sum(res.stats["requests"]) - sum(res.stats["hits"])), res.capacities

    from oled.policies.allocation import UniformAllocation

    path = tmp_path / "curves.json"
    curves.save(path)
    for per_layer in (4, 9, 16):
        equal, _ = misses(UniformAllocation(), per_layer * L)
        assert equal == curves.misses[:, per_layer].sum()
        fitted, caps = misses(CurvesAllocation(curves=str(path)), per_layer * L)
        assert caps == split(curves.misses, per_layer * L)
        assert fitted == _total(curves.misses, caps) <= equal
    assert MissCurves.load(path).source == {"forwards": trace.num_steps, "trace": "t"}


def test_curves_of_another_shape_or_no_curves_are_named(tmp_path) -> None:
    path = tmp_path / "c.json"
    MissCurves(np.zeros((2, 5), np.int64), {"trace": "x.oledtrace"}).save(path)
    with pytest.raises(ValueError, match=r"2 layers x 4 experts \(x.oledtrace\)"):
        CurvesAllocation(curves=str(path)).allocate(
            total_slots=12, num_layers=3, num_experts=4, stats=None
        )
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json is not a miss-curves file"):
        CurvesAllocation(curves=str(tmp_path / "bad.json"))


def test_a_recipe_names_curves_beside_it(tmp_path, monkeypatch) -> None:
    MissCurves(np.zeros((3, 33), np.int64), {}).save(tmp_path / "curves.json")
    text = '[model]\npath = "builtin:tiny"\n[policy.allocation]\nkind = "curves"\ncurves = "{}"\n'
    (tmp_path / "r.toml").write_text(text.format("curves.json"))
    recipe = load_recipe(tmp_path / "r.toml")
    assert recipe.policy.allocation.params["curves"] == str(tmp_path / "curves.json")

    # a recipe named from another folder, the flags over it: the same file (not looked up
    # beside the recipe twice)
    monkeypatch.chdir(tmp_path.parent)
    named = load_recipe(Path(tmp_path.name) / "r.toml").with_values({"decoding.seed": 3})
    assert named.policy.allocation.params["curves"] == str(Path(tmp_path.name) / "curves.json")
    (tmp_path / "r.toml").write_text(text.format("none.json"))
    with pytest.raises(RecipeError, match=r"r.toml:5: .*no such file: .*none.json"):
        load_recipe(tmp_path / "r.toml")


def _cycling(forwards: int) -> list[list[np.ndarray]]:
    """[forward][layer] ids [2, 1]: layer 0 routes experts 0 and 1 every forward, layer 1
    cycles through 0-5 two at a time (an LRU cache needs all 6 to hit)."""
    return [
        [np.array([[0], [1]]), np.array([[2 * (f % 3)], [2 * (f % 3) + 1]])]
        for f in range(forwards)
    ]


def test_stack_allocation_measures_the_curves_as_it_runs() -> None:
    """Uniform until warmed up; then each layer's working set first (2 slots each), and the
    rest where the LRU stack distances say it saves misses: layer 1's cycle of 6."""
    policy = StackAllocation(warmup=4)
    sizes = dict(total_slots=8, num_layers=2, num_experts=8, stats=None)
    for f, layers in enumerate(_cycling(6)):
        for layer, ids in enumerate(layers):
            policy.route(layer, ids)
        if f == 2:
            assert policy.allocate(**sizes) == [4, 4]  # 3 forwards measured
    assert policy.allocate(**sizes) == [2, 6]


def test_stack_allocation_re_plans_the_planner_s_caches() -> None:
    """Through the planner: it hands every layer's routing to the policy, and after a block
    end the cycling layer holds its cycle and stops missing."""
    from oled.policies.planner import Planner
    from oled.policies.retention import LRURetention

    planner = Planner.for_model(
        2, 8, 1, 8, stage_capacity=2, cost=CostModel.profile("h200"),
        allocation=StackAllocation(warmup=3), retention=LRURetention(),
    )  # fmt: skip
    w = np.ones((2, 1), np.float32)
    for f, layers in enumerate(_cycling(12)):
        planner.begin_step(step=f, block=f // 3)
        if f and f % 3 == 0:
            planner.end_block()
        for layer, ids in enumerate(layers):
            plan = planner.plan(layer, ids, w)
        if f >= 9:
            assert len(plan.misses) == 0, f"forward {f}: layer 1 still misses"
    assert planner.capacities == [2, 6]
