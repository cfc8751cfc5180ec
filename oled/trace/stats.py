"""Routing statistics of a trace (`oled trace stats`): how many experts a forward needs, how
much of the previous forward's set the next one reuses, and how stably tokens route by state.

Layout. A forward ("step") runs its pending prefix rows first, then the block's rows: the last
`block_length` rows. A prompt's first forward (`step == 0`) runs the prompt; it is the *prompt
forward*, and every figure below is over the other forwards, the *decode steps*, unless it says
otherwise. Prompts are delimited by `step` restarting at 0. A layer's *set* at a step is the
experts its routed rows name: over the block's rows ("block") or over every row the forward ran
("all rows": what the layer loads; it differs from the block's only at a block's first forward,
by the pending prefix rows).

Figures (per MoE layer, then the mean over layers; `None` in the JSON where nothing counts):
- distinct experts: size of the layer's set per decode step, mean and p90 over steps; block
  rows and all rows; block rows at iteration 0 of a block and at later iterations; and the
  prompt forwards' (mean over prompts) apart.
- tokens per forward: block rows whose state is COMMITTED, mean over decode steps; also total
  commits over every forward (prompt forwards included) divided by the forwards.
- overlap at distance d = 1..5: decode steps s and s + d of one prompt, all-rows sets A and B:
  Jaccard |A & B| / |A | B| and reuse |A & B| / |B|, mean over pairs, within one block
  (same block) and across a block boundary (different blocks).
- route stability: block position at decode step s whose next forward s + 1 is in the same
  block: the fraction of its K routed ids at s that its row at s + 1 also names; grouped by its
  state at s (masked, by confidence bin <0.3, 0.3-0.6, 0.6-0.9, >=0.9; committed; fixed).
- reuse by state: the same (row, s) as route stability, each of its K (row, expert) pairs: is
  the expert in the layer's all-rows set at s + 1; the fraction of pairs, and the same weighted
  by the gate weight; per group. Gate weight per group: mean weight of a (row, expert) pair and
  mean top-1 weight of a row, over the block rows of every decode step.
- ranking (traces that record the router's C best experts per row): per decode step s whose
  s + 1 is the same prompt's, the near misses (experts that masked block rows rank without the
  layer routing to them at s), the experts entering at s + 1 (in its all-rows set, not in s's),
  the share of those that a near miss named, and the share of near misses that enter.
- next-layer prediction (traces that record it, Trace.ahead_ids): per layer l < L - 1 (the
  figure's index; layer l + 1 is predicted) and decode step s, the experts the prediction names
  over every row of s (the top-k that layer l + 1's router gives layer l's router input: what
  the engine copies ahead from), and against layer l + 1's all-rows set at s: the share of that
  set the prediction named (recall), the share of the named experts in it (precision); and for
  decode steps s + 1 of the same prompt as decode step s, the share of layer l + 1's experts
  entering at s + 1 (in its set, not in s's: what a cache misses at large budgets) that the
  prediction at s + 1 named. Shares pool the forwards of a layer (named over all), like the
  ranking's.
- skew: per layer over every row of the trace, load = routed (row, expert) pairs per expert;
  share of the load taken by the top 10% of experts (ceil(0.1 E)), coefficient of variation
  (std / mean, population std) of the load, experts with no load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from oled.token_states import TOKEN_COMMITTED, TOKEN_FIXED, TOKEN_MASKED
from oled.trace.format import Trace

if TYPE_CHECKING:
    from rich.table import Table

Cell = Callable[[dict], str]  # one result -> its cell of a row

CONF_EDGES = (0.3, 0.6, 0.9)
GROUPS = ("masked <0.3", "masked 0.3-0.6", "masked 0.6-0.9", "masked >=0.9", "committed", "fixed")
MAX_DISTANCE = 5
TOP_SHARE = 0.1
DEFAULT_BLOCK_LENGTH = 32


def _fig(per_layer: np.ndarray) -> dict[str, Any]:
    """{'layer_mean', 'per_layer'} of a per-layer figure (NaN -> None)."""
    per_layer = np.asarray(per_layer, np.float64)
    ok = ~np.isnan(per_layer)
    mean = float(per_layer[ok].mean()) if ok.any() else None
    return {"layer_mean": mean, "per_layer": [_num(v) for v in per_layer]}


def _num(v: float) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def _col_mean(x: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Mean of x [L, S] over the selected columns: [L], NaN if none is."""
    if not cols.any():
        return np.full(x.shape[0], np.nan)
    return x[:, cols].mean(axis=1)


def _group_sum(values: np.ndarray, group: np.ndarray, groups: int) -> np.ndarray:
    """Sum of values [L, N] per group [N] (0..groups-1): [L, groups]."""
    layers = values.shape[0]
    idx = np.arange(layers)[:, None] * groups + group[None, :]
    out = np.bincount(idx.ravel(), weights=values.ravel(), minlength=layers * groups)
    return out.reshape(layers, groups)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _presence(
    ids: np.ndarray, step_of_row: np.ndarray, rows: np.ndarray, steps: int, experts: int
) -> np.ndarray:
    """[L, S, E] bool: expert e named by a selected row of step s in layer l."""
    layers = ids.shape[0]
    p = np.zeros(layers * steps * experts, bool)
    sel = np.flatnonzero(rows)
    flat = (np.arange(layers)[:, None, None] * steps + step_of_row[sel][None, :, None]) * experts
    p[(flat + ids[:, sel]).ravel()] = True
    return p.reshape(layers, steps, experts)


def _check(trace: Trace, block_length: int, name: str) -> np.ndarray:
    """Rows per forward [S]; ValueError if the trace's arrays or the block length do not fit."""
    m = trace.meta
    rows_total = trace.token_state.shape[0]
    if trace.ids.shape != (m.num_moe_layers, rows_total, m.top_k) or trace.ids.shape != (
        trace.weights.shape
    ):
        raise ValueError(f"{name}: routing arrays {trace.ids.shape} do not match its metadata")
    off = np.asarray(trace.row_offsets, np.int64)
    if len(off) != trace.num_steps + 1 or off[0] != 0 or off[-1] != rows_total:
        raise ValueError(f"{name}: row offsets do not cover its {rows_total} rows")
    if block_length < 1:
        raise ValueError(f"block length must be at least 1, not {block_length}")
    rows = np.diff(off)
    short = np.flatnonzero(rows < block_length)
    if short.size:
        s = int(short[0])
        raise ValueError(
            f"{name}: forward {s} ran {rows[s]} rows, fewer than the block length "
            f"{block_length} (set --block-length)"
        )
    if rows_total and (trace.ids.min() < 0 or trace.ids.max() >= m.num_experts):
        raise ValueError(f"{name}: expert ids outside 0..{m.num_experts - 1}")
    ahead = trace.ahead_ids
    if ahead is not None:
        want = (max(0, m.num_moe_layers - 1), rows_total, m.top_k)
        if ahead.shape != want:
            raise ValueError(f"{name}: predicted ids {ahead.shape}, not {want}")
        if ahead.size and (ahead.min() < 0 or ahead.max() >= m.num_experts):
            raise ValueError(f"{name}: predicted expert ids outside 0..{m.num_experts - 1}")
    return rows


@dataclass(frozen=True)
class _Layout:
    """Where every row and forward of a trace sits (see the module docstring)."""

    rows: np.ndarray  # [S] rows per forward
    step_of_row: np.ndarray  # [R] the forward of each row
    block_row: np.ndarray  # [R] among its forward's last `block_length` rows
    prompt_fwd: np.ndarray  # [S] a prompt's first forward
    decode: np.ndarray  # [S] any other forward
    new_prompt: np.ndarray  # [S] starts a prompt
    prompt: np.ndarray  # [S] prompt index
    block: np.ndarray  # [S] block index
    iteration: np.ndarray  # [S] iteration within the block
    group: np.ndarray  # [R] index into GROUPS of a block row, -1 for the others


def _layout(trace: Trace, rows: np.ndarray, block_length: int, name: str) -> _Layout:
    """The layout of a checked trace; ValueError if rows before the block are not fixed."""
    S, R = trace.num_steps, trace.token_state.shape[0]
    step_of_row = np.repeat(np.arange(S), rows)
    ends = np.asarray(trace.row_offsets[1:], np.int64)
    block_row = np.arange(R) >= (ends - block_length)[step_of_row]
    stray = ~block_row & (trace.token_state != TOKEN_FIXED)
    if stray.any():
        raise ValueError(
            f"{name}: {int(stray.sum())} rows before the last {block_length} of their forward "
            f"are not fixed: is the block length {block_length}? (set --block-length)"
        )
    prompt_fwd = np.asarray(trace.step) == 0
    new_prompt = prompt_fwd.copy()
    if S:
        new_prompt[0] = True
    return _Layout(
        rows=rows,
        step_of_row=step_of_row,
        block_row=block_row,
        prompt_fwd=prompt_fwd,
        decode=~prompt_fwd,
        new_prompt=new_prompt,
        prompt=np.cumsum(new_prompt) - 1,
        block=np.asarray(trace.block),
        iteration=np.asarray(trace.iteration),
        group=_groups(trace, block_row),
    )


def _groups(trace: Trace, block_row: np.ndarray) -> np.ndarray:
    """[R] index into GROUPS of each block row by its state (and confidence), -1 elsewhere."""
    state = trace.token_state
    conf = trace.confidence.astype(np.float64)
    group = np.full(state.shape[0], -1, np.int64)
    masked = block_row & (state == TOKEN_MASKED)
    group[masked] = np.digitize(conf[masked], CONF_EDGES)
    group[block_row & (state == TOKEN_COMMITTED)] = 4
    group[block_row & (state == TOKEN_FIXED)] = 5
    return group


def _col_p90(x: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """90th percentile of x [L, S] over the selected columns: [L], NaN if none is."""
    if not cols.any():
        return np.full(x.shape[0], np.nan)
    return np.percentile(x[:, cols], 90, axis=1)


def _distinct_experts(lay: _Layout, d_block: np.ndarray, d_all: np.ndarray) -> dict[str, Any]:
    """Set sizes per forward, block rows d_block [L, S] and all rows d_all [L, S]."""
    decode, first = lay.decode, lay.decode & (lay.iteration == 0)
    return {
        "block": {"mean": _fig(_col_mean(d_block, decode)), "p90": _fig(_col_p90(d_block, decode))},
        "all_rows": {"mean": _fig(_col_mean(d_all, decode)), "p90": _fig(_col_p90(d_all, decode))},
        "block_first_iteration": _fig(_col_mean(d_block, first)),
        "block_later_iterations": _fig(_col_mean(d_block, decode & (lay.iteration > 0))),
        "prompt_forward_block": _fig(_col_mean(d_block, lay.prompt_fwd)),
        "prompt_forward_all_rows": _fig(_col_mean(d_all, lay.prompt_fwd)),
    }


def _tokens_per_forward(lay: _Layout, state: np.ndarray) -> dict[str, float | None]:
    """Commits per decode step and per forward (every forward)."""
    S = len(lay.rows)
    committed = lay.block_row & (state == TOKEN_COMMITTED)  # [R]
    commits = np.bincount(lay.step_of_row[committed], minlength=S)  # [S]
    return {
        "decode": _num(commits[lay.decode].mean()) if lay.decode.any() else None,
        "all_forwards": _num(commits.sum() / S) if S else None,
    }


def _distance_pairs(lay: _Layout, d: int) -> list[tuple[str, np.ndarray]]:
    """First steps [P] of decode-step pairs (s, s + d) of one prompt, within and across blocks."""
    if len(lay.rows) > d:
        ok = lay.decode[:-d] & lay.decode[d:] & (lay.prompt[:-d] == lay.prompt[d:])
        same = lay.block[:-d] == lay.block[d:]
    else:
        ok = same = np.zeros(0, bool)
    return [
        ("within_block", np.flatnonzero(ok & same)),
        ("across_block", np.flatnonzero(ok & ~same)),
    ]


def _overlap(lay: _Layout, p_all: np.ndarray) -> dict[str, dict[str, Any]]:
    """Jaccard and reuse of all-rows sets p_all [L, S, E] at distance 1..MAX_DISTANCE."""
    d_all = p_all.sum(-1)  # [L, S]
    overlap: dict[str, dict[str, Any]] = {"jaccard": {}, "reuse": {}, "pairs": {}}
    for where in ("within_block", "across_block"):
        for key in overlap:
            overlap[key][where] = {}
    for d in range(1, MAX_DISTANCE + 1):
        for where, i in _distance_pairs(lay, d):
            inter = (p_all[:, i] & p_all[:, i + d]).sum(-1)  # [L, P]
            na, nb = d_all[:, i], d_all[:, i + d]  # [L, P]
            every = np.ones(len(i), bool)
            overlap["jaccard"][where][str(d)] = _fig(_col_mean(inter / (na + nb - inter), every))
            overlap["reuse"][where][str(d)] = _fig(_col_mean(inter / nb, every))
            overlap["pairs"][where][str(d)] = len(i)
    return overlap


def _next_rows(lay: _Layout) -> tuple[np.ndarray, np.ndarray]:
    """Block rows r [N] whose next forward is the same block's, and their rows there r2 [N]."""
    S = len(lay.rows)
    nxt = np.zeros(S, bool)
    if S > 1:
        nxt[:-1] = lay.decode[:-1] & (lay.prompt[:-1] == lay.prompt[1:])
        nxt[:-1] &= lay.block[:-1] == lay.block[1:]
    r = np.flatnonzero(lay.block_row & nxt[lay.step_of_row] & (lay.group >= 0))
    s = lay.step_of_row[r]
    r2 = r + lay.rows[np.minimum(s + 1, S - 1)]  # the same block position at s + 1
    return r, r2


def _route_stability(ids: np.ndarray, lay: _Layout, r: np.ndarray, r2: np.ndarray) -> dict:
    """Per group: fraction of row r's K routed ids [L, R, K] that row r2 also names."""
    L, G = ids.shape[0], len(GROUPS)
    g = lay.group[r]  # [N]
    kept = np.empty((L, len(r)))  # [L, N]
    for layer in range(L):  # [N, K, K] comparisons, one layer at a time
        a, b = ids[layer, r], ids[layer, r2]
        kept[layer] = (a[:, :, None] == b[:, None, :]).any(-1).mean(-1)
    count = np.bincount(g, minlength=G)  # [G]
    kept_g = _ratio(_group_sum(kept, g, G), count[None, :])  # [L, G]
    return {n: {"kept": _fig(kept_g[:, j]), "rows": int(count[j])} for j, n in enumerate(GROUPS)}


def _reuse_by_state(
    ids: np.ndarray, weights: np.ndarray, p_all: np.ndarray, lay: _Layout, r: np.ndarray
) -> dict:
    """Per group: fraction of row r's (row, expert) pairs in the all-rows set p_all of s + 1."""
    L, S, E = p_all.shape
    K, G = ids.shape[2], len(GROUPS)
    s, g = lay.step_of_row[r], lay.group[r]  # [N]
    count = np.bincount(g, minlength=G)  # [G]
    lidx = np.arange(L)[:, None, None]
    used = p_all.reshape(-1)[((lidx * S + (s + 1)[None, :, None]) * E + ids[:, r]).ravel()]
    used = used.reshape(L, len(r), K)
    w = weights[:, r]  # [L, N, K]
    reuse_g = _ratio(_group_sum(used.sum(-1), g, G), K * count[None, :])  # [L, G]
    wreuse_g = _ratio(_group_sum((w * used).sum(-1), g, G), _group_sum(w.sum(-1), g, G))
    return {
        n: {
            "reuse": _fig(reuse_g[:, j]),
            "weighted_reuse": _fig(wreuse_g[:, j]),
            "pairs": int(count[j]) * K,
        }
        for j, n in enumerate(GROUPS)
    }


def _gate_weight(weights: np.ndarray, lay: _Layout) -> dict:
    """Per group: mean gate weight [L, R, K] of a pair and mean top-1 weight, decode block rows."""
    K, G = weights.shape[2], len(GROUPS)
    q = np.flatnonzero(lay.block_row & lay.decode[lay.step_of_row] & (lay.group >= 0))
    gq = lay.group[q]  # [Q]
    count_q = np.bincount(gq, minlength=G)  # [G]
    wq = weights[:, q]  # [L, Q, K]
    mean_w = _ratio(_group_sum(wq.sum(-1), gq, G), K * count_q[None, :])  # [L, G]
    top1_w = _ratio(_group_sum(wq.max(-1, initial=0.0), gq, G), count_q[None, :])  # [L, G]
    return {
        n: {"mean": _fig(mean_w[:, j]), "top1": _fig(top1_w[:, j]), "rows": int(count_q[j])}
        for j, n in enumerate(GROUPS)
    }


def _skew(ids: np.ndarray, experts: int) -> dict[str, Any]:
    """Load skew per layer over every routed (row, expert) pair of ids [L, R, K]."""
    L, E = ids.shape[0], experts
    flat = (np.arange(L)[:, None, None] * E + ids).ravel()
    load = np.bincount(flat, minlength=L * E).reshape(L, E)  # [L, E]
    total = load.sum(1)  # [L]
    top = max(1, math.ceil(TOP_SHARE * E))
    top_load = -np.sort(-load, axis=1)[:, :top].sum(1)  # [L]
    unused = (load == 0).sum(1)  # [L]
    return {
        "top10_share": _fig(_ratio(top_load, total)),
        "load_cv": _fig(_ratio(load.std(1), load.mean(1))),
        "unused_experts": _fig(unused),
        "unused_total": int(unused.sum()),
    }


def _entering(lay: _Layout, sets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i [P]: the decode steps s whose s + 1 is the same prompt's, the experts entering at
    s + 1 [L, P, E]: in the set at s + 1, not in the set at s) of per-step sets [L, S, E]."""
    i = np.zeros(0, np.int64)
    if len(lay.rows) > 1:
        i = np.flatnonzero(lay.decode[:-1] & (lay.prompt[:-1] == lay.prompt[1:]))
    return i, sets[:, i + 1] & ~sets[:, i]


def _ranking(trace: Trace, lay: _Layout, p_all: np.ndarray) -> dict[str, Any] | None:
    """What the router's ranking below the top-k says about the next forward: per decode step s
    whose s + 1 is the same prompt's, the experts that masked rows rank (1..C) without routing
    to them ("near misses"), how many the layer's set at s lacks, and the share of the experts
    entering at s + 1 (in its set, not in s's) that they name. None without a ranking."""
    if trace.ranked_ids is None:
        return None
    S, E = len(lay.rows), trace.meta.num_experts
    ranked = trace.ranked_ids.astype(np.int64)  # [L, R, C]
    masked = lay.block_row & (trace.token_state == TOKEN_MASKED)  # [R]
    near = _presence(ranked, lay.step_of_row, masked, S, E) & ~p_all  # [L, S, E]
    i, entering = _entering(lay, p_all)  # [P], [L, P, E]
    named = (entering & near[:, i]).sum(-1)  # [L, P]
    every = np.ones(len(i), bool)
    return {
        "ranks": trace.ranks,
        "near_misses": _fig(_col_mean(near[:, i].sum(-1).astype(np.float64), every)),
        "entering": _fig(_col_mean(entering.sum(-1).astype(np.float64), every)),
        "entering_named": _fig(named.sum(1) / np.maximum(1, entering.sum((1, 2)))),
        "near_misses_entering": _fig(named.sum(1) / np.maximum(1, near[:, i].sum((1, 2)))),
    }


def _prediction(trace: Trace, lay: _Layout, p_all: np.ndarray) -> dict[str, Any] | None:
    """How well the recorded next-layer prediction names the next layer's experts (see the
    module docstring), per predicting layer l < L - 1; None without a prediction."""
    if trace.ahead_ids is None:
        return None
    S, R, E = len(lay.rows), trace.token_state.shape[0], trace.meta.num_experts
    ahead = trace.ahead_ids.astype(np.int64)  # [L - 1, R, K]
    named = _presence(ahead, lay.step_of_row, np.ones(R, bool), S, E)  # [L - 1, S, E]
    routed = p_all[1:]  # [L - 1, S, E]: the predicted layers' sets
    d = lay.decode
    both = (named[:, d] & routed[:, d]).sum((1, 2))  # [L - 1]
    i, entering = _entering(lay, routed)  # [P], [L - 1, P, E]
    return {
        "named": _fig(_col_mean(named.sum(-1).astype(np.float64), d)),
        "recall": _fig(_ratio(both, routed[:, d].sum((1, 2)))),
        "precision": _fig(_ratio(both, named[:, d].sum((1, 2)))),
        "entering_named": _fig(
            _ratio((entering & named[:, i + 1]).sum((1, 2)), entering.sum((1, 2)))
        ),
    }


def _size(trace: Trace, lay: _Layout) -> dict[str, Any]:
    """Counts of prompts, forwards, blocks and rows, and the model's shape."""
    m = trace.meta
    S = len(lay.rows)
    new_block = lay.new_prompt.copy()  # [S]
    if S > 1:
        new_block[1:] |= lay.block[1:] != lay.block[:-1]
    return {
        "prompts": int(lay.new_prompt.sum()),
        "prompts_recorded": m.prompt_count,
        "forwards": S,
        "decode_forwards": int(lay.decode.sum()),
        "prompt_forwards": int(lay.prompt_fwd.sum()),
        "blocks": int(new_block.sum()),
        "rows": trace.token_state.shape[0],
        "decode_rows": int(lay.rows[lay.decode].sum()),
        "moe_layers": m.num_moe_layers,
        "experts": m.num_experts,
        "top_k": m.top_k,
    }


def trace_stats(
    trace: Trace, *, block_length: int = DEFAULT_BLOCK_LENGTH, name: str = "trace"
) -> dict[str, Any]:
    """Routing statistics of one trace (see the module docstring): a JSON-ready dict."""
    rows = _check(trace, block_length, name)
    lay = _layout(trace, rows, block_length, name)
    S, R, E = trace.num_steps, trace.token_state.shape[0], trace.meta.num_experts
    ids = trace.ids.astype(np.int64)  # [L, R, K]
    weights = trace.weights.astype(np.float64)  # [L, R, K]
    p_block = _presence(ids, lay.step_of_row, lay.block_row, S, E)  # [L, S, E]
    p_all = _presence(ids, lay.step_of_row, np.ones(R, bool), S, E)  # [L, S, E]
    r, r2 = _next_rows(lay)
    return {
        "trace": name,
        "block_length": block_length,
        "model_path": trace.meta.model_path,
        "size": _size(trace, lay),
        "distinct_experts": _distinct_experts(lay, p_block.sum(-1), p_all.sum(-1)),
        "tokens_per_forward": _tokens_per_forward(lay, trace.token_state),
        "overlap": _overlap(lay, p_all),
        "route_stability": _route_stability(ids, lay, r, r2),
        "reuse_by_state": _reuse_by_state(ids, weights, p_all, lay, r),
        "gate_weight": _gate_weight(weights, lay),
        "skew": _skew(ids, E),
        "ranking": _ranking(trace, lay, p_all),
        "prediction": _prediction(trace, lay, p_all),
    }


def _f(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _rows() -> list[tuple[str, Any]]:
    """(label, result -> cell) of the table."""

    def lm(*path: str, fmt: str = "{:.3f}") -> Cell:
        def cell(res: dict) -> str:
            x = res
            for p in path:
                x = x[p]
            return _f(x["layer_mean"], fmt)

        return cell

    def pair(key: str, d: int) -> Cell:
        def cell(res: dict) -> str:
            o = res["overlap"][key]
            return f"{_f(o['within_block'][str(d)]['layer_mean'])} / " + _f(
                o["across_block"][str(d)]["layer_mean"]
            )

        return cell

    one = "{:.1f}"
    out: list[tuple[str, Any]] = [
        ("prompts / forwards", lambda r: f"{r['size']['prompts']} / {r['size']['forwards']}"),
        (
            "decode forwards / rows",
            lambda r: f"{r['size']['decode_forwards']} / {r['size']['rows']}",
        ),
        (
            "layers x experts, top-k",
            lambda r: f"{r['size']['moe_layers']} x {r['size']['experts']}, {r['size']['top_k']}",
        ),
        ("distinct experts/layer, block (mean)", lm("distinct_experts", "block", "mean", fmt=one)),
        ("  p90", lm("distinct_experts", "block", "p90", fmt=one)),
        ("  block iteration 0", lm("distinct_experts", "block_first_iteration", fmt=one)),
        ("  later iterations", lm("distinct_experts", "block_later_iterations", fmt=one)),
        (
            "distinct experts/layer, all rows (mean)",
            lm("distinct_experts", "all_rows", "mean", fmt=one),
        ),
        ("  p90", lm("distinct_experts", "all_rows", "p90", fmt=one)),
        (
            "prompt forward distinct, block / all rows",
            lambda r: (
                lm("distinct_experts", "prompt_forward_block", fmt=one)(r)
                + " / "
                + lm("distinct_experts", "prompt_forward_all_rows", fmt=one)(r)
            ),
        ),
        (
            "tokens/forward, decode / all forwards",
            lambda r: (
                _f(r["tokens_per_forward"]["decode"], "{:.2f}")
                + " / "
                + _f(r["tokens_per_forward"]["all_forwards"], "{:.2f}")
            ),
        ),
    ]
    out += [(f"Jaccard d={d}, within / across block", pair("jaccard", d)) for d in range(1, 6)]
    out += [(f"reuse d={d}, within / across block", pair("reuse", d)) for d in range(1, 6)]
    out += [(f"routes kept at s+1, {n}", lm("route_stability", n, "kept")) for n in GROUPS]
    out += [
        (
            f"experts used at s+1 (gate-wt), {n}",
            lambda r, n=n: (
                lm("reuse_by_state", n, "reuse")(r)
                + " ("
                + lm("reuse_by_state", n, "weighted_reuse")(r)
                + ")"
            ),
        )
        for n in GROUPS
    ]
    out += [
        (
            f"gate weight mean / top-1, {n}",
            lambda r, n=n: (
                lm("gate_weight", n, "mean")(r) + " / " + lm("gate_weight", n, "top1")(r)
            ),
        )
        for n in GROUPS
    ]
    out += [
        ("load share of top 10% experts", lm("skew", "top10_share")),
        ("expert load CV", lm("skew", "load_cv", fmt="{:.2f}")),
        (
            "unused experts/layer (total)",
            lambda r: lm("skew", "unused_experts", fmt=one)(r) + f" ({r['skew']['unused_total']})",
        ),
    ]

    def optional(section: str) -> Callable[..., Cell]:
        """Cells of a section that traces may lack ("-" where they do)."""

        def cell(key: str, fmt: str = "{:.3f}") -> Cell:
            return lambda r: "-" if r.get(section) is None else lm(section, key, fmt=fmt)(r)

        return cell

    ranked, predicted = optional("ranking"), optional("prediction")

    out += [
        ("near misses/layer (ranked by masked rows, not routed)", ranked("near_misses", one)),
        ("experts entering at s+1 per layer", ranked("entering", one)),
        ("  share a near miss at s named", ranked("entering_named")),
        ("near misses at s that enter at s+1", ranked("near_misses_entering")),
    ]

    out += [
        ("next-layer prediction: experts named/layer", predicted("named", one)),
        ("  share of layer l+1's experts named (recall)", predicted("recall")),
        ("  share named that layer l+1 routed (precision)", predicted("precision")),
        ("  share of layer l+1's entering experts named", predicted("entering_named")),
    ]
    return out


def stats_table(results: list[dict[str, Any]], names: list[str] | None = None) -> Table:
    """A rich Table: one column per result, rows = the figures (means over layers)."""
    from rich.table import Table

    table = Table(title="routing statistics (mean over MoE layers; decode forwards)")
    table.add_column("figure", justify="left", no_wrap=True)
    for i, res in enumerate(results):
        table.add_column(names[i] if names else res["trace"], justify="right")
    for label, cell in _rows():
        table.add_row(label, *(cell(res) for res in results))
    return table


def column_names(paths: list[Path]) -> list[str]:
    """File names, or whole paths where two files share a name."""
    names = [p.name for p in paths]
    return [str(p) if names.count(p.name) > 1 else p.name for p in paths]


def write_json(results: list[dict[str, Any]], out: Path) -> None:
    """Write {'traces': results} (every figure per layer too)."""
    out.write_text(json.dumps({"traces": results}, indent=1, allow_nan=False) + "\n")
