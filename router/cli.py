"""``tandem router``: serve the router with uvicorn. ``main(argv) -> int``.

Two listeners in one process and one event loop: the public app (clients: ``--host``/``--port``)
and the internal app (workers: ``--internal-host``/``--internal-port``, behind the cluster
token). The public app's lifespan owns the shared state, so it starts first.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, ClusterToken
from tandem.engine.request_limits import MAX_REQUEST_BYTES
from tandem.engine.startup_heap import frozen_after_startup
from tandem.router.placement import Policy

if TYPE_CHECKING:
    from fastapi import FastAPI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem router", description="OpenAI-compatible router")
    p.add_argument("--model", default="demo", help="served model: 'demo' or a local HF directory")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model)")
    p.add_argument(
        "--served-model-name", default=None,
        help="name clients and workers use (default: --model as given); match the workers'",
    )  # fmt: skip
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000, help="the public (client) port")
    p.add_argument(
        "--internal-port", type=int, default=8001,
        help="the workers' registry listener (cluster token required)",
    )  # fmt: skip
    p.add_argument("--internal-host", default=None, help="its bind address (default --host)")
    p.add_argument(
        "--cluster-token-file", default=None, metavar="PATH",
        help=f"the cluster token (else ${CLUSTER_TOKEN_ENV}); never pass the token itself",
    )  # fmt: skip
    p.add_argument(
        "--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, metavar="BYTES",
        help="largest client request body; bigger ones get 413 while they arrive",
    )  # fmt: skip
    p.add_argument("--policy", default="prefix-aware",
                   choices=[pol.label for pol in Policy])  # fmt: skip
    p.add_argument(
        "--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
        help="decode prefills locally when the uncached prompt is shorter (0: always remote)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-overload-queue", type=int, default=0, metavar="REQUESTS",
        help="decode prefills locally when every prefill worker has at least this many requests "
        "queued or in flight (0: never)",
    )  # fmt: skip
    p.add_argument(
        "--peer-pull-min-tokens", type=int, default=0, metavar="TOKENS",
        help="a colocated worker pulls a prompt's prefix from a peer (both started with "
        "--kv-peer-pull) that holds at least this many more of its tokens, instead of "
        "recomputing them (0: never; docs/operations.md)",
    )  # fmt: skip
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, help="required bearer key (or TANDEM_API_KEY)")
    keys.add_argument("--api-key-file", default=None, help="file with one accepted key per line")
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="SECONDS")
    add_admission_args(p)
    p.add_argument("--log-level", default="info")
    return p


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """Admission, deadline and migration flags (DESIGN.md §11), shared with ``tandem up``."""
    p.add_argument(
        "--max-inflight-requests", type=int, default=None, metavar="N",
        help="worker sub-requests dispatched at once (a request with n choices counts n; "
        "default: 2 x the decode workers' max_num_seqs)",
    )  # fmt: skip
    p.add_argument(
        "--max-queued-requests", type=int, default=1024, metavar="M",
        help="requests waiting in the router for a slot; beyond it 429 (default 1024)",
    )  # fmt: skip
    p.add_argument(
        "--queue-timeout", type=float, default=30.0, metavar="SECONDS",
        help="longest wait in the router's queue before a 429 (default 30)",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="SECONDS",
        help="deadline of a whole request, queue included (0: none; default 600)",
    )  # fmt: skip
    p.add_argument(
        "--migration-limit", type=int, default=1, metavar="K",
        help="times a stream with output may move to another worker when its own fails "
        "(0: never; default 1)",
    )  # fmt: skip


def admission_errors(args: argparse.Namespace) -> str | None:
    """The first invalid admission flag, as a message; None when all are valid."""
    if args.max_inflight_requests is not None and args.max_inflight_requests < 1:
        return "--max-inflight-requests must be >= 1"
    if args.max_queued_requests < 0:
        return "--max-queued-requests must be >= 0"
    if args.queue_timeout < 0 or args.request_timeout < 0:
        return "--queue-timeout and --request-timeout must be >= 0"
    if args.migration_limit < 0:
        return "--migration-limit must be >= 0"
    return None


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from --api-key, --api-key-file (a mounted Secret) or TANDEM_API_KEY, in that order."""
    if args.api_key:
        return (args.api_key,)
    if args.api_key_file:
        lines = Path(args.api_key_file).read_text().splitlines()
        keys = tuple(k.strip() for k in lines if k.strip())
        if not keys:
            raise ValueError(f"API key file {args.api_key_file} holds no key")
        return keys
    env = os.environ.get("TANDEM_API_KEY", "").strip()
    return (env,) if env else ()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.local_prefill_threshold < 0:
        print("--local-prefill-threshold must be >= 0", file=sys.stderr)
        return 2
    if args.prefill_overload_queue < 0:
        print("--prefill-overload-queue must be >= 0", file=sys.stderr)
        return 2
    if args.peer_pull_min_tokens < 0:
        print("--peer-pull-min-tokens must be >= 0", file=sys.stderr)
        return 2
    problem = admission_errors(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    if args.max_request_bytes < 1024:
        print("--max-request-bytes must be at least 1024", file=sys.stderr)
        return 2
    if args.internal_port == args.port:
        print("--internal-port must differ from --port", file=sys.stderr)
        return 2
    try:
        keys = api_keys_from(args)
    except (OSError, ValueError) as exc:
        print(f"tandem router: {exc}", file=sys.stderr)
        return 2

    from tandem.engine.model_path import resolve_model_path
    from tandem.router.app import RouterConfig, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per worker call would drown the log (and cost time) at any real request rate.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        model_path = args.tokenizer or str(resolve_model_path(args.model))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem router: {exc}", file=sys.stderr)
        return 2
    try:
        token = ClusterToken.require(args.cluster_token_file)
    except ValueError as exc:  # TokenError: missing, unreadable or malformed
        print(f"tandem router: {exc}", file=sys.stderr)
        return 2
    config = RouterConfig(
        model=args.served_model_name or args.model,
        model_path=model_path,
        policy=Policy.parse(args.policy),
        local_prefill_threshold=args.local_prefill_threshold,
        prefill_overload_queue=args.prefill_overload_queue,
        peer_pull_min_tokens=args.peer_pull_min_tokens,
        api_keys=keys,
        heartbeat_timeout_s=args.heartbeat_timeout,
        max_inflight_requests=args.max_inflight_requests,
        max_queued_requests=args.max_queued_requests,
        queue_timeout_s=args.queue_timeout,
        request_timeout_s=args.request_timeout,
        migration_limit=args.migration_limit,
        max_body_bytes=args.max_request_bytes,
        cluster_token=token,
    )
    app = create_app(config)
    frozen_after_startup(app)
    asyncio.run(
        serve_both(
            app,
            (args.host, args.port),
            (args.internal_host or args.host, args.internal_port),
            args.log_level,
        )
    )
    return 0


async def serve_both(
    app: FastAPI, public: tuple[str, int], internal: tuple[str, int], log_level: str
) -> None:
    """Serve ``app`` on ``public`` and its internal app on ``internal`` until a signal stops
    both (uvicorn's handlers set ``should_exit``; the second server follows the first)."""
    import uvicorn

    from tandem.router.internal_app import create_internal_app

    def server(asgi: object, addr: tuple[str, int], lifespan: str) -> uvicorn.Server:
        cfg = uvicorn.Config(asgi, host=addr[0], port=addr[1], log_level=log_level,
                             lifespan=lifespan, timeout_graceful_shutdown=5)  # fmt: skip
        return uvicorn.Server(cfg)

    outer = server(app, public, "on")
    inner = server(create_internal_app(app), internal, "off")
    outer_task = asyncio.create_task(outer.serve())
    while not outer.started:
        if outer_task.done():
            return await outer_task  # failed to start (port in use, lifespan error)
        await asyncio.sleep(0.02)
    inner_task = asyncio.create_task(inner.serve())
    done, _ = await asyncio.wait({outer_task, inner_task}, return_when=asyncio.FIRST_COMPLETED)
    outer.should_exit = inner.should_exit = True
    await asyncio.gather(outer_task, inner_task, return_exceptions=True)
    for task in done:
        if task.exception() is not None:
            raise task.exception()  # type: ignore[misc]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
