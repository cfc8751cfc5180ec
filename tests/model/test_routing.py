"""Routing against a direct, loop-by-loop transcription of DESIGN.md section 4."""

from __future__ import annotations

import math

import pytest
import torch

from oled.model.layers import route


def reference_route(x, weight, bias, *, top_k, n_group, topk_group, scale, normalise):
    """Token by token, group by group, in plain Python over floats."""
    ids_out, w_out = [], []
    e = weight.shape[0]
    per_group = e // n_group
    for row in x.double():
        s = [1 / (1 + math.exp(-float(row @ weight[j].double()))) for j in range(e)]
        b = [s[j] + float(bias[j]) for j in range(e)]
        group_scores = []
        for g in range(n_group):
            members = sorted(b[g * per_group : (g + 1) * per_group], reverse=True)
            group_scores.append(members[0] + members[1])
        kept = sorted(range(n_group), key=lambda g: -group_scores[g])[:topk_group]
        candidates = [j for g in kept for j in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(candidates, key=lambda j: -b[j])[:top_k]
        w = [s[j] for j in chosen]
        if normalise:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        ids_out.append(chosen)
        w_out.append([v * scale for v in w])
    return torch.tensor(ids_out), torch.tensor(w_out)


@pytest.mark.parametrize(
    "experts,groups,keep,top_k", [(32, 4, 2, 4), (64, 8, 4, 6), (16, 8, 3, 1), (256, 8, 4, 8)]
)
def test_route_matches_transcription(experts, groups, keep, top_k):
    gen = torch.Generator().manual_seed(experts + top_k)
    x = torch.randn(12, 48, generator=gen)
    weight = torch.randn(experts, 48, generator=gen) * 0.3
    bias = torch.randn(experts, generator=gen) * 0.2  # large enough to change selections
    kw = dict(top_k=top_k, n_group=groups, topk_group=keep, scale=2.5, normalise=top_k > 1)
    ids, w = route(x, weight, bias, **kw)
    ref_ids, ref_w = reference_route(x, weight, bias, **kw)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w.float(), rtol=1e-5, atol=1e-6)


def test_bias_selects_but_does_not_weigh():
    x = torch.randn(4, 8)
    weight = torch.randn(8, 8)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 always chosen...
    ids, w = route(x, weight, bias, top_k=2, n_group=2, topk_group=1, scale=1.0, normalise=False)
    assert (ids == 5).any(dim=1).all()
    scores = torch.sigmoid(x @ weight.t())
    torch.testing.assert_close(w, scores.gather(1, ids))  # ...but weighted by its plain score


def test_router_stays_fp32_under_autocast():
    """Training runs the model under bf16 autocast; the router must select as in decoding."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=gen)
    weight = torch.randn(32, 64, generator=gen) * 0.3
    bias = torch.randn(32, generator=gen) * 0.01
    kw = dict(top_k=4, n_group=4, topk_group=2, scale=2.5, normalise=True)
    ids, w = route(x, weight, bias, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ids_ac, w_ac = route(x, weight, bias, **kw)
    assert w_ac.dtype == torch.float32
    assert torch.equal(ids_ac, ids)
    torch.testing.assert_close(w_ac, w)
