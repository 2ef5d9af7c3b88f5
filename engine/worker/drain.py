"""``tandem drain``: ask the worker in this pod to drain (the Kubernetes preStop hook).

The worker's drain route is behind the cluster token, which an ``httpGet`` hook cannot send, so
the pod's preStop runs this instead: it reads the token from ``--cluster-token-file`` (the
mounted Secret) or ``$TANDEM_CLUSTER_TOKEN`` and calls ``/v1/internal/drain`` on loopback. Exits
0 once the worker reports it drained, 1 otherwise (Kubernetes sends SIGTERM either way).
"""

from __future__ import annotations

import argparse
import sys

import httpx

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, ClusterToken


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem drain", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="the worker's --port")
    p.add_argument("--timeout", type=float, default=50.0, metavar="SECONDS")
    p.add_argument("--cluster-token-file", default=None, metavar="PATH",
                   help=f"the cluster token (else ${CLUSTER_TOKEN_ENV})")  # fmt: skip
    args = p.parse_args(argv)
    try:
        token = ClusterToken.require(args.cluster_token_file)
    except ValueError as exc:
        print(f"tandem drain: {exc}", file=sys.stderr)
        return 2
    url = f"http://{args.host}:{args.port}/v1/internal/drain"
    try:
        r = httpx.post(
            url, params={"timeout": args.timeout}, headers=token.headers(),
            timeout=args.timeout + 10,
        )  # fmt: skip
    except httpx.HTTPError as exc:
        print(f"tandem drain: {url}: {exc}", file=sys.stderr)
        return 1
    print(r.text)
    return 0 if r.status_code == 200 and r.json().get("drained") else 1
