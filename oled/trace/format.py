"""Routing trace file: per (step, MoE layer) routed ids and gate weights, per step token states.

Stored as safetensors (`safetensors.numpy`). Rows of all steps are concatenated; step s owns rows
`row_offsets[s]:row_offsets[s + 1]` (its T routed tokens, pending prefix rows first).

tensors: ids [L, R, K] int16 (stored as uint8 when every id fits, as for 256 experts),
weights [L, R, K] float16|float32, token_state [R] int8, confidence [R] float32,
row_offsets [S + 1] int64, block / iteration / step [S] int32.
metadata: format "oled-trace", version, num_moe_layers, num_experts, top_k, expert_bytes,
hidden_size, model_path, prompt_count.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from oled.policies.base import StepContext

FORMAT = "oled-trace"
VERSION = "1"


@dataclass(frozen=True)
class TraceMeta:
    """Model shape and provenance of a trace."""

    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int = 0
    hidden_size: int = 0
    model_path: str = ""
    prompt_count: int = 0

    def to_strings(self) -> dict[str, str]:
        """safetensors metadata (str -> str)."""
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_strings(cls, meta: dict[str, str]) -> TraceMeta:
        """Inverse of `to_strings`."""
        ints = ("num_moe_layers", "num_experts", "top_k", "expert_bytes", "hidden_size")
        return cls(
            **{k: int(meta[k]) for k in ints},
            model_path=meta.get("model_path", ""),
            prompt_count=int(meta.get("prompt_count", 0)),
        )


Routing = list[tuple[np.ndarray, np.ndarray]]  # per MoE layer: (ids [T, K], weights [T, K])


@dataclass
class Trace:
    """A recorded (or synthetic) routing trace; iterate for (StepContext, per-layer routing)."""

    meta: TraceMeta
    ids: np.ndarray  # [L, R, K] int16
    weights: np.ndarray  # [L, R, K] float16 or float32
    token_state: np.ndarray  # [R] int8
    confidence: np.ndarray  # [R] float32
    row_offsets: np.ndarray  # [S + 1] int64
    block: np.ndarray  # [S] int32
    iteration: np.ndarray  # [S] int32
    step: np.ndarray  # [S] int32

    @property
    def num_steps(self) -> int:
        """Number of forwards."""
        return len(self.block)

    def __len__(self) -> int:
        return self.num_steps

    @property
    def prompt_starts(self) -> np.ndarray:
        """Step index [P] where each recorded generation starts (its `step` is 0)."""
        return np.flatnonzero(self.step == 0)

    def context(self, s: int) -> StepContext:
        """The StepContext of step index s."""
        a, b = self.row_offsets[s], self.row_offsets[s + 1]
        return StepContext(
            block=int(self.block[s]),
            iteration=int(self.iteration[s]),
            step=int(self.step[s]),
            token_state=self.token_state[a:b],
            confidence=self.confidence[a:b],
        )

    def routing(self, s: int, *, dtype: type = np.float32) -> Routing:
        """Per-layer (ids int64 [T, K], weights [T, K]) of step index s."""
        a, b = self.row_offsets[s], self.row_offsets[s + 1]
        ids = self.ids[:, a:b].astype(np.int64)
        w: np.ndarray = self.weights[:, a:b].astype(dtype)
        return [(ids[layer], w[layer]) for layer in range(self.meta.num_moe_layers)]

    def __iter__(self) -> Iterator[tuple[StepContext, Routing]]:
        for s in range(self.num_steps):
            yield self.context(s), self.routing(s)

    def save(self, path: str | Path) -> None:
        """Write a safetensors trace file."""
        from safetensors.numpy import save_file

        small = self.meta.num_experts <= 256 and (self.ids.size == 0 or self.ids.min() >= 0)
        tensors = {
            "ids": np.ascontiguousarray(self.ids, np.uint8 if small else np.int16),
            "weights": np.ascontiguousarray(self.weights),
            "token_state": np.ascontiguousarray(self.token_state, np.int8),
            "confidence": np.ascontiguousarray(self.confidence, np.float32),
            "row_offsets": np.ascontiguousarray(self.row_offsets, np.int64),
            "block": np.ascontiguousarray(self.block, np.int32),
            "iteration": np.ascontiguousarray(self.iteration, np.int32),
            "step": np.ascontiguousarray(self.step, np.int32),
        }
        metadata = {"format": FORMAT, "version": VERSION, **self.meta.to_strings()}
        save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace file; ValueError naming the file if it is not one."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="np") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise ValueError("no 'oled-trace' format tag in its metadata")
                t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            t["ids"] = t["ids"].astype(np.int16, copy=False)  # uint8 on disk for <= 256 experts
            return cls(meta=TraceMeta.from_strings(meta), **t)
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors raises its own error type for non-safetensors files
            raise ValueError(f"{path} is not an OLED-MoE trace file: {e}") from e


def prompt_count(path: str | Path) -> int:
    """How many generations a trace file holds (where `step` restarts at 0), reading only its
    header and step index; ValueError naming the file if it is not a trace."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(path)
    try:
        with safe_open(str(path), framework="np") as f:
            if (f.metadata() or {}).get("format") != FORMAT:
                raise ValueError("no 'oled-trace' format tag in its metadata")
            step = f.get_tensor("step")
    except Exception as e:  # safetensors raises its own error type for non-safetensors files
        raise ValueError(f"{path} is not an OLED-MoE trace file: {e}") from e
    return int((step == 0).sum())
