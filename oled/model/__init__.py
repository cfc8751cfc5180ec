"""The LLaDA2 MoE model: config, layers, checkpoints, tokenizer and presets."""

from oled.model.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from oled.model.config import ConfigError, ModelConfig
from oled.model.experts import ExpertStore, ResidentExperts
from oled.model.model import LLaDA2Model
from oled.model.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "ExpertStore",
    "LLaDA2Model",
    "ModelConfig",
    "ResidentExperts",
    "Tokenizer",
    "TokenizerError",
    "load_checkpoint",
    "save_checkpoint",
]
