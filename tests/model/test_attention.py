"""Batched attention: the padded block (what CUDA graphs replay) against each sequence's own
attention over exactly its keys."""

from __future__ import annotations

import pytest
import torch

from oled.model.layers import Attention, Rotary, block_causal_mask
from oled.model.model import BatchRows
from oled.model.presets import tiny_config


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_padded_block_equals_attention_per_sequence(kv_heads):
    """Three sequences of unequal rows and prefixes (two still in their prompt, so the mask is
    block-causal within the rows): the padded block, its query heads folded per key head, gives
    each row what the sequence's own attention gives, for every ratio of query to key heads."""
    torch.manual_seed(0)
    cfg = tiny_config()
    cfg = type(cfg)(**{**cfg.__dict__, "num_key_value_heads": kv_heads})
    attn = Attention(cfg).eval()
    rotary = Rotary(dim=cfg.rotary_dim, theta=cfg.rope_theta)
    slots, starts, lengths = [2, 0, 1], [64, 0, 8], [8, 40, 24]
    t = sum(lengths)
    x = torch.randn(1, t, cfg.hidden_size)
    shape = (3, kv_heads, 128, cfg.head_dim)  # [slots, kv, S_max, D]
    prefix = (torch.randn(shape), torch.randn(shape))  # earlier keys and values of each slot
    outs = []
    for exact in (False, True):
        rows = BatchRows.build(
            slots, starts, lengths, [0, 0, 0], keys=96, device="cpu", exact=exact
        )
        mask = (
            rows.mask(8)
            if not exact
            else [block_causal_mask(s, n, 8, "cpu") for s, n in zip(starts, lengths, strict=True)]
        )
        cos, sin = rotary.cos_sin(rows.positions, x.dtype)
        kv = (prefix[0].clone(), prefix[1].clone())
        with torch.inference_mode():
            outs.append(attn(x, rotary, cos, sin, kv, rows, mask))
    assert outs[0].shape == (1, t, cfg.hidden_size)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
