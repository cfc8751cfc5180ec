"""The offloaded runtime computes the same function as the all-resident model.

On one device (here the CPU: slot tables in host memory, copies as memcpy, CPU experts on the
calling thread) every policy and budget must give bit-identical tokens.
"""

from __future__ import annotations

import pytest
import torch

from oled.model.experts import combine, expert_pairs
from oled.offload.budget import Budget, total_slots
from oled.policies import allocation as A
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.runtime import build_runtime, load_runtime

PROMPTS = ["What is the capital of France?", "Once upon a time there was a small robot"]
RETENTION = {
    "lru": R.LRURetention,
    "lfu": R.LFURetention,
    "score_ema": R.ScoreEMARetention,
    "confidence": R.ConfidenceRetention,
}
COMPENSATION = {
    "transfer_only": C.TransferOnly,
    "cpu_only": C.CpuOnly,
    "batch_threshold": lambda: C.BatchThreshold(min_tokens=2),
    "makespan": C.MakespanCompensation,
    "cooperative": C.CooperativeCompensation,
    "interval_refresh": lambda: C.IntervalRefresh(interval=3),
    "static_hot": C.StaticHot,
}
BUDGETS = {"one-slot": Budget("expert_budget", 3), "quarter": Budget("expert_fraction", 0.25)}


def answers(rt, dtype_threshold=0.6):
    return [rt.generate(p, max_new_tokens=40, threshold=dtype_threshold).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    rt = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    return answers(rt)


def offloaded(tiny_dir, budget, retention, compensation, allocation=None, dtype="float32"):
    return build_runtime(
        model=str(tiny_dir),
        device="cpu",
        dtype=dtype,
        budget=budget,
        cost="cpu-ci",
        retention=retention,
        compensation=compensation,
        allocation=allocation or A.UniformAllocation(),
        stage_capacity=2,
    )


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("compensation", COMPENSATION)
@pytest.mark.parametrize("retention", RETENTION)
def test_every_policy_and_budget_gives_the_resident_tokens(
    tiny_dir, reference, retention, compensation, budget
):
    rt = offloaded(tiny_dir, BUDGETS[budget], RETENTION[retention](), COMPENSATION[compensation]())
    assert answers(rt) == reference
    s = rt.stats()
    assert s["hits"] + s["misses"] > 0
    if compensation == "cpu_only":
        assert s["copies"] == 0 and s["cpu_experts"] > 0
    if compensation == "transfer_only":  # a copy decision never turns into a CPU expert
        assert s["cpu_experts"] == 0 and s["copies"] > 0


def test_adaptive_allocation_replans_and_stays_exact(tiny_dir, reference):
    rt = offloaded(
        tiny_dir,
        Budget("expert_fraction", 0.3),
        R.ConfidenceRetention(),
        C.CooperativeCompensation(),
        allocation=A.AdaptiveAllocation(),
    )
    assert answers(rt) == reference
    caps = rt.executor.planner.capacities
    assert sum(caps) <= round(0.3 * 3 * 32)
    assert [t.shape[0] for t in rt.executor.w13] == caps


def test_bf16_is_exact_too(tiny_dir):
    ref = load_runtime(str(tiny_dir), device="cpu", dtype="bfloat16")
    rt = offloaded(
        tiny_dir,
        Budget("expert_budget", 4),
        R.LRURetention(),
        C.MakespanCompensation(),
        dtype="bfloat16",
    )
    assert answers(rt) == answers(ref)


def test_stats_count_every_request(tiny_dir):
    rt = offloaded(tiny_dir, Budget("expert_fraction", 0.25), R.LRURetention(), C.TransferOnly())
    rt.generate(PROMPTS[0], max_new_tokens=32)
    s = rt.stats()
    per_layer = s["per_layer"]
    assert len(per_layer) == 3
    assert sum(r["hits"] for r in per_layer) == s["hits"]
    assert len(s["per_iteration"]) == s["iterations"]
    assert s["copies"] >= s["misses"] - s["cpu_experts"]
    assert s["copy_bytes"] == s["copies"] * rt.checkpoint.experts.expert_bytes
    assert 0 < s["hit_rate"] < 1
    assert 0 < s["plan_ms"] <= s["host_ms"] and s["plan_us_per_layer"] > 0
    assert s["launch_ms"] > 0 and s["pass_ms"] > 0  # copies launched, passes run
    assert s["plan_ms"] + s["launch_ms"] + s["pass_ms"] <= s["host_ms"]
    # the prompt forward and the decode iterations split the totals
    prompt, decode = s["prompt"], s["decode"]
    assert prompt["iterations"] == 1 and decode["iterations"] == s["iterations"] - 1
    assert prompt["calls"] == 3 and prompt["calls"] + decode["calls"] == s["calls"]
    assert prompt["copies"] + decode["copies"] == s["copies"]
    assert prompt["misses"] / prompt["calls"] > decode["misses"] / decode["calls"]


class _SeenCpu(C.CpuOnly):
    """CPU-only compensation that keeps what the engine reports of its CPU experts."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, float]] = []

    def observe_cpu(self, *, layer: int, modeled_ms: float, measured_ms: float) -> None:
        self.seen.append((layer, modeled_ms, measured_ms))


def test_engine_reports_cpu_expert_time_to_the_policy(tiny_dir):
    comp = _SeenCpu()
    rt = offloaded(tiny_dir, Budget("expert_fraction", 0.25), R.LRURetention(), comp)
    rt.generate(PROMPTS[0], max_new_tokens=32)
    cpu_ms = rt.stats()["cpu_ms"]
    assert comp.seen, "no CPU expert time reached the policy"
    assert all(m > 0 and t > 0 for _, m, t in comp.seen)
    # from the decision to the result: at least the worker's own time
    assert sum(t for _, _, t in comp.seen) >= cpu_ms > 0
    assert {layer for layer, _, _ in comp.seen} == {0, 1, 2}


def test_budget_too_small_fails_before_loading(tiny_dir, monkeypatch):
    import oled.runtime as runtime

    def no_loading(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(runtime, "load_checkpoint", no_loading)
    with pytest.raises(ValueError, match=r"budget too small: expert_budget 2 slots.*at least 3"):
        build_runtime(model=str(tiny_dir), device="cpu", budget=Budget("expert_budget", 2))
    with pytest.raises(ValueError, match=r"gpu_memory 0.01 GiB .* Minimum device memory: 0.5"):
        build_runtime(model=str(tiny_dir), device="cpu", budget=Budget("gpu_memory", 1e7))


def test_memory_budget_counts_slots():
    from oled.model.config import mini_config

    cfg = mini_config()
    slots = total_slots(
        Budget("gpu_memory", 24 * 2**30),
        cfg,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        scratch_experts=16,
    )
    # 24 GiB minus 1.8 GiB of non-expert weights, KV cache and reserve: about 3,500 6-MiB slots
    assert 3300 < slots < 3700
    assert (
        total_slots(
            Budget("expert_fraction", 1.0), cfg, dtype=torch.bfloat16, device=torch.device("cpu")
        )
        is None
    )


def test_a_budget_is_per_device_over_its_share():
    """With the experts split over devices, a budget counts each device's slots over its share
    of every layer; a share it holds whole stays resident; one too small names the share."""
    from oled.model.config import mini_config

    cfg = mini_config()  # 19 MoE layers of 256 experts
    cpu = {"dtype": torch.bfloat16, "device": torch.device("cpu")}
    quarter = Budget("expert_fraction", 0.25)
    assert total_slots(quarter, cfg, **cpu, experts=128) == 19 * 32  # of a half
    assert total_slots(quarter, cfg, **cpu) == 19 * 64
    assert total_slots(Budget("slots_per_layer", 128), cfg, **cpu, experts=128) is None
    with pytest.raises(ValueError, match=r"expert_budget 18 slots \(per device, over its 128"):
        total_slots(Budget("expert_budget", 18), cfg, **cpu, experts=128)


@pytest.fixture(scope="module")
def reference_short_blocks(tiny_dir):
    """Resident answers with 8-token blocks: about 13 of the 32 experts per forward, so that a
    quarter cache has experts that a prediction does not name (room to copy ahead)."""
    rt = load_runtime(str(tiny_dir), device="cpu", dtype="float32")
    return answers_short(rt)


def answers_short(rt):
    return [
        rt.generate(p, max_new_tokens=24, threshold=0.6, block_length=8).token_ids for p in PROMPTS
    ]


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize(
    "retention, compensation",
    [("lru", "transfer_only"), ("confidence", "cooperative"), ("score_ema", "makespan")],
)
def test_copies_ahead_keep_the_resident_tokens(
    tiny_dir, reference_short_blocks, retention, compensation, budget
):
    rt = build_runtime(
        model=str(tiny_dir),
        device="cpu",
        dtype="float32",
        budget=BUDGETS[budget],
        cost="cpu-ci",
        retention=RETENTION[retention](),
        compensation=COMPENSATION[compensation](),
        allocation=A.UniformAllocation(),
        stage_capacity=2,
        prefetch=4,
    )
    assert answers_short(rt) == reference_short_blocks
    s = rt.stats()
    assert 0 <= s["predicted_hits"] <= s["predicted"] <= s["copies"]
    assert s["per_layer"][0]["predicted"] == 0  # nothing predicts the first MoE layer
    if budget == "quarter":
        assert s["predicted_hits"] > 0
    stats = rt.executor.planner.stats  # over both answers, the engine's over the last one
    assert stats.predicted.sum() >= s["predicted"] and stats.predicted[0] == 0
    assert stats.predicted_hits.sum() >= s["predicted_hits"]


def test_reference_computes_every_expert_on_the_device_and_runs_follow_it(tiny_dir, reference):
    """Runtime.reference: the all-resident tokens with no CPU expert even under a CPU-only
    policy; a run that follows it commits those tokens and still computes on the CPU."""
    rt = offloaded(tiny_dir, BUDGETS["quarter"], R.LRURetention(), C.CpuOnly())
    trajectory = rt.reference(PROMPTS[0], max_new_tokens=40, threshold=0.6)
    s = rt.stats()
    assert s["cpu_experts"] == 0 and s["copies"] > 0
    assert trajectory.prompt == tuple(rt.prompt_ids(PROMPTS[0], chat=True))
    assert not rt.executor.planner.gpu_only  # only within the reference
    got = rt.generate(PROMPTS[0], max_new_tokens=40, threshold=0.6, follow=trajectory)
    s = rt.stats()
    assert got.token_ids == reference[0] and s["cpu_experts"] > 0
    assert s["followed"] > 0 and s["agreed"] == s["followed"]  # one device: the same choices


class _Shifting(A.AllocationPolicy):
    """Moves slots from layer to layer at every block end (test allocation: every re-plan
    resizes, so kept experts change slots and dropped ones free theirs)."""

    def __init__(self) -> None:
        self.replan, self.turn = True, 0

    def allocate(self, *, total_slots, num_layers, num_experts, stats):
        base = A.uniform_split(total_slots, num_layers, num_experts)
        self.turn += 1
        give, take = self.turn % num_layers, (self.turn + 1) % num_layers
        shift = min(base[give] - 1, num_experts - base[take], 3)
        base[give] -= shift
        base[take] += shift
        return base


@pytest.mark.parametrize(
    "device, ahead_from, compensation",
    [
        ("cpu", "previous", C.TransferOnly),
        ("cpu", "router", C.TransferOnly),
        ("cpu", "previous", C.Resident),
        pytest.param("cuda", "previous", C.TransferOnly, marks=pytest.mark.gpu),
        pytest.param("cuda", "router", C.Resident, marks=pytest.mark.gpu),
    ],
)
def test_layer_calls_stay_exact_across_resizes_and_copies_ahead(
    tiny_dir, device, ahead_from, compensation
):
    """Direct layer calls on skewed random routing, while re-allocations move and drop cached
    experts at every block end, copies ahead evict victims, and `Resident` fills the caches
    before the first call: every call equals the sum over all the layer's experts, exactly."""
    rt = build_runtime(
        model=str(tiny_dir),
        device=device,
        dtype="float32",
        budget=Budget("expert_fraction", 0.4),
        cost="cpu-ci",
        retention=R.LRURetention(),
        compensation=compensation(),
        allocation=_Shifting(),
        stage_capacity=2,
        prefetch=4,
        ahead_from=ahead_from,
    )
    engine = rt.executor
    store, k, layers = engine.store, engine.planner.top_k, len(engine.w13)
    h, e = store.w13[0].shape[2], engine.num_experts
    gen = torch.Generator().manual_seed(0)
    popular = torch.rand(layers, e, generator=gen) ** 3  # skewed routing: hits and misses
    resizes = 0
    for block in range(6):
        for _ in range(3):  # forwards of a block: each layer called in turn
            x = torch.randn(5, h, generator=gen).to(device)
            for layer in range(layers):
                ids = torch.multinomial(popular[layer].expand(5, e), k, generator=gen)  # [T, K]
                weights = torch.rand(5, k, generator=gen)  # [T, K]
                ids, weights = ids.to(device), weights.to(device)
                got = engine(layer, x, ids, weights)
                w13, w2 = store.w13[layer].to(device), store.w2[layer].to(device)
                want = combine(expert_pairs(x, ids, weights, w13, w2), x.dtype)
                assert torch.equal(got, want), (block, layer)
        before = list(engine.planner.capacities)
        engine.on_block_end(None)
        resizes += before != engine.planner.capacities
    assert resizes == 6
    assert engine.planner.stats.predicted.sum() > 0  # copies ahead were made
