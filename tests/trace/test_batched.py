"""A trace's prompts decoded several at a time (oled.trace.batched): the forwards a batch
runs, and the simulator's copies of them against the offload engine's batched replay."""

from __future__ import annotations

import numpy as np
import pytest

from oled.offload.budget import Budget
from oled.policies import compensation as C
from oled.policies import retention as R
from oled.policies.allocation import UniformAllocation
from oled.policies.base import CostModel
from oled.runtime import build_runtime
from oled.trace.batched import batched, whole_groups
from oled.trace.format import Trace
from oled.trace.replay import split_prompts
from oled.trace.simulate import simulate


@pytest.fixture(scope="module")
def trace(trace_file) -> Trace:
    return Trace.load(trace_file)


def test_the_batch_runs_each_prompts_forwards_side_by_side(trace):
    """Three prompts (13, 12 and 16 forwards) two at a time: the first group joins a forward
    apart and runs until its longer prompt ends; the second is prompt 2 with prompt 0 again
    (whole groups); every forward's rows are its streams' traced rows in the order they
    joined."""
    prompts = split_prompts(trace)
    both = batched(trace, 2)
    assert both.meta.prompt_count == 2 and whole_groups(2, 3) == 4
    assert list(both.step) == [*range(13), *range(16)]  # max(0 + 13, 1 + 12), max(16, 1 + 13)
    assert (both.iteration == 0).all()
    offsets = trace.row_offsets
    rows = lambda s: np.arange(offsets[s], offsets[s + 1])  # noqa: E731
    # forward 1 of the first group: prompt 0's second forward, then prompt 1's first
    expected = np.concatenate([rows(prompts[0].first_step + 1), rows(prompts[1].first_step)])
    a, b = both.row_offsets[1], both.row_offsets[2]
    assert np.array_equal(both.ids[:, a:b], trace.ids[:, expected])
    assert np.array_equal(both.confidence[a:b], trace.confidence[expected])
    # every prompt's rows once per request: prompts 0, 1, 2 and 0
    assert both.ids.shape[1] == 2 * (offsets[13] - offsets[0]) + (offsets[-1] - offsets[13])
    # blocks begun: one a join, one a stream's next block (block values only grow in a group)
    first = both.block[:13]
    assert first[0] == 1 and first[1] == 2 and (np.diff(first) >= 0).all()
    assert first[-1] == prompts[0].blocks + prompts[1].blocks
    one = batched(trace, 1)
    assert one.num_steps == trace.num_steps and np.array_equal(one.ids, trace.ids)
    with pytest.raises(ValueError, match="at least 1"):
        batched(trace, 0)


def test_the_simulators_batch_copies_what_the_engines_batch_copies(trace, tiny_dir):
    """LFU, every miss copied, a quarter of the experts: the simulator's copies over the
    batched trace of three prompts equal the offload engine's over a batched replay of them
    (`Runtime.replay_batch`, the prompts joining a forward apart), forward for forward."""
    rt = build_runtime(
        model=str(tiny_dir),
        device="cpu",
        dtype="float32",
        cost="cpu-ci",
        budget=Budget("expert_fraction", 0.25),
        allocation=UniformAllocation(),
        retention=R.LFURetention(),
        compensation=C.TransferOnly(),
    )
    with rt.replay_batch(trace, 3) as (dec, source):
        waiting = [rt.replay_request(source, i) for i in range(3)]
        while waiting or dec.busy:
            if waiting:
                ids, decode, follow = waiting.pop(0)
                dec.add(ids, decode, follow=follow)
            dec.step()
    engine = rt.offload_summary()
    sim = simulate(
        batched(trace, 3),
        allocation=UniformAllocation(),
        retention=R.LFURetention(),
        compensation=C.TransferOnly(),
        cost=CostModel.profile("cpu-ci"),
        total_slots=sum(rt.executor.planner.capacities),
    )
    assert engine["copies"] > 0
    assert sim.copies + sim.staged == engine["copies"]  # staged: past a full layer
    assert sum(sim.stats["requests"]) - sum(sim.stats["hits"]) == engine["misses"]


def test_simulate_streams_counts_misses_per_token(trace_file, tiny_dir, tmp_path):
    """`oled simulate --streams N`: the forwards of N streams, misses per generated token
    beside misses per forward; a batch misses more per forward (here, with three prompts that
    share experts, fewer per token)."""
    from typer.testing import CliRunner

    from oled.cli import app

    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_dir}"\n[runtime]\nbudget = {{ expert_fraction = 0.25 }}\n'
        'cost = "cpu-ci"\n'
    )
    per: dict[int, list[float]] = {}
    for n in (1, 3):
        cmd = ["simulate", str(trace_file), "--recipe", str(recipe), "--streams", str(n)]
        res = CliRunner().invoke(app, cmd, env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        assert f"of {n} stream" in res.output and "misses/token" in res.output
        row = next(line for line in res.output.splitlines() if line.startswith("│ recipe"))
        per[n] = [float(cell) for cell in row.split("│")[2:4]]  # misses/it, misses/token
    tokens = 13 + 19 + 16  # the three prompts' tokens, in a pool of whole groups of 1 and 3
    assert per[3][0] > per[1][0] and per[1][1] > per[3][1] > 0
    assert f"{tokens} tokens" in res.output


def test_simulate_takes_the_costs_of_a_stored_calibration(trace_file, tiny_dir, tmp_path):
    """`--profile FILE.json`: a stored calibration's costs (its `cost`) or a cost model's
    fields drive the simulation; a file that is neither is named."""
    import json

    from typer.testing import CliRunner

    from oled.cli import app

    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_dir}"\n[runtime]\nbudget = {{ expert_fraction = 0.25 }}\n'
    )
    fields = json.loads(CostModel.profile("cpu-ci").to_json())
    stored = tmp_path / "cost-abc.json"
    stored.write_text(json.dumps({"cost": fields, "key": {}, "measured": "2026-12-07"}))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(fields | {"copy_ms_per_expert": 100.0}))
    bad = tmp_path / "bad.json"
    bad.write_text('{"copy": 1}')
    model_ms = []
    for path in (stored, plain):
        cmd = ["simulate", str(trace_file), "--recipe", str(recipe), "--profile", str(path)]
        res = CliRunner().invoke(app, cmd, env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        row = next(line for line in res.output.splitlines() if line.startswith("│ recipe"))
        model_ms.append(float(row.split("│")[5]))  # ms/it (model)
    assert model_ms[1] > 1.5 * model_ms[0]  # copies cost 100 ms each in the second
    for path, what in ((bad, "not a calibration or cost model"), (tmp_path / "no.json", "")):
        cmd = ["simulate", str(trace_file), "--recipe", str(recipe), "--profile", str(path)]
        res = CliRunner().invoke(app, cmd, env={"COLUMNS": "200"})
        assert res.exit_code != 0 and f"cost file {path}" in res.output and what in res.output
