"""``tandem up``: router + N prefill + M decode workers as local processes, one command.

``main(argv) -> int`` is called by ``tandem.cli``. It starts the router and the workers together
(each worker learns the router only through registration, retrying until it listens), waits until
every worker has registered, prints the
URL and a ready-to-paste curl line, and supervises: Ctrl-C or SIGTERM stops every child (SIGTERM,
then SIGKILL after a grace period), so no process is ever left orphaned. A child that exits after
start-up is reported with its log tail and restarted on the same port after a bounded backoff
(1 s doubling to 30 s; back to 1 s once it ran a minute), each restart printed; the router drops
the dead worker meanwhile and the restarted one registers under a new engine id. A child that dies
during start-up fails the whole start. Children run in their own sessions (the terminal's Ctrl-C
reaches only this process, which forwards it) and, on Linux, get SIGTERM if it dies
(``supervisor.py``).

The cluster token: ``$TANDEM_CLUSTER_TOKEN`` or ``--cluster-token-file`` when given, else a
random one made for this run. Children get it in their environment only (never argv, never the
log); workers register on the router's internal listener (``--internal-port``, a free port by
default).
"""

from __future__ import annotations

import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, ClusterToken, generate_token
from tandem.supervisor import ProcessSpec, StartupFailed, Supervisor
from tandem.up_config import (  # re-exported: the command lines are part of `tandem up`
    ROUTER,
    UpConfig,
    build_parser,
    build_specs,
    curl_line,
    free_port,
    parse_config,
    port_is_free,
    router_ports,
    worker_port,
)

__all__ = [
    "ProcessSpec", "UpConfig", "build_parser", "build_specs", "curl_line", "free_port", "launch",
    "main", "parse_config", "run", "worker_port",
]  # fmt: skip


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
        while not supervisor.stopping:
            supervisor.watch(time.monotonic())
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


def main(argv: list[str]) -> int:
    cfg = parse_config(argv)
    for port in router_ports(cfg):
        if not port_is_free(cfg.host, port):
            print(f"tandem up: port {port} on {cfg.host} is in use; pick another with --port",
                  file=sys.stderr)  # fmt: skip
            return 1
    internal = [cfg.internal_port + i for i in range(cfg.routers)] if cfg.internal_port else []
    for port in internal:
        if port in router_ports(cfg) or not port_is_free(cfg.host, port):
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
    specs = build_specs(cfg, iter(worker_port, None), token=token)
    mode = (f"{cfg.prefill} prefill + {cfg.decode} decode" if cfg.prefill
            else f"{cfg.decode} colocated")  # fmt: skip
    if cfg.simulate is not None:
        mode += f" simulated (profile {cfg.simulate})"
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
