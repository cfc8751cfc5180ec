"""Rich tables of benchmark rows: the figures, device time by stage, host time by call."""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING, Any

from oled.bench.report import machine
from oled.model.stages import STAGES

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table

OFFLOAD_COLUMNS = [
    "hit rate",
    "copies/it",
    "copy MB/it",
    "CPU share",
    "prompt CPU",
    "CPU ms/expert",
    "CPU / model",
    "stall ms/it",
    "copy ms/it",
    "copy GB/s",
    "prompt / copies",
    "host µs/layer",
    "plan/launch/pass µs",
    "sync µs/layer",
]


def table(rows: list[dict[str, Any]]) -> Table:
    """A rich table: latency first, then throughput, ratios and offload columns when present."""
    from rich.table import Table

    ratios = len(rows) > 1
    offload = any("offload" in r for r in rows)
    ahead = any(r.get("offload", {}).get("predicted_per_iteration") for r in rows)
    out = Table(show_edge=False, header_style="bold", caption=_caption(rows))
    for col in _columns(ratios, offload, ahead):
        out.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        out.add_row(*_cells(r, rows[0], ratios, offload, ahead))
    return out


def _caption(rows: list[dict[str, Any]]) -> str:
    """The machine, torch, the date and the kernels the rows used."""
    m = machine()
    caption = f"{m['gpu'] if m['gpu'] != 'none' else platform.processor() or 'cpu'}, torch {m['torch']}, {time.strftime('%Y-%m-%d')}"
    used = sorted({row["kernels"] for row in rows if "kernels" in row})
    caption += f", kernels: {' / '.join(used)}" if used else ""
    costs = sorted({_costs(row) for row in rows} - {""})
    return caption + (f", costs: {' / '.join(costs)}" if costs else "")


def _costs(row: dict[str, Any]) -> str:
    """The calibration a row's decisions used: when it was measured and how it stands
    (stored clean, not stored: measured under load, re-checked with a disagreement)."""
    costs = (row.get("decisions") or {}).get("costs") or {}
    if costs.get("source") != "calibrated":
        return str(costs.get("source", ""))
    return f"calibrated {costs.get('measured')} ({costs.get('state') or 'stored'})"


def _columns(ratios: bool, offload: bool, ahead: bool) -> list[str]:
    """End to end first (tokens/s, the mean over all forwards), then the iterations."""
    cols = [
        "config",
        "tokens/s",
        "ms/fwd mean",
        "ms/iter p50",
        "ms/iter p90",
        "prompt ms",
        "tokens/fwd",
        "= resident",
        "max Δlogit",
    ]
    cols += ["ms vs 1st"] * ratios
    cols += OFFLOAD_COLUMNS * offload
    return cols + ["ahead/it (used)"] * ahead


def _cells(
    r: dict[str, Any], first: dict[str, Any], ratios: bool, offload: bool, ahead: bool
) -> list[str]:
    """One row's cells, in the order of `_columns`."""
    cells = [
        r["label"],
        with_spread(r["tokens_per_second"], r.get("tokens_per_second_passes")),
        f"{r['ms_per_forward_mean']:.2f}",
        f"{r['ms_per_iteration_median']:.2f}",
        f"{r['ms_per_iteration_p90']:.2f}",
        fmt(r.get("prompt_ms"), "{:.1f}"),
        f"{r['tokens_per_forward']:.2f}",
        *_agreement_cells(r.get("agreement")),
    ]
    cells += [f"{r['ms_ratio_to_first']:.2f}x"] * ratios
    o = r.get("offload", {})
    if offload:
        cells += _offload_cells(o, r.get("prompt_ms"))
    if ahead:
        used = o.get("predicted_used")
        cells.append(
            fmt(o.get("predicted_per_iteration")) + (f" ({used:.0%})" if used is not None else "")
        )
    return cells


def with_spread(value: float, passes: list[float] | None, pattern: str = "{:.1f}") -> str:
    """A figure with the range of its passes when there are several: "48.6 (47.9-49.1)"."""
    if not passes or len(passes) < 2:
        return pattern.format(value)
    low, high = pattern.format(min(passes)), pattern.format(max(passes))
    return f"{pattern.format(value)} ({low}-{high})"


def _agreement_cells(agreement: dict[str, Any] | None) -> list[str]:
    """Free-running agreement with the resident tokens: "yes", or the share of runs with
    equal tokens and the first answer position that differed; the largest logit difference.
    n/a for rows that replay a trace (its tokens are committed)."""
    if not agreement or agreement.get("tokens_equal") is None:
        return ["n/a", "n/a"]
    equal = agreement["tokens_equal"]
    same = "yes" if equal == 1 else f"{equal:.0%}, from {agreement['first_divergence']}"
    return [same, fmt(agreement.get("max_logit_diff"), "{:.2g}")]


def _offload_cells(o: dict[str, Any], prompt_ms: float | None) -> list[str]:
    """The cells under OFFLOAD_COLUMNS (`prompt_ms` against its copies' time: 1.00x when the
    copy stream is busy all through the prompt forward; a decode CPU expert's host time and the
    engine's CPU-expert time over the calibrated model's, n/a without CPU experts)."""
    copies = o.get("prompt_copy_ms")
    return [
        fmt(o.get("hit_rate"), "{:.1%}"),
        fmt(o.get("copies_per_iteration")),
        fmt(o.get("copy_bytes_per_iteration"), "{:.1f}", 1e-6),
        fmt(o.get("cpu_share"), "{:.1%}"),
        fmt(o.get("prompt_cpu_share"), "{:.1%}"),
        fmt(o.get("cpu_ms_per_expert"), "{:.3f}"),
        fmt(o.get("cpu_time_over_model"), "{:.2f}x"),
        fmt(o.get("stall_ms_per_iteration"), "{:.2f}"),
        fmt(o.get("copy_ms_per_iteration"), "{:.2f}"),
        fmt(o.get("copy_gb_per_s"), "{:.1f}"),
        fmt(prompt_ms / copies if prompt_ms and copies else None, "{:.2f}x"),
        fmt(o.get("host_us_per_layer"), "{:.0f}"),
        _host_split(o),
        fmt(o.get("sync_us_per_layer"), "{:.0f}"),
    ]


def stage_table(rows: list[dict[str, Any]]) -> Group:
    """Device milliseconds per iteration of each forward stage, a column per stage; then the
    kernels outside every stage ('other') that take the most, by name."""
    from rich.console import Group
    from rich.table import Table

    seen = {k for r in rows for k in r.get("stages_ms_per_iteration", {})}
    names = [n for n in (*STAGES, "other") if n in seen]
    title = "device ms per iteration by stage (kernels and copies; CPU experts: host ms)"
    out = Table(show_edge=False, header_style="bold", title=title)
    for col in ["config", *names, "sum"]:
        out.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        stages = r.get("stages_ms_per_iteration", {})
        total = sum(v for k, v in stages.items() if k != "CPU experts") if stages else None
        out.add_row(
            r["label"], *(fmt(stages.get(n), "{:.3f}") for n in names), fmt(total, "{:.3f}")
        )
    unstaged = Table(show_edge=False, header_style="bold", title="device ms per iteration: 'other'")
    for col in ("config", "kernel", "ms"):
        unstaged.add_column(col, justify="right" if col == "ms" else "left")
    for r in rows:
        for name, ms in r.get("unstaged_kernels_ms_per_iteration", {}).items():
            unstaged.add_row(r["label"], name[:KERNEL_NAME], f"{ms:.3f}")
    return Group(out, unstaged) if unstaged.row_count else Group(out)


KERNEL_NAME = 90  # characters of a kernel's name in the tables


def host_table(rows: list[dict[str, Any]], columns: int = 12) -> Table:
    """The host milliseconds per iteration of the stages and API calls that take the most."""
    from rich.table import Table

    peak: dict[str, float] = {}
    for r in rows:
        for name, ms in r.get("host_ms_per_iteration", {}).items():
            peak[name] = max(peak.get(name, 0.0), ms)
    names = sorted(peak, key=lambda name: peak[name], reverse=True)[:columns]
    title = "host ms per iteration by stage (inclusive) and CUDA API call (graphs as run)"
    out = Table(show_edge=False, header_style="bold", title=title)
    for col in ["config", *names]:
        out.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        host = r.get("host_ms_per_iteration", {})
        out.add_row(r["label"], *(fmt(host.get(n), "{:.3f}") for n in names))
    return out


def _host_split(offload: dict) -> str:
    """The planner's, the copy launches' and the passes' parts of the host path, µs per layer."""
    parts = [offload.get(f"{k}_us_per_layer") for k in ("plan", "launch", "pass")]
    return "n/a" if None in parts else "/".join(f"{v:.0f}" for v in parts)


def fmt(value: float | None, pattern: str = "{:.1f}", scale: float = 1.0) -> str:
    return "n/a" if value is None else pattern.format(value * scale)
