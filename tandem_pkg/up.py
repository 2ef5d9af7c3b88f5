"""``tandem up``: router + N prefill + M decode workers as local processes, one command.

``main(argv) -> int`` is called by ``tandem.cli``. It starts the router and the workers together
(each worker learns the router only through registration, retrying until it listens), waits until
every worker has registered, prints the
URL and a ready-to-paste curl line, and supervises: Ctrl-C or SIGTERM stops every child (SIGTERM,
then SIGKILL after a grace period), and a child that dies takes the whole set down with its log tail
printed, so no process is ever left orphaned. Children run in their own sessions (the terminal's
Ctrl-C reaches only this process, which forwards it) and, on Linux, get SIGTERM if it dies.

The cluster token: ``$TANDEM_CLUSTER_TOKEN`` or ``--cluster-token-file`` when given, else a
random one made for this run. Children get it in their environment only (never argv, never the
log); workers register on the router's internal listener (``--internal-port``, a free port by
default).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, ClusterToken, generate_token
from tandem.up_config import (  # re-exported: the command lines are part of `tandem up`
    ROUTER,
    ProcessSpec,
    UpConfig,
    build_parser,
    build_specs,
    curl_line,
    free_port,
    parse_config,
    router_ports,
)

__all__ = [
    "ProcessSpec", "UpConfig", "build_parser", "build_specs", "curl_line", "free_port", "launch",
    "main", "parse_config", "run",
]  # fmt: skip


class StartupFailed(Exception):
    pass


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes] = field(repr=False)

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
        env = {**os.environ, **dict(spec.env), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            spec.argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads run before the spawns
        )
        child = Child(spec, proc, log_path, log_file)
        self.children.append(child)
        return child

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


def _get_json(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> dict | None:
    try:
        r = httpx.get(url, timeout=timeout, headers=headers)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def registered_roles(internal_url: str, token: str | None = None) -> dict[str, int] | None:
    """Worker counts by role from the router's internal listener (needs the cluster token)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    body = _get_json(f"{internal_url}/internal/workers", headers=headers)
    if body is None:
        return None
    counts: dict[str, int] = {}
    for w in body.get("workers", []):
        counts[w["role"]] = counts.get(w["role"], 0) + 1
    return counts


def run(
    specs: Sequence[ProcessSpec],
    supervisor: Supervisor,
    startup_timeout_s: float,
    on_ready: Callable[[], None],
) -> int:
    """Start ``specs`` (routers first), wait until every router lists every worker, supervise;
    returns the exit code."""
    out = supervisor.out
    routers = [s for s in specs if s.role == ROUTER]
    token = dict(routers[0].env).get(CLUSTER_TOKEN_ENV)
    want: dict[str, int] = {}
    for s in specs:
        if s.role != ROUTER:
            want[s.role] = want.get(s.role, 0) + 1
    try:
        # All at once: workers retry registration until the router listens, and loading the model
        # overlaps with the router's start-up.
        for spec in specs:
            supervisor.spawn(spec)
        supervisor.wait_until(
            lambda: all(_get_json(f"{r.url}/health") is not None for r in routers),
            startup_timeout_s, "the router(s)",
        )  # fmt: skip
        supervisor.wait_until(
            lambda: all(registered_roles(r.internal_url or r.url, token) == want for r in routers),
            startup_timeout_s, "every worker to register with every router",
        )  # fmt: skip
        for c in supervisor.children:
            out(f"  {c.spec.name:<12} pid {c.proc.pid:<8} {c.spec.url}  log: {c.log_path}")
        on_ready()
        reported: set[str] = set()
        while not supervisor.stopping:
            for child in supervisor.children:
                if child.proc.poll() is None or child.spec.name in reported:
                    continue
                reported.add(child.spec.name)
                out(f"tandem up: {child.spec.name} exited with code {child.proc.returncode}. "
                    f"Last lines of {child.log_path}:\n{child.tail()}")  # fmt: skip
            if not _can_serve(supervisor):
                out("tandem up: every router or every decode worker is gone; stopping")
                return 1
            time.sleep(0.2)
        out("tandem up: stopping")
        return 0
    except StartupFailed as exc:
        if supervisor.stopping:
            out("tandem up: interrupted during start-up; stopping")
            return 130
        out(f"tandem up: start-up failed: {exc}")
        return 1
    finally:
        supervisor.stop_all()


def _can_serve(supervisor: Supervisor) -> bool:
    """A dead prefill, one of several decode workers or one of several routers is survivable:
    routers drop a dead worker from their registries and place traffic on the others (or
    prefill on decode), and clients use another router. Serving needs a router and at least one
    decode (or colocated) worker."""
    alive = [c.spec for c in supervisor.children if c.proc.poll() is None]
    return any(s.role == ROUTER for s in alive) and any(
        s.role in ("decode", "colocated") for s in alive
    )


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        # As uvicorn binds: a port in TIME_WAIT from a previous run is free to reuse.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def main(argv: list[str]) -> int:
    cfg = parse_config(argv)
    for port in router_ports(cfg):
        if not _port_is_free(cfg.host, port):
            print(f"tandem up: port {port} on {cfg.host} is in use; pick another with --port",
                  file=sys.stderr)  # fmt: skip
            return 1
    internal = [cfg.internal_port + i for i in range(cfg.routers)] if cfg.internal_port else []
    for port in internal:
        if port in router_ports(cfg) or not _port_is_free(cfg.host, port):
            print(f"tandem up: internal port {port} is in use; pick another with "
                  "--internal-port", file=sys.stderr)  # fmt: skip
            return 1
    for note in cfg.notes:
        print(note, flush=True)
    try:
        given = ClusterToken.load(cfg.cluster_token_file)
    except ValueError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    token = given.current if given is not None else generate_token()
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tandem-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = build_specs(cfg, iter(free_port, None), token=token)
    mode = (f"{cfg.prefill} prefill + {cfg.decode} decode" if cfg.prefill
            else f"{cfg.decode} colocated")  # fmt: skip
    print(f"tandem up: starting router and {mode} worker(s) for model {cfg.model!r}; "
          f"logs in {log_dir}", flush=True)  # fmt: skip

    def ready() -> None:
        urls = ", ".join(f"http://{cfg.host}:{p}/v1" for p in router_ports(cfg))
        registries = ", ".join(s.internal_url or "" for s in specs if s.role == ROUTER)
        print(f"\nTandem is ready at {urls}  (Ctrl-C to stop; workers register at "
              f"{registries})\n\n{curl_line(cfg)}\n", flush=True)  # fmt: skip

    return launch(specs, log_dir, cfg.startup_timeout_s, ready)


def launch(
    specs: Sequence[ProcessSpec],
    log_dir: Path,
    startup_timeout_s: float,
    on_ready: Callable[[], None],
) -> int:
    """Run ``specs`` under a Supervisor with SIGINT/SIGTERM forwarded; main thread only."""
    supervisor = Supervisor(log_dir, out=lambda s: print(s, flush=True))
    previous = {sig: signal.signal(sig, supervisor.request_stop)
                for sig in (signal.SIGINT, signal.SIGTERM)}  # fmt: skip
    try:
        return run(specs, supervisor, startup_timeout_s, on_ready)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
