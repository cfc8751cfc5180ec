"""Miss curves and the split of the slot budget by marginal gain (utility-based cache
partitioning, Qureshi & Patt, MICRO 2006).

A layer's miss curve `misses[c]` is how many experts it misses over a tuning trace with `c` slots
(c = 0..E) under a retention policy, every miss copied (oled.trace.curves measures it). Given the
curves, `split` finds the capacities that minimise the total misses under the budget, exactly
(a min-plus sum over layers). The equal split is one of the capacities it considers, so on the
trace the curves come from the split never misses more than the equal one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "oled-miss-curves"


@dataclass(frozen=True)
class MissCurves:
    """Per MoE layer, the misses at every capacity 0..E, and where they were measured."""

    misses: np.ndarray  # [L, E + 1] int64
    source: dict  # the trace, its forwards, the retention policy and its parameters

    @property
    def num_layers(self) -> int:
        return self.misses.shape[0]

    @property
    def num_experts(self) -> int:
        return self.misses.shape[1] - 1

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT, **self.source, "misses": self.misses.tolist()}
        Path(path).write_text(json.dumps(data) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MissCurves:
        """Read a curves file; ValueError naming the file where it is not one."""
        try:
            data = json.loads(Path(path).read_text())
            if data.pop("format", None) != FORMAT:
                raise ValueError(f"no {FORMAT!r} format tag")
            misses = np.asarray(data.pop("misses"), np.int64)
            if misses.ndim != 2 or misses.shape[1] < 2:
                raise ValueError(f"misses of shape {misses.shape}, not [layers, experts + 1]")
        except OSError as exc:
            raise ValueError(f"{path}: cannot read miss curves ({exc.strerror or exc})") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a miss-curves file: {exc}") from None
        return cls(misses, data)


def split(misses: np.ndarray, total_slots: int) -> list[int]:
    """Capacities [L], each in 1..E, summing to min(total_slots, L * E), that minimise the
    summed misses of the curves [L, E + 1]; among equal totals the first found (fewest slots
    in the earliest layers)."""
    layers, e1 = misses.shape
    e = e1 - 1
    total = min(total_slots, layers * e)
    if total < layers:
        raise ValueError(f"{total_slots} slots is below the minimum of {layers} (one per layer)")
    inf = np.iinfo(np.int64).max // 4
    best = np.full(total + 1, inf, np.int64)  # best[u]: least misses of the layers so far in u
    best[0] = 0
    choice = np.zeros((layers, total + 1), np.int64)
    for layer in range(layers):
        nxt = np.full(total + 1, inf, np.int64)
        for c in range(1, min(e, total) + 1):
            cand = best[: total + 1 - c] + misses[layer, c]  # [total + 1 - c]
            better = cand < nxt[c:]
            nxt[c:][better] = cand[better]
            choice[layer, c:][better] = c
        best = nxt
    used = total  # every slot: the equal split is among the candidates
    caps = []
    for layer in range(layers - 1, -1, -1):
        c = int(choice[layer, used])
        caps.append(c)
        used -= c
    caps.reverse()
    return caps
