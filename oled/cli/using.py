"""The interactive and operational commands: generate, chat, serve, bench, env.

Each imports its implementation lazily, so that `oled --help` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from oled.cli.options import (
    BlockOpt,
    CacheOpt,
    DeviceOpt,
    DtypeOpt,
    GraphsOpt,
    KernelsOpt,
    MaxTokensOpt,
    ModelOpt,
    PrefillChunkOpt,
    RecipeOpt,
    SeedOpt,
    StepsOpt,
    TemperatureOpt,
    ThresholdOpt,
    TransferOpt,
    at_least,
    command_spec,
    err_console,
    load,
    user_errors,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from oled.bench import BenchConfig, TraceWorkload
    from oled.decoding import GenerationStats
    from oled.trace.format import Trace


@user_errors
def generate(
    prompt: Annotated[str, typer.Argument(help="The question or text to continue.")],
    recipe: RecipeOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    cache_size: CacheOpt = None,
    graphs: GraphsOpt = None,
    kernels: KernelsOpt = None,
    transfer: TransferOpt = None,
    max_tokens: MaxTokensOpt = None,
    block_length: BlockOpt = None,
    threshold: ThresholdOpt = None,
    steps: StepsOpt = None,
    temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat format: continue the text.")] = False,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute the prefix.")] = False,
) -> None:
    """Generate an answer, streaming each finished block, then print decoding statistics."""
    from oled.model.tokenizer import check_text

    if not prompt.strip():
        raise ValueError(
            "the prompt is empty: give the text to answer (or to continue, with --raw)"
        )
    check_text(prompt, "the prompt")
    spec = command_spec(
        recipe,
        model,
        device=device,
        dtype=dtype,
        cache_size=cache_size,
        graphs=graphs,
        kernels=kernels,
        transfer=transfer,
        block_length=block_length,
        threshold=threshold,
        steps=steps,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        use_cache=False if no_cache else None,
    )
    rt = load(spec, progress=True)
    ids = rt.prompt_ids(prompt, chat=not raw)
    for block in rt.stream(ids):
        sys.stdout.write(rt.tokenizer.decode(block.new_tokens))
        sys.stdout.flush()
    sys.stdout.write("\n")
    print_stats(rt.last_stats)


def print_stats(stats: GenerationStats) -> None:
    from oled.decoding.decoder import median_p90

    median, _ = median_p90(stats.decode_ms)
    err_console.print(
        f"[dim]{stats.new_tokens} tokens, {stats.iterations} forwards, "
        f"{stats.tokens_per_forward:.2f} tokens/forward, "
        f"prompt forward {stats.prompt_ms or 0.0:.1f} ms, "
        f"{median:.1f} ms/iteration after it (median), "
        f"{stats.tokens_per_second:.1f} tokens/s, finish: {stats.stopped}[/dim]"
    )


@user_errors
def serve(
    recipe: RecipeOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    cache_size: CacheOpt = None,
    graphs: GraphsOpt = None,
    kernels: KernelsOpt = None,
    transfer: TransferOpt = None,
    block_length: BlockOpt = None,
    threshold: ThresholdOpt = None,
    steps: StepsOpt = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", help="Upper bound a request may ask for.")
    ] = 4096,
    default_max_tokens: Annotated[
        int | None,
        typer.Option(
            help="max_tokens when a request gives none (default: the recipe's decoding.max_new_tokens)."
        ),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id clients use (default: the model's name).")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="OLED_API_KEY", help="Require this bearer token on /v1 routes."),
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(
            "--max-batch",
            help="Requests decoded together, one forward for all (default: the recipe's "
            "runtime.max_batch, else 8; 1: one at a time).",
        ),
    ] = None,
    max_queue: Annotated[
        int | None,
        typer.Option(
            "--max-queue",
            help="Requests kept waiting for a place in the batch; more are answered 429 with "
            "Retry-After (default: the recipe's runtime.max_queue, else 64; 0: none wait).",
        ),
    ] = None,
    prefill_chunk: PrefillChunkOpt = None,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming)."""
    from oled.serve.server import run_server, served_name

    at_least(1, max_tokens=max_tokens)
    spec = command_spec(
        recipe,
        model,
        device=device,
        dtype=dtype,
        cache_size=cache_size,
        graphs=graphs,
        kernels=kernels,
        transfer=transfer,
        block_length=block_length,
        threshold=threshold,
        steps=steps,
        max_tokens=default_max_tokens,
        max_tokens_flag="--default-max-tokens",
        max_batch=max_batch,
        max_queue=max_queue,
        prefill_chunk=prefill_chunk,
    )
    run_server(
        spec,
        host=host,
        port=port,
        model_name=served_model_name or served_name(spec),
        max_tokens=max_tokens,
        api_key=api_key,
    )


@user_errors
def chat(
    recipe: RecipeOpt = None,
    model: ModelOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    cache_size: CacheOpt = None,
    graphs: GraphsOpt = None,
    kernels: KernelsOpt = None,
    transfer: TransferOpt = None,
    block_length: BlockOpt = None,
    threshold: ThresholdOpt = None,
    steps: StepsOpt = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    seed: SeedOpt = None,
    system: Annotated[str | None, typer.Option(help="System prompt.")] = None,
) -> None:
    """Chat in the terminal: streams each finished block; /help lists the commands."""
    from oled.chat import ChatSession, run_chat, setup_readline
    from oled.model.tokenizer import check_text

    if system is not None:
        check_text(system, "--system")
    spec = command_spec(
        recipe,
        model,
        device=device,
        dtype=dtype,
        cache_size=cache_size,
        graphs=graphs,
        kernels=kernels,
        transfer=transfer,
        block_length=block_length,
        threshold=threshold,
        steps=steps,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
    )
    rt = load(spec)
    setup_readline()
    run_chat(ChatSession(runtime=rt, decode=rt.decode, system=system))


def env(
    require_cuda: Annotated[
        bool, typer.Option("--require-cuda", help="Fail unless a CUDA GPU is usable.")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of a table.")
    ] = False,
    recalibrate: Annotated[
        bool,
        typer.Option(
            "--recalibrate",
            help="Measure the stored cost calibrations again; a file is replaced only by a "
            "measurement taken on a quiet machine with every figure inside its bounds.",
        ),
    ] = False,
) -> None:
    """Show Python, torch, CUDA, GPU, copy bandwidth, CPU (AMX, threads), the cost
    calibrations and package versions."""
    import json

    from oled.env import collect
    from oled.env import recalibrate as measure_again

    if recalibrate:
        for line in measure_again():
            err_console.print(f"recalibrate: {line}", highlight=False, soft_wrap=True)
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
    model: ModelOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    cache_size: CacheOpt = None,
    graphs: GraphsOpt = None,
    kernels: KernelsOpt = None,
    transfer: TransferOpt = None,
    gen_length: Annotated[int, typer.Option(help="Tokens generated per run.")] = 256,
    block_length: BlockOpt = None,
    threshold: ThresholdOpt = None,
    steps: StepsOpt = None,
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
            help="Every row commits the resident model's tokens, so that all do the same work "
            "(CPU experts agree with the GPU to a tolerance only); one more untimed run per "
            "row measures the free-running agreement. Default: rows run free and each timed "
            "run is compared with the resident tokens."
        ),
    ] = False,
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
    streams: Annotated[
        str | None,
        typer.Option(
            "--streams",
            help="Concurrent streams, e.g. 1,2,4,8: per count, the same requests (as many as "
            "the largest count, seeded random prompts; with a routing trace, its --prompts "
            "replayed, each at least once, in whole groups) decode that many at a time in one "
            "batch; "
            "aggregate and per-request tokens/s, time to first token, the running streams' "
            "slowdown while prompts join, copies per token; --runs timed passes each.",
        ),
    ] = None,
    prefill_chunk: PrefillChunkOpt = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option(
            "--prompt-file",
            help='With --streams: the requests\' prompts from a JSONL file ({"prompt": ...} or '
            '{"messages": [...]} a line, in turn, chat-formatted) instead of random ones.',
        ),
    ] = None,
) -> None:
    """Benchmark ms per iteration, tokens/s and offload figures; compare recipes side by side.

    Each row is a recipe (or, without one, the model) with the flags over it; a row decodes
    with its recipe's decoding, generating --gen-length tokens. With --streams, rows of
    concurrent requests decoded together instead."""
    from oled import bench as b

    if max_tokens is not None:
        gen_length = max_tokens
        at_least(1, max_tokens=max_tokens)
    at_least(1, gen_length=gen_length, prompt_length=prompt_length, runs=runs)
    at_least(0, warmup_runs=warmup_runs)
    cfg = b.BenchConfig(
        gen_length=gen_length,
        prompt_length=prompt_length,
        warmup_runs=warmup_runs,
        runs=runs,
        seed=seed,
        profile=profile,
    )
    flags = dict(
        device=device,
        dtype=dtype,
        cache_size=cache_size,
        graphs=graphs,
        kernels=kernels,
        transfer=transfer,
        block_length=block_length,
        threshold=threshold,
        steps=steps,
        prefill_chunk=prefill_chunk,
    )
    paths = [*(recipes or []), *([recipe] if recipe else [])]
    if prompts is not None and routing is None and not paths:
        raise ValueError("--prompts selects traced prompts: give --routing trace:PATH")
    if streams is not None:
        counts = stream_counts(streams)
        if follow:
            raise ValueError("--streams decodes freely or replays a trace: drop --follow")
        specs = [
            (label, with_routing(spec, routing, prompts))
            for label, spec in _row_specs(paths, model, cache_size, flags)
        ]
        works = [_trace_workload(spec) for _, spec in specs]
        if prompt_file is not None and any(works):
            raise ValueError("--prompt-file and a routing trace both give the prompts: drop one")
        _bench_streams(cfg, specs, counts, report_dir, _chat_prompts(prompt_file), works)
        return
    if prompt_file is not None:
        raise ValueError("--prompt-file gives the prompts of --streams: add --streams")
    specs = [
        (label, with_routing(spec, routing, prompts))
        for label, spec in _row_specs(paths, model, cache_size, flags)
    ]
    _bench_rows(cfg, specs, [_trace_workload(spec) for _, spec in specs], follow, report_dir)


def stream_counts(text: str) -> list[int]:
    """`--streams` as counts: positive integers, comma-separated."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--streams takes positive counts such as 1,2,4,8, not {text!r}")
    return counts


def _profile_note(cfg: BenchConfig, rt: Any) -> None:
    """Say that a CPU row's profile has host times only."""
    if cfg.profile and rt.device.type != "cuda":
        err_console.print(
            f"[yellow]--profile: no device timeline on {rt.device}; "
            "host time per stage only[/yellow]"
        )


def _chat_prompts(path: Path | None) -> list[list[dict[str, str]]] | None:
    """The chat messages of each prompt of a JSONL prompt file (None without one)."""
    from oled.experiment.workload import read_jsonl

    return None if path is None else [p.as_messages() for p in read_jsonl(path)]


def _bench_streams(
    cfg: BenchConfig,
    specs: Sequence[tuple[str, Any]],
    counts: list[int],
    report_dir: Path | None,
    prompts: list[list[dict[str, str]]] | None = None,
    works: Sequence[TraceWorkload | None] | None = None,
) -> None:
    """Rows of concurrent streams per spec (oled.bench.streams), the tables and the report;
    a row with a trace workload replays its prompts."""
    from oled import bench as b
    from oled.bench.streams import bench_streams, streams_table
    from oled.runtime import build
    from oled.trace.batched import whole_groups

    rows, used = [], "cpu"
    for (label, spec), work in zip(specs, works or [None] * len(specs), strict=True):
        rt = build(spec)
        used = str(rt.device)
        if work is not None:
            requests = whole_groups(max(counts), len(work.prompts))
            what = (
                f"{requests} replays of {len(work.prompts)} prompts of {work.name} (routing, "
                "commits and lengths from the trace; prompts in one forward each)"
            )
        else:
            source = f"{len(prompts)} file prompts" if prompts else f"prompt {cfg.prompt_length}"
            what = (
                f"{max(counts)} requests, {source}, {cfg.gen_length} tokens, prompts in chunks "
                f"of {rt.prefill_chunk or 'all'} tokens"
            )
        err_console.print(
            f"[dim]{label}: {what}, at {counts} streams, {cfg.warmup_runs} warm-up + "
            f"{cfg.runs} timed passes[/dim]"
        )
        _profile_note(cfg, rt)
        rows += bench_streams(rt, cfg, label, counts, prompts=prompts, work=work)
        del rt
    out = Console(highlight=False, width=max(240, Console().width))  # 14 columns fit
    out.print(streams_table(rows))
    if any("stages_ms_per_iteration" in r for r in rows):
        out.print(b.stage_table(rows))
    if any("host_ms_per_iteration" in r for r in rows):
        out.print(b.host_table(rows))
    if report_dir is not None:
        err_console.print(f"[dim]report: {b.write_report(report_dir, cfg, rows, used)}[/dim]")


def _row_specs(
    paths: list[Path], model: str | None, cache_size: int | None, flags: dict
) -> list[tuple[str, Any]]:
    """Each recipe with the flags over it, labelled by its stem; without recipes, one row of
    the model, labelled by its name (and cache size); an encoded transfer is named."""
    if paths:
        specs = [(p.stem, command_spec(p, model, **flags)) for p in paths]
    else:
        spec = command_spec(None, model, **flags)
        name = spec.model.name
        specs = [(name if cache_size is None else f"{name} cache={cache_size}", spec)]
    return [(label + transfer_label(spec), spec) for label, spec in specs]


def transfer_label(spec: Any) -> str:
    """A row label's mark of an encoded transfer: " lossless", " fp8 (lossy)", or none."""
    from oled.model.codec import describe

    transfer = spec.runtime.transfer
    return "" if transfer == "plain" else f" {describe(transfer)}"


def with_routing(spec: Any, routing: str | None, prompts: str | None) -> Any:
    """A bench row's spec with `--routing` (a trace path from the working directory) and
    `--prompts` over its workload; a `--routing` given selects `--prompts` of its trace (all
    when not given), whatever the recipe selected."""
    from oled.recipe import TRACE

    values: dict[str, Any] = {}
    if routing is not None:
        if routing.startswith(TRACE) and routing.removeprefix(TRACE):
            routing = TRACE + str(Path(routing.removeprefix(TRACE)).expanduser().resolve())
        values = {"workload.routing": routing, "workload.trace_prompts": prompts}
    elif prompts is not None:
        values = {"workload.trace_prompts": prompts}
    if not values:
        return spec
    origins = {"workload.routing": "--routing", "workload.trace_prompts": "--prompts"}
    return spec.with_values(values, origins)


def _bench_rows(
    cfg: BenchConfig,
    specs: Sequence[tuple[str, Any]],
    works: Sequence[TraceWorkload | None],
    follow: bool,
    report_dir: Path | None,
) -> None:
    """Run every row (one runtime at a time), print the tables and write the report (after
    each row too, when there are several, so that finished rows survive a later failure)."""
    import gc

    from oled import bench as b
    from oled.runtime import build

    rows, used, report = [], "cpu", None
    for (label, spec), work in zip(specs, works, strict=True):
        rt = build(spec)
        used = str(rt.device)
        _profile_note(cfg, rt)
        if work is not None:
            err_console.print(
                f"[dim]{label}: {b.replay_warmups(cfg, len(work.prompts))} warm-up replays + "
                f"{cfg.runs} timed passes over {len(work.prompts)} prompts of {work.name} "
                "(routing, commits and lengths from the trace)[/dim]"
            )
            rows.append(b.bench_replay(rt, cfg, label, work))
        else:
            err_console.print(
                f"[dim]{label}: {cfg.warmup_runs} warm-up + {cfg.runs} timed "
                f"runs, prompt {cfg.prompt_length}, {cfg.gen_length} tokens"
                "[/dim]"
            )
            rows.append(b.bench_runtime(rt, cfg, label, follow))
        if report_dir is not None and len(specs) > 1:
            report = b.write_report(report_dir, cfg, rows, used, report)
        del rt
        gc.collect()
    rows = b.with_ratios(rows)
    out = Console(highlight=False, width=max(330, Console().width))  # 25 columns fit
    out.print(b.table(rows))
    if any("stages_ms_per_iteration" in r for r in rows):
        out.print(b.stage_table(rows))
    if any("host_ms_per_iteration" in r for r in rows):
        out.print(b.host_table(rows))
    if report_dir is not None:
        err_console.print(
            f"[dim]report: {b.write_report(report_dir, cfg, rows, used, report)}[/dim]"
        )


_TRACES: dict[Path, Trace] = {}  # traces loaded by this process, by path


def _trace_workload(spec: Any) -> TraceWorkload | None:
    """The trace workload (oled.bench.TraceWorkload) a bench row replays, or None: its
    recipe's `workload.routing` and `trace_prompts` (validated with the recipe), checked
    against the row's model geometry before anything loads."""
    from oled.bench import TraceWorkload
    from oled.model.config import ModelConfig
    from oled.runtime import resolve_model
    from oled.trace.format import Trace
    from oled.trace.replay import check_geometry, select_prompts

    path = spec.routing_trace()
    if path is None:
        return None
    path = path.resolve()
    if path not in _TRACES:
        _TRACES[path] = Trace.load(path)
    trace = _TRACES[path]
    check_geometry(trace, ModelConfig.from_json(resolve_model(spec.model.path)))
    chosen = select_prompts(spec.workload.trace_prompts, len(trace.prompt_starts))
    return TraceWorkload(trace=trace, prompts=tuple(chosen), name=path.name)


def register(app: typer.Typer) -> None:
    """Add the commands to the `oled` app."""
    app.command()(generate)
    app.command()(serve)
    app.command()(chat)
    app.command()(env)
    app.command()(bench)
