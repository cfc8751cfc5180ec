"""Routing trace file: per (step, MoE layer) routed ids and gate weights, per step token states.

Stored as safetensors (`safetensors.numpy`). Rows of all steps are concatenated; step s owns rows
`row_offsets[s]:row_offsets[s + 1]` (its T routed tokens, pending prefix rows first).

tensors: ids [L, R, K] int16 (stored as uint8 when every id fits, as for 256 experts),
weights [L, R, K] float16|float32, token_state [R] int8, confidence [R] float32,
row_offsets [S + 1] int64, block / iteration / step [S] int32; optionally (version 2) the
router's ranking: ranked_ids [L, R, C] (uint8 like ids) and ranked_scores [L, R, C] uint8, the C
experts of highest selection score (sigmoid score plus expert bias, before the group limit), best
first, and their sigmoid scores in steps of 1/255; optionally (version 3) the next layer's
predicted routing: ahead_ids [L - 1, R, K] (uint8 like ids), at index l the top-k that MoE layer
l + 1's router gives layer l's router input (oled.offload.predict.NextLayerRouting: what the
engine copies ahead from while layer l computes).
metadata: format "oled-trace", version, num_moe_layers, num_experts, top_k, expert_bytes,
hidden_size, model_path, prompt_count.
"""

from __future__ import annotations

import json
import lzma
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from oled.policies.base import StepContext

FORMAT = "oled-trace"
VERSION = "3"  # 2: the optional router ranking; 3: the optional next-layer prediction
SCORE_STEPS = 255  # ranked_scores on disk: round(score x 255) as uint8


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
    ranked_ids: np.ndarray | None = None  # [L, R, C] int16: the router's C best, best first
    ranked_scores: np.ndarray | None = None  # [L, R, C] float32: their sigmoid scores
    ahead_ids: np.ndarray | None = None  # [L - 1, R, K] int16: layer l + 1's predicted ids

    @property
    def ranks(self) -> int:
        """C: how many of the router's best experts each row records (0: none)."""
        return 0 if self.ranked_ids is None else self.ranked_ids.shape[2]

    def ranking(self, s: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Per-layer (ranked ids int64 [T, C], scores float32 [T, C]) of step index s, or None
        where the trace records no ranking."""
        if self.ranked_ids is None or self.ranked_scores is None:
            return None
        a, b = self.row_offsets[s], self.row_offsets[s + 1]
        ids = self.ranked_ids[:, a:b].astype(np.int64)
        scores = self.ranked_scores[:, a:b]
        return [(ids[layer], scores[layer]) for layer in range(self.meta.num_moe_layers)]

    def ahead(self, s: int) -> list[np.ndarray] | None:
        """Per MoE layer l < L - 1, the ids int64 [T, K] that layer l + 1's router gives layer
        l's router input in step index s (the prediction to copy ahead from), or None where the
        trace records none."""
        if self.ahead_ids is None:
            return None
        a, b = self.row_offsets[s], self.row_offsets[s + 1]
        return list(self.ahead_ids[:, a:b].astype(np.int64))

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

    def save(self, path: str | Path, *, compress: bool = False) -> None:
        """Write a safetensors trace file; `compress`: xz-compressed (about 2.5x smaller, for
        traces kept in a repository; slower to write, read the same way)."""
        from safetensors.numpy import save, save_file

        small = self.meta.num_experts <= 256 and (self.ids.size == 0 or self.ids.min() >= 0)
        id_type = np.uint8 if small else np.int16
        tensors = {
            "ids": np.ascontiguousarray(self.ids, id_type),
            "weights": np.ascontiguousarray(self.weights),
            "token_state": np.ascontiguousarray(self.token_state, np.int8),
            "confidence": np.ascontiguousarray(self.confidence, np.float32),
            "row_offsets": np.ascontiguousarray(self.row_offsets, np.int64),
            "block": np.ascontiguousarray(self.block, np.int32),
            "iteration": np.ascontiguousarray(self.iteration, np.int32),
            "step": np.ascontiguousarray(self.step, np.int32),
        }
        if self.ranked_ids is not None and self.ranked_scores is not None:
            tensors["ranked_ids"] = np.ascontiguousarray(self.ranked_ids, id_type)
            quantised = np.rint(np.clip(self.ranked_scores, 0, 1) * SCORE_STEPS)
            tensors["ranked_scores"] = np.ascontiguousarray(quantised, np.uint8)
        if self.ahead_ids is not None:
            tensors["ahead_ids"] = np.ascontiguousarray(self.ahead_ids, id_type)
        metadata = {"format": FORMAT, "version": VERSION, **self.meta.to_strings()}
        if compress:
            Path(path).write_bytes(lzma.compress(save(tensors, metadata=metadata)))
        else:
            save_file(tensors, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace file (plain or compressed); ValueError naming the file if it is not
        one."""
        meta, t = _read(path, None)
        t["ids"] = t["ids"].astype(np.int16, copy=False)  # uint8 on disk for <= 256 experts
        if "ranked_ids" in t:
            t["ranked_ids"] = t["ranked_ids"].astype(np.int16, copy=False)
            t["ranked_scores"] = t["ranked_scores"].astype(np.float32) / SCORE_STEPS
        if "ahead_ids" in t:
            t["ahead_ids"] = t["ahead_ids"].astype(np.int16, copy=False)
        return cls(meta=TraceMeta.from_strings(meta), **t)


XZ_MAGIC = b"\xfd7zXZ\x00"


def _read(path: str | Path, names: tuple[str, ...] | None) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, tensors) of a trace file, plain or xz-compressed: those in `names`, or all;
    FileNotFoundError, or ValueError naming the file if it is not a trace."""
    from safetensors import safe_open
    from safetensors.numpy import load

    if not Path(path).is_file():
        raise FileNotFoundError(path)
    try:
        with open(path, "rb") as f:
            compressed = f.read(len(XZ_MAGIC)) == XZ_MAGIC
        if compressed:
            data = lzma.decompress(Path(path).read_bytes())
            (size,) = struct.unpack("<Q", data[:8])
            meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
            tensors = load(data)
        else:
            with safe_open(str(path), framework="np") as f:
                meta = f.metadata() or {}
                keys = [k for k in f.keys() if names is None or k in names]  # noqa: SIM118
                tensors = {k: f.get_tensor(k) for k in keys}
        if meta.get("format") != FORMAT:
            raise ValueError("no 'oled-trace' format tag in its metadata")
    except Exception as e:  # safetensors raises its own error type for non-safetensors files
        raise ValueError(f"{path} is not an OLED-MoE trace file: {e}") from e
    return meta, {k: v for k, v in tensors.items() if names is None or k in names}


def read_meta(path: str | Path) -> TraceMeta:
    """A trace file's TraceMeta (reading only its header where it is not compressed)."""
    return TraceMeta.from_strings(_read(path, ())[0])


def prompt_count(path: str | Path) -> int:
    """How many generations a trace file holds (where `step` restarts at 0), reading only its
    header and step index where it is not compressed; ValueError naming the file if it is not
    a trace."""
    return int((_read(path, ("step",))[1]["step"] == 0).sum())
