"""Where OLED-MoE keeps what it builds and downloads on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """Where built-in models and built code are kept: $OLED_HOME, else ~/.cache/oled."""
    return Path(os.environ.get("OLED_HOME") or Path.home() / ".cache" / "oled")
