"""CPU experts beside a device (oled.offload.host_experts): their rows added into the layer's
pairs give `expert_pairs`' values; beside a GPU through pinned buffers kept between calls."""

from __future__ import annotations

import pytest
import torch

from oled.kernels import cpu
from oled.model.experts import expert_pairs
from oled.offload.host_experts import HostExperts


def layer(seed: int, tokens: int, experts: int = 16, h: int = 256, i: int = 128, k: int = 4):
    """bf16 tables and activations, and slots [T, K] of which about half run on the host."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * i, h, generator=g) / 16).bfloat16()
    w2 = (torch.randn(experts, h, i, generator=g) / 11).bfloat16()
    x = torch.randn(tokens, h, generator=g).bfloat16()
    slots = torch.randint(0, experts, (tokens, k), generator=g)
    slots[torch.rand(tokens, k, generator=g) < 0.5] = -1
    return x, slots, torch.rand(tokens, k, generator=g), w13, w2


def test_the_host_path_of_a_cpu_device_adds_expert_pairs_values():
    host = HostExperts(torch.device("cpu"))
    for seed, tokens in ((0, 3), (1, 12)):
        x, slots, weights, w13, w2 = layer(seed, tokens)
        pairs = torch.zeros(tokens, slots.shape[1], x.shape[1])
        host.add(pairs, *host.rows(x, slots, weights, w13, w2))
        assert torch.equal(pairs, expert_pairs(x, slots, weights, w13, w2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_beside_a_gpu_kept_pinned_buffers_give_each_calls_own_rows():
    """Calls of growing and shrinking sizes, each added before the next writes the buffers:
    every layer's pairs equal that layer's rows computed with buffers of its own."""
    host = HostExperts(torch.device("cuda"))
    got, want = [], []
    for seed, tokens in ((0, 2), (1, 30), (2, 1), (3, 30)):
        x, slots, weights, w13, w2 = layer(seed, tokens)
        index, rows = host.rows(x, slots, weights, w13, w2)
        assert rows.is_pinned() == (cpu.unsupported(x, w13, w2) is None)
        pairs = torch.zeros(tokens, slots.shape[1], x.shape[1], device="cuda")
        host.add(pairs, index, rows)
        got.append(pairs)
        own_index, own = HostExperts(torch.device("cuda")).rows(x, slots, weights, w13, w2)
        ref = torch.zeros(tokens * slots.shape[1], x.shape[1])
        ref[own_index] = own
        want.append(ref.view_as(pairs))
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))
