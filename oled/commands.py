"""The interactive and operational commands: chat, serve, bench, env.

Kept out of `oled/cli.py` (which only registers them); each imports its implementation lazily
so that `oled --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from oled.options import (
    BlockOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    GraphsOpt,
    KernelsOpt,
    ModelOpt,
    RecipeOpt,
    ThresholdOpt,
    err_console,
    user_errors,
)


def spec_of(model: str, device: str, dtype: str, recipe: Path | None, cache_size: int | None,
            graphs: bool = True, kernels: str | None = None, **decode):  # fmt: skip
    from oled.decoding import DecodeConfig
    from oled.launch import RuntimeSpec

    return RuntimeSpec(model=model, device=device, dtype=dtype, recipe=recipe,
                       cache_size=cache_size, graphs=graphs, kernels=kernels,
                       decode=DecodeConfig(**decode))  # fmt: skip


@user_errors
def serve(
    recipe: RecipeOpt = None,
    model: ModelOpt = "builtin:tiny",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "bfloat16",
    cache_size: CacheOpt = None,
    graphs: GraphsOpt = True,
    kernels: KernelsOpt = None,
    block_length: BlockOpt = 32,
    threshold: ThresholdOpt = 0.95,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Upper bound a request may ask for.")
    ] = 4096,
    default_max_tokens: Annotated[
        int, typer.Option(help="max_tokens when a request gives none.")
    ] = 256,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id clients use (default: the model's name).")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="OLED_API_KEY", help="Require this bearer token on /v1 routes."),
    ] = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming)."""
    from oled.serve.command import run_server

    spec = spec_of(model, device, dtype, recipe, cache_size, graphs, kernels, block_length=block_length,
                   threshold=threshold, max_new_tokens=max_tokens)  # fmt: skip
    run_server(spec, host=host, port=port, model_name=served_model_name,
               default_max_tokens=default_max_tokens, max_tokens=max_tokens, api_key=api_key)  # fmt: skip


@user_errors
def chat(
    recipe: RecipeOpt = None,
    model: ModelOpt = "builtin:tiny",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "bfloat16",
    cache_size: CacheOpt = None,
    graphs: GraphsOpt = True,
    kernels: KernelsOpt = None,
    block_length: BlockOpt = 32,
    threshold: ThresholdOpt = 0.95,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per reply.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy; > 0 samples.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
) -> None:
    """Chat in the terminal: streams each finished block; /help lists the commands."""
    import time

    from oled.chat import ChatSession, run_chat, setup_readline
    from oled.launch import build

    spec = spec_of(model, device, dtype, recipe, cache_size, graphs, kernels, block_length=block_length,
                   threshold=threshold, max_new_tokens=max_tokens, temperature=temperature,
                   seed=seed)  # fmt: skip
    t0 = time.perf_counter()
    rt = build(spec)
    err_console.print(f"[dim]loaded {rt.checkpoint.path} on {rt.device} "
                      f"in {time.perf_counter() - t0:.1f} s[/dim]")  # fmt: skip
    setup_readline()
    run_chat(ChatSession(runtime=rt, decode=spec.decode, system=system))


def env(
    require_cuda: Annotated[
        bool, typer.Option("--require-cuda", help="Fail unless a CUDA GPU is usable.")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of a table.")
    ] = False,
) -> None:
    """Show Python, torch, CUDA, GPU, copy bandwidth, CPU (AMX) and package versions."""
    import json

    from oled.env import collect

    report = collect(require_cuda=require_cuda)
    out = Console(highlight=False, soft_wrap=True)
    if json_out:
        out.print_json(json.dumps(report.as_dict()))
    else:
        width = max(len(k) for k, _ in report.rows)
        for key, value in report.rows:
            out.print(f"{key:>{width}}: {value}")
    for failure in report.failures:
        err_console.print(f"[red]error:[/red] {failure}")
    if report.failures:
        raise typer.Exit(1)


@user_errors
def bench(
    recipes: Annotated[
        list[Path] | None, typer.Argument(help="Recipes to compare side by side.")
    ] = None,
    recipe: RecipeOpt = None,
    model: ModelOpt = "builtin:tiny",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "bfloat16",
    cache_size: CacheOpt = None,
    graphs: GraphsOpt = True,
    kernels: KernelsOpt = None,
    gen_length: Annotated[int, typer.Option(help="Tokens generated per run.")] = 256,
    block_length: BlockOpt = 32,
    threshold: ThresholdOpt = 0.95,
    max_tokens: Annotated[
        int | None, typer.Option("--max-tokens", help="Same as --gen-length.")
    ] = None,
    prompt_length: Annotated[int, typer.Option(help="Seeded random prompt tokens.")] = 512,
    warmup_runs: Annotated[int, typer.Option(help="Untimed runs first.")] = 1,
    runs: Annotated[int, typer.Option(help="Timed runs.")] = 3,
    seed: Annotated[int, typer.Option(help="Prompt seed.")] = 0,
    profile: Annotated[
        bool, typer.Option(help="Device time per forward stage, from the profiler (GPU only).")
    ] = False,
    report_dir: Annotated[Path | None, typer.Option(help="Write a JSON report here.")] = None,
    follow: Annotated[
        bool,
        typer.Option(
            help="Rows after the first commit the first row's tokens, so that all do the same "
            "work (CPU experts agree with the GPU to a tolerance only)."
        ),
    ] = True,
    routing: Annotated[
        str | None,
        typer.Option(
            "--routing",
            help="model: the routers' own; trace:PATH: replay a routing trace's routing, "
            "commits and confidences on every row (its prompts replace the random one; "
            "default: each recipe's workload.routing).",
        ),
    ] = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help="With a trace: which of its prompts to replay (I, A:B or a comma-separated "
            "list; default: the recipe's workload.trace_prompts, else all).",
        ),
    ] = None,
) -> None:
    """Benchmark ms per iteration, tokens/s and offload figures; compare recipes side by side."""
    import gc

    from oled import bench as b
    from oled.launch import build, check

    cfg = b.BenchConfig(gen_length=max_tokens or gen_length, block_length=block_length,
                        threshold=threshold, prompt_length=prompt_length,
                        warmup_runs=warmup_runs, runs=runs, seed=seed, profile=profile)  # fmt: skip
    paths = [*(recipes or []), *([recipe] if recipe else [])]
    name = model.split(":", 1)[1] if model.startswith("builtin:") else Path(model).name
    specs = [(p.stem, spec_of(model, device, dtype, p, None, graphs, kernels)) for p in paths] or [
        (name if cache_size is None else f"{name} cache={cache_size}",
         spec_of(model, device, dtype, None, cache_size, graphs, kernels))
    ]  # fmt: skip
    for _, spec in specs:
        check(spec)
    works = [_trace_workload(spec, routing, prompts) for _, spec in specs]
    if prompts is not None and not any(works):
        raise ValueError("--prompts selects traced prompts: give --routing trace:PATH")
    rows, used, report = [], "cpu", None
    trajectory = b.Trajectory() if follow else None
    for (label, spec), work in zip(specs, works, strict=True):
        rt = build(spec)
        used = str(rt.device)
        if profile and rt.device.type != "cuda":
            err_console.print(f"[yellow]--profile: no device timeline on {rt.device}; "
                              "host time per stage only[/yellow]")  # fmt: skip
        if work is not None:
            err_console.print(f"[dim]{label}: {cfg.warmup_runs} warm-up + {cfg.runs} timed "
                              f"passes over {len(work.prompts)} prompts of {work.name} "
                              "(routing, commits and lengths from the trace)[/dim]")  # fmt: skip
            rows.append(b.bench_replay(rt, cfg, label, work))
        else:
            err_console.print(f"[dim]{label}: {cfg.warmup_runs} warm-up + {cfg.runs} timed "
                              f"runs, prompt {cfg.prompt_length}, {cfg.gen_length} tokens"
                              "[/dim]")  # fmt: skip
            rows.append(b.bench_runtime(rt, cfg, label, trajectory))
        if report_dir is not None and len(specs) > 1:  # the rows done, should a later one fail
            report = b.write_report(report_dir, cfg, rows, used, report)
        del rt
        gc.collect()
    rows = b.with_ratios(rows)
    out = Console(highlight=False, width=max(225, Console().width))  # 16 columns fit
    out.print(b.table(rows))
    if any("stages_ms_per_iteration" in r for r in rows):
        out.print(b.stage_table(rows))
    if any("host_ms_per_iteration" in r for r in rows):
        out.print(b.host_table(rows))
    if report_dir is not None:
        err_console.print(
            f"[dim]report: {b.write_report(report_dir, cfg, rows, used, report)}[/dim]"
        )


_TRACES: dict[Path, object] = {}  # traces loaded by this process, by path


def _trace_workload(spec, routing: str | None, prompts: str | None):
    """The trace workload (oled.bench.TraceWorkload) a bench row replays, or None: `--routing`
    (paths from the working directory) over the row's recipe's `workload.routing`; checked
    against the row's model geometry before anything loads."""
    from oled.bench import TraceWorkload
    from oled.decoding.replay import check_geometry, select_prompts
    from oled.model.config import ModelConfig
    from oled.recipe import TRACE, load_recipe, routing_trace
    from oled.runtime import resolve_model
    from oled.trace.format import Trace

    recipe = load_recipe(spec.recipe) if spec.recipe is not None else None
    if routing is not None:
        if routing != "model" and not (routing.startswith(TRACE) and routing[len(TRACE) :]):
            raise ValueError(f"--routing: expected 'model' or 'trace:PATH' (got {routing!r})")
        path = routing_trace(routing)
    else:
        path = recipe.routing_trace() if recipe is not None else None
        if prompts is None and recipe is not None:
            prompts = recipe.workload.trace_prompts
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(f"no such trace file: {path}")
    path = path.resolve()
    if path not in _TRACES:
        _TRACES[path] = Trace.load(path)
    trace = _TRACES[path]
    model = recipe.model.path if recipe is not None else spec.model
    check_geometry(trace, ModelConfig.from_json(resolve_model(model)))
    chosen = select_prompts(prompts, len(trace.prompt_starts))
    return TraceWorkload(trace=trace, prompts=tuple(chosen), name=path.name)


def register(app: typer.Typer) -> None:
    """Add the commands to the `oled` app."""
    app.command()(serve)
    app.command()(chat)
    app.command()(env)
    app.command()(bench)
