"""Connector end to end in one process (threads and loops): transfers, leases, aborts, faults."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import torch
import zmq
from kvt_helpers import SMALL, Collector
from prometheus_client import CollectorRegistry

from tandem.engine.kv_connector import FailureReason, KVTransferParams
from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer import create_kv_transfer_metrics
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.auth import FrameAuth, holder_proof, pull_proof

OPEN = FrameAuth(None)  # what a connector built without a cluster token seals with
SECRET = "5e" * 32

TRANSPORTS = ["tcp", "ucx"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bit patterns contain NaNs, which torch.equal treats as unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_copied(
    src: torch.Tensor, dst: torch.Tensor, remote: list[int], local: list[int]
) -> None:
    for r, loc in zip(remote, local, strict=True):
        assert torch.equal(dst[loc].view(torch.uint8), src[r].view(torch.uint8)), (r, loc)
    untouched = sorted(set(range(dst.shape[0])) - set(local))
    assert not dst[untouched].view(torch.uint8).any(), "a block outside the request was written"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_partial_noncontiguous_pull_is_bit_exact(make, transport: str) -> None:
    registry = CollectorRegistry()
    metrics = create_kv_transfer_metrics(registry, "demo", "decode")
    pre = make(transport, "prefill", seed=1)
    dec = make(transport, "decode", metrics=metrics)
    pc, dc = Collector(pre), Collector(dec)
    params = pre.publish("req", [7, 8, 9, 2, 40, 41, 63], num_tokens=110, first_token_id=5)
    assert params.engine_id == pre.engine_id and params.side_channel == pre.side_channel_address
    # decode's prefix cache already holds the first block: it pulls the other six
    remote, local = [8, 9, 2, 40, 41, 63], [0, 1, 5, 20, 21, 3]
    dec.start_load("d-req", params, remote, local)
    result = dc.load("d-req")
    assert (result.ok, result.reason) == (True, None)
    assert_copied(pre.kv_cache, dec.kv_cache, remote, local)
    pc.release("req")
    nbytes = registry.get_sample_value(
        "tandem_kv_transfer_bytes_total",
        {"model": "demo", "role": "decode", "direction": "recv", "transport": transport},
    )
    assert nbytes == 6 * SMALL.block_bytes


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_ended_load_and_a_release_wake_the_engine(make, transport: str) -> None:
    """``wake`` (the engine thread's) is called once a load has ended, with its result already
    takeable, and once released blocks are takeable on the prefill: an engine that only waits
    on the connector takes them then, not at its next poll."""
    woke = {"prefill": threading.Event(), "decode": threading.Event()}
    pre = make(transport, "prefill", seed=1, wake=woke["prefill"].set)
    dec = make(transport, "decode", wake=woke["decode"].set)
    params = pre.publish("req", [3, 4], num_tokens=20, first_token_id=5)
    assert not woke["prefill"].is_set()  # publishing is the engine's own act
    dec.start_load("d-req", params, [3, 4], [0, 1])
    assert woke["decode"].wait(10.0)
    (result,) = dec.take_finished_loads()
    assert (result.request_id, result.ok) == ("d-req", True)
    assert woke["prefill"].wait(10.0)  # decode's release after the pull
    assert pre.take_released() == ["req"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_prefills_two_decodes_concurrently(make, transport: str) -> None:
    pres = [make(transport, "prefill", seed=10 + i) for i in range(2)]
    decs = [make(transport, "decode") for _ in range(2)]
    dcs = [Collector(d) for d in decs]
    plans = []
    for i in range(8):
        pre, dec = pres[i % 2], decs[(i // 2) % 2]
        remote = [(i * 7 + k * 3) % 64 for k in range(4)]
        local = [i * 4 + k for k in range(4)][::-1]
        params = pre.publish(f"r{i}", remote, 64, i)
        dec.start_load(f"d{i}", params, remote, local)
        plans.append((pre, dec, remote, local))
    for i, (pre, dec, remote, local) in enumerate(plans):
        result = dcs[(i // 2) % 2].load(f"d{i}")
        assert result.ok, result
        for r, loc in zip(remote, local, strict=True):
            assert same(dec.kv_cache[loc], pre.kv_cache[r])
    for pre in pres:
        pc = Collector(pre)
        for i in range(8):
            if plans[i][0] is pre:
                pc.release(f"r{i}")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_full_local_hit_just_releases(make, transport: str) -> None:
    pre, dec = make(transport, "prefill", seed=2), make(transport, "decode")
    pc, dc = Collector(pre), Collector(dec)
    params = pre.publish("req", [1, 2], 32, 9)
    dec.start_load("d", params, [], [])
    assert dc.load("d").ok
    pc.release("req")
    assert not dec.kv_cache.view(torch.uint8).any()


def test_lease_expires_when_decode_never_pulls(make) -> None:
    registry = CollectorRegistry()
    metrics = create_kv_transfer_metrics(registry, "demo", "prefill")
    pre = make("tcp", "prefill", lease_seconds=0.3, metrics=metrics)
    pc = Collector(pre)
    pre.publish("forgotten", [1, 2, 3], 48, 1)
    pre.publish("also", [4], 16, 1)
    pc.release("forgotten", timeout=5.0)
    pc.release("also", timeout=5.0)
    assert (
        registry.get_sample_value(
            "tandem_kv_transfer_failures_total",
            {"model": "demo", "role": "prefill", "reason": "lease_expired"},
        )
        == 2
    )


def test_decode_renews_lease_while_load_pending(make) -> None:
    """A fake prefill that accepts the handshake but never answers the PULL: the pending load
    must renew its lease every third of it, and give up with TIMEOUT, never success."""
    ctx = zmq.Context.instance()
    side, data = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    side_port = side.bind_to_random_port("tcp://127.0.0.1")
    data_port = data.bind_to_random_port("tcp://127.0.0.1")
    try:
        dec = make("tcp", "decode", transfer_timeout=2.0)
        dc = Collector(dec)
        params = KVTransferParams.from_dict(
            {
                "engine_id": "fake",
                "side_channel": f"tcp://127.0.0.1:{side_port}",
                "remote_request_id": "req",
                "block_ids": [1, 2],
                "num_tokens": 32,
                "first_token_id": 1,
                "lease_seconds": 0.6,
                "transfer_secret": SECRET,
            }
        )
        dec.start_load("d", params, [1, 2], [1, 2])
        ident, hello = side.recv_multipart()
        assert isinstance(p.unseal(hello, OPEN), p.Hello)
        reply = p.HelloOk("fake", "tcp", SMALL, f"tcp://127.0.0.1:{data_port}")
        side.send_multipart([ident, p.seal(reply, OPEN)])
        data_ident, ready, proof = data.recv_multipart()
        assert (data_ident, ready) == (ident, b"ready")
        assert OPEN.check_connect(b"tcp-data", data_ident, proof)
        data.send_multipart([data_ident, b"ready"])
        seen = []
        while len([m for m in seen if isinstance(m, p.Renew)]) < 3:
            assert side.poll(3000), f"no renewal; saw {seen}"
            seen.append(p.unseal(side.recv_multipart()[1], OPEN))
        renews = [m for m in seen if isinstance(m, p.Renew)]
        holder = holder_proof(SECRET, "fake", "req")
        assert all(m == p.Renew("fake", ("req",), (holder,)) for m in renews)
        assert isinstance(seen[0], p.Pull) and seen[0].segments == ((1, 2),)
        assert seen[0].proof == pull_proof(SECRET, "fake", "req", seen[0].xfer_id, ((1, 2),))
        result = dc.load("d")
        assert (result.ok, result.reason) == (False, FailureReason.TIMEOUT)
        # and it tells prefill to release what it will not pull
        while True:
            assert side.poll(3000), "no release"
            msg = p.unseal(side.recv_multipart()[1], OPEN)
            if isinstance(msg, p.Release):
                assert msg == p.Release("fake", "req", p.ReleaseKind.FAILED, holder)
                break
    finally:
        side.close(linger=0)
        data.close(linger=0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_on_prefill_releases_and_fails_later_pull(make, transport: str) -> None:
    pre, dec = make(transport, "prefill", seed=4), make(transport, "decode")
    pc, dc = Collector(pre), Collector(dec)
    params = pre.publish("req", [1, 2], 32, 9)
    pre.abort("req")
    pc.poll()
    assert pc.released == ["req"]
    dec.start_load("d", params, [1, 2], [3, 4])
    result = dc.load("d")
    assert (result.ok, result.reason) == (False, FailureReason.UNKNOWN_REQUEST)
    assert not dec.kv_cache.view(torch.uint8).any()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_on_decode_reports_and_releases_prefill(make, transport: str) -> None:
    pre, dec = make(transport, "prefill", seed=5), make(transport, "decode")
    pc, dc = Collector(pre), Collector(dec)
    params = pre.publish("req", [1, 2], 32, 9)
    dec.start_load("d", params, [1, 2], [3, 4])
    dec.abort("d")
    result = dc.load("d")
    assert (result.ok, result.reason) == (False, FailureReason.ABORTED)
    pc.release("req")


@pytest.mark.parametrize(
    ("other", "field"),
    [
        (KVLayout(4, 2, 64, 32, "float32", 64), "block_size"),
        (KVLayout(4, 2, 64, 16, "float16", 64), "dtype"),
        (KVLayout(4, 4, 64, 16, "float32", 64), "num_kv_heads"),
    ],
)
def test_layout_mismatch_refused_at_handshake(make, other: KVLayout, field: str) -> None:
    pre, dec = make("tcp", "prefill", seed=6), make("tcp", "decode", layout=other)
    dc = Collector(dec)
    params = pre.publish("req", [1], 16, 9)
    dec.start_load("d", params, [1], [1])
    result = dc.load("d")
    assert (result.ok, result.reason) == (False, FailureReason.LAYOUT_MISMATCH)
    assert field in result.detail and "KV layout mismatch" in result.detail


def test_restarted_prefill_is_detected_as_stale(make) -> None:
    old = make("tcp", "prefill", seed=7)
    params = old.publish("req", [1], 16, 9)
    port = int(params.side_channel.rsplit(":", 1)[1])
    old.close()
    new = make("tcp", "prefill", seed=8, side_channel_port=port)
    assert new.side_channel_address == params.side_channel and new.engine_id != old.engine_id
    new.publish("req", [1], 16, 9)  # same request id on the successor: must not be served
    dec = make("tcp", "decode")
    dc = Collector(dec)
    dec.start_load("d", params, [1], [1])
    result = dc.load("d")
    assert (result.ok, result.reason) == (False, FailureReason.STALE_ENGINE)
    assert not dec.kv_cache.view(torch.uint8).any()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_loads_from_a_known_prefill_skip_the_handshake_until_its_engine_changes(
    make, transport: str
) -> None:
    """A load from a prefill engine decode already shook hands with takes the open link at once
    (no ``_peer_for``); one whose params name another engine at the same address (a restart)
    does not, and handshakes afresh with the successor."""
    old = make(transport, "prefill", seed=7)
    dec = make(transport, "decode")
    dc = Collector(dec)
    side = dec._decode
    looked_up: list[str] = []
    peer_for = side._peer_for

    async def counting_peer_for(params: KVTransferParams):  # noqa: ANN202
        looked_up.append(params.engine_id)
        return await peer_for(params)

    side._peer_for = counting_peer_for
    for i in range(3):
        params = old.publish(f"r{i}", [i + 1], 16, 9)
        dec.start_load(f"d{i}", params, [i + 1], [i + 1])
        assert dc.load(f"d{i}").ok
        assert same(dec.kv_cache[i + 1], old.kv_cache[i + 1])
    assert looked_up == [old.engine_id]  # the first load's handshake only
    port = int(params.side_channel.rsplit(":", 1)[1])
    old.close()
    new = make(transport, "prefill", seed=8, side_channel_port=port)
    params = new.publish("r9", [9], 16, 9)
    dec.start_load("d9", params, [9], [9])
    result = dc.load("d9")
    assert (result.ok, result.reason) == (True, None)
    assert same(dec.kv_cache[9], new.kv_cache[9])
    assert looked_up == [old.engine_id, new.engine_id]


def test_dead_peer_does_not_block_others(make) -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        pre = make("tcp", "prefill", seed=9)
        dec = make("tcp", "decode", handshake_timeout=1.0)
        dc = Collector(dec)
        ghost = pre.publish("ghost", [3], 16, 1).to_dict()
        ghost["side_channel"] = f"tcp://127.0.0.1:{port}"
        dec.start_load("d-ghost", KVTransferParams.from_dict(ghost), [3], [3])
        params = pre.publish("real", [4, 5], 32, 1)
        dec.start_load("d-real", params, [4, 5], [10, 11])
        assert dc.load("d-real", timeout=5.0).ok
        assert "d-ghost" not in dc.loads  # still waiting on the dead peer
        assert same(dec.kv_cache[10:12], pre.kv_cache[4:6])
        ghost_result = dc.load("d-ghost", timeout=5.0)
        assert (ghost_result.ok, ghost_result.reason) == (False, FailureReason.HANDSHAKE)
    finally:
        silent.close(linger=0)


class RawPeer:
    """A hostile or buggy decode speaking raw frames to a prefill side channel."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, b"R" * 16)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, data: bytes, sealed: bool = True) -> p.Message:
        """Send ``data`` (sealed as a connector would, unless told not to); the reply."""
        self.sock.send(OPEN.seal(data) if sealed else data)
        assert self.sock.poll(5000), "no answer"
        return p.unseal(self.sock.recv(), OPEN)

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_side_channel_input_rejected_while_real_transfer_completes(
    make, transport: str
) -> None:
    registry = CollectorRegistry()
    metrics = create_kv_transfer_metrics(registry, "demo", "prefill")
    pre = make(transport, "prefill", seed=11, metrics=metrics)
    dec = make(transport, "decode")
    pc, dc = Collector(pre), Collector(dec)
    victim = pre.publish("victim", [20, 21, 22], 48, 1)
    raw = RawPeer(pre.side_channel_address)
    try:
        eid = pre.engine_id

        def pull(engine: str, rid: str, xfer: int, segs: tuple[tuple[int, int], ...]) -> p.Pull:
            # a peer that does hold the transfer's secret, asking for the wrong things
            proof = pull_proof(victim.transfer_secret, engine, rid, xfer, segs)
            return p.Pull(engine, rid, xfer, segs, proof)

        cases = [
            (b"\xc1garbage", "malformed"),
            (msgpack.packb({"v": 99, "t": "hello"}), "version"),
            (msgpack.packb({"v": p.PROTOCOL_VERSION, "t": "gimme"}), "unknown_type"),
            (p.encode_message(pull(eid, "victim", 1, ((20, 3),))), "no_handshake"),
        ]
        for data, code in cases:
            reply = raw.ask(data)
            assert isinstance(reply, p.Error) and reply.code == code, reply
        hello = raw.ask(p.encode_message(p.Hello("raw", transport, SMALL)))
        assert isinstance(hello, p.HelloOk) and hello.engine_id == eid
        cases = [
            (pull(eid, "nobody", 2, ((20, 3),)), "unknown_request"),
            (pull(eid, "victim", 3, ((60, 10),)), "invalid_request"),  # out of range
            (pull(eid, "victim", 4, ((19, 2),)), "invalid_request"),  # not the request's
            (pull("someone-else", "victim", 5, ((20, 1),)), "stale_engine"),
            (p.Release("someone-else", "victim", p.ReleaseKind.DONE, "0" * 64), "stale_engine"),
        ]
        for msg, code in cases:
            reply = raw.ask(p.encode_message(msg))
            assert isinstance(reply, p.Error) and reply.code == code, reply
        # an oversized frame: zmq drops it and disconnects that peer only
        raw.sock.send(b"\x00" * (p.MAX_MESSAGE_BYTES + 10))
        dec.start_load("d", victim, [20, 21, 22], [1, 2, 3])
        assert dc.load("d").ok
        for r, loc in ((20, 1), (21, 2), (22, 3)):
            assert same(dec.kv_cache[loc], pre.kv_cache[r])
        pc.release("victim")
        bad = registry.get_sample_value(
            "tandem_kv_transfer_failures_total",
            {"model": "demo", "role": "prefill", "reason": "bad_message"},
        )
        assert bad == 3
    finally:
        raw.close()


def test_start_load_bad_arguments_change_nothing(make) -> None:
    pre, dec = make("tcp", "prefill", seed=12), make("tcp", "decode")
    params = pre.publish("req", [1, 2], 32, 9)
    with pytest.raises(ValueError, match="subset"):
        dec.start_load("d", params, [1, 3], [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        dec.start_load("d", params, [1, 2], [1, 64])
    with pytest.raises(ValueError, match="length"):
        dec.start_load("d", params, [1, 2], [1])
    with pytest.raises(ValueError, match="repeat"):
        dec.start_load("d", params, [1, 2], [5, 5])
    with pytest.raises(ValueError, match="out of range"):
        pre.publish("other", [64], 16, 1)
    with pytest.raises(ValueError, match="already published"):
        pre.publish("req", [3], 16, 1)
    assert dec.take_finished_loads() == [] and pre.take_released() == []
    with pytest.raises(RuntimeError):
        dec.publish("x", [1], 16, 1)
    with pytest.raises(RuntimeError):
        pre.start_load("x", params, [1], [1])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bind_all_interfaces_advertises_reachable_host(make, transport: str) -> None:
    pre = make(transport, "prefill", seed=13, host="0.0.0.0", advertise_host="127.0.0.1")
    dec = make(transport, "decode")
    dc = Collector(dec)
    assert pre.side_channel_address.startswith("tcp://127.0.0.1:")
    params = pre.publish("req", [6], 16, 1)
    dec.start_load("d", params, [6], [9])
    assert dc.load("d").ok
    assert same(dec.kv_cache[9], pre.kv_cache[6])


def test_hold_keeps_lease_alive_until_load_and_abort_releases(make) -> None:
    pre = make("tcp", "prefill", seed=14, lease_seconds=0.4)
    dec = make("tcp", "decode")
    pc, dc = Collector(pre), Collector(dec)
    kept, dropped = pre.publish("kept", [2, 3], 32, 1), pre.publish("dropped", [4], 16, 1)
    dec.hold("d-kept", kept)
    dec.hold("d-dropped", dropped)
    with pytest.raises(ValueError, match="already held"):
        dec.hold("d-kept", kept)
    deadline = time.monotonic() + 1.5  # more than three lease lengths
    while time.monotonic() < deadline:
        pc.poll()
        assert pc.released == [], "a held request lost its lease"
        time.sleep(0.01)
    dec.abort("d-dropped")
    pc.release("dropped", timeout=5)
    dec.start_load("d-kept", kept, [2, 3], [7, 8])
    assert dc.load("d-kept").ok
    assert same(dec.kv_cache[7:9], pre.kv_cache[2:4])
    pc.release("kept")
    assert "d-dropped" not in dc.loads  # a held request that never loaded has no LoadResult


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_without_the_transfer_secret_gets_nothing(make, transport: str) -> None:
    """A decode holding the cluster token but not the grant's secret: refused before a byte
    moves (UCX too: its receives are never posted), and the grant stays pullable."""
    from tandem.engine.cluster_token import ClusterToken

    token = ClusterToken(["one-cluster-token-for-both"])
    registry = CollectorRegistry()
    metrics = create_kv_transfer_metrics(registry, "demo", "prefill")
    pre = make(transport, "prefill", seed=31, cluster_token=token, metrics=metrics)
    dec = make(transport, "decode", cluster_token=token)
    dc = Collector(dec)
    params = pre.publish("req", [3, 4], 32, 1)
    guessed = KVTransferParams.from_dict({**params.to_dict(), "transfer_secret": "1" * 64})
    dec.start_load("guess", guessed, [3, 4], [8, 9])
    result = dc.load("guess")
    assert (result.ok, result.reason) == (False, FailureReason.UNAUTHORIZED)
    assert not dec.kv_cache.view(torch.uint8).any()
    refused = registry.get_sample_value(
        "tandem_kv_transfer_failures_total",
        {"model": "demo", "role": "prefill", "reason": "unauthorized"},
    )
    assert refused >= 1  # the pull (and the guesser's release) were refused and counted
    dec.start_load("real", params, [3, 4], [8, 9])
    assert dc.load("real").ok
    assert same(dec.kv_cache[8:10], pre.kv_cache[3:5])
    Collector(pre).release("req")


def test_connectors_with_different_tokens_never_handshake(make) -> None:
    from tandem.engine.cluster_token import ClusterToken

    pre = make("tcp", "prefill", seed=32, cluster_token=ClusterToken(["prefill-side-token-1"]))
    dec = make("tcp", "decode", cluster_token=ClusterToken(["decode-side-token-22"]),
               handshake_timeout=1.0)  # fmt: skip
    dc = Collector(dec)
    dec.start_load("d", pre.publish("req", [1], 16, 1), [1], [1])
    result = dc.load("d")
    assert not result.ok and result.reason in (FailureReason.UNAUTHORIZED, FailureReason.HANDSHAKE)
    assert not dec.kv_cache.view(torch.uint8).any()


def test_different_fingerprints_never_exchange_kv(make) -> None:
    """Another model computed the prefill's KV: refused at the handshake, naming both sides,
    before a byte reaches decode's blocks; the same fingerprint moves the blocks."""
    pre = make("tcp", "prefill", seed=41, fingerprint="aaaa", identity="model A")
    other = make("tcp", "decode", fingerprint="bbbb", identity="model B")
    same_fp = make("tcp", "decode", fingerprint="aaaa", identity="model A")
    params = pre.publish("req", [2, 3], 32, 1)
    oc, sc = Collector(other), Collector(same_fp)
    other.start_load("d", params, [2, 3], [4, 5])
    result = oc.load("d")
    assert (result.ok, result.reason) == (False, FailureReason.INCOMPATIBLE)
    assert "model A" in result.detail and "model B" in result.detail
    assert not other.kv_cache.view(torch.uint8).any()
    same_fp.start_load("d", params, [2, 3], [4, 5])
    assert sc.load("d").ok
    assert same(same_fp.kv_cache[4:6], pre.kv_cache[2:4])
    Collector(pre).release("req")
