"""The benchmark packages (``benchlib``, ``pd_bench``) live in ``benchmarks/``, which the scripts
put on ``sys.path`` themselves; the tests do the same (the repo root itself never goes there)."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
