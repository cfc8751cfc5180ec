"""`oled trace stats`: routing statistics on hand-made traces with known figures, on synthetic
traces, and through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from oled.cli import app
from oled.token_states import TOKEN_COMMITTED as C
from oled.token_states import TOKEN_FIXED as F
from oled.token_states import TOKEN_MASKED as M
from oled.trace.format import Trace, TraceMeta
from oled.trace.stats import GROUPS, trace_stats
from oled.trace.synthetic import synthetic_trace


def make_trace(steps, *, experts: int = 16, top_k: int = 2) -> Trace:
    """steps: (block, iteration, step, ids [T][K], states [T], conf [T], weights [T][K] | None),
    one MoE layer."""
    ids, ws, st, cf, off, meta = [], [], [], [], [0], []
    for block, it, step, rows, states, conf, w in steps:
        rows = np.asarray(rows, np.int16)
        ids.append(rows)
        ws.append(np.full(rows.shape, 0.5, np.float32) if w is None else np.asarray(w, np.float32))
        st.append(np.asarray(states, np.int8))
        cf.append(np.asarray(conf, np.float32))
        off.append(off[-1] + len(rows))
        meta.append((block, it, step))
    return Trace(
        meta=TraceMeta(num_moe_layers=1, num_experts=experts, top_k=top_k),
        ids=np.concatenate(ids)[None],
        weights=np.concatenate(ws)[None],
        token_state=np.concatenate(st),
        confidence=np.concatenate(cf),
        row_offsets=np.asarray(off, np.int64),
        block=np.array([m[0] for m in meta], np.int32),
        iteration=np.array([m[1] for m in meta], np.int32),
        step=np.array([m[2] for m in meta], np.int32),
    )


# one prompt, block length 2: a prompt forward (2 prompt rows + the block), then 3 decode steps
PROMPT_1 = [
    (0, 0, 0, [[0, 1], [2, 3], [4, 5], [6, 7]], [F, F, C, M], [1, 1, 0.9, 0.2], None),
    (0, 1, 1, [[8, 9], [4, 6]], [F, C], [1, 0.95], None),
    # block 1: one pending prefix row (block 0's last commit), then the block's two rows
    (
        1,
        0,
        2,
        [[4, 10], [11, 12], [11, 13]],
        [F, C, M],
        [1, 0.96, 0.7],
        [[0.5, 0.5], [0.75, 0.25], [0.5, 0.5]],
    ),
    (1, 1, 3, [[11, 14], [11, 13]], [F, C], [1, 0.97], None),
]
PROMPT_2 = [
    (0, 0, 0, [[0, 1], [0, 2]], [C, M], [0.99, 0.1], None),
    (0, 1, 1, [[0, 1], [0, 3]], [F, C], [1, 0.99], None),
]


def lm(fig) -> float | None:
    return fig["layer_mean"]


def test_hand_made_trace_figures() -> None:
    r = trace_stats(make_trace(PROMPT_1), block_length=2)
    assert r["size"] == {
        "prompts": 1,
        "prompts_recorded": 0,
        "forwards": 4,
        "decode_forwards": 3,
        "prompt_forwards": 1,
        "blocks": 2,
        "rows": 11,
        "decode_rows": 7,
        "moe_layers": 1,
        "experts": 16,
        "top_k": 2,
    }
    d = r["distinct_experts"]
    # block sets of the decode steps: {4,6,8,9}, {11,12,13}, {11,13,14}
    assert lm(d["block"]["mean"]) == pytest.approx(10 / 3)
    assert lm(d["block"]["p90"]) == pytest.approx(3.8)  # linear percentile of [3, 3, 4]
    # all rows add the prefix row {4, 10} at step 2
    assert lm(d["all_rows"]["mean"]) == pytest.approx(4.0)
    assert lm(d["block_first_iteration"]) == 3
    assert lm(d["block_later_iterations"]) == 3.5
    assert lm(d["prompt_forward_block"]) == 4 and lm(d["prompt_forward_all_rows"]) == 8
    assert r["tokens_per_forward"] == {"decode": 1.0, "all_forwards": 1.0}

    o = r["overlap"]
    # within block 1: {4,10,11,12,13} -> {11,13,14}: 2 shared of 6
    assert lm(o["jaccard"]["within_block"]["1"]) == pytest.approx(1 / 3)
    assert lm(o["reuse"]["within_block"]["1"]) == pytest.approx(2 / 3)
    # across the boundary: {4,6,8,9} -> {4,10,11,12,13}: 1 shared of 8
    assert lm(o["jaccard"]["across_block"]["1"]) == pytest.approx(1 / 8)
    assert lm(o["reuse"]["across_block"]["1"]) == pytest.approx(1 / 5)
    assert lm(o["jaccard"]["across_block"]["2"]) == 0 and lm(o["reuse"]["across_block"]["2"]) == 0
    assert o["pairs"]["within_block"] == {"1": 1, "2": 0, "3": 0, "4": 0, "5": 0}
    assert o["pairs"]["across_block"] == {"1": 1, "2": 1, "3": 0, "4": 0, "5": 0}
    assert lm(o["jaccard"]["within_block"]["2"]) is None  # the prompt forward never counts

    # step 2 -> 3: committed position [11,12] -> [11,14]; masked (conf 0.7) [11,13] kept
    rs = r["route_stability"]
    assert lm(rs["committed"]["kept"]) == 0.5 and rs["committed"]["rows"] == 1
    assert lm(rs["masked 0.6-0.9"]["kept"]) == 1.0 and rs["masked 0.6-0.9"]["rows"] == 1
    for g in ("masked <0.3", "masked 0.3-0.6", "masked >=0.9", "fixed"):
        assert lm(rs[g]["kept"]) is None and rs[g]["rows"] == 0
    # expert 11 (gate 0.75) is used at step 3, expert 12 (0.25) is not
    rb = r["reuse_by_state"]
    assert lm(rb["committed"]["reuse"]) == 0.5 and lm(rb["committed"]["weighted_reuse"]) == 0.75
    assert lm(rb["masked 0.6-0.9"]["reuse"]) == 1.0 and rb["committed"]["pairs"] == 2
    gw = r["gate_weight"]  # committed rows of decode steps: (.5,.5), (.75,.25), (.5,.5)
    assert lm(gw["committed"]["mean"]) == pytest.approx(0.5)
    assert lm(gw["committed"]["top1"]) == pytest.approx((0.5 + 0.75 + 0.5) / 3)
    assert gw["fixed"]["rows"] == 2 and lm(gw["fixed"]["top1"]) == 0.5

    load = np.array([1, 1, 1, 1, 3, 1, 2, 1, 1, 1, 1, 4, 1, 2, 1, 0], float)  # 22 routed pairs
    sk = r["skew"]
    assert lm(sk["top10_share"]) == pytest.approx(7 / 22)  # experts 11 and 4 (ceil(1.6) = 2)
    assert lm(sk["load_cv"]) == pytest.approx(load.std() / load.mean())
    assert sk["unused_total"] == 1 and sk["unused_experts"]["per_layer"] == [1.0]


def test_second_prompt_pairs_stay_inside_their_prompt() -> None:
    one = trace_stats(make_trace(PROMPT_1), block_length=2)
    two = trace_stats(make_trace(PROMPT_1 + PROMPT_2), block_length=2)
    assert two["size"]["prompts"] == 2 and two["size"]["prompt_forwards"] == 2
    assert two["size"]["blocks"] == 3
    assert two["overlap"]["pairs"] == one["overlap"]["pairs"]
    assert two["route_stability"]["masked <0.3"]["rows"] == 0  # its step is a prompt forward
    assert lm(two["distinct_experts"]["prompt_forward_block"]) == 3.5  # {4,5,6,7}, {0,1,2}
    assert lm(two["distinct_experts"]["block"]["mean"]) == pytest.approx(13 / 4)
    assert two["tokens_per_forward"] == {"decode": 1.0, "all_forwards": 1.0}


def test_known_commit_schedule() -> None:
    # block of 8, 3 commits per forward: 3, 3, 2 per block; the first forward counts apart
    t = synthetic_trace(
        num_layers=2, num_experts=32, top_k=4, blocks=2, block_length=8, commits_per_iteration=3
    )
    r = trace_stats(t, block_length=8)
    assert r["tokens_per_forward"]["decode"] == pytest.approx(13 / 5)
    assert r["tokens_per_forward"]["all_forwards"] == pytest.approx(16 / 6)
    assert r["size"]["blocks"] == 2 and r["size"]["decode_forwards"] == 5


def test_synthetic_trace_shapes_and_structure(tmp_path) -> None:
    t = synthetic_trace(num_layers=5, num_experts=64, blocks=4, block_length=16, seed=4)
    r = trace_stats(t, block_length=16)
    assert r["size"]["rows"] == len(t.token_state) and r["size"]["forwards"] == t.num_steps
    assert len(r["distinct_experts"]["block"]["mean"]["per_layer"]) == 5
    # fixed positions keep their routing; committed ones reroute; masked ones drift a little
    rs = r["route_stability"]
    assert lm(rs["fixed"]["kept"]) == 1.0
    masked = [lm(rs[g]["kept"]) for g in GROUPS[:4] if rs[g]["rows"]]
    assert masked and min(masked) > 0.8 > lm(rs["committed"]["kept"])
    o = r["overlap"]
    for d in "12345":
        for where in ("within_block", "across_block"):
            j, u = lm(o["jaccard"][where][d]), lm(o["reuse"][where][d])
            assert j is None or 0 <= j <= u <= 1
    assert lm(o["jaccard"]["within_block"]["1"]) > lm(o["jaccard"]["across_block"]["1"])
    assert lm(o["jaccard"]["within_block"]["1"]) > lm(o["jaccard"]["within_block"]["5"])
    assert 0.1 < lm(r["skew"]["top10_share"]) <= 1
    json.dumps(r, allow_nan=False)


def test_block_length_that_does_not_fit() -> None:
    t = make_trace(PROMPT_1)
    with pytest.raises(ValueError, match="fewer than the block length 3"):
        trace_stats(t, block_length=3)
    with pytest.raises(ValueError, match="are not fixed: is the block length 1"):
        trace_stats(t, block_length=1)


def test_cli_table_and_json(tmp_path) -> None:
    a, b = tmp_path / "a.oledtrace", tmp_path / "b.oledtrace"
    synthetic_trace(num_layers=3, num_experts=32, top_k=4, blocks=2, seed=1).save(a)
    make_trace(PROMPT_1).save(b)
    out = tmp_path / "stats.json"
    runner = CliRunner()
    res = runner.invoke(
        app, ["trace", "stats", str(a), str(b), "--json", str(out), "--block-length", "32"]
    )
    assert res.exit_code == 2 and "fewer than the block length 32" in res.output  # b has 2
    res = runner.invoke(app, ["trace", "stats", str(a), "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "a.oledtrace" in res.output and "Jaccard d=1" in res.output
    data = json.loads(out.read_text())
    (r,) = data["traces"]
    assert r["trace"] == str(a) and r["size"]["moe_layers"] == 3
    assert len(r["skew"]["load_cv"]["per_layer"]) == 3
    assert math.isclose(
        r["distinct_experts"]["block"]["mean"]["layer_mean"],
        np.mean(r["distinct_experts"]["block"]["mean"]["per_layer"]),
    )


def test_cli_not_a_trace(tmp_path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a trace")
    res = CliRunner().invoke(app, ["trace", "stats", str(bad)])
    assert res.exit_code == 2
    assert "is not an OLED-MoE trace file" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(app, ["trace", "stats", str(tmp_path / "missing.oledtrace")])
    assert res.exit_code == 2 and "error" in res.output


def test_cli_json_to_a_folder_that_is_not_there(tmp_path, monkeypatch) -> None:
    a = tmp_path / "a.oledtrace"
    synthetic_trace(num_layers=3, num_experts=32, top_k=4, blocks=2, seed=1).save(a)

    def computed(*_, **__):
        raise AssertionError("statistics computed before checking --json")

    monkeypatch.setattr("oled.trace.stats.trace_stats", computed)
    out = tmp_path / "nowhere" / "stats.json"
    res = CliRunner().invoke(app, ["trace", "stats", str(a), "--json", str(out)])
    assert res.exit_code == 2
    assert res.output == f"error: --json {out}: no such directory {out.parent}\n"


def test_stats_report_the_router_s_ranking(trace_file) -> None:
    """A recorded trace's near misses: counted, and shares that are shares."""
    from oled.trace.format import Trace
    from oled.trace.stats import stats_table, trace_stats

    res = trace_stats(Trace.load(trace_file), block_length=8)
    ranking = res["ranking"]
    assert ranking["ranks"] == 16 and ranking["near_misses"]["layer_mean"] > 0
    for key in ("entering_named", "near_misses_entering"):
        assert 0 <= ranking[key]["layer_mean"] <= 1
    assert stats_table([res]).row_count > 0


def test_stats_report_the_next_layer_s_predicted_routing() -> None:
    """Layer 1 predicted from layer 0's router input, by hand: recall and precision over the
    decode steps' sets, and the share of the experts entering layer 1's set that it named."""
    from dataclasses import replace

    from oled.trace.stats import stats_table

    one = make_trace(PROMPT_1)  # rows per forward 4, 2, 3, 2; forward 0 the prompt's
    layer1 = [[0, 1]] * 4 + [[0, 1], [2, 3]] + [[0, 1], [4, 5], [4, 6]] + [[4, 5], [7, 8]]
    ahead = [[0, 1]] * 4 + [[0, 1], [2, 9]] + [[0, 1], [4, 9], [9, 10]] + [[4, 5], [4, 9]]
    trace = replace(
        one,
        meta=replace(one.meta, num_moe_layers=2),
        ids=np.concatenate([one.ids, np.asarray(layer1, np.int16)[None]]),
        weights=np.concatenate([one.weights, one.weights]),
        ahead_ids=np.asarray(ahead, np.int16)[None],
    )
    p = trace_stats(trace, block_length=2)["prediction"]
    # decode steps: routed {0,1,2,3}, {0,1,4,5,6}, {4,5,7,8}; named {0,1,2,9}, {0,1,4,9,10},
    # {4,5,9}: 3 + 3 + 2 named and routed
    assert lm(p["named"]) == 4 and p["named"]["per_layer"] == [4.0]
    assert lm(p["recall"]) == pytest.approx(8 / 13)
    assert lm(p["precision"]) == pytest.approx(8 / 12)
    # entering: {4,5,6} at step 2 (4 named), {7,8} at step 3 (none)
    assert lm(p["entering_named"]) == pytest.approx(1 / 5)
    cells = _cells(stats_table([trace_stats(trace, block_length=2)]))
    assert cells["  share of layer l+1's experts named (recall)"] == f"{8 / 13:.3f}"
    plain = trace_stats(replace(trace, ahead_ids=None), block_length=2)
    assert plain["prediction"] is None
    assert _cells(stats_table([plain]))["  share named that layer l+1 routed (precision)"] == "-"
    with pytest.raises(ValueError, match="predicted ids"):
        trace_stats(replace(trace, ahead_ids=trace.ahead_ids[:, :3]), block_length=2)


def _cells(table) -> dict[str, str]:  # noqa: ANN001
    """A one-column stats table: {figure: cell}."""
    labels, values = table.columns[0]._cells, table.columns[1]._cells
    return dict(zip(labels, values, strict=True))


def test_stats_report_the_recorded_prediction(trace_file) -> None:
    """A recorded trace's next-layer prediction: shares that are shares, most of the next
    layer's experts named."""
    from oled.trace.format import Trace
    from oled.trace.stats import trace_stats

    p = trace_stats(Trace.load(trace_file), block_length=8)["prediction"]
    assert len(p["recall"]["per_layer"]) == 2  # 3 MoE layers: layers 1 and 2 predicted
    for key in ("recall", "precision", "entering_named"):
        assert 0 <= lm(p[key]) <= 1
    assert lm(p["recall"]) > 0 and lm(p["named"]) > 0
