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
    steps: int | None = None  # denoising steps per block: at least block_length / steps commits
    strict_threshold: bool = False  # commit confidence > threshold (LLaDA2's generate), not >=

    def at_least(self, iteration: int) -> int:
        """The fewest positions iteration `iteration` of a block commits: 1, or with `steps`
        the schedule of LLaDA2's generate (block_length / steps each, the remainder one more
        in the first iterations; it sums to block_length, and open positions are tracked apart
        from their tokens, so a block ends within `steps`)."""
        if self.steps is None:
            return 1
        base, extra = divmod(self.block_length, self.steps)
        return base + (iteration < extra) if iteration < self.steps else 1

    def __post_init__(self) -> None:
        if self.block_length < 1:
            raise ValueError("block_length must be at least 1")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.steps is not None and not 1 <= self.steps <= self.block_length:
            raise ValueError(
                f"steps ({self.steps}) must be between 1 and block_length ({self.block_length})"
            )
