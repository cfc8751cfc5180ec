"""The model to train, its optimizer and one training step.

Routed experts are trainable parameters of a training-only executor (`TrainExperts`); routing is
the model's own group-limited sigmoid router, and `expert_bias` follows the auxiliary-loss-free
balancing rule (after each step, bias += u * sign(mean load - load)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from oled.model.config import ModelConfig
from oled.model.model import LLaDA2Model
from oled.train.config import TrainConfig
from oled.train.data import Batch
from oled.train.experts import TrainExperts
from oled.train.objective import diffusion_loss


@dataclass
class Learner:
    """The model, its routed experts and the optimizer over both."""

    model: LLaDA2Model
    experts: TrainExperts
    params: list[Tensor]
    opt: torch.optim.Optimizer


def init_model(cfg: ModelConfig, gen: torch.Generator) -> LLaDA2Model:
    """A model with norms at 1, output projections scaled down by depth, the rest std 0.02."""
    model = LLaDA2Model(cfg)
    out_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith("dense.weight") or name.endswith("down_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for block in model.moe_blocks:
            block.gate.expert_bias.zero_()
    return model


def make_learner(
    cfg: TrainConfig, mcfg: ModelConfig, gen: torch.Generator, device: torch.device
) -> Learner:
    """The initialised model on `device` with its experts plugged in, and AdamW (no weight
    decay on vectors)."""
    model = init_model(mcfg, gen).to(device)
    experts = TrainExperts(mcfg, gen).to(device)
    model.set_executor(experts)
    params = [*model.parameters(), *experts.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    return Learner(model, experts, params, opt)


def train_step(
    learner: Learner,
    batch: Batch,
    lr: float,
    cfg: TrainConfig,
    mask_id: int,
    gen: torch.Generator,
    autocast: torch.autocast,
) -> tuple[Tensor, Tensor]:
    """One optimizer step at `lr` on `batch`, gradients clipped to norm 1, then the balancing
    rule: (loss, masked cross-entropy)."""
    for g in learner.opt.param_groups:
        g["lr"] = lr
    learner.experts.load.zero_()
    with autocast:
        loss, ce = diffusion_loss(learner.model, batch, cfg, mask_id, gen)
    learner.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(learner.params, 1.0)
    learner.opt.step()
    balance(learner.model, learner.experts, cfg.bias_update)
    return loss, ce


@torch.no_grad()
def balance(model: LLaDA2Model, experts: TrainExperts, u: float) -> None:
    """Auxiliary-loss-free balancing: raise the bias of under-loaded experts, lower the rest."""
    for m, block in enumerate(model.moe_blocks):
        load = experts.load[m].to(block.gate.expert_bias.device)
        block.gate.expert_bias += u * torch.sign(load.mean() - load)
