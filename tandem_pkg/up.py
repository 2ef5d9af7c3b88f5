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

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, ClusterToken, generate_token

ROUTER = "router"


@dataclass(slots=True, frozen=True)
class UpConfig:
    model: str = "demo"
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    kv_transport: str = "ucx"
    api_key: str | None = None
    local_prefill_threshold: int = 0
    prefill_overload_queue: int = 0
    policy: str = "prefix-aware"
    engine_options: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    log_dir: str | None = None
    internal_port: int | None = None  # the router's registry listener; None: a free port
    cluster_token_file: str | None = None
    simulate: str | None = None  # a profile: every worker simulated (tandem.engine.sim)


@dataclass(slots=True, frozen=True)
class ProcessSpec:
    """One child: ``role`` is ``router`` or the worker role it registers as."""

    name: str
    role: str
    argv: tuple[str, ...]
    url: str
    env: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # secrets: never printed
    internal_url: str | None = None  # the router's registry listener (router only)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def worker_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A free port below the kernel's ephemeral range. A probed port is bound only when the
    worker starts; meanwhile every starting child binds ephemeral ports of its own (KV events,
    side channel, data sockets), and with dozens of workers one of those would take a port
    handed out from that same range (seen with 32 simulated workers)."""
    rng = rng or random.Random()
    lo, _ = _ephemeral_range()
    for _ in range(1000):
        port = rng.randrange(10000, max(10001, lo))
        if _port_is_free(host, port):
            return port
    return free_port(host)


def build_specs(
    cfg: UpConfig, ports: Iterator[int], python: str = sys.executable, token: str = ""
) -> list[ProcessSpec]:
    """The router first, then the workers; ``--prefill 0`` makes the decode workers colocated.
    ``token`` (the cluster token) goes into every child's environment, never its argv."""
    base = (python, "-m", "tandem.cli")
    taken = {cfg.port}

    def next_port() -> int:
        # A port probed free can be the router's own (not bound yet) or one handed out already.
        port = next(p for p in ports if p not in taken)
        taken.add(port)
        return port

    internal_port = cfg.internal_port if cfg.internal_port is not None else next_port()
    taken.add(internal_port)
    router_url = f"http://{cfg.host}:{cfg.port}"
    internal_url = f"http://{cfg.host}:{internal_port}"
    router_argv = base + (
        ROUTER, "--model", cfg.model, "--host", cfg.host, "--port", str(cfg.port),
        "--internal-port", str(internal_port),
        "--policy", cfg.policy, "--local-prefill-threshold", str(cfg.local_prefill_threshold),
        "--prefill-overload-queue", str(cfg.prefill_overload_queue),
    )  # fmt: skip
    # Secrets travel in the environment, not argv, so `ps` does not show them.
    shared = ((CLUSTER_TOKEN_ENV, token),) if token else ()
    env = shared + ((("TANDEM_API_KEY", cfg.api_key),) if cfg.api_key else ())
    specs = [ProcessSpec(ROUTER, ROUTER, router_argv, router_url, env, internal_url)]
    decode_role = "decode" if cfg.prefill > 0 else "colocated"
    roles = ["prefill"] * cfg.prefill + [decode_role] * cfg.decode
    counters: dict[str, int] = {}
    for role in roles:
        i = counters.get(role, 0)
        counters[role] = i + 1
        port = next_port()
        argv = base + (
            role, "--model", cfg.model, "--host", "127.0.0.1", "--port", str(port),
            "--router-url", internal_url, "--kv-transport", cfg.kv_transport,
        )  # fmt: skip
        for opt in cfg.engine_options:
            argv += ("--engine-option", opt)
        if cfg.simulate is not None:
            argv += ("--simulate", cfg.simulate)
        specs.append(ProcessSpec(f"{role}-{i}", role, argv, f"http://127.0.0.1:{port}", shared))
    return specs


def curl_line(cfg: UpConfig) -> str:
    content = "Hello!"
    if cfg.model == "demo":
        from tandem.engine.demo.task import make_user_message

        content = make_user_message("hello42")
    body = {"model": cfg.model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 32}  # fmt: skip
    parts = ["curl", f"http://{cfg.host}:{cfg.port}/v1/chat/completions",
             "-H", "Content-Type: application/json"]  # fmt: skip
    if cfg.api_key:
        parts += ["-H", f"Authorization: Bearer {cfg.api_key}"]
    parts += ["-d", json.dumps(body)]
    return shlex.join(parts)


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
    """Start ``specs`` (router first), wait for registration, supervise; returns the exit code."""
    out = supervisor.out
    router = specs[0]
    token = dict(router.env).get(CLUSTER_TOKEN_ENV)
    internal = router.internal_url or router.url
    want: dict[str, int] = {}
    for s in specs[1:]:
        want[s.role] = want.get(s.role, 0) + 1
    try:
        # All at once: workers retry registration until the router listens, and loading the model
        # overlaps with the router's start-up.
        for spec in specs:
            supervisor.spawn(spec)
        supervisor.wait_until(
            lambda: _get_json(f"{router.url}/health") is not None, startup_timeout_s, "the router"
        )
        supervisor.wait_until(
            lambda: registered_roles(internal, token) == want, startup_timeout_s,
            "every worker to register",
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
            if not _can_serve(supervisor, router):
                out("tandem up: the router or every decode worker is gone; stopping")
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


def _can_serve(supervisor: Supervisor, router: ProcessSpec) -> bool:
    """A dead prefill or one of several decode workers is survivable: the router drops it from
    its registry and places traffic on the others (or prefills on decode). Serving needs the
    router and at least one decode (or colocated) worker."""
    alive = [c.spec for c in supervisor.children if c.proc.poll() is None]
    return router in alive and any(s.role in ("decode", "colocated") for s in alive)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem up", description="Run router and workers locally")
    p.add_argument("--model", default=None,
                   help="'demo' (default, or the profile's model with --simulate) or a local HF "
                   "directory")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers; 0 = colocated")
    p.add_argument("--decode", type=int, default=1, help="decode (or colocated) workers")
    p.add_argument("--kv-transport", choices=("ucx", "tcp"), default="ucx")
    p.add_argument("--api-key", default=None)
    p.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS")
    p.add_argument("--prefill-overload-queue", type=int, default=0, metavar="REQUESTS",
                   help="prefill on decode when every prefill worker has this many queued "
                   "(0: never)")  # fmt: skip
    p.add_argument("--policy", choices=("prefix-aware", "least-load", "round-robin"),
                   default="prefix-aware")  # fmt: skip
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to every worker (repeatable)")  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--log-dir", default=None, help="where child logs go (default: a temp dir)")
    p.add_argument("--internal-port", type=int, default=None,
                   help="the router's worker-registry port (default: a free port)")  # fmt: skip
    p.add_argument("--cluster-token-file", default=None, metavar="PATH",
                   help=f"the cluster token (else ${CLUSTER_TOKEN_ENV}, else a random one per "
                   "run); children get it in their environment")  # fmt: skip
    p.add_argument("--simulate", default=None, metavar="PROFILE.json",
                   help="simulated workers from a `tandem profile`: no weights, the profiled "
                   "step and KV transfer times, everything else real")  # fmt: skip
    return p


def parse_config(argv: list[str]) -> UpConfig:
    a = build_parser().parse_args(argv)
    if a.prefill < 0 or a.decode < 1:
        raise SystemExit("tandem up: --prefill must be >= 0 and --decode >= 1")
    if a.local_prefill_threshold < 0 or a.prefill_overload_queue < 0:
        raise SystemExit(
            "tandem up: --local-prefill-threshold and --prefill-overload-queue must be >= 0"
        )
    simulate = None
    if a.simulate is not None:
        from tandem.engine.sim.profile import load_profile

        try:
            profile = load_profile(a.simulate)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"tandem up: --simulate {a.simulate}: {exc}") from None
        simulate = str(Path(a.simulate).resolve())
        if a.model is None:
            a.model = profile.model.name
    model = a.model or "demo"
    if model != "demo" and not Path(model).is_dir():
        raise SystemExit(f"tandem up: model directory {model!r} does not exist")
    return UpConfig(
        model=model, host=a.host, port=a.port, prefill=a.prefill, decode=a.decode,
        kv_transport=a.kv_transport, api_key=a.api_key,
        local_prefill_threshold=a.local_prefill_threshold,
        prefill_overload_queue=a.prefill_overload_queue, policy=a.policy,
        engine_options=tuple(a.engine_option), startup_timeout_s=a.startup_timeout,
        log_dir=a.log_dir, internal_port=a.internal_port,
        cluster_token_file=a.cluster_token_file, simulate=simulate,
    )  # fmt: skip


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
    if not _port_is_free(cfg.host, cfg.port):
        print(f"tandem up: port {cfg.port} on {cfg.host} is in use; pick another with --port",
              file=sys.stderr)  # fmt: skip
        return 1
    if cfg.internal_port is not None and (
        cfg.internal_port == cfg.port or not _port_is_free(cfg.host, cfg.internal_port)
    ):
        print(f"tandem up: internal port {cfg.internal_port} is in use; pick another with "
              "--internal-port", file=sys.stderr)  # fmt: skip
        return 1
    try:
        given = ClusterToken.load(cfg.cluster_token_file)
    except ValueError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    token = given.current if given is not None else generate_token()
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tandem-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = build_specs(cfg, iter(worker_port, None), token=token)
    mode = (f"{cfg.prefill} prefill + {cfg.decode} decode" if cfg.prefill
            else f"{cfg.decode} colocated")  # fmt: skip
    if cfg.simulate is not None:
        mode += f" simulated (profile {cfg.simulate})"
    print(f"tandem up: starting router and {mode} worker(s) for model {cfg.model!r}; "
          f"logs in {log_dir}", flush=True)  # fmt: skip

    def ready() -> None:
        url = f"http://{cfg.host}:{cfg.port}/v1"
        internal = specs[0].internal_url
        print(f"\nTandem is ready at {url}  (Ctrl-C to stop; workers register at {internal})"
              f"\n\n{curl_line(cfg)}\n", flush=True)  # fmt: skip

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
