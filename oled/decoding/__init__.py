"""Block diffusion decoding."""

from oled.decoding.decoder import BlockDecoder, DecodeConfig, GenerationStats
from oled.decoding.follow import Trajectory
from oled.decoding.observers import BlockInfo, DecodeObserver, IterationInfo

__all__ = [
    "BlockDecoder",
    "BlockInfo",
    "DecodeConfig",
    "DecodeObserver",
    "GenerationStats",
    "IterationInfo",
    "Trajectory",
]
