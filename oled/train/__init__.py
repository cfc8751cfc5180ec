"""Training of the built-in default model (`builtin:tiny`) and of the routing twin.

A small LLaDA2-architecture MoE diffusion LM trained with masked diffusion matching the block
decoder (`objective`), on Shakespeare's works and the King James Bible (`corpus`, `data`), its
routed experts as trainable grouped GEMMs (`experts`), their routing balanced without an
auxiliary loss (`step`). `config` holds the flags and presets, `schedule` the run's length and
learning rate, `evaluation` the validation loss, `checkpoint` the export, `loop` the run.
`tools/train_default.py` is the command line.
"""

from __future__ import annotations

from oled.train.checkpoint import checkpoint_tensors, export
from oled.train.config import DESCRIPTION, PRESETS, TrainConfig, parse_config
from oled.train.corpus import PACKAGES, chat_pairs, load_texts, plain_documents
from oled.train.data import Batch, Data
from oled.train.evaluation import evaluate
from oled.train.experts import TrainExperts, grouped_mm_trains, train_grouped_mm
from oled.train.loop import main
from oled.train.objective import diffusion_loss, dual_mask, hidden_states
from oled.train.schedule import Schedule, lr_factor
from oled.train.step import Learner, balance, init_model, make_learner, train_step

__all__ = [
    "DESCRIPTION",
    "PACKAGES",
    "PRESETS",
    "Batch",
    "Data",
    "Learner",
    "Schedule",
    "TrainConfig",
    "TrainExperts",
    "balance",
    "chat_pairs",
    "checkpoint_tensors",
    "diffusion_loss",
    "dual_mask",
    "evaluate",
    "export",
    "grouped_mm_trains",
    "hidden_states",
    "init_model",
    "load_texts",
    "lr_factor",
    "main",
    "make_learner",
    "parse_config",
    "plain_documents",
    "train_grouped_mm",
    "train_step",
]
