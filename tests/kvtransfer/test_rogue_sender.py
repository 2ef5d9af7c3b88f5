"""A compromised prefill (it holds the cluster token) cannot write into a decode's blocks beyond
its own transfer: data for a transfer its connection did not open is dropped and counted, data
that does not prove the transfer's secret fails that transfer, and neither touches a block;
meanwhile a real transfer from an honest prefill completes bit-exact."""

from __future__ import annotations

import secrets

import msgpack
import torch
import zmq
from kvt_helpers import SMALL, Collector
from prometheus_client import CollectorRegistry

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.kv_connector import FailureReason, KVTransferParams
from tandem.kvtransfer import create_kv_transfer_metrics
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.auth import FrameAuth, data_mac, new_transfer_secret

TOKEN = ClusterToken(["the-cluster-token-all-peers-hold"])
AUTH = FrameAuth(TOKEN)


class RoguePrefill:
    """Raw side-channel and data sockets speaking the protocol as a prefill would."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.side, self.data = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        for s in (self.side, self.data):
            s.setsockopt(zmq.LINGER, 0)
        self.side_port = self.side.bind_to_random_port("tcp://127.0.0.1")
        self.data_port = self.data.bind_to_random_port("tcp://127.0.0.1")
        self.secret = new_transfer_secret()
        self.ident = b""

    def params(self) -> KVTransferParams:
        return KVTransferParams.from_dict({
            "engine_id": "rogue", "side_channel": f"tcp://127.0.0.1:{self.side_port}",
            "remote_request_id": "own", "block_ids": [1, 2], "num_tokens": 32,
            "first_token_id": 1, "lease_seconds": 30.0, "transfer_secret": self.secret,
        })  # fmt: skip

    def recv(self) -> p.Message:
        assert self.side.poll(5000), "decode sent nothing"
        self.ident, frame = self.side.recv_multipart()
        return p.unseal(frame, AUTH)

    def reply(self, msg: p.Message) -> None:
        self.side.send_multipart([self.ident, p.seal(msg, AUTH)])

    def accept_data_connection(self) -> bytes:
        assert self.data.poll(5000)
        ident, ready, proof = self.data.recv_multipart()
        assert ready == b"ready" and AUTH.check_connect(b"tcp-data", ident, proof)
        self.data.send_multipart([ident, b"ready"])
        return ident

    def send_data(self, ident: bytes, xfer_id: int, secret: str, payloads: list[bytes]) -> None:
        sizes = [len(b) for b in payloads]
        header = msgpack.packb(
            {"xfer_id": xfer_id, "sizes": sizes, "mac": data_mac(secret, xfer_id, sizes)},
            use_bin_type=True,
        )
        self.data.send_multipart([ident, header, *payloads])

    def close(self) -> None:
        self.side.close(0)
        self.data.close(0)


def test_rogue_sender_cannot_write_outside_its_own_authenticated_transfer(make) -> None:
    registry = CollectorRegistry()
    metrics = create_kv_transfer_metrics(registry, "demo", "decode")
    honest = make("tcp", "prefill", seed=21, cluster_token=TOKEN)
    dec = make("tcp", "decode", cluster_token=TOKEN, metrics=metrics, transfer_timeout=2.0)
    dc = Collector(dec)
    rogue = RoguePrefill()
    try:
        dec.start_load("d-rogue", rogue.params(), [1, 2], [10, 11])
        assert isinstance(rogue.recv(), p.Hello)
        rogue.reply(p.HelloOk("rogue", "tcp", SMALL, f"tcp://127.0.0.1:{rogue.data_port}"))
        data_ident = rogue.accept_data_connection()
        pull = rogue.recv()
        assert isinstance(pull, p.Pull) and pull.segments == ((1, 2),)
        rogue.reply(p.PullAccepted(pull.xfer_id))
        victim = honest.publish("victim", [5, 6, 7], 48, 1)
        dec.start_load("d-victim", victim, [5, 6, 7], [20, 21, 22])
        block = b"\xab" * (2 * SMALL.block_bytes)
        # 1. bytes aimed at a transfer this connection never opened (a guess at another's id)
        rogue.send_data(data_ident, secrets.randbits(43) | 1, rogue.secret, [block])
        # 2. its own transfer, but without the secret the puller was given
        rogue.send_data(data_ident, pull.xfer_id, new_transfer_secret(), [block])
        result = dc.load("d-rogue")
        assert (result.ok, result.reason) == (False, FailureReason.UNAUTHORIZED), result
        assert dc.load("d-victim").ok
        for r, loc in zip((5, 6, 7), (20, 21, 22), strict=True):
            assert torch.equal(dec.kv_cache[loc].view(torch.uint8),
                               honest.kv_cache[r].view(torch.uint8))  # fmt: skip
        written = {20, 21, 22}
        others = [b for b in range(SMALL.num_blocks) if b not in written]
        assert not dec.kv_cache[others].view(torch.uint8).any(), "a rogue byte reached a block"

        def failures(reason: str) -> float:
            labels = {"model": "demo", "role": "decode", "reason": reason}
            return registry.get_sample_value("tandem_kv_transfer_failures_total", labels) or 0.0

        assert failures("unknown_transfer") == 1
        assert failures("unauthorized") == 1
    finally:
        rogue.close()
