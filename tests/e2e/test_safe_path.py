"""Children started from a checkout must import installed packages, not the repo root's folders of
the same name (kernels/ against Hugging Face's `kernels`, a transformers dependency since 5.25)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_cli_puts_its_children_in_safe_path_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.SAFE_PATH_ENV, raising=False)
    assert cli.main(["--help"]) == 0
    assert os.environ[cli.SAFE_PATH_ENV] == "1"


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="no `kernels` installed")
def test_a_child_in_the_repo_root_finds_the_installed_kernels_package() -> None:
    code = "import kernels; print(kernels.__file__)"
    env = {k: v for k, v in os.environ.items() if k != cli.SAFE_PATH_ENV}

    def origin(extra: dict[str, str]) -> Path:
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, **extra},
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        return Path(run.stdout.strip()).resolve()

    ours = ROOT / "kernels" / "__init__.py"
    assert origin({}) == ours  # the hazard: the root shadows the installed package
    installed = origin({cli.SAFE_PATH_ENV: "1"})
    assert installed != ours and "site-packages" in installed.parts
