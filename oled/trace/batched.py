"""A trace's prompts as a batch decodes them together: one forward over every running stream.

`batched(trace, streams)` lays out the forwards that `oled bench --streams N --routing` runs
(oled.bench.streams, oled.decoding.batch): the selected prompts in turn, in groups of
`streams` (by default every prompt at least once, in whole groups); within a group the prompts
join one forward apart, each running its traced forwards in order, the rows of every running
stream side by side (in the order they joined), and a stream leaves after its last traced
forward. The result is a trace of those batched
forwards, for the simulator (`oled simulate --streams N`): each forward's rows are its streams'
traced rows (routing, token states, confidences, rankings and predictions); `step` counts the
forwards of a group (each group starts at 0, as a recorded generation does), `iteration` is 0,
and `block` counts the blocks begun in the group so far, as the batch decoder tells the
policies (a new value: some stream began a block). Such a trace is not replayable itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from oled.trace.format import Trace
from oled.trace.replay import ReplayPrompt, split_prompts


def batched(trace: Trace, streams: int, prompts: Sequence[int] | None = None) -> Trace:
    """`trace`'s prompts `prompts` decoded `streams` at a time (default: every prompt in turn,
    each at least once, in whole groups: `oled bench --streams N --routing`'s pool);
    ValueError for fewer than one stream."""
    if streams < 1:
        raise ValueError(f"streams must be at least 1, not {streams}")
    traced = split_prompts(trace)
    if prompts is None:
        prompts = [i % len(traced) for i in range(whole_groups(streams, len(traced)))]
    pool = [traced[i] for i in prompts]
    if not pool:
        raise ValueError("no prompts to decode")
    starts = np.asarray(trace.row_offsets, np.int64)
    rows: list[np.ndarray] = []  # per batched forward: the trace rows it runs
    block: list[int] = []
    step: list[int] = []
    for g in range(0, len(pool), streams):
        forwards = _group(pool[g : g + streams], np.asarray(trace.block))
        for f, (parts, begun) in enumerate(forwards):
            rows.append(np.concatenate([np.arange(starts[s], starts[s + 1]) for s in parts]))
            block.append(begun)
            step.append(f)
    index = np.concatenate(rows)  # every prompt has a forward
    lengths = np.array([len(r) for r in rows], np.int64)

    def take(a: np.ndarray | None, axis: int) -> np.ndarray | None:
        return None if a is None else np.take(a, index, axis=axis)

    return replace(
        trace,
        ids=np.take(trace.ids, index, axis=1),
        weights=np.take(trace.weights, index, axis=1),
        token_state=np.take(trace.token_state, index),
        confidence=np.take(trace.confidence, index),
        row_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        block=np.asarray(block, np.int32),
        iteration=np.zeros(len(rows), np.int32),
        step=np.asarray(step, np.int32),
        ranked_ids=take(trace.ranked_ids, 1),
        ranked_scores=take(trace.ranked_scores, 1),
        ahead_ids=take(trace.ahead_ids, 1),
        meta=replace(trace.meta, prompt_count=-(-len(pool) // streams)),
    )


def whole_groups(streams: int, prompts: int) -> int:
    """Requests that cover `prompts` prompts, each at least once, in whole groups of
    `streams`."""
    return streams * -(-prompts // streams)


def _group(group: Sequence[ReplayPrompt], block: np.ndarray) -> list[tuple[list[int], int]]:
    """The batched forwards of one group: per forward, the trace steps of its running streams
    (in the order they joined) and the blocks begun so far."""
    arriving = deque(group)
    running: list[tuple[ReplayPrompt, int]] = []  # each stream and its next step
    out, begun = [], 0
    while arriving or running:
        if arriving:
            running.append((arriving.popleft(), 0))
            begun += 1
        # a stream whose step begins a later block began it now
        begun += sum(
            s > 0 and block[p.first_step + s] != block[p.first_step + s - 1] for p, s in running
        )
        out.append(([p.first_step + s for p, s in running], begun))
        running = [(p, s + 1) for p, s in running if s + 1 < p.steps]
    return out
