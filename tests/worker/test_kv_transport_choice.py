"""Without ucxx (hidden here by a stand-in that fails to import, as on a platform with no
wheel): `tandem up` moves KV over TCP and says so, and an explicit `--kv-transport ucx` fails
with one clear line naming the fix, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.child_command import tandem_argv


@pytest.fixture
def no_ucxx(tmp_path: Path) -> dict[str, str]:
    shadow = tmp_path / "hide" / "ucxx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'ucxx'\")\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "hide"),
            "TANDEM_CLUSTER_TOKEN": "kv-transport-choice-token-01"}  # fmt: skip


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(tandem_argv(*args), env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "args", [["decode", "--kv-transport", "ucx"], ["prefill"], ["up", "--kv-transport", "ucx"]]
)
def test_explicit_ucx_without_ucxx_is_one_clear_line(
    args: list[str], no_ucxx: dict[str, str], tmp_path: Path
) -> None:
    r = run(args, no_ucxx, tmp_path)  # a worker's default transport is ucx
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert "ucxx" in lines[0] and "--kv-transport tcp" in lines[0] and "pip install" in lines[0]


def test_up_picks_tcp_without_ucxx_and_ucx_with_it(no_ucxx: dict[str, str], tmp_path: Path) -> None:
    code = ("import json; from tandem.up import parse_config; c = parse_config([]); "
            "print(json.dumps([c.kv_transport, list(c.notes)]))")  # fmt: skip
    hidden = subprocess.run([sys.executable, "-c", code], env=no_ucxx, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    transport, notes = json.loads(hidden.stdout)
    assert transport == "tcp" and len(notes) == 1 and "--kv-transport tcp" in notes[0]
    present = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, check=True)  # fmt: skip
    assert json.loads(present.stdout) == ["ucx", []]
