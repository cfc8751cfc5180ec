"""Misses against Belady's on the routing twin's traces, every policy and budget (simulator).

    python tools/twin_misses.py TRACE... [--curves recipes/twin/curves-lfu.json] [--json OUT]
    python tools/twin_misses.py TRACE... --ahead [--json OUT]

Misses per forward (all MoE layers) and their multiple of Belady's with bypass at the equal
split; OLED rows use the curves file's split (fitted on the tuning split only). With --ahead:
copies ahead from the forward before (runtime.ahead_from = "previous"), each row with and
without them: the modelled iteration, the link's time and the share of it hidden under compute.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from oled import registry
from oled.policies.base import CostModel
from oled.trace.format import Trace
from oled.trace.simulate import belady_bypass, simulate

BUDGETS = (0.25, 0.375, 0.5, 0.625, 0.75)
# row -> (allocation, retention, compensation); "curves" takes --curves
ROWS = {
    "LRU": ("uniform", "lru", "transfer_only"),
    "LFU": ("uniform", "lfu", "transfer_only"),
    "HybriMoE": ("uniform", "score_ema", "makespan"),
    "TIDE": ("uniform", "lru", "interval_refresh"),
    "OLED (adaptive, confidence)": ("adaptive", "confidence", "cooperative"),
    "OLED (curves, LFU)": ("curves", "lfu", "cooperative"),
    "OLED (stack, LFU)": ("stack", "lfu", "cooperative"),
    "  transfer-only": ("curves", "lfu", "transfer_only"),
    "  uniform allocation": ("uniform", "lfu", "cooperative"),
    "  confidence retention": ("curves", "confidence", "cooperative"),
}


def build(kind: str, name: str, curves: str) -> object:
    params = {"curves": curves} if (kind, name) == ("allocation", "curves") else {}
    return registry.registry(kind).build(name, **params)


AHEAD_ROWS = ("LFU", "OLED (curves, LFU)", "  transfer-only")


def ahead(trace: Trace, curves: str) -> dict:
    """Per budget and row, with and without copies ahead from the forward before: modelled
    ms per forward, link ms per forward, hidden share, copies ahead and used per forward."""
    L, E, S = trace.meta.num_moe_layers, trace.meta.num_experts, trace.num_steps
    res: dict = {}
    for budget in BUDGETS:
        cell: dict = {}
        for row in AHEAD_ROWS:
            for limit in (0, 64):
                names = zip(("allocation", "retention", "compensation"), ROWS[row], strict=True)
                pol = {k: build(k, n, curves) for k, n in names}
                sim = simulate(
                    trace,
                    total_slots=round(budget * E) * L,
                    cost=CostModel.profile("h200"),
                    prefetch_limit=limit,
                    ahead_from="previous",
                    **pol,
                )
                cell[f"{row.strip()}{' + ahead' if limit else ''}"] = {
                    "ms": sim.ms_per_iteration,
                    "link_ms": sim.copy_ms_per_iteration,
                    "hidden": sim.hidden_copy_share,
                    "ahead": sum(sim.stats["predicted"]) / S,
                    "used": sum(sim.stats["predicted_hits"]) / S,
                }
        res[budget] = cell
        print(f"{budget:.1%}:")
        for name, v in cell.items():
            print(
                f"  {name:30s} {v['ms']:6.2f} ms/it, link {v['link_ms']:6.2f} ms/it, "
                f"{v['hidden']:4.0%} hidden, ahead {v['ahead']:5.1f}/it ({v['used']:5.1f} used)",
                flush=True,
            )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--curves", default="recipes/twin/curves-lfu.json")
    ap.add_argument("--ahead", action="store_true", help="copies ahead from the forward before")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict = {}
    if args.ahead:
        for path in args.traces:
            print(f"\n{path.name}: copies ahead from the forward before (modelled, h200)")
            out[path.name] = ahead(Trace.load(path), args.curves)
        if args.json:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
        return
    for path in args.traces:
        trace = Trace.load(path)
        L, E, S = trace.meta.num_moe_layers, trace.meta.num_experts, trace.num_steps
        print(f"\n{path.name}: {S} forwards; misses per forward (x Belady at the equal split)")
        res: dict = {}
        for budget in BUDGETS:
            slots = round(budget * E) * L
            cell: dict = {}
            belady = None
            for row, (a, r, c) in ROWS.items():
                kinds = ("allocation", "retention", "compensation")
                pol = {k: build(k, n, args.curves) for k, n in zip(kinds, (a, r, c), strict=True)}
                sim = simulate(trace, total_slots=slots, cost=CostModel.profile("h200"), **pol)
                req = int(np.sum(sim.stats["requests"]))
                if belady is None:
                    belady = req * (1 - belady_bypass(trace, [slots // L] * L)) / S
                    cell["Belady"] = belady
                cell[row] = (req - int(np.sum(sim.stats["hits"]))) / S
                if a == "curves" and "Belady (curves split)" not in cell:
                    cell["Belady (curves split)"] = (
                        req * (1 - belady_bypass(trace, sim.capacity_history)) / S
                    )
            res[budget] = cell
            print(
                f"{budget:.1%}: "
                + "; ".join(f"{k} {v:.1f} ({v / belady:.2f}x)" for k, v in cell.items()),
                flush=True,
            )
        out[path.name] = res
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
