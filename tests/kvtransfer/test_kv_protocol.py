"""Wire protocol: encode/decode round trips and exact rejection of bad frames."""

from __future__ import annotations

import msgpack
import pytest

from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer import protocol as p

LAYOUT = KVLayout(4, 2, 64, 16, "float32", 64)
V = p.PROTOCOL_VERSION
PROOF = "ab" * 32


def _raw(**body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "msg",
    [
        p.Hello("dec", "ucx", LAYOUT),
        p.HelloOk("pre", "tcp", LAYOUT, "tcp://127.0.0.1:5000"),
        p.Pull("pre", "req-1", 7, ((3, 2), (9, 1)), PROOF),
        p.PullAccepted(7),
        p.PullDone(7, True, None),
        p.PullDone(8, False, "timeout"),
        p.Renew("pre", ("a", "b"), (PROOF, "cd" * 32)),
        p.Renew("pre", (), ()),
        p.Release("pre", "req-1", p.ReleaseKind.ABORTED, PROOF),
        p.Aborted("pre", "req-1", "lease_expired"),
        p.Error("unknown_request", "nope", "req-1", 7),
        p.Error("malformed", "bad", None, None),
    ],
)
def test_round_trip(msg: p.Message) -> None:
    assert p.decode_message(p.encode_message(msg)) == msg


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"\xc1\xff garbage", "malformed"),
        (b"", "malformed"),
        (
            _raw(v=V, t="hello", engine_id="x", transport="tcp", layout=LAYOUT.to_wire()) + b"x",
            "malformed",
        ),
        (msgpack.packb([1, 2, 3]), "malformed"),
        (_raw(v=V + 1, t="pull"), "version"),
        (_raw(t="pull"), "version"),
        (_raw(v=V, t="teleport"), "unknown_type"),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="r", xfer_id=1, segments=[]),
            "invalid_field",
        ),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="r", xfer_id=1, segments=[[-1, 2]]),
            "invalid_field",
        ),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="r", xfer_id=1, segments=[[0, 0]]),
            "invalid_field",
        ),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="r", xfer_id=1, segments=[[0, 1.5]]),
            "invalid_field",
        ),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="r", xfer_id=-1, segments=[[0, 1]]),
            "invalid_field",
        ),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="r", xfer_id=True, segments=[[0, 1]]),
            "invalid_field",
        ),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="", xfer_id=1, segments=[[0, 1]]),
            "invalid_field",
        ),
        (
            _raw(v=V, t="pull", engine_id="e", request_id="r" * 257, xfer_id=1, segments=[[0, 1]]),
            "invalid_field",
        ),
        (_raw(v=V, t="pull", engine_id="e", xfer_id=1, segments=[[0, 1]]), "invalid_field"),
        (
            _raw(v=V, t="hello", engine_id="e", transport="rdma", layout=LAYOUT.to_wire()),
            "invalid_field",
        ),
        (
            _raw(
                v=V,
                t="hello",
                engine_id="e",
                transport="tcp",
                layout={**LAYOUT.to_wire(), "dtype": "int64"},
            ),
            "invalid_field",
        ),
        (
            _raw(
                v=V,
                t="hello",
                engine_id="e",
                transport="tcp",
                layout={**LAYOUT.to_wire(), "extra": 1},
            ),
            "invalid_field",
        ),
        (
            _raw(
                v=V,
                t="hello",
                engine_id="e",
                transport="tcp",
                layout={**LAYOUT.to_wire(), "block_size": 0},
            ),
            "invalid_field",
        ),
        (_raw(v=V, t="renew", engine_id="e", request_ids=["a", 3]), "invalid_field"),
        (
            _raw(v=V, t="renew", engine_id="e", request_ids=["a"] * (p.MAX_RENEW_IDS + 1)),
            "invalid_field",
        ),
        (_raw(v=V, t="release", engine_id="e", request_id="r", kind="maybe"), "invalid_field"),
        (_raw(v=V, t="pull_done", xfer_id=1, ok=1, reason=None), "invalid_field"),
        (
            msgpack.packb({"v": V, "t": "pull_ok", "xfer_id": b"\x01"}, use_bin_type=True),
            "malformed",
        ),
        (b"\x00" * (p.MAX_MESSAGE_BYTES + 1), "oversized"),
    ],
)
def test_rejects(data: bytes, code: str) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_message(data)
    assert info.value.code == code


def test_check_pull_segments() -> None:
    owned = frozenset({2, 3, 4, 10})
    assert p.check_pull_segments(((2, 3), (10, 1)), owned, 64) is None
    assert p.check_pull_segments(((3, 1),), owned, 64) is None
    assert p.check_pull_segments(((4, 2),), owned, 64) == "block 5 is not part of this request"
    assert p.check_pull_segments(((2, 1), (2, 1)), owned, 64) == "block 2 requested twice"
    assert p.check_pull_segments(((63, 2),), owned, 64) == (
        "blocks 63..64 out of range (num_blocks 64)"
    )


def test_plan_segments_coalesces_runs_contiguous_on_both_sides() -> None:
    assert p.plan_segments([3, 4, 5, 9, 10], [0, 1, 7, 8, 9]) == [(3, 0, 2), (5, 7, 1), (9, 8, 2)]
    assert p.plan_segments([], []) == []
    assert p.plan_segments([5, 4], [1, 2]) == [(5, 1, 1), (4, 2, 1)]
    with pytest.raises(ValueError):
        p.plan_segments([1, 2], [1])


def test_sealed_frames_open_only_under_the_same_token() -> None:
    from tandem.engine.cluster_token import ClusterToken
    from tandem.kvtransfer.auth import FrameAuth

    ours = FrameAuth(ClusterToken(["token-of-this-cluster-0001"]))
    theirs = FrameAuth(ClusterToken(["token-of-another-cluster-2"]))
    msg = p.Pull("pre", "req-1", 7, ((3, 2),), PROOF)
    assert p.unseal(p.seal(msg, ours), ours) == msg
    for frame in (p.seal(msg, theirs), p.encode_message(msg), b"", b"\x00" * 40):
        with pytest.raises(p.ProtocolError) as info:
            p.unseal(frame, ours)
        assert info.value.code == "unauthorized"
    tampered = bytearray(p.seal(msg, ours))
    tampered[-1] ^= 1
    with pytest.raises(p.ProtocolError) as info:
        p.unseal(bytes(tampered), ours)
    assert info.value.code == "unauthorized"
    with pytest.raises(p.ProtocolError) as info:
        p.unseal(b"\x00" * (p.MAX_FRAME_BYTES + 1), ours)
    assert info.value.code == "oversized"


@pytest.mark.parametrize(
    "body",
    [
        _raw(v=V, t="pull", engine_id="e", request_id="r", xfer_id=1, segments=[[0, 1]]),
        _raw(
            v=V,
            t="pull",
            engine_id="e",
            request_id="r",
            xfer_id=1,
            segments=[[0, 1]],
            proof="AB" * 32,
        ),  # fmt: skip
        _raw(
            v=V,
            t="pull",
            engine_id="e",
            request_id="r",
            xfer_id=1,
            segments=[[0, 1]],
            proof="ab" * 31,
        ),  # fmt: skip
        _raw(v=V, t="renew", engine_id="e", request_ids=["a", "b"], proofs=[PROOF]),
        _raw(v=V, t="release", engine_id="e", request_id="r", kind="done"),
    ],
)
def test_proofs_are_required_and_well_formed(body: bytes) -> None:
    with pytest.raises(p.ProtocolError) as info:
        p.decode_message(body)
    assert info.value.code == "invalid_field"
