"""The benchmark's JSON report and the machine it names."""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from oled.bench.runs import BenchConfig


def machine() -> dict[str, str]:
    """Python, torch, GPU and platform of this machine."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpu": gpu,
        "platform": platform.platform(),
    }


def write_report(
    report_dir: Path, cfg: BenchConfig, rows: list[dict], device: str, path: Path | None = None
) -> Path:
    """The rows as bench-<time>.json in `report_dir`, or over `path` (the same report written
    again after each row, so that the rows done survive a later failure)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    path = path or report_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    body = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": sys.argv,
        "machine": machine(),
        "device": device,
        "config": asdict(cfg),
        "rows": rows,
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path
