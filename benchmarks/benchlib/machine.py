"""What a benchmark report says about the machine it ran on, and percentiles."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


def machine() -> str:
    return f"{os.cpu_count()} CPUs ({cpu_model()}), load average {os.getloadavg()[0]:.1f} at start"


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile of a non-empty list (0 <= p <= 100)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]
