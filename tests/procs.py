"""Start tandem processes for end-to-end tests and wait on conditions (never bare sleeps)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from tandem.child_command import PREFIX

# The cluster token every `tandem` process a test starts shares (through the environment, as
# `tandem up` and the operator hand it over); tests present it on worker-facing routes.
CLUSTER_TOKEN = "test-cluster-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {CLUSTER_TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


T = TypeVar("T")

# What `tandem up` prints once every router lists every worker; a child that dies before it is a
# failed start-up, and `tandem up` then stops every process.
UP_READY = "Tandem is ready"


def up_is_ready(log: Path) -> bool:
    """Whether the `tandem up` writing ``log`` has finished its start-up."""
    return UP_READY in log.read_text(errors="replace")


def poll(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    """`probe()` until it returns something truthy; that value."""
    found: list[T] = []

    def ready() -> bool:
        value = probe()
        if value:
            found.append(value)
        return bool(value)

    wait_for(ready, timeout, what, interval)
    return found[0]


class Proc:
    """A `tandem ...` subprocess with its log in a file; stop() kills its whole process group."""

    def __init__(
        self,
        args: list[str],
        log_dir: Path,
        name: str,
        env: dict[str, str | None] | None = None,
        script: Path | None = None,
    ) -> None:
        """``script``: run this file (a test double wrapping ``tandem.cli``) instead."""
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        merged = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "TANDEM_CLUSTER_TOKEN": CLUSTER_TOKEN,
            **(env or {}),
        }
        # ``env`` may map a name to None to remove it (e.g. to let `tandem up` make a token).
        env = {k: v for k, v in merged.items() if v is not None}
        self.proc = subprocess.Popen(
            [sys.executable, *([str(script)] if script else list(PREFIX)), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(log_dir),  # never the repo root: operator/ would shadow the stdlib
            start_new_session=True,
        )

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.alive():
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def wait_healthy(url: str, proc: Proc, timeout: float = 90.0) -> None:
    def ok() -> bool:
        if not proc.alive():
            raise RuntimeError(f"process exited:\n{proc.log_tail()}")
        try:
            return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ok, timeout, f"{url}/health")
