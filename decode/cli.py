"""`tandem decode`: a worker that decodes, pulling KV from prefill workers (or prefilling
locally when the router says so)."""

from __future__ import annotations

from tandem.decode.hooks import LoadFailurePolicy
from tandem.decode.role import DecodeRole
from tandem.engine.role import Role
from tandem.engine.worker.cli import parser, serve
from tandem.transports import require


def main(argv: list[str]) -> int:
    p = parser(Role.DECODE)
    p.add_argument(
        "--kv-load-failure-policy",
        choices=[m.name.lower() for m in LoadFailurePolicy],
        default="recompute",
        help="when a KV pull fails: prefill the prompt here (recompute) or fail the request",
    )
    args = p.parse_args(argv)
    require(args.kv_transport, "tandem decode")
    role = DecodeRole(
        args.kv_transport,
        args.kv_lease_seconds,
        args.kv_load_failure_policy,
        args.kv_transfer_timeout,
    )
    return serve(args, role)
