"""GPU evidence for the offload engine: resident vs every baseline and OLED at several budgets.

Builds (or reuses) the full-size `mini-shape` random checkpoint on the machine, loads it once
(experts pinned) and measures every configuration in one process with `oled.bench` (the same
warm-up, timed runs and table as `oled bench`); the 16B checkpoint is loaded once, not per
configuration. Usage (one H200, well under 10 minutes):

    python tools/bench_offload.py --model /tmp/oled-mini-shape --report-dir reports
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

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
from oled.decoding import DecodeConfig, Trajectory  # noqa: E402
from oled.kernels import use as use_kernels  # noqa: E402
from oled.model.checkpoint import load_checkpoint  # noqa: E402
from oled.model.experts import ResidentExperts  # noqa: E402
from oled.model.presets import init_checkpoint  # noqa: E402
from oled.offload.budget import Budget, total_slots  # noqa: E402
from oled.offload.copies import use_batches  # noqa: E402
from oled.policies import ANCHORS, anchor_policies  # noqa: E402
from oled.policies import allocation as A  # noqa: E402
from oled.policies import compensation as C  # noqa: E402
from oled.policies import retention as R  # noqa: E402
from oled.runtime import Runtime, make_engine, make_planner  # noqa: E402

CONFIGS = {
    **{name: lambda name=name: anchor_policies(name) for name in ANCHORS},
    # OLED with one mechanism replaced by the baseline's, to see what each contributes
    "oled/uniform-alloc": lambda: anchor_policies("oled") | {"allocation": A.UniformAllocation()},
    "oled/transfer-only": lambda: anchor_policies("oled") | {"compensation": C.TransferOnly()},
    "oled/lru-retention": lambda: anchor_policies("oled") | {"retention": R.LRURetention()},
    # `oled tune recipes/twin/tune.toml` on the twin's tuning split (recipes/twin/oled-tuned.toml)
    "oled-tuned": lambda: tuned("recipes/twin/oled-tuned.toml"),
}


def tuned(recipe: str) -> dict:
    """The policies of a recipe file (relative to the repository)."""
    from oled.experiment.build import build_policy
    from oled.recipe import load_recipe

    r = load_recipe(Path(__file__).resolve().parents[1] / recipe)
    return {
        k: build_policy(k, getattr(r.policy, k))
        for k in ("allocation", "retention", "compensation")
    }


def main() -> None:
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
    ap.add_argument("--configs", default="all", help=f"comma-separated of: {', '.join(CONFIGS)}")
    ap.add_argument(
        "--prefetch", default="0", help="comma-separated experts per layer copied ahead (0 = off)"
    )
    ap.add_argument(
        "--ahead-from",
        choices=["model", "recorded"],
        default="model",
        help="predict the next layer's routing with its router (model), or read it from a trace "
        "of the followed generation (recorded: a perfect prediction, the bound)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="device time per stage (rows with graphs)"
    )
    ap.add_argument("--report-dir", default="reports")
    ap.add_argument(
        "--no-follow",
        dest="follow",
        action="store_false",
        help="let each row commit its own tokens (by default rows follow the first row's)",
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
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--cost", default="calibrate", help="cost model: calibrate or a profile")
    ap.add_argument("--trace", default=None, help="record the resident run's routing here")
    ap.add_argument(
        "--routing",
        default=None,
        metavar="TRACE",
        help="replay this trace's routing, confidences and commits (resident with graphs only)",
    )
    ap.add_argument("--prompts", default="all", help="the trace's prompts to replay: all, I, A:B")
    ap.add_argument(
        "--cprofile",
        default=None,
        metavar="NAME@FRACTION",
        help="host profile (cProfile) of one more generation of this row",
    )
    args = ap.parse_args()
    dev = torch.device(args.device)
    ckpt = load(Path(args.model), dev)
    cfg = BenchConfig(
        gen_length=args.gen_length, prompt_length=args.prompt_length, runs=args.runs,
        warmup_runs=args.warmup_runs, profile=args.profile,
    )  # fmt: skip
    decode = DecodeConfig(max_new_tokens=args.gen_length)
    resident = ResidentExperts(ckpt.experts, dev)
    rows = []
    # every row at the main prompt length commits the first row's tokens: the same work
    trajectory = Trajectory() if args.follow else None
    if args.ahead_from == "recorded" and trajectory is None:
        ap.error("--ahead-from recorded needs rows that follow one trajectory (no --no-follow)")
    oracle = None  # RecordedRouting of the followed generation, with --ahead-from recorded
    kernel_modes = {"auto": ["auto"], "torch": ["torch"], "both": ["auto", "torch"]}[args.kernels]
    work = replay_workload(args.routing, args.prompts) if args.routing else None
    resident_modes = (True,) if work else (True, False)
    for kernels, graphs in [(k, g) for k in kernel_modes for g in resident_modes]:
        rt = Runtime(checkpoint=ckpt, device=dev, executor=resident, decode=decode, graphs=graphs,
                     kernels=kernels)  # fmt: skip
        mode = ("graphs" if graphs else "eager") + suffix(kernels)
        rcfg = replace(cfg, profile=graphs and cfg.profile)
        rows.append(
            bench_replay(rt, rcfg, f"resident {mode}", work)
            if work
            else bench_runtime(rt, rcfg, f"resident {mode}", trajectory)
        )
        for n in [int(n) for n in args.resident_prompts.split(",") if n]:
            longer = replace(cfg, prompt_length=n, profile=False)
            rows.append(bench_runtime(rt, longer, f"resident {mode} p{n}"))
        if args.trace and not graphs:
            from oled.trace.commands import record_trace

            record_trace(rt, [random_prompt(rt, cfg.prompt_length, cfg.seed)], Path(args.trace))
        if args.ahead_from == "recorded" and not graphs and oracle is None:
            oracle = recorded_routing(rt, cfg, trajectory)
        print(f"done: resident {mode}", flush=True)
        del rt
    del resident
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    report = write_report(Path(args.report_dir), cfg, rows, str(dev))  # rewritten after each row
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.graphs]
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    for frac in [float(f) for f in args.budgets.split(",") if f]:
        budget = Budget("expert_fraction", frac)
        slots = total_slots(budget, ckpt.config, dtype=torch.bfloat16, device=dev)
        ahead = [int(n) for n in args.prefetch.split(",")]
        planners, launches = args.planner.split(","), args.copies.split(",")
        drivers = [None if d == "auto" else False for d in args.driver.split(",")]
        for name, graphs, kernels, prefetch, plans, batched, driver in [
            (n, g, k, a, pl, c == "batched", d)
            for n in names for g in modes for k in kernel_modes for a in ahead for pl in planners
            for c in launches for d in drivers
        ]:  # fmt: skip
            use_batches(batched)
            p = CONFIGS[name]()
            use_kernels(kernels)  # the cost calibration times the kernels the row runs
            planner = make_planner(
                ckpt, dev, slots, 8, p["allocation"], p["retention"], p["compensation"], args.cost,
                prefetch, plans,
            )  # fmt: skip
            engine = make_engine(ckpt, dev, planner, driver)
            observers = [engine]
            if prefetch and oracle is not None:
                engine.predict = oracle
                observers.append(oracle)
            rt = Runtime(checkpoint=ckpt, device=dev, executor=engine, decode=decode,
                         observers=observers, graphs=graphs, kernels=kernels)  # fmt: skip
            label = f"{name} @ {frac:g}" + ("" if graphs else " eager") + suffix(kernels)
            label += f" ahead {prefetch}" if prefetch else ""
            label += " recorded" if prefetch and oracle is not None else ""
            label += "" if planner.compiled else " python-planner"
            label += "" if batched else " copies-each"
            label += " python-launch" if graphs and engine.cuda and engine.driver is None else ""
            rcfg = replace(cfg, profile=graphs and cfg.profile)
            rows.append(
                bench_replay(rt, rcfg, label, work)
                if work
                else bench_runtime(rt, rcfg, label, trajectory)
            )
            if hasattr(p["compensation"], "slowdown"):  # learned from the measured CPU experts
                rows[-1]["cpu_slowdown"] = p["compensation"].slowdown
                print(f"{label}: CPU-expert slowdown now {p['compensation'].slowdown:.2f}")
            if graphs and kernels == kernel_modes[0] and args.cprofile == f"{name}@{frac:g}":
                host_profile(rt, cfg, Path(args.report_dir) / "host_profile.txt")
            report = write_report(Path(args.report_dir), cfg, rows, str(dev), report)  # so far
            print(f"done: {label}", flush=True)
            del rt, engine, planner
            torch.cuda.empty_cache() if dev.type == "cuda" else None
    console = Console(highlight=False, width=250)
    console.print(table(with_ratios(rows)))
    if args.profile:
        console.print(stage_table(rows))
        console.print(host_table(rows))
    print(f"report: {write_report(Path(args.report_dir), cfg, rows, str(dev), report)}")


def replay_workload(path: str, prompts: str) -> TraceWorkload:
    """The trace at `path` and the selected prompt indices (all, I, A:B)."""
    from oled.decoding.replay import select_prompts
    from oled.trace.format import Trace

    trace = Trace.load(path)
    chosen = select_prompts(prompts, len(trace.prompt_starts))
    return TraceWorkload(trace=trace, prompts=tuple(chosen), name=Path(path).name)


def recorded_routing(rt: Runtime, cfg: BenchConfig, trajectory: Trajectory):
    """The routing of one generation that follows `trajectory`, as a perfect prediction."""
    from oled.offload.predict import RecordedRouting
    from oled.trace.commands import record

    prompt = random_prompt(rt, cfg.prompt_length, cfg.seed)
    return RecordedRouting(record(rt, [prompt], decode=bench_decode(rt, cfg), follow=trajectory))


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


def load(path: Path, dev: torch.device):
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
