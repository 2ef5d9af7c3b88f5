"""`tandem colocated`: a worker that prefills and decodes every request itself; with
``--kv-peer-pull`` it also pulls prompt prefixes from peers that hold them and serves its own
(decode/peer.py). It lives with the decode role because a peer pull is a decode-side pull."""

from __future__ import annotations

from tandem.decode.peer import PeerColocatedRole
from tandem.engine.role import Role
from tandem.engine.worker.cli import parser, serve
from tandem.engine.worker.role import ColocatedRole
from tandem.transports import require


def main(argv: list[str]) -> int:
    p = parser(Role.COLOCATED)
    p.add_argument(
        "--kv-peer-pull",
        action="store_true",
        help="pull a prompt's cached prefix from a peer the router names instead of recomputing "
        "it, and serve such pulls of this worker's cache (a KV connector over --kv-transport)",
    )
    args = p.parse_args(argv)
    if not args.kv_peer_pull:
        return serve(args, ColocatedRole())
    require(args.kv_transport, "tandem colocated")
    role = PeerColocatedRole(args.kv_transport, args.kv_lease_seconds, args.kv_transfer_timeout)
    return serve(args, role)
