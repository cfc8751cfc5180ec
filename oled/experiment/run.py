"""`oled run`: build the runtime, run the workload, summarise, report, plot and track."""

from __future__ import annotations

import csv
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from oled.experiment.report import (
    SUMMARY_ROWS,
    Stats,
    format_value,
    per_layer,
    summarize,
    write_report,
)
from oled.experiment.tracking import Tracker, check_store, tracked_run
from oled.experiment.workload import Prompt, load_prompts
from oled.model.parallel import is_main
from oled.recipe import Recipe

RuntimeFactory = Callable[[Recipe], Any]


@dataclass
class RunResult:
    """What `run_experiment` produced."""

    report: dict[str, Any]
    report_dir: Path
    files: list[Path]
    run_id: str | None  # MLflow run id (None when tracking is off)


def prompt_input(prompt: Prompt, chat: bool) -> str | list[dict[str, str]]:
    """What the runtime decodes for `prompt`: its messages (chat) or its plain text."""
    if chat:
        return prompt.as_messages()
    return prompt.prompt if prompt.prompt is not None else prompt.as_messages()[-1]["content"]


def generate(
    runtime: Any, prompt: Prompt, chat: bool, follow: Any = None, reference: Any = None
) -> Stats:
    """One generation (committing `follow`'s tokens when given); its stats dict, with its
    `agreement` with `reference` (oled.decoding.follow.Agreement) when one is given."""
    from oled.decoding.follow import Agreement

    agree = Agreement(reference) if reference is not None else None
    runtime.generate(
        prompt_input(prompt, chat), chat=chat, follow=follow, observers=[agree] if agree else []
    )
    return dict(runtime.stats()) | ({"agreement": agree.result()} if agree else {})


def run_workload(
    runtime: Any, recipe: Recipe, prompts: Sequence[Prompt], console: Console | None = None
) -> list[Stats]:
    """With `workload.follow` or `agreement`, first each prompt's reference (every expert on
    the device: Runtime.reference). Following, the later generations commit its tokens and one
    more free-running generation per prompt measures the agreement; else each timed
    generation is compared with it as it runs. Then warm-up generations (untimed) and
    `repeats` timed passes over the prompts; the timed ones' stats."""
    wl = recipe.workload
    refs = wl.follow or wl.agreement
    free_runs = wl.follow and wl.agreement  # following: one more free run per prompt measures
    extra = len(prompts) * (int(refs) + int(free_runs))
    timed: list[Stats] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("reference", total=extra + wl.warmup + wl.repeats * len(prompts))
        reference = [None] * len(prompts)
        for i, prompt in enumerate(prompts if refs else []):
            reference[i] = runtime.reference(prompt_input(prompt, wl.chat), chat=wl.chat)
            bar.advance(task)
        follow = reference if wl.follow else [None] * len(prompts)
        free = [None] * len(prompts)  # following: each prompt's free-running agreement
        for i, prompt in enumerate(prompts if free_runs else []):
            bar.update(task, description="agreement")
            free[i] = generate(runtime, prompt, wl.chat, None, reference[i])["agreement"]
            bar.advance(task)
        bar.update(task, description="warm-up")
        for i in range(wl.warmup):
            generate(runtime, prompts[i % len(prompts)], wl.chat, follow[i % len(prompts)])
            bar.advance(task)
        bar.update(task, description="generate")
        compare = reference if wl.agreement and not wl.follow else [None] * len(prompts)
        for _ in range(wl.repeats):
            for i, prompt in enumerate(prompts):
                stats = generate(runtime, prompt, wl.chat, follow[i], compare[i])
                timed.append(stats | ({"agreement": free[i]} if free[i] else {}))
                bar.advance(task)
    return timed


def replay_workload(
    runtime: Any,
    recipe: Recipe,
    trace: Any,
    indices: Sequence[int],
    console: Console | None = None,
) -> list[Stats]:
    """With `workload.routing = "trace:PATH"`: warm-up replays (untimed) and `repeats` timed
    passes over the selected traced prompts (Runtime.replay); the timed ones' stats."""
    wl = recipe.workload
    timed: list[Stats] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("warm-up", total=wl.warmup + wl.repeats * len(indices))
        for i in range(wl.warmup):
            runtime.replay(trace, indices[i % len(indices)])
            bar.advance(task)
        bar.update(task, description="replay")
        for _ in range(wl.repeats):
            for index in indices:
                timed.append(dict(runtime.replay(trace, index)) | {"trace_prompt": index})
                bar.advance(task)
    return timed


@dataclass
class Workload:
    """What a recipe decodes: its prompts, or (`replay`) a trace and the traced prompts'
    indices that `workload.routing` replays."""

    prompts: list[Prompt]
    replay: tuple[Any, list[int]] | None = None


def load_workload(recipe: Recipe) -> Workload:
    """The recipe's workload, loaded (and checked) before any model is."""
    path = recipe.routing_trace()
    if path is None:
        return Workload(load_prompts(recipe.workload.prompts, recipe.folder))
    from oled.trace.format import Trace
    from oled.trace.replay import select_prompts

    trace = Trace.load(path)
    chosen = select_prompts(recipe.workload.trace_prompts, len(trace.prompt_starts))
    return Workload([], (trace, chosen))


def run_loaded(
    runtime: Any, recipe: Recipe, work: Workload, console: Console | None = None
) -> list[Stats]:
    """`run_workload` over the prompts, or `replay_workload` over the traced ones."""
    if work.replay is None:
        return run_workload(runtime, recipe, work.prompts, console)
    return replay_workload(runtime, recipe, *work.replay, console)


def make_report(
    recipe: Recipe, generations: list[Stats], seconds: float, decisions: Any = None
) -> dict[str, Any]:
    """The JSON report: recipe, how the offload decisions were made (Runtime.decisions),
    summary, per layer and per generation figures."""
    return {
        "recipe": recipe.data(),
        "recipe_hash": recipe.hash(),
        "wall_seconds": seconds,
        "decisions": decisions,
        "summary": summarize(generations),
        "per_layer": per_layer(generations),
        "generations": generations,
    }


def summary_table(report: dict[str, Any], title: str) -> Table:
    """The summary as a rich table."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label, fmt in SUMMARY_ROWS:
        table.add_row(label, format_value(report["summary"].get(key), fmt))
    layers = [layer["hit_rate"] for layer in report["per_layer"]]
    if any(rate is not None for rate in layers):
        table.add_row("hit rate per layer", " ".join(format_value(r, "{:.0%}") for r in layers))
    if report.get("decisions"):
        table.add_row("decisions", decisions_text(report["decisions"]))
    return table


def decisions_text(decisions: dict[str, Any]) -> str:
    """One line on how the offload decisions were made: the cost model's source (a calibration:
    when it was measured, whether it was stored clean, measured under load and not stored, or
    re-checked with a disagreement) and whether a policy adapts to live timings (then the same
    recipe can decide differently next time)."""
    costs = decisions.get("costs") or {}
    source = costs.get("source", "?")
    if "measured" in costs:
        source += f" {costs['measured']}"
    if costs.get("state"):
        source += f" ({costs['state']})"
    if decisions.get("adaptive"):
        return f"{source}; live adaptation on: decisions follow this run's timings"
    if costs.get("stored") is False:
        return f"{source}; this run's costs: the next run measures again"
    return f"{source}; deterministic"


def layer_metrics(layers: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """`hit_rate.layer_NN` for every MoE layer, zero-padded so that the names sort by layer."""
    width = max(2, len(str(len(layers) - 1)))
    return {f"hit_rate.layer_{layer['layer']:0{width}d}": layer["hit_rate"] for layer in layers}


def write_iterations(report: dict[str, Any], directory: Path) -> Path:
    """`iteration_ms.csv`: one row per forward of every timed generation (iteration 0 runs
    the prompt)."""
    path = directory / "iteration_ms.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["generation", "iteration", "ms"])
        for g, gen in enumerate(report["generations"]):
            writer.writerows((g, i, ms) for i, ms in enumerate(gen.get("iteration_ms", [])))
    return path


def log_run(tracker: Tracker, recipe: Recipe, report: dict[str, Any], files: list[Path]) -> None:
    """The summary and the per-layer hit rates as one metric each, the report's files (JSON,
    per-iteration CSV, plots) and the recipe as artifacts."""
    tracker.log_metrics(report["summary"] | layer_metrics(report["per_layer"]))
    tracker.log_artifacts(files)
    tracker.log_recipe(recipe)


def report_dir(recipe: Recipe) -> Path:
    """`<report_dir>/<recipe name>-<date-time>-<hash>`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(recipe.tracking.report_dir) / f"{recipe.name}-{stamp}-{recipe.hash()}"


def planner_kind(runtime: Any) -> str | None:
    """How the runtime's host decisions run: "compiled", "python", or None (no planner)."""
    if runtime.engine is None:
        return None
    return "compiled" if runtime.engine.planner.compiled else "python"


def launch_kind(runtime: Any) -> str | None:
    """How the runtime's graphed layer calls launch: "compiled" (oled.offload.driver),
    "python", or None (no offload engine)."""
    if runtime.engine is None:
        return None
    return "compiled" if runtime.engine.driver is not None else "python"


def run_experiment(
    recipe: Recipe,
    *,
    factory: RuntimeFactory | None = None,
    console: Console | None = None,
    out: Console | None = None,
) -> RunResult | None:
    """Run a recipe end to end. The runtime is built first, so a set-up error (no model, a
    budget too small, no such device) leaves no MLflow run; once the run has started it ends
    FAILED if anything raises. Progress goes to `console` (stderr), the summary table and the
    report's folder to `out` (stdout), so that `oled run R > out.txt` keeps the results. Of
    several processes (runtime.devices), only the first reports; the others return None."""
    console = console or Console(stderr=True)
    out = out or Console()
    if factory is None:
        from oled.runtime import build

        factory = build
    work = load_workload(recipe)
    check_store(recipe)  # an MLflow store that cannot open fails before the model loads
    start = time.perf_counter()
    runtime = factory(recipe)  # set-up errors (model, budget, device) raise before any run
    # one more process of runtime.devices: it decodes beside rank 0, which reports
    if not is_main():
        run_loaded(runtime, recipe, work, Console(quiet=True))
        return None
    with tracked_run(recipe) as tracker:
        tracker.log_params(recipe.flatten())
        tracker.set_tags(
            {
                "oled.runtime_device": getattr(runtime, "device", None),
                "oled.planner": planner_kind(runtime),
                "oled.launch": launch_kind(runtime),
            }
        )
        generations = run_loaded(runtime, recipe, work, console)
        decisions = runtime.decisions() if hasattr(runtime, "decisions") else None
        report = make_report(recipe, generations, time.perf_counter() - start, decisions)
        directory = report_dir(recipe)
        files = write_report(report, directory)
        files.append(write_iterations(report, directory))
        log_run(tracker, recipe, report, files)
    out.print(summary_table(report, f"{recipe.name} ({recipe.hash()})"))
    out.print(f"report: {directory}", soft_wrap=True, highlight=False)
    return RunResult(report, directory, files, tracker.run_id or None)
