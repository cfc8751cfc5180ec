"""The masked-diffusion objective, matching the block decoder.

A sequence holds several 32-token blocks; every block draws its own mask ratio t ~ U(eps, 1) and
masks its maskable positions with probability t. Attention is block-causal as in
`LLaDA2Model.forward`: a noisy block sees itself and the clean earlier blocks. All blocks of a
sequence train at once by running a noisy copy and a clean copy side by side (noisy block b
attends to noisy block b and to clean blocks < b, clean block b to clean blocks <= b, both at
the same absolute positions), which computes for every block exactly what
`LLaDA2Model.forward(clean[:b] + noisy[b])` computes for its last block. Loss: cross-entropy on
masked positions weighted 1/t (the MDLM / LLaDA ELBO), averaged over the positions that could be
masked. Chat samples (LLaDA2 prompt format) mask only the answer, so the prompt stays clean as
in decoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.types import Device

from oled.model.model import LLaDA2Model
from oled.train.config import TrainConfig
from oled.train.data import Batch


def dual_mask(L: int, bl: int, device: Device) -> Tensor:
    """[2L, 2L] bool over (noisy copy, clean copy): see the module docstring."""
    blk = torch.arange(L, device=device) // bl
    same = blk[:, None] == blk[None, :]
    before = blk[None, :] < blk[:, None]
    upto = blk[None, :] <= blk[:, None]
    none = torch.zeros(L, L, dtype=torch.bool, device=device)
    top = torch.cat([same, before], dim=1)  # noisy queries
    bottom = torch.cat([none, upto], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


def hidden_states(model: LLaDA2Model, tokens: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
    """The model's final normed hidden states [B, T, H] for any positions and attention mask."""
    x = model.model.word_embeddings(tokens)
    cos, sin = model.rotary.cos_sin(positions, x.dtype)
    for layer in model.model.layers:
        x = layer(x, model.rotary, cos, sin, None, 0, mask)
    return model.model.norm(x)


def diffusion_loss(
    model: LLaDA2Model, batch: Batch, cfg: TrainConfig, mask_id: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """(1/t-weighted ELBO loss, plain masked cross-entropy) for one batch."""
    tokens, maskable = batch.tokens, batch.maskable
    b, L = tokens.shape
    bl = cfg.block_length
    nb = L // bl
    device = tokens.device
    t = cfg.eps + (1 - cfg.eps) * torch.rand(b, nb, generator=gen, device=device)  # [B, nb]
    t_pos = t.repeat_interleave(bl, dim=1)  # [B, L]
    masked = maskable & (torch.rand(b, L, generator=gen, device=device) < t_pos)
    noisy = torch.where(masked, mask_id, tokens)
    seq = torch.cat([noisy, tokens], dim=1)  # [B, 2L]
    pos = torch.arange(L, device=device).repeat(2)
    h = hidden_states(model, seq, pos, dual_mask(L, bl, device))[:, :L]  # [B, L, H]
    logits = model.lm_head(h[masked]).float()  # [M, V]
    ce = F.cross_entropy(logits, tokens[masked], reduction="none")  # [M]
    denom = maskable.sum().clamp(min=1)
    elbo = (ce / t_pos[masked]).sum() / denom
    return elbo, ce.mean() if ce.numel() else ce.sum()
