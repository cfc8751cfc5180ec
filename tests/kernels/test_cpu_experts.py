"""The C kernel for CPU experts (oled.kernels.cpu) against torch's products in `expert_rows`:
the same rounding points, so the bf16 outputs agree but for the summation order, and the same
bits for every thread count."""

from __future__ import annotations

import pytest
import torch

from oled import kernels
from oled.clib import Library, cpu_features
from oled.kernels import cpu
from oled.model import experts


def expert_rows(*args):
    """As the engine computes CPU experts beside a GPU."""
    return experts.expert_rows(*args, native=True)


pytestmark = pytest.mark.skipif(
    cpu.unsupported(torch.zeros(16, dtype=torch.bfloat16), *[torch.zeros(1, 16, 16).bfloat16()] * 2)
    is not None,
    reason="the C kernel cannot be built here",
)


def case(seed: int, tokens: int = 6, k: int = 4, experts: int = 8, h: int = 256, i: int = 128):
    """bf16 weights and activations of a layer and routed slots [T, K] (-1: computed elsewhere)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * i, h, generator=g) / 16).bfloat16()
    w2 = (torch.randn(experts, h, i, generator=g) / 11).bfloat16()
    x = torch.randn(tokens, h, generator=g).bfloat16()
    slots = torch.randint(0, experts, (tokens, k), generator=g)
    slots[0, 1] = -1
    weights = torch.rand(tokens, k, generator=g)
    return x, slots, weights, w13, w2


def with_torch(*args):
    kernels.use("torch")
    try:
        return experts.expert_rows(*args)
    finally:
        kernels.use("auto")


@pytest.mark.parametrize("tokens", [1, 3, 6, 40])  # 40: experts with 1-9 pairs, some to torch
def test_the_kernel_agrees_with_torch_to_rounding(tokens):
    args = case(tokens, tokens=tokens, experts=32)
    index, rows = expert_rows(*args)
    ref_index, ref = with_torch(*args)
    assert torch.equal(index, ref_index)
    assert rows.dtype == torch.float32 and rows.shape == ref.shape
    # bf16 rounds at four points; a different order of the sums flips an ulp now and then
    assert torch.allclose(rows, ref, rtol=2e-2, atol=1e-3)
    assert (rows == ref).float().mean() > 0.95
    assert (rows - ref).norm() / ref.norm() < 1e-2


def test_the_same_bits_for_every_thread_count_on_either_threads(monkeypatch):
    """On torch's OpenMP team (found here: torch runs on libgomp) and on the kernel's own."""
    assert cpu.team() is not None
    args = case(7, tokens=5)
    outs = on_threads(args)
    monkeypatch.setattr(cpu, "team", lambda: None)
    outs += on_threads(args)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def on_threads(args, counts=(1, 2, 3)) -> list[torch.Tensor]:
    """The kernel's rows for `args` on each of these thread counts."""
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in counts:
            torch.set_num_threads(threads)
            outs.append(expert_rows(*args)[1])
        return outs
    finally:
        torch.set_num_threads(before)


def test_many_calls_in_a_row_reuse_the_threads():
    args = case(3, tokens=2)
    first = expert_rows(*args)[1]
    for _ in range(200):  # the pool's phases and generations wrap around cleanly
        assert torch.equal(expert_rows(*args)[1], first)


def test_the_cpu_devices_own_path_stays_torchs(monkeypatch):
    """A CPU device computes every expert with torch, as its resident model does (so batched
    and single requests keep the same rounding there); beside a GPU the C kernel runs."""
    calls = []
    kernel = cpu.expert_rows
    monkeypatch.setattr(cpu, "expert_rows", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    args = case(2, tokens=3)
    assert torch.equal(experts.expert_rows(*args)[1], with_torch(*args)[1]) and not calls
    expert_rows(*args)
    assert calls


@pytest.mark.parametrize("seed", range(4))
def test_the_pairs_group_by_expert_as_torchs_stable_sort(seed):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(-1, 6, (5 + seed, 3), generator=g)  # [T, K], -1: elsewhere
    weights = torch.rand(slots.shape, generator=g)  # [T, K]
    groups = cpu.group(slots.numpy(), weights.numpy(), 6, cpu.Space())
    flat = torch.where(slots.reshape(-1) < 0, 99, slots.reshape(-1))
    order = torch.argsort(flat, stable=True)[: int((flat < 99).sum())]
    assert groups.order.tolist() == order.tolist()
    assert groups.experts.tolist() == sorted(set(flat[order].tolist()))
    assert groups.counts.tolist() == [int((flat == e).sum()) for e in groups.experts]
    assert groups.largest == max(groups.counts)
    assert groups.tokens.tolist() == (order // 3).tolist()
    assert groups.weights.tolist() == weights.reshape(-1)[order].tolist()
    empty = cpu.group(torch.full((2, 2), -1).numpy(), weights[:2, :2].numpy(), 6, cpu.Space())
    assert len(empty.order) == len(empty.experts) == 0 and empty.offs.tolist() == [0]
    slots[0, 0] = 5
    with pytest.raises(ValueError, match="past the table's 5 experts"):
        cpu.group(slots.numpy(), weights.numpy(), 5, cpu.Space())


def test_kept_buffers_give_the_bits_of_fresh_ones_and_wait_for_their_last_use():
    """Calls of several sizes through one Space (growing it, then reusing a larger one) give
    the outputs of calls with buffers of their own, and each waits for the event in `busy`."""
    space, waits = cpu.Space(), []

    class Busy:
        def synchronize(self):
            waits.append(1)

    for seed, tokens in ((1, 2), (2, 40), (3, 3)):  # 40: some experts through torch
        args = case(seed, tokens=tokens, experts=32)
        fresh = expert_rows(*args)
        space.busy = Busy()
        index, rows = experts.expert_rows(*args, native=True, space=space)
        assert torch.equal(index, fresh[0]) and torch.equal(rows, fresh[1])
    assert len(waits) == 3 and space.busy is None


def test_what_the_kernel_refuses_goes_to_torch():
    x, slots, weights, w13, w2 = case(1)
    assert "bfloat16" in cpu.unsupported(x.float(), w13.float(), w2.float())
    assert "multiples of 16" in cpu.unsupported(x[:, :40], w13[:, :, :40], w2[:, :40])
    assert cpu.unsupported(x, w13, w2) is None
    index, rows = expert_rows(x.float(), slots, weights, w13.float(), w2.float())
    assert rows.shape == (len(index), x.shape[1])  # computed by torch, in fp32


def test_native_builds_are_tagged_by_the_cpu(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: A\nflags\t\t: fpu avx2\n" * 2)
    assert cpu_features(info) == "model name\t: A\nflags\t\t: fpu avx2"
    plain = Library("x", cpu.LIBRARY.sources, cpu.LIBRARY.parts)
    assert plain._target() != cpu.LIBRARY._target()  # the flags and the CPU enter the tag


@pytest.mark.parametrize("h", [256, 2048])  # 2048: eight tokens' rows take two passes over a block
def test_up_to_eight_tokens_of_one_expert_agree_with_torch_on_any_threads(h):
    for tokens in (5, 8):
        x, slots, weights, w13, w2 = case(tokens, tokens=tokens, k=2, experts=2, h=h, i=64)
        slots[:, 0], slots[:, 1] = 1, 0  # each expert has all the tokens
        args = (x, slots, weights, w13, w2)
        outs = on_threads(args)
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        ref = with_torch(*args)[1]
        assert torch.allclose(outs[0], ref, rtol=2e-2, atol=1e-3)
        assert (outs[0] - ref).norm() / ref.norm() < 1e-2


def test_the_read_sums_the_experts_weights():
    _, _, _, w13, w2 = case(4, experts=4)
    experts = torch.tensor([3, 1])
    words = torch.cat([w[experts].reshape(-1).view(torch.int64) for w in (w13, w2)])
    assert cpu.read(experts, w13, w2) == int(words.sum())


def test_every_phase_asks_the_team_for_all_threads(monkeypatch):
    """A call of fewer pairs than threads still asks the OpenMP runtime for the same team in
    each of its phases: a region of another size makes the runtime form its team anew, which
    cost milliseconds a call on 16 cores. A stand-in for GOMP_parallel records each region's
    size and runs the phase's work on the calling thread."""
    import ctypes

    sizes: list[int] = []
    task = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)
    def parallel(fn, data, threads, flags):
        sizes.append(threads)
        task(fn)(data)  # one member takes every item

    args = case(11, tokens=1, k=2)  # one pair (the other is -1): the first phase has one item
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        reference = expert_rows(*args)[1]
        address = ctypes.cast(parallel, ctypes.c_void_p).value
        monkeypatch.setattr(cpu, "team", lambda: address)
        rows = expert_rows(*args)[1]
    finally:
        torch.set_num_threads(before)
    assert sizes and set(sizes) == {3}
    assert torch.equal(rows, reference)
