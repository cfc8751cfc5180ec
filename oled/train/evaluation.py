"""Validation loss on held-out text and chat samples."""

from __future__ import annotations

import torch
from torch.types import Device

from oled.model.model import LLaDA2Model
from oled.train.config import TrainConfig
from oled.train.data import Data
from oled.train.experts import TrainExperts
from oled.train.objective import diffusion_loss


@torch.no_grad()
def evaluate(
    model: LLaDA2Model,
    experts: TrainExperts,
    data: Data,
    cfg: TrainConfig,
    mask_id: int,
    device: Device,
    autocast: torch.autocast,
) -> dict[str, float]:
    """Validation loss on held-out text and chat samples with fixed noise (seeded).

    The expert load counted during the evaluation is dropped: it is the training step's."""
    load = experts.load.clone()
    gen = torch.Generator().manual_seed(1234)
    noise = torch.Generator(device=device).manual_seed(4321)
    elbo = ce = 0.0
    for _ in range(cfg.eval_batches):
        batch = data.batch(cfg.batch, gen, val=True).to(device)
        with autocast:
            e, c = diffusion_loss(model, batch, cfg, mask_id, noise)
        elbo += e.item() / cfg.eval_batches
        ce += c.item() / cfg.eval_batches
    experts.load.copy_(load)
    return {"val_loss": elbo, "val_ce": ce}
