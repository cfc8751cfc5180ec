"""`oled trace` (record routing while decoding) and `oled simulate` (replay through policies)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from oled.cli.options import check_writable, save_or_keep, user_errors
from oled.recipe.schema import DECODING

trace_app = typer.Typer(help="Record routing traces.", no_args_is_help=True)
console = Console(highlight=False, soft_wrap=True)


@trace_app.command("record")
@user_errors
def trace_record(
    recipe: Annotated[Path, typer.Argument(help="Recipe naming the model, decoding, workload.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Trace file to write.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key.")] = None,
    compress: Annotated[
        bool, typer.Option("--compress", help="Write it xz-compressed (about 2.5x smaller).")
    ] = False,
) -> None:
    """Decode the recipe's workload and store its routing, the router's 16 best experts per
    row with their scores, confidences and decode states."""
    from oled.experiment.run import load_workload
    from oled.recipe import load_recipe
    from oled.runtime import build
    from oled.trace.record import record, record_replay

    r = load_recipe(recipe, set_ or [])
    check_writable(out, "--out")
    work = load_workload(r)  # a trace routing: record its replay on this model
    runtime = build(r.with_values({"runtime.budget": {"resident": True}}))
    if work.replay is None:
        ids = [runtime.prompt_ids(p.as_messages(), chat=True) for p in work.prompts]
        trace = record(runtime, ids, progress=True)
    else:
        trace = record_replay(runtime, *work.replay, progress=True)
    save_or_keep(lambda path: trace.save(path, compress=compress), out, "trace")
    console.print(
        f"wrote {out}: {trace.num_steps} forwards x {trace.meta.num_moe_layers} MoE layers, "
        f"{trace.meta.prompt_count} prompts, {out.stat().st_size / 2**20:.2f} MiB"
    )


@trace_app.command("curves")
@user_errors
def trace_curves(
    trace_file: Annotated[Path, typer.Argument(help="A tuning trace from `oled trace record`.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Miss-curves file to write (JSON).")],
    retention: Annotated[
        str, typer.Option(help="Retention policy the curves are measured under (registry name).")
    ] = "lfu",
) -> None:
    """Every MoE layer's misses at every capacity, for `policy.allocation = {kind = "curves",
    curves = OUT}`: the split of the slots with the fewest misses on this trace."""
    from oled import registry
    from oled.trace.curves import fit_curves
    from oled.trace.format import Trace

    check_writable(out, "--out")
    trace = Trace.load(trace_file)
    build = registry.registry("retention")
    build.target(retention)  # an unknown name fails here, naming the known ones
    source = {"trace": trace_file.name, "retention": retention}
    curves = fit_curves(trace, lambda: build.build(retention), source=source, progress=True)
    save_or_keep(curves.save, out, "curves")
    console.print(
        f"wrote {out}: {curves.num_layers} layers x capacities 0-{curves.num_experts} "
        f"under {retention}, {trace.num_steps} forwards"
    )


@trace_app.command("stats")
@user_errors
def trace_stats_cmd(
    traces: Annotated[list[Path], typer.Argument(help="Trace files from `oled trace record`.")],
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write every figure, per layer too, as JSON.")
    ] = None,
    block_length: Annotated[
        int, typer.Option(help="Block length the traces were decoded with.")
    ] = DECODING.block_length,
) -> None:
    """Routing statistics: distinct experts per forward, overlap between forwards, route
    stability and expert reuse by token state, load skew (one column per trace)."""
    from oled.trace.format import Trace
    from oled.trace.stats import column_names, stats_table, trace_stats, write_json

    if json_out is not None:
        check_writable(json_out, "--json")
    names = column_names(traces)
    results = [trace_stats(Trace.load(p), block_length=block_length, name=str(p)) for p in traces]
    console.print(stats_table(results, names))
    if json_out is not None:
        save_or_keep(lambda path: write_json(results, path), json_out, "JSON")
        console.print(f"wrote {json_out}")


@user_errors
def simulate_cmd(
    trace_file: Annotated[Path, typer.Argument(help="A trace from `oled trace record`.")],
    recipe: Annotated[Path, typer.Option(help="Recipe whose budget and policies to replay.")],
    profile: Annotated[
        str | None,
        typer.Option(
            help="Cost profile (h200, cpu-ci), or a JSON file of costs: a stored calibration "
            "(`oled env` lists them) or a cost model's fields; default: the recipe's."
        ),
    ] = None,
    baselines: Annotated[
        bool, typer.Option("--baselines", help="Also replay every baseline at the same budget.")
    ] = False,
    bound: Annotated[
        bool,
        typer.Option(
            "--bound",
            help="Also replay the recipe's allocation with Belady's choice inside the planner "
            "(evict the furthest next use, every miss copied): the least any retention misses "
            "where a layer holds a forward's experts; then the same with each layer's misses "
            "split so that the link and the CPU finish together (the time both links allow).",
        ),
    ] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key.")] = None,
    devices: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Devices that split every layer's experts, each with the budget over its "
            "share (default: the recipe's runtime.devices).",
        ),
    ] = None,
    streams: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Decode the trace's prompts this many at a time, as `oled bench --streams N "
            "--routing` does (each forward runs every running stream's traced rows side by "
            "side); adds misses per generated token.",
        ),
    ] = None,
) -> None:
    """Replay a trace through policies: misses per forward, Belady's at the same capacities and
    the multiple, modelled latency, copies, CPU share and the share of the link's time hidden
    under compute (the recipe's model, where it is on this machine, must route like the trace).
    With --bound, a row "bound": the recipe's allocation with Belady's choice inside the
    planner, the least misses any retention policy can reach under the planner's rules where a
    layer holds every expert a forward needs; and a row "bound, both links": the same choice
    with each layer's misses split between the link and the CPU so that both finish together,
    the time the two links allow.
    With `runtime.prefetch` > 0, copies ahead replay (per forward, and how many the next layer
    then needed): `runtime.ahead_from = "router"` from the next-layer prediction the trace
    records (none where it records none: the table's caption says so), "previous" from the
    forward before.
    With several devices, each plans its share of the experts with its own cache: the misses
    per forward of each device, and the forward's time as the slowest device's plus the
    modelled all-reduce of every MoE layer.
    With --streams N, the forwards of the prompts decoded N at a time (oled.trace.batched)."""
    from oled.experiment.simulate import simulate_recipe
    from oled.recipe import load_recipe
    from oled.trace.format import Trace

    trace = Trace.load(trace_file)
    tokens = 0
    if streams is not None:
        from oled.token_states import TOKEN_COMMITTED
        from oled.trace.batched import batched

        trace = batched(trace, streams)
        tokens = int((trace.token_state == TOKEN_COMMITTED).sum())
    base = load_recipe(recipe, set_ or [])
    runs = {"recipe": base}
    if baselines:
        from oled.policies import ANCHORS

        for name, (a, r, c) in ANCHORS.items():
            runs[name] = base.with_values(
                {
                    "policy.allocation": {"kind": a},
                    "policy.retention": {"kind": r},
                    "policy.compensation": {"kind": c},
                }
            )
    split = (devices or base.runtime.devices) > 1
    if bound and split:
        raise typer.BadParameter("the clairvoyant bound is for one device", param_hint="--bound")
    ahead = base.runtime.prefetch > 0
    title = f"{trace_file.name}: {trace.num_steps} forwards"
    if streams is not None:
        title += f" of {streams} stream{'s' * (streams > 1)}, {tokens} tokens"
    if split:
        title += f", {devices or base.runtime.devices} devices"
    table = Table(title=title)
    for col in (
        "policy",
        "misses/it",
        *(["misses/token"] if tokens else []),
        *(["per device"] if split else []),
        "Belady",
        "x Belady",
        "ms/it (model)",
        "copies/it",
        *(["ahead/it (used)"] if ahead else []),
        "CPU share",
        "copy time hidden",
        "misses routed before",
    ):
        if col == "policy":  # names whole, however narrow the terminal
            table.add_column(col, no_wrap=True, min_width=max(map(len, runs)))
        else:
            table.add_column(col, justify="right")
    rows = [(name, run, False, False) for name, run in runs.items()]
    rows += [("bound", base, True, False), ("bound, both links", base, True, True)] if bound else []
    for name, run, clairvoyant, split_misses in rows:
        res, best = simulate_recipe(
            trace,
            run,
            profile=profile,
            devices=devices,
            clairvoyant=clairvoyant,
            split=split_misses,
        )
        requests = sum(res.stats["requests"])
        misses = requests - sum(res.stats["hits"])
        least = requests * (1 - best)  # Belady's misses at the same capacities
        forwards = max(1, res.iterations)
        each = " / ".join(f"{d['misses'] / forwards:.1f}" for d in res.per_device)
        table.add_row(
            name,
            f"{misses / forwards:.1f}",
            *([f"{misses / tokens:.1f}"] if tokens else []),
            *([each] if split else []),
            f"{least / max(1, res.iterations):.1f}",
            f"{misses / least:.2f}x" if least else "-",
            f"{res.ms_per_iteration:.2f}",
            f"{res.copies_per_iteration:.1f}",
            *(
                [f"{res.ahead_per_iteration:.1f} ({res.ahead_used_per_iteration:.1f})"]
                if ahead
                else []
            ),
            f"{100 * res.cpu_share:.1f}%",
            f"{100 * res.hidden_copy_share:.0f}%",
            f"{100 * res.misses_routed_before:.0f}%",
        )
        if ahead:
            table.caption = f"copies ahead: {res.ahead_source}"
    console.print(table)


def register(app: typer.Typer) -> None:
    app.add_typer(trace_app, name="trace")
    app.command(name="simulate")(simulate_cmd)
