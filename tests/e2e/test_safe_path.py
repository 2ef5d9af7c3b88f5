"""Children started from a checkout must import installed packages, not the repo root's folders of
the same name (kernels/ against Hugging Face's `kernels`, a transformers dependency since 5.25)."""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.child_command import PREFIX, subcommand, tandem_argv
from tandem.up_config import UpConfig, build_specs

ROOT = Path(__file__).resolve().parents[2]


def test_every_child_of_tandem_up_runs_in_safe_path_mode() -> None:
    cfg = UpConfig(model="demo", port=18000, prefill=1, decode=1, routers=2)
    specs = build_specs(cfg, itertools.count(19000), python="/py")
    assert [s.argv[:4] for s in specs] == [("/py", "-P", "-m", "tandem.cli")] * 4
    assert [subcommand(s.argv) for s in specs] == ["router", "router", "prefill", "decode"]


def test_subcommand_reads_only_tandem_children() -> None:
    assert subcommand(tandem_argv("up", "--port", "1")) == "up"
    assert subcommand(("/py", "-m", "tandem.cli", "up")) is None  # not how tandem starts one
    assert subcommand(("/py", *PREFIX)) is None
    assert subcommand(("/py", "worker_proc.py", "decode")) is None


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="no `kernels` installed")
def test_a_child_in_the_repo_root_finds_the_installed_kernels_package() -> None:
    def origin(*flags: str) -> Path:
        code = "import kernels; print(kernels.__file__)"
        run = subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=True)  # fmt: skip
        return Path(run.stdout.strip()).resolve()

    ours = ROOT / "kernels" / "__init__.py"
    assert origin() == ours  # the hazard: the root shadows the installed package
    installed = origin("-P")
    assert installed != ours and "site-packages" in installed.parts
