"""The worker command line shared by every role: flags, engine options, serving.

``tandem prefill|decode|colocated`` are ``tandem.prefill.cli`` / ``tandem.decode.cli``: each
builds this parser (adding its own flags), makes its ``WorkerRole`` and calls ``serve``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, ClusterToken
from tandem.engine.cpu_threads import default_threads, set_engine_threads
from tandem.engine.llm import build_engine_config
from tandem.engine.role import Role
from tandem.engine.startup_heap import frozen_after_startup
from tandem.engine.worker.role import WorkerRole

# Engine options the flags set: given twice, the engine would get "multiple values" for them.
_FIRST_CLASS = frozenset({"model", "dtype", "device", "served_model_name"})


def engine_option(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--engine-option takes key=value, got {text!r}")
    value: Any = raw
    for conv in (int, float):
        try:
            value = conv(raw)
            break
        except ValueError:
            continue
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    return key.replace("-", "_"), value


def parser(role: Role) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"tandem {role.label}", description=f"Run a {role.label} worker."
    )
    p.add_argument("--model", default="demo", help="'demo' or a local Hugging Face directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--advertise-host",
        default=os.environ.get("TANDEM_ADVERTISE_HOST") or None,
        help="address peers and the router use to reach this worker "
        "(default $TANDEM_ADVERTISE_HOST, else --host)",
    )
    p.add_argument(
        "--router-url", action="append", default=[], metavar="URL",
        help="register and heartbeat with this router's internal listener (repeatable; a name "
        "that resolves to several addresses, such as a headless Service, means every one)",
    )  # fmt: skip
    p.add_argument(
        "--cluster-token-file", default=None, metavar="PATH",
        help=f"the cluster token (else ${CLUSTER_TOKEN_ENV}); never pass the token itself",
    )  # fmt: skip
    p.add_argument("--kv-transport", choices=["ucx", "tcp"], default="ucx")
    for flag, what in (("--kv-events-port", "KV-event publisher"),
                       ("--kv-side-channel-port", "KV side channel (prefill)"),
                       ("--kv-data-port", "KV data listener (prefill)")):  # fmt: skip
        p.add_argument(flag, type=int, default=0, metavar="PORT",
                       help=f"the {what} port (default 0: any free port)")  # fmt: skip
    p.add_argument("--kv-lease-seconds", type=float, default=10.0)
    p.add_argument(
        "--kv-transfer-timeout", type=float, metavar="SECONDS",
        default=float(os.environ.get("TANDEM_KV_TRANSFER_TIMEOUT") or 30.0),
        help="longest phase of one KV pull before it fails and decode recomputes "
        "(default $TANDEM_KV_TRANSFER_TIMEOUT, else 30)",
    )  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--engine-option",
        action="append",
        type=engine_option,
        default=[],
        metavar="KEY=VALUE",
        help="any engine option, e.g. max_num_seqs=64 (repeatable)",
    )
    p.add_argument(
        "--max-waiting-requests", type=int, default=None, metavar="N",
        help="refuse generate with 503 beyond this many waiting requests "
        "(default: 4 x max_num_seqs)",
    )  # fmt: skip
    p.add_argument(
        "--simulate",
        default=None,
        metavar="PROFILE.json",
        help="a simulated worker: the real scheduler, cache and protocols, the profiled step and "
        "KV transfer times from `tandem profile`, no weights (--model gives the tokenizer)",
    )
    p.add_argument(
        "--threads", type=int, default=None, metavar="N",
        help="CPU threads for the engine (default: $OMP_NUM_THREADS, else the CPUs this "
        "process may use: its affinity capped by its cgroup CPU limit)",
    )  # fmt: skip
    p.add_argument("--log-level", default="info")
    return p


def serve(args: argparse.Namespace, role: WorkerRole) -> int:
    """Run the worker of ``role`` with the parsed shared flags until it is stopped."""
    if not 0 < args.port < 65536:
        raise SystemExit(f"--port must be in 1..65535, got {args.port}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        raise SystemExit("--max-waiting-requests must be >= 1")
    for name in ("kv_events_port", "kv_side_channel_port", "kv_data_port"):
        if not 0 <= getattr(args, name) < 65536:
            raise SystemExit(f"--{name.replace('_', '-')} must be in 0..65535")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {args.threads}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        token = ClusterToken.require(args.cluster_token_file)
    except ValueError as exc:  # TokenError: missing, unreadable or malformed
        raise SystemExit(f"tandem {role.role.label}: {exc}") from None
    import uvicorn

    from tandem.engine.worker.app import create_app
    from tandem.engine.worker.service import WorkerConfig

    options = dict(args.engine_option)
    clash = sorted(set(options) & _FIRST_CLASS)
    if clash:
        raise SystemExit(
            f"tandem {role.role.label}: --engine-option {clash[0]}=... collides with "
            f"--{clash[0].replace('_', '-')}; pass it that way"
        )
    try:
        engine_config = build_engine_config(
            args.model,
            dtype=args.dtype,
            device=args.device,
            served_model_name=args.served_model_name or args.model,
            **options,
        )
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"invalid engine option: {exc}") from None
    profile = None
    if args.simulate is not None:
        from tandem.engine.sim.profile import load_profile

        try:
            profile = load_profile(args.simulate)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--simulate {args.simulate}: {exc}") from None
    config = WorkerConfig(
        engine=engine_config,
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        router_urls=tuple(args.router_url),
        max_waiting_requests=args.max_waiting_requests,
        cluster_token=token,
        kv_events_port=args.kv_events_port,
        kv_side_channel_port=args.kv_side_channel_port,
        kv_data_port=args.kv_data_port,
        simulate=profile,
    )
    threads = args.threads if args.threads is not None else default_threads()
    set_engine_threads(threads)
    logging.getLogger(__name__).info("engine threads: %d", threads)
    app = create_app(config, role)
    frozen_after_startup(app)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    app.state.shutdown = lambda: setattr(server, "should_exit", True)
    server.run()
    if app.state.engine_failed:
        logging.getLogger(__name__).critical("exiting: the engine thread died")
        return 1
    return 0
