"""Disaggregated prefill/decode against the best colocated deployment, under SLOs.

Every deployment gets the same two worker cores (``--cpus``; ``taskset`` pins each process and
``OMP_NUM_THREADS`` matches its cores): one colocated worker on both cores with its token budget
swept (``--budgets``), two colocated workers one per core (``colo2``), and 1 prefill + 1 decode
worker over ``tcp`` and ``ucx`` with ``--local-prefill-threshold`` in ``--thresholds``. The router,
guidellm and the ITL canary share ``--aux-cpus`` (a third core when the machine has one; on two
cores the first worker core, which the report states).

guidellm drives the load: prefill-heavy (1-2 k prompts, 64-256 outputs) and chat (~256/~256) at
Poisson rates, and a bursty trace (short background requests plus bursts of long prompts) at
several loads. A calibration run per deployment (one request at a time) gives the unloaded
latencies; each request's SLO is a multiple of the best deployment's unloaded TTFT for its prompt
length and of the best unloaded ITL (``--slo``). Goodput: the highest rate at which >= 90 % of the
requests meet both. Worker metrics (queue depth, KV usage, KV transfer bytes and seconds) are
sampled every second. Writes ``--json`` (every request, every sample) and the PNGs under
``--plots-dir``; prints the tables.

    python benchmarks/pd_vs_colocated.py --duration 20 --repeats 2   # the full comparison
    python benchmarks/pd_vs_colocated.py --estimate                  # its wall time, nothing run
    python benchmarks/pd_vs_colocated.py --deployments pd-tcp-t0 --workloads chat \\
        --rates chat=1 --duration 10 --repeats 1                      # a smoke run

The code is the ``pd_bench`` package beside this file (``benchlib`` holds what it shares with the
other serving benchmarks).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pd_bench.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(__doc__))
