"""``tandem.engine.cpu_threads``: the CPU quota a worker sizes itself to, and the split of a
machine's CPUs between `tandem up`'s workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.engine import cpu_threads
from tandem.engine.cpu_threads import (
    available_cpus,
    cgroup_cpu_limit,
    default_threads,
    split_threads,
)


@pytest.mark.parametrize(
    ("line", "cpus"),
    [("200000 100000\n", 2.0), ("150000 100000", 1.5), ("50000 100000", 0.5),
     ("max 100000\n", None), ("", None), ("max", None), ("x 100000", None), ("0 100000", None),
     ("100000 0", None), ("1 2 3", None)],
)  # fmt: skip
def test_cgroup_cpu_limit(line: str, cpus: float | None) -> None:
    assert cgroup_cpu_limit(line) == cpus


def _cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, v2: str | None) -> None:
    path = tmp_path / "cpu.max"
    if v2 is not None:
        path.write_text(v2)
    monkeypatch.setattr(cpu_threads, "CGROUP_V2_CPU_MAX", path)
    monkeypatch.setattr(cpu_threads, "CGROUP_V1_QUOTA", tmp_path / "no-v1-quota")


def test_available_cpus_is_the_affinity_capped_by_the_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    _cgroup(monkeypatch, tmp_path, "max 100000")
    assert available_cpus() == 4
    _cgroup(monkeypatch, tmp_path, "250000 100000")  # a 2500m limit: 2 whole CPUs
    assert available_cpus() == 2
    _cgroup(monkeypatch, tmp_path, "50000 100000")  # under one CPU still runs one thread
    assert available_cpus() == 1
    _cgroup(monkeypatch, tmp_path, "800000 100000")  # a quota above the affinity
    assert available_cpus() == 4
    _cgroup(monkeypatch, tmp_path, None)  # no cgroup file at all
    assert available_cpus() == 4


def test_cgroup_v1_quota(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    monkeypatch.setattr(cpu_threads, "CGROUP_V2_CPU_MAX", tmp_path / "absent")
    (tmp_path / "quota").write_text("300000\n")
    (tmp_path / "period").write_text("100000\n")
    monkeypatch.setattr(cpu_threads, "CGROUP_V1_QUOTA", tmp_path / "quota")
    monkeypatch.setattr(cpu_threads, "CGROUP_V1_PERIOD", tmp_path / "period")
    assert available_cpus() == 3
    (tmp_path / "quota").write_text("-1\n")  # v1's "no limit"
    assert available_cpus() == 8


def test_default_threads_prefers_a_valid_omp_num_threads(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2})
    _cgroup(monkeypatch, tmp_path, None)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert default_threads() == 5
    for ignored in ("0", "two", "-1", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", ignored)
        assert default_threads() == 3


def test_split_threads() -> None:
    assert split_threads(2, 1) == 1  # tandem up's colocated demo on this 2-core machine
    assert split_threads(2, 2) == 1  # 1P1D: never less than one each
    assert split_threads(16, 2) == 7
    assert split_threads(16, 3) == 5
    assert split_threads(8, 1, reserved=0) == 8
    assert split_threads(1, 4) == 1
    for bad in ((0, 1), (2, 0), (2, 1, -1)):
        with pytest.raises(ValueError):
            split_threads(*bad)
