"""How many CPU threads an engine may use, and splitting a machine's CPUs between processes.

Why this matters: the CPU path's parallel regions (torch's and the C kernels' OpenMP) end in a
barrier, so a step is as slow as its most delayed thread. When a worker runs more threads than it
has cores to itself (torch's default is every core the process may run on, whatever its cgroup
quota; `tandem up` puts the router and the client on the same cores), the OS preempts one of
them for a time slice and the whole step waits: on a 2-core machine a colocated demo worker at
24 req/s streamed tokens 3.5 ms apart with 2 threads and 0.8 ms apart with 1 (issue 14's
validation, docs/planning.md). So a worker sizes itself to its CPU quota, and `tandem up`
divides the machine's CPUs between its workers, leaving one for the router.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cgroup_cpu_limit(cpu_max: str) -> float | None:
    """The CPUs a cgroup v2 ``cpu.max`` line allows (``"200000 100000"`` -> 2.0); None for no
    limit (``"max 100000"``) or a line that is not one."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _quota() -> float | None:
    text = _read(CGROUP_V2_CPU_MAX)
    if text is not None:
        return cgroup_cpu_limit(text)
    quota, period = _read(CGROUP_V1_QUOTA), _read(CGROUP_V1_PERIOD)
    if quota is None or period is None:
        return None
    return cgroup_cpu_limit(f"{quota.strip()} {period.strip()}")


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota
    (a Kubernetes CPU limit of 1500m gives 1; rounded down, at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    quota = _quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def omp_num_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it is a positive integer (the user chose), else None."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def default_threads() -> int:
    """A worker's engine threads when no flag says: ``omp_num_threads()``, else
    ``available_cpus()``."""
    return omp_num_threads() or available_cpus()


def split_threads(cpus: int, workers: int, reserved: int = 1) -> int:
    """Threads for each of ``workers`` engines sharing ``cpus`` with ``reserved`` CPUs left for
    the rest (the router, the client): never more threads in all than CPUs where that is
    possible, at least 1 each. Pure; ``tandem up`` and the planner's validation call it."""
    if cpus < 1 or workers < 1 or reserved < 0:
        raise ValueError("cpus and workers must be >= 1 and reserved >= 0")
    return max(1, (cpus - reserved) // workers)


def set_engine_threads(threads: int) -> None:
    """Make torch (and so the C kernels, which read ``torch.get_num_threads()``) use
    ``threads``; called once by a worker or the profiler before the model loads."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
