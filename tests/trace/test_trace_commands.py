"""`oled trace record` and `oled simulate` end to end on the tiny model."""

from __future__ import annotations

from typer.testing import CliRunner

from oled.cli import app
from oled.decoding.trace_file import Trace


def test_record_then_simulate_every_baseline(tmp_path, tiny_dir):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_dir}"\n[runtime]\ndevice = "cpu"\ndtype = "float32"\n'
        'budget = { expert_fraction = 0.25 }\ncost = "cpu-ci"\n'
        "[decoding]\nmax_new_tokens = 32\n"
    )
    out = tmp_path / "t.oledtrace"
    runner = CliRunner()
    res = runner.invoke(app, ["trace", "record", str(recipe), "-o", str(out)])
    assert res.exit_code == 0, res.output
    trace = Trace.load(out)
    assert trace.meta.num_moe_layers == 3 and trace.num_steps > 10
    res = runner.invoke(app, ["simulate", str(out), "--recipe", str(recipe), "--baselines"])
    assert res.exit_code == 0, res.output
    for name in ("lru", "hybrimoe", "tide", "fiddler", "llamacpp", "oled", "Belady"):
        assert name in res.output


def test_simulate_needs_a_slot_budget(tmp_path, tiny_dir):
    from oled.trace.synthetic import synthetic_trace

    trace_file = tmp_path / "s.oledtrace"
    synthetic_trace(num_layers=3, num_experts=32, top_k=4, blocks=1).save(trace_file)
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[model]\npath = "{tiny_dir}"\n[runtime]\nbudget = {{ gpu_memory = "8GiB" }}\n'
    )
    res = CliRunner().invoke(app, ["simulate", str(trace_file), "--recipe", str(recipe)])
    assert res.exit_code == 2
    assert "gpu_memory budget needs a device to size: give expert_fraction, expert_budget or " \
        "slots_per_layer" in " ".join(res.output.split())  # fmt: skip
