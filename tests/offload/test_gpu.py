"""On a CUDA device: offloaded decoding gives the resident tokens (skipped without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oled.offload.budget import Budget
from oled.offload.engine import STAGED
from oled.policies import allocation as A
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.runtime import build_runtime, load_runtime

pytestmark = pytest.mark.gpu
PROMPTS = ["What is the capital of France?", "Once upon a time there was a small robot"]


def tokens(rt):
    return [rt.generate(p, max_new_tokens=64, threshold=0.6).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Eager, every expert resident: the reference tokens."""
    return tokens(load_runtime(str(tiny_dir), device="cuda", dtype="bfloat16", graphs=False))


def test_graphed_resident_is_bit_exact_and_replays(tiny_dir, reference):
    """The whole forward as one CUDA graph per shape: the eager tokens, and graphs reused."""
    rt = load_runtime(str(tiny_dir), device="cuda", dtype="bfloat16")
    assert tokens(rt) == reference
    captures = rt.forward.graphs.captures
    assert rt.forward.replays > 0 and captures > 0
    assert tokens(rt) == reference
    assert rt.forward.graphs.captures == captures, "the same prompts captured new graphs"


def test_a_failed_capture_runs_eagerly_once_then_captures(tiny_dir, reference, monkeypatch):
    """A capture that fails (a Triton kernel's first launch does) costs one eager forward; the
    key is captured on its next use, and the tokens stay the eager ones."""
    from oled.model.graphs import Graphs

    real, failures = Graphs.capture, []

    def capture_failing_once(self, fn):
        if not failures:
            failures.append(1)
            raise RuntimeError("capture refused (test)")
        return real(self, fn)

    monkeypatch.setattr(Graphs, "capture", capture_failing_once)
    rt = load_runtime(str(tiny_dir), device="cuda", dtype="bfloat16")
    assert tokens(rt) == reference
    assert failures and rt.forward.retried and rt.forward.failed is None
    assert rt.forward.replays > 0


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("frac", [0.125, 0.5])
def test_gpu_only_policies_are_bit_exact(tiny_dir, reference, frac, graphs):
    """Hits, cached copies and staged copies all run on the GPU: the resident tokens exactly,
    eagerly and as graph pieces around each layer's host decision.

    A 4-slot stage is far smaller than a layer's misses at 12.5%, so staged experts go through
    it in several rounds (graphs too); none may fall back to the CPU.
    """
    rt = build_runtime(
        model=str(tiny_dir),
        device="cuda",
        dtype="bfloat16",
        cost="h200",
        budget=Budget("expert_fraction", frac),
        allocation=A.UniformAllocation(),
        retention=R.LRURetention(),
        compensation=C.TransferOnly(),
        stage_capacity=4,
        graphs=graphs,
    )
    got = tokens(rt)
    s = rt.stats()
    assert s["cpu_experts"] == 0, "GPU-only policies fell back to CPU experts"
    assert s["copies"] > 0 and s["staged"] > 0
    assert got == reference
    assert (getattr(rt.forward, "replays", 0) > 0) == graphs
    if graphs:  # the staged rounds replay as graphs too, launched from C once captured
        assert max(key[2] for key in rt.executor.graphs.graphs) >= STAGED
        assert rt.executor.driver is not None and rt.executor.driver.launched > 0


DRIVEN = {  # budget, compensation, adaptive allocation, stage capacity
    "staged-rounds": (0.125, C.TransferOnly(), False, 4),
    "cpu-experts": (0.25, C.CpuOnly(), False, 8),
    "adaptive-resizes": (0.25, C.TransferOnly(), True, 8),
}


@pytest.mark.parametrize("case", DRIVEN)
def test_launches_from_c_give_the_python_launches_tokens(tiny_dir, case):
    """Layer calls launched from C (oled.offload.driver) against the same runtime launching in
    Python: the same tokens and the same counts (CPU experts included: same host, same sums),
    most calls launched from C; timings recorded both ways."""
    frac, comp, adaptive, stage = DRIVEN[case]
    runs = {}
    for driver in (True, False):
        rt = build_runtime(
            model=str(tiny_dir),
            device="cuda",
            dtype="bfloat16",
            cost="h200",
            budget=Budget("expert_fraction", frac),
            retention=R.LRURetention(),
            compensation=type(comp)(),
            stage_capacity=stage,
            driver=driver,
            allocation=A.AdaptiveAllocation(min_shift=0) if adaptive else A.UniformAllocation(),
        )
        runs[driver] = (tokens(rt), rt.stats(), rt.executor)
    (got, s, engine), (want, s_py, _) = runs[True], runs[False]
    assert got == want
    for name in ("hits", "misses", "copies", "staged", "cpu_experts", "cpu_tokens"):
        assert s[name] == s_py[name], name
    if case == "cpu-experts":
        assert s["cpu_experts"] > 0
    assert engine.driver.launched > 0
    m = engine.metrics  # the last generation's, from both paths
    timed = ("cpu_ms",) if case == "cpu-experts" else ("copy_ms", "stall_ms", "launch_ms")
    for name in ("calls", "plan_ms", "pass_ms", "host_ms", *timed):
        assert m.total(name) > 0, name


def test_graphed_adaptive_allocation_is_bit_exact(tiny_dir, reference):
    """Re-sized slot tables drop their layer's graphs; the tokens stay the resident ones."""
    rt = build_runtime(
        model=str(tiny_dir),
        device="cuda",
        dtype="bfloat16",
        cost="h200",
        budget=Budget("expert_fraction", 0.25),
        allocation=A.AdaptiveAllocation(min_shift=0),
        retention=R.LRURetention(),
        compensation=C.TransferOnly(),
    )
    assert tokens(rt) == reference
    assert rt.forward.replays > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_copies_ahead_are_bit_exact(tiny_dir, graphs):
    """Copies a layer ahead from the predicted routing (8-token blocks leave a quarter cache
    room for them) give the resident tokens; in the static path the prediction replays."""

    def short_blocks(rt):
        return [
            rt.generate(p, max_new_tokens=48, threshold=0.6, block_length=8).token_ids
            for p in PROMPTS
        ]

    kw = dict(model=str(tiny_dir), device="cuda", dtype="bfloat16")
    reference = short_blocks(load_runtime(**kw, graphs=False))
    rt = build_runtime(
        **kw,
        cost="h200",
        budget=Budget("expert_fraction", 0.25),
        retention=R.LRURetention(),
        compensation=C.TransferOnly(),
        prefetch=4,
        graphs=graphs,
    )
    assert short_blocks(rt) == reference
    s = rt.stats()
    assert 0 < s["predicted_hits"] <= s["predicted"] <= s["copies"]
    if graphs:
        assert any(key[-1] == "predict" for key in rt.executor.graphs.graphs)


def test_cpu_experts_stay_within_tolerance(tiny_dir):
    """With CPU experts the sums differ in rounding only: logits close, tokens mostly equal."""
    kw = dict(model=str(tiny_dir), device="cuda", dtype="bfloat16")
    ref = load_runtime(**kw)
    rt = build_runtime(
        **kw,
        cost="h200",
        budget=Budget("expert_fraction", 0.25),
        retention=R.LRURetention(),
        compensation=C.CpuOnly(),
    )
    x = torch.randint(0, 700, (1, 64), device="cuda")
    with torch.inference_mode():
        a = ref.model(x, block_length=32)
        ref_logits = a.clone()
        rt.model.set_executor(rt.executor)
        b = rt.model(x, block_length=32)
    rel = (b - ref_logits).norm() / ref_logits.norm()
    assert rel < 2e-2, f"relative logit error {rel:.2e}"
    assert rt.executor.metrics.total("cpu_experts") > 0


@pytest.mark.parametrize("batched", [True, False])
def test_runtime_copies_move_the_right_rows(batched):
    """Expert rows go host (pinned) -> slots through the CUDA runtime, in stream order, in one
    batched call (CUDA 12.8+) or one call per row; whole tensors go both ways."""
    from oled.offload import copies
    from oled.offload.copies import Rows, launch, runtime_memcpy, transfer

    assert runtime_memcpy() is not None, "libcudart not found: copies fall back to torch"
    if batched and tuple(int(v) for v in torch.version.cuda.split(".")[:2]) >= (12, 8):
        assert copies.runtime_memcpy_batch() is not None, "no cudaMemcpyBatchAsync"
    src = [torch.randn(6, 8, 4).to(torch.bfloat16).pin_memory() for _ in range(2)]
    dst = [torch.zeros(3, 8, 4, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    stream = torch.cuda.Stream()
    copies.use_batches(batched)
    try:
        launch(Rows.of(*src), Rows.of(*dst), np.array([5, 0, 2]), np.array([1, 2, 0]), stream)
        default = [torch.zeros_like(d) for d in dst]  # the default stream takes no batches
        launch(Rows.of(*src), Rows.of(*default), [1, 3], [0, 2], torch.cuda.current_stream())
    finally:
        copies.use_batches(True)
    stream.synchronize()
    torch.cuda.current_stream().synchronize()
    for s, d, a in zip(src, dst, default, strict=True):
        assert torch.equal(d.cpu(), s[[2, 5, 0]])
        assert torch.equal(a[[0, 2]].cpu(), s[[1, 3]])
    back = torch.empty(3, 8, 4, dtype=torch.bfloat16).pin_memory()
    transfer(back, dst[0], stream)  # device -> pinned host
    again = torch.empty_like(dst[0])
    transfer(again, back, stream)  # and back
    stream.synchronize()
    assert torch.equal(back, src[0][[2, 5, 0]]) and torch.equal(again, dst[0])


@pytest.mark.parametrize("transfer", ["lossless", "fp8", "int4"])
@pytest.mark.parametrize("budget", [0.25, 0.125])
def test_encoded_transfers_on_the_device(tiny_dir, reference, transfer, budget):
    """Misses copied encoded and decoded on the device, layer calls launched from C: the
    resident tokens bit for bit when lossless; a lossy codec's give those of the resident
    model with its experts round-tripped through it, bit for bit, with fewer bytes."""
    from tests.offload.test_encoded import lossy_resident

    def run(name):
        rt = build_runtime(
            model=str(tiny_dir),
            device="cuda",
            dtype="bfloat16",
            cost="h200",
            budget=Budget("expert_fraction", budget),
            retention=R.LRURetention(),
            compensation=C.TransferOnly(),
            stage_capacity=2,
            transfer=name,
        )
        return rt, tokens(rt), rt.stats()

    plain, plain_tokens, a = run("plain")
    rt, got, b = run(transfer)
    assert plain_tokens == reference
    if transfer == "lossless":
        assert got == reference
    else:
        assert got == tokens(lossy_resident(tiny_dir, transfer, device="cuda", graphs=False))
    assert b["copies"] > 0 and b["copy_bytes"] < a["copy_bytes"]
    assert not rt.forward.failed, rt.forward.failed  # graphs, so that C launches the layers
    assert rt.executor.driver is not None and rt.executor.driver.launched > 0
