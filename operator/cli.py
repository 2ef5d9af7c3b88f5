"""`tandem operator`: run the Kopf operator for TandemServices.

The `tandem` console script calls `main(argv)` with the arguments after `operator`. Credentials
come from the pod's service account, or else from $KUBECONFIG / ~/.kube/config.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from tandem.operator.handlers import OperatorConfig, build_registry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem operator",
        description="Run the Tandem operator (manages TandemService resources).",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable; glob patterns allowed)",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="do not coordinate with other operator replicas through Kopf peering",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=10.0,
        help="how often each TandemService is re-checked for drift and autoscaled (default 10)",
    )
    parser.add_argument(
        "--scrape-timeout-seconds",
        type=float,
        default=3.0,
        help="timeout of one /metrics scrape in the direct metrics source (default 3)",
    )
    parser.add_argument(
        "--plan-timeout",
        type=float,
        default=120.0,
        help="seconds one `tandem plan` subprocess of the planner may take (default 120)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=8081,
        help="serve the operator's own metrics on this port (0 disables; default 8081)",
    )
    parser.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="address the operator's metrics endpoint binds to (default 0.0.0.0)",
    )
    parser.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def main(argv: list[str]) -> int:
    """Parse `argv` (without the program and subcommand names) and run until signalled."""
    args = build_parser().parse_args(argv)
    if args.resync_seconds <= 0 or args.scrape_timeout_seconds <= 0 or args.plan_timeout <= 0:
        build_parser().error(
            "--resync-seconds, --scrape-timeout-seconds and --plan-timeout must be > 0"
        )
    if not 0 <= args.metrics_port <= 65535:
        build_parser().error("--metrics-port must be in 0..65535")
    if not args.namespace and not args.all_namespaces:
        build_parser().error("give --namespace NS (repeatable) or --all-namespaces")
    # Kopf's formatter puts "[namespace/name]" before every per-object line ("Timer 'resync'
    # succeeded"), which a plain logging.basicConfig drops: without it a log cannot say which
    # TandemService a handler ran for.
    kopf.configure(
        verbose=args.verbose,
        log_format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        log_prefix=True,
    )
    logging.getLogger("asyncio").propagate = True  # configure() mutes asyncio's own errors
    logging.getLogger("asyncio").handlers.clear()
    cfg = OperatorConfig(
        resync_seconds=args.resync_seconds,
        scrape_timeout_seconds=args.scrape_timeout_seconds,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port or None,
        plan_timeout_seconds=args.plan_timeout,
    )
    registry = build_registry(cfg)
    asyncio.run(
        kopf.operator(
            registry=registry,
            standalone=args.standalone,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
        )
    )
    return 0
