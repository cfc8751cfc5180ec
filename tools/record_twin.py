"""Record the routing twin's traces (docs/routing-twin.md) with one load of the checkpoint.

    python tools/record_twin.py CHECKPOINT [--out recipes/twin] [--pace 2.5]

Writes, from `recipes/twin/record.toml` (the twin resident, bf16, blocks of 32, up to 128 new
tokens) on the two prompt splits:
- twin-tune.oledtrace and twin-heldout.oledtrace at the recipe's threshold (0.95);
- twin-tune-fast.oledtrace and twin-heldout-fast.oledtrace at the threshold whose tokens per
  forward on the tuning split come nearest `--pace` (LLaDA2.0-mini's 2.55 at 0.95), chosen
  among THRESHOLDS on the tuning prompts alone (or `--fast-threshold`, chosen so before).
Prints a line per trace (forwards, tokens per forward, MiB) and writes pace.json beside them.
The traces are written xz-compressed (Trace.save), to keep the committed ones small.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from oled.decoding import DecodeConfig
from oled.experiment.run import load_workload
from oled.recipe import load_recipe
from oled.runtime import Runtime, build
from oled.trace.format import Trace
from oled.trace.record import record
from oled.trace.stats import trace_stats

HERE = Path(__file__).resolve().parent.parent / "recipes" / "twin"
THRESHOLDS = (0.35, 0.3, 0.25, 0.2, 0.15)  # the twin paces 2.5 near 0.25 (pace.json)


def tokens_per_forward(trace: Trace) -> float:
    """Commits per decode forward, as `oled trace stats` reports them."""
    return float(trace_stats(trace)["tokens_per_forward"]["decode"] or 0.0)


def prompts(runtime: Runtime, checkpoint: Path, split: str) -> list[list[int]]:
    r = load_recipe(
        HERE / "record.toml",
        [f"model.path={checkpoint}", f"workload.prompts={HERE / f'prompts-{split}.jsonl'}"],
    )
    return [runtime.prompt_ids(p.as_messages(), chat=True) for p in load_workload(r).prompts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--pace", type=float, default=2.5, help="tokens per forward of the fast pace")
    ap.add_argument(
        "--fast-threshold",
        type=float,
        default=None,
        help="the fast pace's threshold as chosen before (pace.json): no search",
    )
    args = ap.parse_args()
    checkpoint = args.checkpoint.resolve()
    recipe = load_recipe(HERE / "record.toml", [f"model.path={checkpoint}"])
    runtime = build(recipe.with_values({"runtime.budget": {"resident": True}}))
    base: DecodeConfig = runtime.decode
    ids = {split: prompts(runtime, checkpoint, split) for split in ("tune", "heldout")}
    args.out.mkdir(parents=True, exist_ok=True)

    def save(trace: Trace, name: str, threshold: float) -> float:
        path = args.out / f"twin-{name}.oledtrace"
        trace.save(path, compress=True)
        tpf = tokens_per_forward(trace)
        print(
            f"{path.name}: threshold {threshold}, {trace.num_steps} forwards, "
            f"{tpf:.2f} tokens per forward, {path.stat().st_size / 2**20:.2f} MiB",
            flush=True,
        )
        return tpf

    pace = {"base_threshold": base.threshold}
    for split in ("tune", "heldout"):
        pace[f"{split}_tokens_per_forward"] = save(
            record(runtime, ids[split]), split, base.threshold
        )
    tried = {}
    for threshold in THRESHOLDS if args.fast_threshold is None else (args.fast_threshold,):
        trace = record(runtime, ids["tune"], decode=replace(base, threshold=threshold))
        tried[threshold] = (tokens_per_forward(trace), trace)
        print(f"  tuning split at {threshold}: {tried[threshold][0]:.2f} tokens per forward")
    fast = min(tried, key=lambda t: abs(tried[t][0] - args.pace))
    pace |= {"fast_threshold": fast, "tried": {str(t): v[0] for t, v in tried.items()}}
    pace["tune-fast_tokens_per_forward"] = save(tried[fast][1], "tune-fast", fast)
    heldout = record(runtime, ids["heldout"], decode=replace(base, threshold=fast))
    pace["heldout-fast_tokens_per_forward"] = save(heldout, "heldout-fast", fast)
    (args.out / "pace.json").write_text(json.dumps(pace, indent=1) + "\n")


if __name__ == "__main__":
    main()
