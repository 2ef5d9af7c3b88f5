"""Proofs on the KV connector (kvtransfer/auth.py): each binds exactly what it names."""

from __future__ import annotations

import pytest

from tandem.engine.cluster_token import ClusterToken
from tandem.kvtransfer.auth import (
    XFER_ID_BITS,
    FrameAuth,
    Unauthorized,
    data_mac,
    holder_proof,
    new_transfer_secret,
    new_xfer_id,
    pull_proof,
)

S = "3c" * 32


def test_pull_proof_binds_engine_request_transfer_and_blocks() -> None:
    base = pull_proof(S, "pre", "req", 7, ((1, 2),))
    assert base == pull_proof(S, "pre", "req", 7, ((1, 2),)) and len(base) == 64
    for other in (
        pull_proof(new_transfer_secret(), "pre", "req", 7, ((1, 2),)),
        pull_proof(S, "pre2", "req", 7, ((1, 2),)),
        pull_proof(S, "pre", "req2", 7, ((1, 2),)),
        pull_proof(S, "pre", "req", 8, ((1, 2),)),
        pull_proof(S, "pre", "req", 7, ((1, 3),)),
        pull_proof(S, "pre", "req", 7, ((1, 2), (9, 1))),
        pull_proof(S, "pr", "ereq", 7, ((1, 2),)),  # no ambiguity between adjacent fields
    ):
        assert other != base
    assert holder_proof(S, "pre", "req") not in (base, holder_proof(S, "pre", "req2"))
    assert data_mac(S, 7, [64, 32]) != data_mac(S, 7, [64, 33]) != data_mac(S, 8, [64, 32])


@pytest.mark.parametrize("secret", ["", "ab" * 31, "zz" * 32])
def test_malformed_secrets_are_refused(secret: str) -> None:
    with pytest.raises(Unauthorized):
        pull_proof(secret, "pre", "req", 1, ((0, 1),))


def test_frames_and_connect_proofs() -> None:
    ours = FrameAuth(ClusterToken(["cluster-token-number-one"]))
    theirs = FrameAuth(ClusterToken(["cluster-token-number-two"]))
    assert ours.open(ours.seal(b"body")) == b"body"
    for frame in (theirs.seal(b"body"), FrameAuth(None).seal(b"body"), b"body", b""):
        with pytest.raises(Unauthorized):
            ours.open(frame)
    proof = ours.connect_proof(b"tcp-data", b"t" * 16)
    assert ours.check_connect(b"tcp-data", b"t" * 16, proof)
    assert not ours.check_connect(b"ucx-data", b"t" * 16, proof)
    assert not ours.check_connect(b"tcp-data", b"u" * 16, proof)
    assert not theirs.check_connect(b"tcp-data", b"t" * 16, proof)


def test_transfer_ids_are_random_unique_and_fit_a_ucx_tag() -> None:
    taken: set[int] = set()
    for _ in range(2000):
        x = new_xfer_id(taken)
        assert 0 < x < 1 << XFER_ID_BITS and x not in taken
        taken.add(x)
    assert (max(taken) << 20 | (1 << 20) - 1) < 1 << 63
    assert len({new_transfer_secret() for _ in range(100)}) == 100
