"""`tandem prefill`: a worker that runs chunked prefill and hands the KV to decode workers."""

from __future__ import annotations

from tandem.engine.role import Role
from tandem.engine.worker.cli import parser, serve
from tandem.prefill.role import PrefillRole
from tandem.transports import require


def main(argv: list[str]) -> int:
    args = parser(Role.PREFILL).parse_args(argv)
    require(args.kv_transport, "tandem prefill")
    role = PrefillRole(args.kv_transport, args.kv_lease_seconds, args.kv_transfer_timeout)
    return serve(args, role)
