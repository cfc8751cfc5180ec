"""GPU evidence for the offload engine: resident vs every baseline and OLED at several budgets.

Builds (or reuses) the full-size `mini-shape` random checkpoint on the machine, loads it once
(experts pinned) and measures every configuration in one process with `oled.bench` (the same
warm-up, timed runs and table as `oled bench`); the 16B checkpoint is loaded once, not per
configuration. Usage (one H200, well under 10 minutes):

    python tools/bench_offload.py --model /tmp/oled-mini-shape --report-dir reports
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402

from oled.bench import (  # noqa: E402
    BenchConfig,
    TraceWorkload,
    bench_decode,
    bench_replay,
    bench_runtime,
    host_table,
    random_prompt,
    run_once,
    stage_table,
    table,
    with_ratios,
    write_report,
)
from oled.decoding import DecodeConfig  # noqa: E402
from oled.kernels import cpu  # noqa: E402
from oled.kernels import use as use_kernels  # noqa: E402
from oled.model.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from oled.model.codec import describe  # noqa: E402
from oled.model.experts import ResidentExperts  # noqa: E402
from oled.model.presets import init_checkpoint  # noqa: E402
from oled.offload.budget import Budget, total_slots  # noqa: E402
from oled.offload.copies import use_batches  # noqa: E402
from oled.offload.encoded import EncodedCopies  # noqa: E402
from oled.policies import ANCHORS, anchor_policies  # noqa: E402
from oled.policies import allocation as A  # noqa: E402
from oled.policies import compensation as C  # noqa: E402
from oled.policies import retention as R  # noqa: E402
from oled.runtime import (  # noqa: E402
    Runtime,
    decision_cost,
    make_engine,
    make_planner,
)

if TYPE_CHECKING:
    from oled.offload.engine import OffloadEngine
    from oled.offload.predict import RecordedRouting

CURVES = "recipes/twin/oled.toml"
CONFIGS = {
    **{name: lambda name=name: anchor_policies(name) for name in ANCHORS},
    # `oled tune recipes/twin/tune.toml` on the twin's tuning split (recipes/twin/oled-tuned.toml)
    "oled-tuned": lambda: tuned("recipes/twin/oled-tuned.toml"),
    # recipes/twin/oled.toml: slots split on miss curves fitted on the tuning split, LFU
    # retention, cooperative compensation
    "oled-curves": lambda: tuned(CURVES),
}
# One mechanism replaced by another, to see what each contributes: "oled/uniform-alloc", or
# several joined by "+", "oled-curves/transfer-only+uniform-alloc"
SWAPS = {
    "uniform-alloc": lambda: {"allocation": A.UniformAllocation()},
    "transfer-only": lambda: {"compensation": C.TransferOnly()},
    "lru-retention": lambda: {"retention": R.LRURetention()},
    "confidence-retention": lambda: {"retention": R.ConfidenceRetention()},
}
SHOWN = [*CONFIGS, "oled/uniform-alloc", "oled/transfer-only", "oled/lru-retention"]
SHOWN += [f"oled-curves/{s}" for s in ("uniform-alloc", "transfer-only", "confidence-retention")]


def policies(name: str) -> dict:
    """The policies of one config name: a base in CONFIGS, then its swaps after a "/"."""
    base, _, swaps = name.partition("/")
    if base not in CONFIGS or any(s not in SWAPS for s in swaps.split("+") if swaps):
        raise SystemExit(
            f"unknown config {name!r}: a base of {list(CONFIGS)}, then /SWAP[+SWAP]"
            f" of {list(SWAPS)}"
        )
    out = CONFIGS[base]()
    for s in swaps.split("+") if swaps else []:
        out |= SWAPS[s]()
    return out


KERNEL_MODES = {"auto": ["auto"], "torch": ["torch"], "both": ["auto", "torch"]}
GRAPH_MODES = {"on": [True], "off": [False], "both": [True, False]}


def tuned(recipe: str) -> dict:
    """The policies of a recipe file (relative to the repository)."""
    from oled.recipe import load_recipe

    return load_recipe(Path(__file__).resolve().parents[1] / recipe).policy.build()


class Combo(NamedTuple):
    """One offloaded row's settings, besides its budget."""

    name: str
    graphs: bool
    kernels: str
    prefetch: int
    planner: str
    batched: bool
    driver: bool | None
    transfer: str
    cpu_experts: str  # oled.kernels.cpu.use: "auto" (the C kernel) or "torch"


@dataclass
class Bench:
    """What every row shares: the checkpoint, the settings, and the rows measured so far."""

    args: argparse.Namespace
    ckpt: Checkpoint
    dev: torch.device
    cfg: BenchConfig
    decode: DecodeConfig
    follow: bool
    kernel_modes: list[str]
    work: TraceWorkload | None
    rows: list[dict] = field(default_factory=list)
    report: Path | None = None
    encoded: dict[str, EncodedCopies] = field(default_factory=dict)  # the last transfer's

    def transfer(self, name: str) -> EncodedCopies | None:
        """The encoded experts of transfer `name`; None for "plain". Only the last transfer's
        are kept (host memory holds the bf16 experts and one encoded copy of them), and rows
        run transfer by transfer, so each is encoded once."""
        if name == "plain":
            return None
        if name not in self.encoded:
            self.encoded.clear()
            gc.collect()  # the earlier transfer's pinned tables, before the next are made
            t0 = time.perf_counter()
            self.encoded[name] = e = EncodedCopies(self.ckpt.experts, name, self.dev)
            print(
                f"encoded ({describe(name)}) in {time.perf_counter() - t0:.1f} s: "
                f"{e.ratio:.4f} of the bytes",
                flush=True,
            )
        return self.encoded[name]

    def measure(self, rt: Runtime, label: str, graphs: bool) -> None:
        """Time one row: replay the workload, or generate (following the resident tokens)."""
        rcfg = replace(self.cfg, profile=graphs and self.cfg.profile)
        self.rows.append(
            bench_replay(rt, rcfg, label, self.work)
            if self.work
            else bench_runtime(rt, rcfg, label, self.follow)
        )

    def save(self) -> Path:
        """Write the rows so far: the same report, rewritten after each row."""
        out = Path(self.args.report_dir)
        self.report = write_report(out, self.cfg, self.rows, str(self.dev), self.report)
        return self.report


def main() -> None:
    """Measure every row, print the tables and write the report."""
    ap = parser()
    args = ap.parse_args()
    for name in config_names(args):
        policies(name)  # an unknown name fails before the checkpoint loads
    dev = torch.device(args.device)
    ckpt = load(Path(args.model), dev)
    # every row at the main prompt length commits the first row's tokens: the same work
    if args.ahead_from == "recorded" and not args.follow:
        ap.error(
            "--ahead-from recorded needs rows that follow the resident tokens (no --no-follow)"
        )
    bench = Bench(
        args=args,
        ckpt=ckpt,
        dev=dev,
        cfg=bench_config(args),
        decode=DecodeConfig(max_new_tokens=args.gen_length),
        follow=args.follow,
        kernel_modes=KERNEL_MODES[args.kernels],
        work=replay_workload(args.routing, args.prompts) if args.routing else None,
    )
    oracle = resident_rows(bench)
    bench.save()
    for transfer in args.transfers.split(","):  # each transfer's experts encoded once
        for frac in [float(f) for f in args.budgets.split(",") if f]:
            budget_rows(bench, frac, oracle, transfer)
    print_summary(bench)


def parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/oled-mini-shape")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument(
        "--resident-prompts", default="", help="also time resident at these prompt lengths"
    )
    ap.add_argument(
        "--graphs",
        choices=["on", "off", "both"],
        default="on",
        help="CUDA graphs for the offloaded rows (resident always runs both)",
    )
    ap.add_argument(
        "--kernels",
        choices=["auto", "torch", "both"],
        default="auto",
        help="fused Triton kernels (auto), plain torch, or both rows for every configuration",
    )
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--warmup-runs", type=int, default=1)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--budgets", default="0.5,0.25,0.125")
    ap.add_argument(
        "--configs",
        default="all",
        help=f"comma-separated of: {', '.join(SHOWN)} (swaps join with +)",
    )
    ap.add_argument(
        "--prefetch", default="0", help="comma-separated experts per layer copied ahead (0 = off)"
    )
    ap.add_argument(
        "--ahead-from",
        choices=["model", "recorded", "previous"],
        default="model",
        help="predict the next layer's routing with its router (model; in replays of "
        "--routing, the traced model's prediction that the trace recorded), read it from a "
        "trace of the followed generation (recorded: a perfect prediction, the bound), or copy "
        "what the next layer routed the forward before (previous: also in replays of "
        "--routing); either way on the link's spare time",
    )
    ap.add_argument(
        "--profile", action="store_true", help="device time per stage (rows with graphs)"
    )
    ap.add_argument("--report-dir", default="reports")
    ap.add_argument(
        "--no-follow",
        dest="follow",
        action="store_false",
        help="let each row commit its own tokens (by default rows follow the resident tokens)",
    )
    ap.add_argument(
        "--planner",
        default="auto",
        help="comma-separated host planners per row: auto, compiled, python (the same decisions)",
    )
    ap.add_argument(
        "--copies",
        default="batched",
        help="comma-separated copy launches per row: batched (one call per layer), each (one "
        "call per expert and table)",
    )
    ap.add_argument(
        "--driver",
        default="auto",
        help="comma-separated layer launches per row: auto (from C where possible), python",
    )
    ap.add_argument(
        "--transfers",
        default="plain",
        help="comma-separated per row: how misses cross the link: plain, lossless, fp8 or int4 "
        "(lossy)",
    )
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--cost", default="calibrate", help="cost model: calibrate or a profile")
    ap.add_argument("--trace", default=None, help="record the resident run's routing here")
    ap.add_argument(
        "--routing",
        default=None,
        metavar="TRACE",
        help="replay this trace's routing, confidences and commits (resident with graphs only)",
    )
    ap.add_argument(
        "--cpu-experts",
        choices=list(KERNEL_MODES),
        default="auto",
        help="CPU experts through the C kernel (auto), torch's products, or both rows",
    )
    ap.add_argument("--prompts", default="all", help="the trace's prompts to replay: all, I, A:B")
    ap.add_argument(
        "--cprofile",
        default=None,
        metavar="NAME@FRACTION",
        help="host profile (cProfile) of one more generation of this row",
    )
    return ap


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """Warm-up, timed runs and lengths of every row."""
    return BenchConfig(
        gen_length=args.gen_length,
        prompt_length=args.prompt_length,
        runs=args.runs,
        warmup_runs=args.warmup_runs,
        profile=args.profile,
    )


def resident_rows(bench: Bench) -> RecordedRouting | None:
    """Resident rows (with and without graphs, per kernel mode), and their extras; the
    recorded routing of the followed generation with --ahead-from recorded."""
    args, cfg = bench.args, bench.cfg
    resident = ResidentExperts(bench.ckpt.experts, bench.dev)
    oracle = None
    graph_modes = (True,) if bench.work else (True, False)
    for kernels, graphs in [(k, g) for k in bench.kernel_modes for g in graph_modes]:
        rt = Runtime(
            checkpoint=bench.ckpt,
            device=bench.dev,
            executor=resident,
            decode=bench.decode,
            graphs=graphs,
            kernels=kernels,
        )
        mode = ("graphs" if graphs else "eager") + suffix(kernels)
        bench.measure(rt, f"resident {mode}", graphs)
        resident_prompt_rows(bench, rt, mode)
        if args.trace and not graphs:
            record_resident(rt, cfg, Path(args.trace))
        if args.ahead_from == "recorded" and not graphs and oracle is None:
            oracle = recorded_routing(rt, cfg)
        print(f"done: resident {mode}", flush=True)
        del rt
    del resident
    free_cache(bench.dev)
    return oracle


def resident_prompt_rows(bench: Bench, rt: Runtime, mode: str) -> None:
    """Resident rows at the --resident-prompts lengths (not profiled, not followed)."""
    for n in [int(n) for n in bench.args.resident_prompts.split(",") if n]:
        longer = replace(bench.cfg, prompt_length=n, profile=False)
        bench.rows.append(bench_runtime(rt, longer, f"resident {mode} p{n}"))


def record_resident(rt: Runtime, cfg: BenchConfig, out: Path) -> None:
    """Record the routing of one generation from the benchmark's prompt into `out`."""
    from oled.trace.record import record_trace

    record_trace(rt, [random_prompt(rt, cfg.prompt_length, cfg.seed)], out)


def config_names(args: argparse.Namespace) -> list[str]:
    """The --configs names, in table order."""
    return SHOWN if args.configs == "all" else args.configs.split(",")


def combos(args: argparse.Namespace, kernel_modes: list[str]) -> list[Combo]:
    """Every offloaded row of one budget, in table order (every transfer)."""
    names = config_names(args)
    graph_modes = GRAPH_MODES[args.graphs]
    ahead = [int(n) for n in args.prefetch.split(",")]
    planners, launches = args.planner.split(","), args.copies.split(",")
    drivers = [None if d == "auto" else False for d in args.driver.split(",")]
    transfers = args.transfers.split(",")
    cpu_modes = KERNEL_MODES[args.cpu_experts]
    return [
        Combo(n, g, k, a, pl, c == "batched", d, t, m)
        for n in names
        for g in graph_modes
        for k in kernel_modes
        for a in ahead
        for pl in planners
        for c in launches
        for d in drivers
        for t in transfers
        for m in cpu_modes
    ]


def budget_rows(bench: Bench, frac: float, oracle: RecordedRouting | None, transfer: str) -> None:
    """Every offloaded row of `transfer` at the budget of `frac` of the experts."""
    budget = Budget("expert_fraction", frac)
    slots = total_slots(budget, bench.ckpt.config, dtype=torch.bfloat16, device=bench.dev)
    for combo in combos(bench.args, bench.kernel_modes):
        if combo.transfer == transfer:
            offloaded_row(bench, combo, frac, slots, oracle)


def offloaded_row(
    bench: Bench, c: Combo, frac: float, slots: int | None, oracle: RecordedRouting | None
) -> None:
    """Measure one offloaded row (and its host profile if --cprofile names it)."""
    ckpt, dev, args = bench.ckpt, bench.dev, bench.args
    use_batches(c.batched)
    p = policies(c.name)
    use_kernels(c.kernels)  # the cost calibration times the kernels the row runs
    cpu.use(c.cpu_experts)
    transfer = bench.transfer(c.transfer)
    cost, costs = decision_cost(args.cost, ckpt, dev, transfer)  # priced by what a copy moves
    planner = make_planner(
        ckpt,
        dev,
        slots,
        stage_capacity=8,
        allocation=p["allocation"],
        retention=p["retention"],
        compensation=p["compensation"],
        cost=cost,
        prefetch=c.prefetch,
        ahead_from="previous" if args.ahead_from == "previous" else "router",
        planner=c.planner,
    )
    engine = make_engine(ckpt, dev, planner, driver=c.driver, encoded=transfer)
    recorded = bool(c.prefetch) and oracle is not None
    observers = [engine]
    if recorded:
        engine.predict = oracle
        observers.append(oracle)
    rt = Runtime(
        checkpoint=ckpt,
        device=dev,
        executor=engine,
        decode=bench.decode,
        observers=observers,
        graphs=c.graphs,
        kernels=c.kernels,
        costs=costs,
    )
    label = row_label(c, frac, recorded, planner.compiled, engine)
    bench.measure(rt, label, c.graphs)
    if hasattr(p["compensation"], "slowdown"):  # learned from the measured CPU experts
        bench.rows[-1]["cpu_slowdown"] = p["compensation"].slowdown
        print(f"{label}: CPU-expert slowdown now {p['compensation'].slowdown:.2f}")
    if c.graphs and c.kernels == bench.kernel_modes[0] and args.cprofile == f"{c.name}@{frac:g}":
        host_profile(rt, bench.cfg, Path(args.report_dir) / "host_profile.txt")
    bench.save()
    print(f"done: {label}", flush=True)
    del rt, engine, planner
    free_cache(dev)


def row_label(c: Combo, frac: float, recorded: bool, compiled: bool, engine: OffloadEngine) -> str:
    """An offloaded row's label: the configuration and budget, then what is not the default."""
    label = f"{c.name} @ {frac:g}" + ("" if c.graphs else " eager") + suffix(c.kernels)
    label += f" ahead {c.prefetch}" if c.prefetch else ""
    label += " recorded" if recorded else ""
    label += "" if compiled else " python-planner"
    label += "" if c.batched else " copies-each"
    label += " python-launch" if c.graphs and engine.cuda and engine.driver is None else ""
    label += "" if c.transfer == "plain" else f" {describe(c.transfer)}"
    label += "" if c.cpu_experts == "auto" else " torch-cpu-experts"
    return label


def print_summary(bench: Bench) -> None:
    """The table of every row (and the stage and host tables with --profile); the report."""
    console = Console(highlight=False, width=360)  # 25 columns and the copies ahead fit
    console.print(table(with_ratios(bench.rows)))
    if bench.args.profile:
        console.print(stage_table(bench.rows))
        console.print(host_table(bench.rows))
    print(f"report: {bench.save()}")


def free_cache(dev: torch.device) -> None:
    """Collect the last row's objects (a runtime and its engine refer to each other, so `del`
    alone leaves them, their slot tables and graphs, to a later collection) and give the
    freed device memory back (CUDA only)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def replay_workload(path: str, prompts: str) -> TraceWorkload:
    """The trace at `path` and the selected prompt indices (all, I, A:B)."""
    from oled.trace.format import Trace
    from oled.trace.replay import select_prompts

    trace = Trace.load(path)
    chosen = select_prompts(prompts, len(trace.prompt_starts))
    return TraceWorkload(trace=trace, prompts=tuple(chosen), name=Path(path).name)


def recorded_routing(rt: Runtime, cfg: BenchConfig) -> RecordedRouting:
    """The routing of a resident runtime's generation (the one every following row commits),
    as a perfect prediction."""
    from oled.offload.predict import RecordedRouting
    from oled.trace.record import record

    prompt = random_prompt(rt, cfg.prompt_length, cfg.seed)
    return RecordedRouting(record(rt, [prompt], decode=bench_decode(rt, cfg)))


def suffix(kernels: str) -> str:
    """Row label suffix for the kernels: none for the default (fused on CUDA)."""
    return "" if kernels == "auto" else f" {kernels}-kernels"


def host_profile(rt: Runtime, cfg: BenchConfig, out: Path) -> None:
    """cProfile of one generation, the 40 functions with the most own time, into `out`."""
    import cProfile
    import io
    import pstats

    prompt = random_prompt(rt, cfg.prompt_length, cfg.seed)
    profiler = cProfile.Profile()
    profiler.enable()
    _, _, tokens = run_once(rt, prompt, bench_decode(rt, cfg))
    profiler.disable()
    text = io.StringIO()
    print(f"{rt.last_stats.iterations} iterations", file=text)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text.getvalue())
    print(text.getvalue()[:3000])


def load(path: Path, dev: torch.device) -> Checkpoint:
    """The checkpoint at `path` (built there first if missing), experts pinned for CUDA."""
    t0 = time.perf_counter()
    if not (path / "config.json").exists():
        init_checkpoint(path, preset="mini-shape", seed=0, device=dev)
        print(f"built mini-shape checkpoint in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(path, device=dev, dtype=torch.bfloat16, pin_experts=dev.type == "cuda")
    print(f"loaded (experts pinned: {ckpt.experts.pinned}) in {time.perf_counter() - t0:.0f} s")
    return ckpt


if __name__ == "__main__":
    main()
