"""Local processes for the live operator tests: one command, its own environment and session.

tests/procs.py's `Proc` inherits the test's environment; the live tests need processes with a
chosen environment (a kubeconfig for the operator, a rendered pod's env for the pod harness) and
binaries other than `tandem` (prometheus). The test that creates one owns it and must `stop()`
it (fixtures do, in `finally`); stop signals the whole process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
from procs import wait_for

from tandem import child_command


def tandem_argv(args: Sequence[str]) -> list[str]:
    """The `tandem` console script, as the local install runs it."""
    return list(child_command.tandem_argv(*args))


class LocalProcess:
    """A subprocess in a new session, stdout and stderr to `<log_dir>/<name>.log`."""

    def __init__(
        self,
        argv: Sequence[str],
        log_dir: Path,
        name: str,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ if env is None else env),
                # Never the repo root: operator/ would shadow the stdlib module.
                cwd=str(log_dir),
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM the process group, SIGKILL it if it does not exit in `timeout` seconds."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                self.proc.wait(5)
        return self.proc.returncode

    def wait_http_ok(self, url: str, timeout: float) -> None:
        """Wait until GET `url` answers 200; fail at once, with the log, if the process dies."""

        def ok() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.log_tail()}")
            try:
                return httpx.get(url, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ok, timeout, f"{self.name}: {url}", interval=0.2)
