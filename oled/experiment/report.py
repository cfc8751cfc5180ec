"""Summaries of generation stats, the JSON report and its plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oled.decoding.decoder import median_p90
from oled.decoding.follow import agreement_summary

Stats = dict[str, Any]  # one generation's stats dict (keys agreed with the runtime)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def median_and_p90(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Median and p90 (oled.decoding.decoder.median_p90); None for no values."""
    return median_p90(values) if values else (None, None)


def _total(generations: Sequence[Stats], key: str) -> float:
    return float(sum(g.get(key, 0) or 0 for g in generations))


def _reported(generations: Sequence[Stats], key: str, value: Any) -> Any:
    """`value` if any generation reported `key` (a resident runtime reports no copies)."""
    return value if any(key in g for g in generations) else None


def per_layer(generations: Sequence[Stats]) -> list[dict[str, Any]]:
    """Hits, misses and hit rate of every layer, summed over generations."""
    layers: list[dict[str, Any]] = []
    for gen in generations:
        for i, layer in enumerate(gen.get("per_layer") or []):
            if i == len(layers):
                layers.append({"layer": i, "hits": 0, "misses": 0})
            layers[i]["hits"] += layer.get("hits", 0)
            layers[i]["misses"] += layer.get("misses", 0)
    for layer in layers:
        layer["hit_rate"] = _ratio(layer["hits"], layer["hits"] + layer["misses"])
    return layers


def _decode(generations: Sequence[Stats], key: str) -> float:
    """`key` summed over the decode iterations (all forwards of a generation that has no
    prompt/decode split, such as a resident one)."""
    return float(sum((g["decode"] if "decode" in g else g).get(key, 0) or 0 for g in generations))


def summarize(generations: Sequence[Stats]) -> dict[str, Any]:
    """The figures of a run: latency per token, per decode iteration (median, p90; a
    generation's first forward runs the prompt and counts apart as `prompt_ms`), hits, copies,
    CPU."""
    iteration_ms = [ms for g in generations for ms in g.get("iteration_ms", [])[1:]]
    prompt_ms = [g["iteration_ms"][0] for g in generations if g.get("iteration_ms")]
    decode_iterations = sum(max(0, len(g.get("iteration_ms", [])) - 1) for g in generations)
    tokens, iterations = _total(generations, "tokens"), _total(generations, "iterations")
    seconds = _total(generations, "seconds")
    hits, misses = _total(generations, "hits"), _total(generations, "misses")
    cpu, gpu = _total(generations, "cpu_experts"), _total(generations, "gpu_experts")
    copy_gb = _total(generations, "copy_bytes") / 1e9
    median, p90 = median_and_p90(iteration_ms)
    return {
        "generations": len(generations),
        "tokens": int(tokens),
        "iterations": int(iterations),
        "seconds": seconds,
        "ms_per_token": _ratio(1000 * seconds, tokens),
        "ms_per_forward": _ratio(1000 * seconds, iterations),  # every forward, the prompt's too
        "tokens_per_second": _ratio(tokens, seconds),
        "ms_per_iteration": median,
        "ms_per_iteration_p90": p90,
        "prompt_ms": median_and_p90(prompt_ms)[0],
        "tokens_per_forward": _ratio(tokens, iterations),
        "hit_rate": _ratio(hits, hits + misses),
        "copies": _reported(generations, "copies", int(_total(generations, "copies"))),
        "copy_gb": _reported(generations, "copy_bytes", copy_gb),
        "copy_gb_per_iteration": _reported(
            generations,
            "copy_bytes",
            _ratio(_decode(generations, "copy_bytes") / 1e9, decode_iterations),
        ),
        "cpu_share": _ratio(cpu, cpu + gpu),
        "stall_ms": _reported(generations, "stall_ms", _total(generations, "stall_ms")),
        "stall_ms_per_iteration": _ratio(_decode(generations, "stall_ms"), decode_iterations),
        # following a reference: how often the run's own choice was the committed token
        "agreement": _ratio(_total(generations, "agreed"), _total(generations, "followed")),
        "prompt_cpu_share": _prompt_cpu_share(generations),
    } | agreement_summary([g["agreement"] for g in generations if g.get("agreement")])


def _prompt_cpu_share(generations: Sequence[Stats]) -> float | None:
    """The CPU's share of the expert work in the generations' first forwards (the prompt's)."""
    parts = [g["prompt"] for g in generations if isinstance(g.get("prompt"), dict)]
    cpu = sum(p.get("cpu_experts", 0) for p in parts)
    return _ratio(cpu, cpu + sum(p.get("gpu_experts", 0) for p in parts)) if parts else None


SUMMARY_ROWS = [  # (key, label, format): what a user waits for first
    ("tokens_per_second", "tokens / s (end to end)", "{:.1f}"),
    ("ms_per_forward", "ms / forward (mean, prompt's too)", "{:.2f}"),
    ("ms_per_token", "ms / token", "{:.2f}"),
    ("ms_per_iteration", "ms / decode iteration (median)", "{:.2f}"),
    ("ms_per_iteration_p90", "ms / decode iteration (p90)", "{:.2f}"),
    ("prompt_ms", "ms / prompt forward (median)", "{:.1f}"),
    ("tokens_per_forward", "tokens / forward", "{:.2f}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("copies", "copies", "{:d}"),
    ("copy_gb", "copy GB", "{:.3f}"),
    ("cpu_share", "CPU share of expert work", "{:.1%}"),
    ("stall_ms", "stall ms (total)", "{:.1f}"),
    ("agreement", "own choices = reference tokens", "{:.1%}"),
    ("tokens_equal", "answers = resident's (free-running)", "{:.0%}"),
    ("first_divergence", "first differing answer token", "{:d}"),
    ("max_logit_diff", "largest logit difference", "{:.3g}"),
    ("prompt_cpu_share", "CPU share in the prompt forward", "{:.1%}"),
]


def format_value(value: Any, fmt: str) -> str:
    """A summary value for display ('-' when absent)."""
    return "-" if value is None else fmt.format(value)


def write_report(report: dict[str, Any], directory: Path) -> list[Path]:
    """`report.json` plus plots into `directory`; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return [path, *write_plots(report, directory)]


def write_plots(report: dict[str, Any], directory: Path) -> list[Path]:
    """Hit rate per layer, latency breakdown and (if recorded) expert residency, as PNGs."""
    plt = pyplot()
    written = []
    for name, draw in (("hit_rate_per_layer", _hit_rate), ("latency", _latency)):
        fig = draw(plt, report)
        if fig is not None:
            written.append(save_figure(plt, fig, directory / f"{name}.png"))
    residency = [g["residency"] for g in report["generations"] if g.get("residency")]
    if residency:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        image = ax.imshow(list(zip(*residency[0], strict=False)), aspect="auto", origin="lower")
        ax.set(xlabel="iteration", ylabel="layer", title="resident experts per layer")
        fig.colorbar(image, ax=ax)
        written.append(save_figure(plt, fig, directory / "residency.png"))
    return written


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Write `fig` to `path` as a PNG and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _hit_rate(plt: Any, report: dict[str, Any]) -> Any:
    layers = [layer for layer in report["per_layer"] if layer["hit_rate"] is not None]
    if not layers:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([layer["layer"] for layer in layers], [layer["hit_rate"] for layer in layers])
    ax.set(xlabel="layer", ylabel="hit rate", ylim=(0, 1), title="expert cache hit rate")
    return fig


def _latency(plt: Any, report: dict[str, Any]) -> Any:
    series = [ms for g in report["generations"] for ms in g.get("iteration_ms", [])]
    if not series:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(series, linewidth=0.8)
    left.set(xlabel="iteration", ylabel="ms", title="latency per iteration")
    summary = report["summary"]
    total_ms = 1000 * summary["seconds"]
    stall = min(summary["stall_ms"] or 0.0, total_ms)
    right.bar(["compute and other", "stalled on copies"], [total_ms - stall, stall])
    right.set(ylabel="ms (all timed generations)", title="latency breakdown")
    return fig
