"""`oled trace` (record routing while decoding) and `oled simulate` (replay through policies)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from oled.decoding.observers import DecodeObserver, IterationInfo

trace_app = typer.Typer(help="Record routing traces.", no_args_is_help=True)
console = Console(highlight=False, soft_wrap=True)


class _StepRecorder(DecodeObserver):
    """Hands every iteration's token states to the trace recorder."""

    def __init__(self, recorder) -> None:
        self.recorder = recorder

    def on_generation_start(self, prompt_length: int) -> None:
        self.recorder.new_prompt()

    def on_iteration(self, info: IterationInfo) -> None:
        from oled.offload.engine import step_context

        self.recorder.record_step(step_context(info))


def recording(runtime):
    """A recorder for `runtime`'s model and the two hooks that feed it.

    Returns (recorder, observer, remove): pass `observer` to `Runtime.stream`; call `remove()`
    to detach the routing hook.
    """
    from oled.trace.recorder import TraceRecorder

    cfg = runtime.config
    recorder = TraceRecorder(
        num_moe_layers=cfg.num_moe_layers, num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok, expert_bytes=runtime.checkpoint.experts.expert_bytes,
        hidden_size=cfg.hidden_size, model_path=str(runtime.checkpoint.path),
    )  # fmt: skip

    def hook(layer, ids, weights) -> None:
        recorder.record_routing(layer, ids.cpu().numpy(), weights.float().cpu().numpy())

    return recorder, _StepRecorder(recorder), runtime.model.add_routing_hook(hook)


def record(runtime, prompt_ids: list[list[int]], *, decode=None, follow=None):
    """Decode each prompt with `runtime` (its decode settings unless `decode`; committing
    `follow`'s tokens if given), recording per forward and MoE layer the routing: the Trace."""
    recorder, observer, remove = recording(runtime)
    try:
        for ids in prompt_ids:
            for _ in runtime.stream(ids, decode=decode, observers=[observer], follow=follow):
                pass
    finally:
        remove()
    return recorder.build()


def record_replay(runtime, trace, prompts=None):
    """Replay `trace`'s prompts (indices; all by default) on `runtime` (Runtime.replay),
    recording what the runtime routed, committed and reported: the Trace (the replayed one,
    row for row, with weights at the recorder's precision)."""
    recorder, observer, remove = recording(runtime)
    try:
        for index in range(len(runtime.routing_replay(trace))) if prompts is None else prompts:
            runtime.replay(trace, index, observers=[observer])
    finally:
        remove()
    return recorder.build()


def record_trace(runtime, prompt_ids: list[list[int]], out: Path) -> Path:
    """`record` the prompts' routing into the trace file `out`."""
    record(runtime, prompt_ids).save(out)
    return out


@trace_app.command("record")
def trace_record(
    recipe: Annotated[Path, typer.Argument(help="Recipe naming the model, decoding, workload.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Trace file to write.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key.")] = None,
) -> None:
    """Decode the recipe's workload and store its routing, confidences and decode states."""
    from oled.experiment.build import build
    from oled.options import user_errors
    from oled.recipe import load_recipe

    @user_errors
    def go() -> None:
        from oled.experiment.run import load_workload
        from oled.trace.format import Trace

        r = load_recipe(recipe, set_ or [])
        work = load_workload(r)  # a trace routing: record its replay on this model
        runtime = build(r.with_values({"runtime.budget": {"resident": True}}))
        if work.replay is None:
            ids = [runtime.prompt_ids(p.as_messages(), chat=True) for p in work.prompts]
            record_trace(runtime, ids, out)
        else:
            record_replay(runtime, *work.replay).save(out)
        t = Trace.load(out)
        console.print(
            f"wrote {out}: {t.num_steps} forwards x {t.meta.num_moe_layers} MoE layers, "
            f"{t.meta.prompt_count} prompts, {out.stat().st_size / 2**20:.2f} MiB"
        )

    go()


@trace_app.command("stats")
def trace_stats_cmd(
    traces: Annotated[list[Path], typer.Argument(help="Trace files from `oled trace record`.")],
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write every figure, per layer too, as JSON.")
    ] = None,
    block_length: Annotated[
        int, typer.Option(help="Block length the traces were decoded with.")
    ] = 32,
) -> None:
    """Routing statistics: distinct experts per forward, overlap between forwards, route
    stability and expert reuse by token state, load skew (one column per trace)."""
    from oled.options import user_errors
    from oled.trace.format import Trace
    from oled.trace.stats import column_names, stats_table, trace_stats, write_json

    @user_errors
    def go() -> None:
        names = column_names(traces)
        results = [
            trace_stats(Trace.load(p), block_length=block_length, name=str(p)) for p in traces
        ]
        console.print(stats_table(results, names))
        if json_out is not None:
            write_json(results, json_out)
            console.print(f"wrote {json_out}")

    go()


def simulate_recipe(trace, recipe, *, profile: str | None = None):
    """Replay `trace` through a recipe's policies and budget: (SimResult, Belady bound)."""
    from oled import registry as reg
    from oled.experiment.build import build_policy
    from oled.policies import with_oled_defaults
    from oled.policies.base import CostModel
    from oled.trace.simulate import belady_bypass, simulate

    slots = trace_slots(trace, recipe.runtime.budget)
    cost_name = profile or recipe.runtime.cost
    if cost_name == "calibrate":
        raise ValueError("simulation needs a named cost profile: --profile h200 or cpu-ci")
    policies = {kind: build_policy(kind, getattr(recipe.policy, kind)) for kind in reg.POLICY_KINDS}
    result = simulate(
        trace, total_slots=slots, cost=CostModel.profile(cost_name),
        stage_capacity=recipe.runtime.stage_capacity or 8, **with_oled_defaults(**policies),
    )  # fmt: skip
    bound = belady_bypass(trace, result.capacity_history)
    return result, bound


def trace_slots(trace, budget) -> int:
    """Total expert slots of a recipe budget for the traced model's shape."""
    layers, experts = trace.meta.num_moe_layers, trace.meta.num_experts
    if budget.expert_fraction is not None:
        slots = round(budget.expert_fraction * layers * experts)
    elif budget.expert_budget is not None:
        slots = int(budget.expert_budget)
    else:
        raise ValueError(
            "simulation needs the budget as expert_fraction or expert_budget (the trace has no "
            "device memory to fit)"
        )
    if slots < layers:
        raise ValueError(f"budget of {slots} slots is below one per MoE layer ({layers})")
    return min(slots, layers * experts)


def simulate_cmd(
    trace_file: Annotated[Path, typer.Argument(help="A trace from `oled trace record`.")],
    recipe: Annotated[Path, typer.Option(help="Recipe whose budget and policies to replay.")],
    profile: Annotated[
        str | None, typer.Option(help="Cost profile (h200, cpu-ci); default: the recipe's.")
    ] = None,
    baselines: Annotated[
        bool, typer.Option("--baselines", help="Also replay every baseline at the same budget.")
    ] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key.")] = None,
) -> None:
    """Replay a trace through policies; hit rates and modelled latency beside the Belady bound."""
    from oled.options import user_errors
    from oled.recipe import load_recipe
    from oled.trace.format import Trace

    @user_errors
    def go() -> None:
        trace = Trace.load(trace_file)
        base = load_recipe(recipe, set_ or [])
        runs = {"recipe": base}
        if baselines:
            from oled.policies import ANCHORS

            for name, (a, r, c) in ANCHORS.items():
                runs[name] = base.with_values(
                    {"policy.allocation": {"kind": a}, "policy.retention": {"kind": r},
                     "policy.compensation": {"kind": c}}
                )  # fmt: skip
        table = Table(title=f"{trace_file.name}: {trace.num_steps} forwards")
        for col in ("policy", "hit rate", "Belady bound", "ms/it (model)", "copies/it",
                    "GB/it", "CPU share"):  # fmt: skip
            table.add_column(col, justify="left" if col == "policy" else "right")
        for name, r in runs.items():
            res, bound = simulate_recipe(trace, r, profile=profile)
            table.add_row(
                name, f"{res.hit_rate:.3f}", f"{bound:.3f}", f"{res.ms_per_iteration:.2f}",
                f"{res.copies_per_iteration:.1f}", f"{res.gb_copied_per_iteration:.3f}",
                f"{100 * res.cpu_share:.1f}%",
            )  # fmt: skip
        console.print(table)

    go()


def register(app: typer.Typer) -> None:
    app.add_typer(trace_app, name="trace")
    app.command(name="simulate")(simulate_cmd)
