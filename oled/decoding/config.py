"""The decoder's settings, with their defaults (the recipe schema's decoding defaults are these).

No torch here: recipes validate and commands parse flags without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Decoding parameters."""

    block_length: int = 32
    threshold: float = 0.95
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    seed: int = 0
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.block_length < 1:
            raise ValueError("block_length must be at least 1")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
