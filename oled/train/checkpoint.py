"""The trained model written as a LLaDA2 checkpoint (oled.model.checkpoint's layout)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from oled.model.checkpoint import expert_tensor_names, save_checkpoint
from oled.model.config import ModelConfig
from oled.model.model import LLaDA2Model
from oled.model.tokenizer import Tokenizer
from oled.train.experts import TrainExperts


def checkpoint_tensors(
    model: LLaDA2Model, experts: TrainExperts, cfg: ModelConfig
) -> Iterator[tuple[str, Tensor]]:
    """Every tensor in the LLaDA2 layout: bf16, expert_bias in fp32, experts per expert."""
    for name, t in model.state_dict().items():
        dtype = torch.float32 if name.endswith("expert_bias") else torch.bfloat16
        yield name, t.detach().to("cpu", dtype)
    i = cfg.moe_intermediate_size
    for m, layer in enumerate(cfg.moe_layers):
        w13, w2 = experts.w13[m].detach().cpu(), experts.w2[m].detach().cpu()
        for e in range(cfg.num_experts):
            g, u, d = expert_tensor_names(layer, e)
            yield g, w13[e, :i].to(torch.bfloat16)
            yield u, w13[e, i:].to(torch.bfloat16)
            yield d, w2[e].to(torch.bfloat16)


def export(
    out: Path, model: LLaDA2Model, experts: TrainExperts, mcfg: ModelConfig, tok: Tokenizer
) -> None:
    """`out`/checkpoint, written beside it first and then moved over the previous one."""
    target = out / "checkpoint"
    tmp = out / "checkpoint.tmp"
    save_checkpoint(
        tmp,
        config=mcfg,
        tensors=checkpoint_tensors(model, experts, mcfg),
        tokenizer=tok,
        shard_bytes=None,
    )
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
