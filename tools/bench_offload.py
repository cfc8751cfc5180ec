"""GPU evidence for the offload engine: resident vs every baseline and OLED at several budgets.

Builds (or reuses) the full-size `mini-shape` random checkpoint on the machine, loads it once
(experts pinned), then decodes the same fixed prompt under every configuration in one process and
prints one table. Usage (one H200, well under 10 minutes):

    python tools/bench_offload.py --model /tmp/oled-mini-shape --out report.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oled.decoding import DecodeConfig  # noqa: E402
from oled.model.checkpoint import load_checkpoint  # noqa: E402
from oled.model.experts import ResidentExperts  # noqa: E402
from oled.model.presets import init_checkpoint  # noqa: E402
from oled.offload.budget import Budget, total_slots  # noqa: E402
from oled.offload.engine import OffloadEngine  # noqa: E402
from oled.policies import allocation as A  # noqa: E402
from oled.policies import compensation as C  # noqa: E402
from oled.policies import retention as R  # noqa: E402
from oled.runtime import Runtime, make_planner  # noqa: E402

CONFIGS = {
    "lru (mixtral-offloading)": lambda: (A.UniformAllocation(), R.LRURetention(), C.TransferOnly()),
    "lfu (MoE-Infinity)": lambda: (A.UniformAllocation(), R.LFURetention(), C.TransferOnly()),
    "hybrimoe": lambda: (A.UniformAllocation(), R.ScoreEMARetention(), C.MakespanCompensation()),
    "tide (interval_refresh)": lambda: (
        A.UniformAllocation(),
        R.LRURetention(),
        C.IntervalRefresh(),
    ),
    "fiddler (static_hot)": lambda: (A.UniformAllocation(), R.LFURetention(), C.StaticHot()),
    "llama.cpp (batch_threshold)": lambda: (
        A.UniformAllocation(),
        R.LRURetention(),
        C.BatchThreshold(),
    ),
    "oled": lambda: (A.AdaptiveAllocation(), R.ConfidenceRetention(), C.CooperativeCompensation()),
    # OLED with one mechanism replaced by the baseline's, to see what each contributes
    "oled/uniform-alloc": lambda: (
        A.UniformAllocation(),
        R.ConfidenceRetention(),
        C.CooperativeCompensation(),
    ),
    "oled/transfer-only": lambda: (
        A.AdaptiveAllocation(),
        R.ConfidenceRetention(),
        C.TransferOnly(),
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/oled-mini-shape")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--budgets", default="0.5,0.25,0.125")
    ap.add_argument("--configs", default="all")
    ap.add_argument("--out", default="bench_offload.json")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--cost", default="h200", help="cost profile for the policies")
    ap.add_argument("--trace", default=None, help="record the resident run's routing here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    path = Path(args.model)
    t0 = time.perf_counter()
    if not (path / "config.json").exists():
        init_checkpoint(path, preset="mini-shape", seed=0, device=args.device)
        print(f"built mini-shape checkpoint in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(path, device=dev, dtype=torch.bfloat16, pin_experts=dev.type == "cuda")
    print(f"loaded (experts pinned: {ckpt.experts.pinned}) in {time.perf_counter() - t0:.0f} s")
    prompt = torch.randint(
        0, ckpt.tokenizer.eos_id, (args.prompt_length,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    decode = DecodeConfig(max_new_tokens=args.gen_length, threshold=0.95)
    rows = []
    resident = ResidentExperts(ckpt.experts, dev)
    res_rt = Runtime(checkpoint=ckpt, device=dev, executor=resident, decode=decode)
    ref = run(res_rt, prompt, args)
    rows.append(("resident", 1.0, ref))
    if args.trace:
        record(res_rt, prompt, Path(args.trace))
    del resident
    torch.cuda.empty_cache()
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    for frac in [float(f) for f in args.budgets.split(",")]:
        slots = total_slots(
            Budget("expert_fraction", frac), ckpt.config, dtype=torch.bfloat16, device=dev
        )
        for name in names:
            alloc, ret, comp = CONFIGS[name]()
            planner = make_planner(ckpt, dev, slots, 8, alloc, ret, comp, args.cost)
            engine = OffloadEngine(store=ckpt.experts, device=dev, planner=planner)
            rt = Runtime(
                checkpoint=ckpt, device=dev, executor=engine, decode=decode, observers=[engine]
            )
            result = run(rt, prompt, args)
            result["same_tokens"] = result.pop("tokens_out") == ref["tokens_out"]
            rows.append((name, frac, result))
            engine.close()
            del rt, engine, planner
            torch.cuda.empty_cache()
            print_row(name, frac, result, ref, flush=True)
    ref.pop("tokens_out", None)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "rows": [{"config": n, "budget": f, **r} for n, f, r in rows],
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print_table(rows, ref)


def record(rt: Runtime, prompt: list[int], out: Path) -> None:
    """The routing of one generation of the benchmark prompt, as a trace file."""
    from oled.trace.commands import record_trace

    record_trace(rt, [prompt], out)
    print(f"recorded {out}", flush=True)


def run(rt: Runtime, prompt: list[int], args) -> dict:
    """One warm-up generation, then `runs` timed ones; per-iteration times from CUDA sync."""
    list(rt.stream(prompt, decode=DecodeConfig(max_new_tokens=32)))
    iteration_ms, tokens, seconds, stats = [], [], 0.0, {}
    for _ in range(args.runs):
        out = []
        for block in rt.stream(prompt):
            out += block.new_tokens
        stats = rt.stats()
        iteration_ms += stats["iteration_ms"]
        seconds += stats["seconds"]
        tokens.append(out)
    ms = sorted(iteration_ms)
    return {
        "ms_median": statistics.median(ms),
        "ms_p90": ms[int(0.9 * (len(ms) - 1))],
        "tokens_per_s": sum(len(t) for t in tokens) / seconds,
        "iterations": len(ms),
        "hit_rate": stats.get("hit_rate", 1.0),
        "copy_gb_per_iter": stats.get("copy_bytes", 0.0) / 1e9 / max(1, stats["iterations"]),
        "copies_per_iter": stats.get("copies", 0.0) / max(1, stats["iterations"]),
        "cpu_share": stats.get("cpu_share", 0.0),
        "stall_ms_per_iter": stats.get("stall_ms", 0.0) / max(1, stats["iterations"]),
        "copy_ms_per_iter": stats.get("copy_ms", 0.0) / max(1, stats["iterations"]),
        "host_us_per_layer": stats.get("host_us_per_layer", 0.0),
        "tokens_out": tokens[0],
    }


HEADER = (
    f"{'config':<28} {'budget':>6} {'ms/it':>7} {'p90':>7} {'tok/s':>7} {'x res':>6} "
    f"{'hit':>5} {'cp/it':>6} {'GB/it':>6} {'cpu%':>5} {'stall':>6} {'copy':>6} {'host us':>7} same"
)


def print_row(name, frac, r, ref, flush=False) -> None:
    same = "yes" if r.get("same_tokens", True) else "no"
    print(
        f"{name:<28} {frac:>6.3f} {r['ms_median']:>7.2f} {r['ms_p90']:>7.2f} "
        f"{r['tokens_per_s']:>7.1f} {r['ms_median'] / ref['ms_median']:>6.2f} "
        f"{r['hit_rate']:>5.2f} {r['copies_per_iter']:>6.1f} {r['copy_gb_per_iter']:>6.3f} "
        f"{100 * r['cpu_share']:>5.1f} {r['stall_ms_per_iter']:>6.2f} {r['copy_ms_per_iter']:>6.2f} "
        f"{r['host_us_per_layer']:>7.0f} {same}",
        flush=flush,
    )


def print_table(rows, ref) -> None:
    print("\n" + HEADER)
    for name, frac, r in rows:
        print_row(name, frac, r, ref)


if __name__ == "__main__":
    main()
