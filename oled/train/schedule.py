"""The run's length in steps (fitted to a time budget) and its learning-rate schedule."""

from __future__ import annotations

import math
import time

from oled.train.config import TrainConfig

UNTIMED_STEPS = 10  # warm-up steps (kernel selection, allocator growth) before the timed ones
TIMED_STEPS = 10


class Schedule:
    """The steps to run: `max_steps`, or with a time budget the steps that fit the time left.

    The length first comes from the time of steps 10-20 (after the first steps' warm-up:
    kernel selection, allocator growth) plus one timed evaluation's share, and is planned again
    at every evaluation from the time since the last one, so that a step time that changes as
    the router spreads out still fits.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.total = cfg.max_steps
        self.budget = cfg.minutes * 60
        self.t0 = time.time()
        self.t_timed = self.t0  # when the timed steps began
        self.mark: tuple[int, float] | None = None  # (step, time) the length was last planned at

    def timing(self, step: int) -> bool:
        """Whether `step` starts or ends the timed steps (with a time budget only)."""
        return bool(self.cfg.minutes) and step in (UNTIMED_STEPS, UNTIMED_STEPS + TIMED_STEPS)

    def plan(self, step: int, per_step: float) -> int:
        """The schedule's length: the steps that fit the time left, evaluations included."""
        left = self.budget - (time.time() - self.t0)
        return min(self.cfg.max_steps, max(step + 1, step + int(left / per_step * 0.98)))

    def fit(self, step: int, per_step: float) -> None:
        """Plan the length from the time of a step at `step` and mark the time."""
        self.total = self.plan(step, per_step)
        self.mark = (step, time.time())

    def replan(self, step: int) -> None:
        """At an evaluation: plan again from the step time since the last plan."""
        if self.mark is not None and self.mark[0] < step < self.total:
            self.fit(step, (time.time() - self.mark[1]) / (step - self.mark[0]))

    def resume(self, step: int, total: int, minutes: float) -> None:
        """Go on at `step` of a run planned to `total` steps that has trained `minutes`."""
        self.total = total
        self.t0 = time.time() - minutes * 60
        self.mark = (step, time.time()) if self.cfg.minutes else None

    def minutes(self) -> float:
        return (time.time() - self.t0) / 60


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_lr_frac`."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac))
