"""Misses against Belady's on the routing twin's traces, every policy and budget (simulator).

    python tools/twin_misses.py TRACE... [--curves recipes/twin/curves-lfu.json] [--json OUT]
    python tools/twin_misses.py TRACE... --ahead [--json OUT]

Misses per forward (all MoE layers) and their multiple of Belady's with bypass at the equal
split; OLED rows use the curves file's split (fitted on the tuning split only). "Belady in the
planner" is the planner evicting the cached expert used furthest ahead: the bound for any
retention policy under the planner's rules (every miss cached, the forward's own experts kept)
where a layer holds every expert a forward needs (not at 25% on the twin). With --ahead:
each row without copies ahead, with copies ahead from the forward before (runtime.ahead_from =
"previous") and, where the trace records the next-layer prediction, from the router's
(runtime.ahead_from = "router", replayed from the trace): misses per forward, the modelled
iteration, the link's time and the share of it hidden under compute, copies ahead and used.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from oled import registry
from oled.policies.base import CostModel
from oled.policies.planner import AheadFrom
from oled.trace.format import Trace
from oled.trace.simulate import ClairvoyantRetention, belady_bypass, simulate

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
# suffix -> (prefetch_limit, ahead_from)
AHEAD: dict[str, tuple[int, AheadFrom]] = {
    "": (0, "previous"),
    " + ahead": (64, "previous"),
    " + router ahead": (16, "router"),
}


def ahead(trace: Trace, curves: str) -> dict:
    """Per budget and row, without copies ahead, with those from the forward before and
    (where the trace records it) from the router's prediction: misses, modelled ms, link ms
    per forward, hidden share, copies ahead and used per forward."""
    L, E, S = trace.meta.num_moe_layers, trace.meta.num_experts, trace.num_steps
    variants = {k: v for k, v in AHEAD.items() if v[1] == "previous" or trace.ahead_ids is not None}
    res: dict = {}
    for budget in BUDGETS:
        cell: dict = {}
        for row in AHEAD_ROWS:
            for suffix, (limit, source) in variants.items():
                names = zip(("allocation", "retention", "compensation"), ROWS[row], strict=True)
                pol = {k: build(k, n, curves) for k, n in names}
                sim = simulate(
                    trace,
                    total_slots=round(budget * E) * L,
                    cost=CostModel.profile("h200"),
                    prefetch_limit=limit,
                    ahead_from=source,
                    **pol,
                )
                cell[row.strip() + suffix] = {
                    "misses": sum(sim.stats["misses"]) / S,
                    "ms": sim.ms_per_iteration,
                    "link_ms": sim.copy_ms_per_iteration,
                    "hidden": sim.hidden_copy_share,
                    "ahead": sim.ahead_per_iteration,
                    "used": sim.ahead_used_per_iteration,
                }
        res[budget] = cell
        print(f"{budget:.1%}:")
        for name, v in cell.items():
            print(
                f"  {name:37s} {v['misses']:6.1f} misses/it, {v['ms']:6.2f} ms/it, "
                f"link {v['link_ms']:6.2f} ms/it, "
                f"{v['hidden']:4.0%} hidden, ahead {v['ahead']:5.1f}/it ({v['used']:5.1f} used)",
                flush=True,
            )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--curves", default="recipes/twin/curves-lfu.json")
    ap.add_argument(
        "--ahead", action="store_true", help="copies ahead: from the forward before, the router"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict = {}
    if args.ahead:
        for path in args.traces:
            trace = Trace.load(path)
            print(f"\n{path.name}: copies ahead (modelled, h200)")
            if trace.ahead_ids is None:
                print("(it records no next-layer prediction: no router rows)")
            out[path.name] = ahead(trace, args.curves)
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
            sim = simulate(
                trace,
                total_slots=slots,
                cost=CostModel.profile("h200"),
                allocation=build("allocation", "uniform", args.curves),
                retention=ClairvoyantRetention(trace),
                compensation=build("compensation", "transfer_only", args.curves),
            )
            cell["Belady in the planner"] = (req - int(np.sum(sim.stats["hits"]))) / S
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
