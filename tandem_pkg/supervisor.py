"""The supervisor behind ``tandem up``: starts the children, restarts one that exits after
start-up (bounded backoff, each restart printed), and stops them all (SIGTERM, then SIGKILL).

Used by ``up.run``; owns the children's processes and log files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
HEALTHY_RUN_S = 60.0  # a child that ran this long restarts from the first backoff step again


@dataclass(slots=True, frozen=True)
class ProcessSpec:
    """One child: ``role`` is ``router`` or the worker role it registers as."""

    name: str
    role: str
    argv: tuple[str, ...]
    url: str
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # secrets: never printed
    internal_url: str | None = None  # the router's registry listener (router only)


class StartupFailed(Exception):
    pass


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes] = field(repr=False)
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff_step: int = 0
    restart_at: float | None = None  # set while a restart is pending

    def tail(self, lines: int = 30) -> str:
        self.log_file.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Supervisor:
    """Starts, watches and stops the children. Owns their processes and log files."""

    def __init__(self, log_dir: Path, out: Callable[[str], None] = print) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.out = out
        self._stop_signal: int | None = None

    def request_stop(self, signum: int, _frame: object = None) -> None:
        self._stop_signal = signum

    @property
    def stopping(self) -> bool:
        return self._stop_signal is not None

    def spawn(self, spec: ProcessSpec) -> Child:
        log_path = self.log_dir / f"{spec.name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop_all
        child = Child(spec, self._popen(spec, log_file), log_path, log_file)
        self.children.append(child)
        return child

    @staticmethod
    def _popen(spec: ProcessSpec, log_file: IO[bytes]) -> subprocess.Popen[bytes]:
        env = {**os.environ, **dict(spec.env), "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(
            spec.argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - the supervisor runs no threads
        )

    def watch(self, now: float) -> None:
        """Report children that exited and restart them when their backoff is over."""
        for c in self.children:
            if c.restart_at is None and c.proc.poll() is not None:
                ran = now - c.started_at
                if ran >= HEALTHY_RUN_S:
                    c.backoff_step = 0
                delay = RESTART_BACKOFF_S[min(c.backoff_step, len(RESTART_BACKOFF_S) - 1)]
                c.backoff_step += 1
                c.restart_at = now + delay
                self.out(f"tandem up: {c.spec.name} exited with code {c.proc.returncode} after "
                         f"{ran:.0f} s; restarting in {delay:g} s. Last lines of {c.log_path}:\n"
                         f"{c.tail()}")  # fmt: skip
            elif c.restart_at is not None and now >= c.restart_at:
                c.log_file.write(f"\n--- tandem up: restart {c.restarts + 1} ---\n".encode())
                c.log_file.flush()
                c.proc = self._popen(c.spec, c.log_file)
                c.restarts += 1
                c.started_at, c.restart_at = now, None
                self.out(f"tandem up: restarted {c.spec.name} (restart {c.restarts}), "
                         f"pid {c.proc.pid}")  # fmt: skip

    def dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``ready`` until true; raises StartupFailed when a child dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.stopping:
                raise StartupFailed("interrupted")
            child = self.dead()
            if child is not None:
                raise StartupFailed(
                    f"{child.spec.name} exited with code {child.proc.returncode} while waiting "
                    f"for {what}; last lines of {child.log_path}:\n{child.tail()}"
                )
            if time.monotonic() > deadline:
                raise StartupFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.2)

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every live child, SIGKILL whoever outlives the grace period; reap all."""
        for c in reversed(self.children):
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
            c.log_file.close()
