"""The fused routed-expert kernels against `expert_pairs`, their batch invariance, CUDA graphs.

Without a GPU the kernels run through Triton's interpreter, on small shapes.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from oled import kernels  # noqa: E402
from oled.kernels import moe  # noqa: E402
from oled.kernels.moe import BLOCK_M, fused_expert_pairs  # noqa: E402
from oled.model.experts import expert_pairs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ATOL = 1e-4  # fp32 tables: only the summation order differs from the torch GEMMs
LOW_RTOL = 2e-2  # bf16/fp16: gate, up, activation and output each round to 8 (11) bits


@pytest.fixture(autouse=True)
def torch_reference(monkeypatch):
    """`expert_pairs` takes its torch path here, whichever kernels the runtime chose."""
    monkeypatch.setattr(kernels, "fused", lambda *args, **kw: False, raising=False)


def make_table(s: int, h: int, i: int, dtype: torch.dtype, seed: int) -> tuple:
    """w13 [S, 2I, H], w2 [S, H, I] scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(s, 2 * i, h, generator=g) / h**0.5  # [S, 2I, H]
    w2 = torch.randn(s, h, i, generator=g) / i**0.5  # [S, H, I]
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def make_batch(t: int, k: int, h: int, s: int, dtype: torch.dtype, seed: int, *, drop=0.25):
    """x [T, H], slots [T, K] in [-1, S) (about `drop` of them -1), weights [T, K] fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)  # [T, H]
    slots = torch.randint(0, s, (t, k), generator=g)  # [T, K]
    slots[torch.rand(t, k, generator=g) < drop] = -1
    weights = torch.rand(t, k, generator=g)  # [T, K]
    return x, slots.to(DEVICE), weights.to(DEVICE)


def check_close(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, dtype) -> None:
    """Rows of slot -1 are exact zeros; others within FP32_ATOL, or LOW_RTOL of the row norm."""
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got[slots < 0], torch.zeros_like(got[slots < 0]))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=FP32_ATOL)
    else:
        err = (got - want).norm(dim=-1)  # [T, K]
        assert (err <= LOW_RTOL * want.norm(dim=-1) + 1e-6).all(), err.max()


CASES = {  # name: T, K, H, I, S
    "general": (6, 3, 64, 32, 7),
    "one_token": (1, 4, 32, 16, 5),
    "tiny_model": (4, 2, 128, 64, 12),
    "odd_tiles": (3, 2, 48, 80, 4),  # H, I multiples of 16 but not of 32
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_expert_pairs(case, dtype):
    t, k, h, i, s = CASES[case]
    w13, w2 = make_table(s, h, i, dtype, seed=1)
    x, slots, weights = make_batch(t, k, h, s, dtype, seed=2)
    check_close(
        fused_expert_pairs(x, slots, weights, w13, w2),
        expert_pairs(x, slots, weights, w13, w2),
        slots,
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_layouts(dtype):
    """Every pair -1; one slot repeated past BLOCK_M rows; repeated slots within a token."""
    h, i, s = 32, 16, 6
    w13, w2 = make_table(s, h, i, dtype, seed=3)
    t = BLOCK_M // 4 + 2
    x, _, weights = make_batch(t, 5, h, s, dtype, seed=4)
    layouts = [
        torch.full((t, 5), -1),  # nothing computed here: all zeros
        torch.full((t, 5), 3),  # one expert, 5 * t > BLOCK_M rows: several row blocks
        torch.tensor([[2, 2, -1, 5, 2]]).repeat(t, 1),  # repeats; slots 0, 1, 3, 4 empty
    ]
    weights[:, 1] = weights[:, 0]
    for slots in layouts:
        slots = slots.to(DEVICE)
        got = fused_expert_pairs(x, slots, weights, w13, w2)
        check_close(got, expert_pairs(x, slots, weights, w13, w2), slots, dtype)
    assert torch.equal(got[:, 0], got[:, 1])  # same token, slot and weight: the same row


def test_counting_sort_and_torch_sort_agree(monkeypatch):
    """Past RANK_MAX_PAIRS the pairs are ordered by torch's stable sort: the same rows, bitwise."""
    h, i, s = 32, 16, 9
    w13, w2 = make_table(s, h, i, torch.float32, seed=10)
    x, slots, weights = make_batch(40, 4, h, s, torch.float32, seed=11)  # 160 pairs: 2 programs
    ranked = fused_expert_pairs(x, slots, weights, w13, w2)
    check_close(ranked, expert_pairs(x, slots, weights, w13, w2), slots, torch.float32)
    monkeypatch.setattr(moe, "RANK_MAX_PAIRS", 0)
    assert torch.equal(fused_expert_pairs(x, slots, weights, w13, w2), ranked)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant(dtype):
    """A pair's row is bit-identical across table sizes, slot placements and batch contents."""
    h, i, experts = 64, 32, 5
    w13, w2 = make_table(experts, h, i, dtype, seed=5)
    x, ids, weights = make_batch(3, 2, h, experts, dtype, seed=6, drop=0.0)  # ids: experts
    base = fused_expert_pairs(x, ids, weights, w13, w2)  # [3, 2, H] table = experts in order

    # The same experts in a larger table at other slots, the free slots filled with noise.
    s = 11
    place = torch.tensor([7, 2, 10, 0, 5], device=DEVICE)  # expert e sits in slot place[e]
    big13, big2 = make_table(s, h, i, dtype, seed=7)
    big13[place], big2[place] = w13, w2
    moved = fused_expert_pairs(x, place[ids], weights, big13, big2)
    assert torch.equal(moved, base)

    # Extra tokens (sharing experts, so every group grows) around the same pairs.
    xe, ide, we = make_batch(9, 2, h, experts, dtype, seed=8, drop=0.2)
    rows = torch.tensor([1, 4, 8], device=DEVICE)  # where the original tokens go
    xe[rows], ide[rows], we[rows] = x, ids, weights
    crowd = fused_expert_pairs(
        xe, place[ide.clamp(min=0)].masked_fill(ide < 0, -1), we, big13, big2
    )
    assert torch.equal(crowd[rows], base)


# --- on a GPU: the real shape, batch invariance and CUDA graph capture -----------------------

REAL = dict(t=32, k=8, h=2048, i=512, s=256)


def real_inputs(distinct: int, seed: int) -> tuple:
    """Decode-shaped inputs: 32 tokens, top-8 over `distinct` experts of a 256-slot bf16 table."""
    g = torch.Generator().manual_seed(seed)
    t, k, s = REAL["t"], REAL["k"], REAL["s"]
    used = torch.randperm(s, generator=g)[:distinct]  # [distinct]
    picks = torch.stack([torch.randperm(distinct, generator=g)[:k] for _ in range(t)])  # [T, K]
    slots = used[picks]  # [T, K]
    slots[torch.rand(t, k, generator=g) < 0.1] = -1
    x = torch.randn(t, REAL["h"], generator=g).to("cuda", torch.bfloat16)  # [T, H]
    weights = torch.rand(t, k, generator=g).to("cuda")  # [T, K]
    return x, slots.cuda(), weights


@pytest.fixture(scope="module")
def real_table():
    w13, w2 = make_table(REAL["s"], REAL["h"], REAL["i"], torch.bfloat16, seed=9)
    return w13, w2


@pytest.mark.gpu
@pytest.mark.parametrize("distinct", [8, 30, 256])
def test_real_shape_matches_expert_pairs(real_table, distinct):
    w13, w2 = real_table
    x, slots, weights = real_inputs(distinct, seed=distinct)
    if distinct == 256:  # every slot used: tokens 0..31 cover all 256 slots
        slots = torch.arange(256, device="cuda").view(32, 8)
    check_close(
        fused_expert_pairs(x, slots, weights, w13, w2),
        expert_pairs(x, slots, weights, w13, w2),
        slots,
        torch.bfloat16,
    )


@pytest.mark.gpu
def test_real_shape_batch_invariant(real_table):
    w13, w2 = real_table
    x, slots, weights = real_inputs(30, seed=11)
    full = fused_expert_pairs(x, slots, weights, w13, w2)  # [32, 8, H]
    used = slots[slots >= 0].unique()  # the experts these pairs use, compacted to a small table
    remap = torch.full((REAL["s"],), -1, dtype=torch.long, device="cuda")
    remap[used] = torch.randperm(len(used), device="cuda") + 3
    small13 = torch.randn(len(used) + 5, *w13.shape[1:], device="cuda").to(w13.dtype)
    small2 = torch.randn(len(used) + 5, *w2.shape[1:], device="cuda").to(w2.dtype)
    small13[remap[used]], small2[remap[used]] = w13[used], w2[used]
    mapped = torch.where(slots >= 0, remap[slots.clamp(min=0)], -1)  # [32, 8]
    for lo, hi in [(0, 32), (0, 1), (5, 17)]:  # all tokens, one, a middle run
        part = fused_expert_pairs(x[lo:hi], mapped[lo:hi], weights[lo:hi], small13, small2)
        assert torch.equal(part, full[lo:hi])


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager(real_table):
    w13, w2 = real_table
    x, slots, weights = real_inputs(30, seed=12)
    fused_expert_pairs(x, slots, weights, w13, w2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_expert_pairs(x, slots, weights, w13, w2)
    for seed in (13, 14):  # new routing each replay, as decode steps bring
        x2, slots2, weights2 = real_inputs(50 if seed == 13 else 8, seed=seed)
        x.copy_(x2)
        slots.copy_(slots2)
        weights.copy_(weights2)
        graph.replay()
        assert torch.equal(out, fused_expert_pairs(x2, slots2, weights2, w13, w2))
