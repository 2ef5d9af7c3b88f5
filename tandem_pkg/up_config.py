"""``tandem up``'s configuration: flags, and the command line of every child it starts.

Pure (no processes): ``parse_config`` turns argv into an ``UpConfig``; ``build_specs`` turns that
into ``ProcessSpec`` s, routers first. ``up.py`` runs and supervises them.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tandem.child_command import tandem_argv
from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV
from tandem.engine.cpu_threads import available_cpus, omp_num_threads, split_threads
from tandem.supervisor import ProcessSpec
from tandem.transports import TRANSPORTS, pick, require

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
    internal_port: int | None = None  # the first router's registry listener; None: free ports
    cluster_token_file: str | None = None
    routers: int = 1  # router processes on consecutive ports, every worker registered with all
    notes: tuple[str, ...] = ()  # what parse_config chose for the user (printed at start)
    simulate: str | None = None  # a profile: every worker simulated (tandem.engine.sim)
    # Router admission, deadline and migration flags; None: the router's default (not passed).
    max_inflight_requests: int | None = None
    max_queued_requests: int | None = None
    queue_timeout: float | None = None
    request_timeout: float | None = None
    migration_limit: int | None = None
    # Prefix pulls between colocated workers (--peer-pull-min-tokens; 0: off). parse_config
    # turns them on only where they can pay: several real colocated workers.
    peer_pull_min_tokens: int = 0
    # Each worker's --threads; None: the worker's own default (OMP_NUM_THREADS, or its CPUs).
    worker_threads: int | None = None


# tandem up's --peer-pull-min-tokens default: off. In benchmarks/peer_pull.py's run of 2026-12-01
# a pull never beat recomputing the prefix on this machine (docs/benchmarks.md), so pulls are
# opt-in until a measurement says where they win.
DEFAULT_PEER_PULL_MIN_TOKENS = 0

_ROUTER_PASSTHROUGH = (
    ("max_inflight_requests", "--max-inflight-requests"),
    ("max_queued_requests", "--max-queued-requests"),
    ("queue_timeout", "--queue-timeout"),
    ("request_timeout", "--request-timeout"),
    ("migration_limit", "--migration-limit"),
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        # As uvicorn binds: a port in TIME_WAIT from a previous run is free to reuse.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


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
        if port_is_free(host, port):
            return port
    return free_port(host)


def router_ports(cfg: UpConfig) -> list[int]:
    """The routers' public ports: ``--port`` and the ones after it."""
    return [cfg.port + i for i in range(cfg.routers)]


def build_specs(
    cfg: UpConfig, ports: Iterator[int], python: str = sys.executable, token: str = ""
) -> list[ProcessSpec]:
    """The routers first, then the workers; ``--prefill 0`` makes the decode workers colocated.
    ``token`` (the cluster token) goes into every child's environment, never its argv. Every
    worker gets every router's internal URL (one ``--router-url`` each)."""
    base = tandem_argv(python=python)
    taken = set(router_ports(cfg))
    if cfg.internal_port is not None:
        taken |= {cfg.internal_port + i for i in range(cfg.routers)}

    def next_port() -> int:
        # A port probed free can be a router's own (not bound yet) or one handed out already.
        port = next(p for p in ports if p not in taken)
        taken.add(port)
        return port

    # Secrets travel in the environment, not argv, so `ps` does not show them.
    shared = ((CLUSTER_TOKEN_ENV, token),) if token else ()
    env = shared + ((("TANDEM_API_KEY", cfg.api_key),) if cfg.api_key else ())
    specs = []
    for i, port in enumerate(router_ports(cfg)):
        internal_port = cfg.internal_port + i if cfg.internal_port is not None else next_port()
        internal_url = f"http://{cfg.host}:{internal_port}"
        router_argv = base + (
            ROUTER, "--model", cfg.model, "--host", cfg.host, "--port", str(port),
            "--internal-port", str(internal_port),
            "--policy", cfg.policy, "--local-prefill-threshold", str(cfg.local_prefill_threshold),
            "--prefill-overload-queue", str(cfg.prefill_overload_queue),
            "--peer-pull-min-tokens", str(cfg.peer_pull_min_tokens),
        )  # fmt: skip
        for attr, flag in _ROUTER_PASSTHROUGH:
            value = getattr(cfg, attr)
            if value is not None:
                router_argv += (flag, str(value))
        name = ROUTER if cfg.routers == 1 else f"{ROUTER}-{i}"
        url = f"http://{cfg.host}:{port}"
        specs.append(ProcessSpec(name, ROUTER, router_argv, url, env, internal_url))
    registries: tuple[str, ...] = ()
    for r in specs:
        registries += ("--router-url", r.internal_url or r.url)
    decode_role = "decode" if cfg.prefill > 0 else "colocated"
    roles = ["prefill"] * cfg.prefill + [decode_role] * cfg.decode
    counters: dict[str, int] = {}
    for role in roles:
        i = counters.get(role, 0)
        counters[role] = i + 1
        port = next_port()
        argv = base + (
            role, "--model", cfg.model, "--host", "127.0.0.1", "--port", str(port),
            *registries, "--kv-transport", cfg.kv_transport,
        )  # fmt: skip
        for opt in cfg.engine_options:
            argv += ("--engine-option", opt)
        if cfg.simulate is not None:
            argv += ("--simulate", cfg.simulate)
        if cfg.worker_threads is not None:
            argv += ("--threads", str(cfg.worker_threads))
        if role == "colocated" and cfg.peer_pull_min_tokens > 0:
            argv += ("--kv-peer-pull",)
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem up", description="Run router and workers locally")
    p.add_argument("--model", default=None,
                   help="'demo' (default, or the profile's model with --simulate) or a local HF "
                   "directory")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers; 0 = colocated")
    p.add_argument("--decode", type=int, default=1, help="decode (or colocated) workers")
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        metavar="R",
        help="router processes on --port, --port+1, ...; workers register with all",
    )
    p.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default=None,
        help="default: ucx when ucxx is installed, else tcp (said at start)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS")
    p.add_argument("--prefill-overload-queue", type=int, default=0, metavar="REQUESTS",
                   help="prefill on decode when every prefill worker has this many queued "
                   "(0: never)")  # fmt: skip
    p.add_argument("--peer-pull-min-tokens", type=int, default=None, metavar="TOKENS",
                   help="colocated workers pull a prompt's prefix from a peer holding this many "
                   "more of its tokens (needs --prefill 0 and several workers; default 0: "
                   "never)")  # fmt: skip
    p.add_argument("--policy", choices=("prefix-aware", "least-load", "round-robin"),
                   default="prefix-aware")  # fmt: skip
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to every worker (repeatable)")  # fmt: skip
    p.add_argument("--worker-threads", type=int, default=None, metavar="N",
                   help="CPU threads per worker (default: this machine's CPUs less one for the "
                   "router, split between the workers; $OMP_NUM_THREADS if set)")  # fmt: skip
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
    from tandem.router.cli import add_admission_args

    add_admission_args(p)  # passed to the router only when given
    p.set_defaults(**{attr: None for attr, _ in _ROUTER_PASSTHROUGH})
    return p


def _worker_threads(
    given: int | None, workers: int, simulate: str | None
) -> tuple[int | None, str]:
    """Each worker's engine threads and the note saying why. Workers sharing this machine's
    CPUs with each other and the router must not run more threads than there are CPUs: a
    parallel step waits for its slowest thread (``tandem.engine.cpu_threads``)."""
    if given is not None:
        if given < 1:
            raise SystemExit("tandem up: --worker-threads must be >= 1")
        return given, ""
    if simulate is not None or omp_num_threads() is not None:
        return None, ""  # simulated steps are waits; an explicit OMP_NUM_THREADS is the user's
    cpus = available_cpus()
    threads = split_threads(cpus, workers)
    return threads, (
        f"each of the {workers} workers uses {threads} CPU thread(s) ({cpus} CPUs, one left "
        "for the router; --worker-threads to change)"
    )


def parse_config(argv: list[str]) -> UpConfig:
    a = build_parser().parse_args(argv)
    if a.prefill < 0 or a.decode < 1:
        raise SystemExit("tandem up: --prefill must be >= 0 and --decode >= 1")
    if a.local_prefill_threshold < 0 or a.prefill_overload_queue < 0:
        raise SystemExit(
            "tandem up: --local-prefill-threshold and --prefill-overload-queue must be >= 0"
        )
    from tandem.router.cli import admission_errors
    from tandem.router.cli import build_parser as router_parser

    given = {attr: getattr(a, attr) for attr, _ in _ROUTER_PASSTHROUGH}
    checked = router_parser().parse_args([])
    for attr, value in given.items():
        if value is not None:
            setattr(checked, attr, value)
    problem = admission_errors(checked)
    if problem is not None:
        raise SystemExit(f"tandem up: {problem}")
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
    if not 1 <= a.routers <= 16:
        raise SystemExit("tandem up: --routers must be in 1..16")
    if a.kv_transport is not None:
        require(a.kv_transport, "tandem up")
    transport, note = pick(a.kv_transport)
    peers = a.prefill == 0 and a.decode > 1 and simulate is None
    pull = a.peer_pull_min_tokens
    if pull is None:
        pull = DEFAULT_PEER_PULL_MIN_TOKENS if peers else 0
    elif pull < 0:
        raise SystemExit("tandem up: --peer-pull-min-tokens must be >= 0")
    elif pull > 0 and not peers:
        raise SystemExit(
            "tandem up: --peer-pull-min-tokens needs --prefill 0, --decode 2 or more and no "
            "--simulate (prefix pulls are between real colocated workers)"
        )
    threads, threads_note = _worker_threads(a.worker_threads, a.prefill + a.decode, simulate)
    notes = tuple(n for n in (note, threads_note) if n)
    return UpConfig(
        peer_pull_min_tokens=pull, worker_threads=threads,
        model=model, host=a.host, port=a.port, prefill=a.prefill, decode=a.decode,
        kv_transport=transport, api_key=a.api_key, routers=a.routers,
        notes=notes,
        local_prefill_threshold=a.local_prefill_threshold,
        prefill_overload_queue=a.prefill_overload_queue, policy=a.policy,
        engine_options=tuple(a.engine_option), startup_timeout_s=a.startup_timeout,
        log_dir=a.log_dir, internal_port=a.internal_port,
        cluster_token_file=a.cluster_token_file, simulate=simulate, **given,
    )  # fmt: skip
