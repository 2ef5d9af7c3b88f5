"""Lease state machine under a fake clock."""

from __future__ import annotations

import pytest

from tandem.engine.kv_connector import FailureReason as R
from tandem.kvtransfer.lease import LeaseTable, Released


def test_expires_without_renewal() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", now=0.0, lease_seconds=2.0)
    assert t.expire(1.9) == []
    assert t.expire(2.0) == [Released("a", R.LEASE_EXPIRED)]
    assert "a" not in t and t.expire(10.0) == []


def test_renewal_extends_from_now() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 2.0)
    assert t.renew("a", 1.5)
    assert t.expire(3.0) == []
    assert t.expire(3.5) == [Released("a", R.LEASE_EXPIRED)]
    assert not t.renew("a", 4.0)
    assert not t.renew("unknown", 0.0)


def test_confirm_releases_once() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 2.0)
    assert t.release("a", None, 1.0) == [Released("a", None)]
    assert t.release("a", None, 1.0) == []
    assert t.expire(100.0) == []


def test_release_waits_for_in_flight_transfer() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 2.0)
    assert t.begin_transfer("a", 1.0)
    assert t.release("a", R.ABORTED, 1.5) == []
    assert not t.is_active("a")
    assert not t.begin_transfer("a", 1.6)  # no new pulls once releasing
    assert t.end_transfer("a", 2.0) == [Released("a", R.ABORTED)]


def test_expiry_during_transfer_defers_then_releases() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 1.0)
    assert t.begin_transfer("a", 0.5)
    assert t.expire(1.6) == []  # deadline passed while the blocks are on the wire
    assert t.end_transfer("a", 1.7) == [Released("a", R.LEASE_EXPIRED)]


def test_stuck_transfer_is_cut_off_after_grace() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 1.0)
    t.begin_transfer("a", 0.0)
    assert t.expire(1.0) == []
    assert t.expire(5.9) == []
    assert t.expire(6.0) == [Released("a", R.LEASE_EXPIRED)]
    assert t.end_transfer("a", 7.0) == []


def test_two_transfers_both_must_end() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 1.0)
    t.begin_transfer("a", 0.0)
    t.begin_transfer("a", 0.0)
    assert t.release("a", None, 0.1) == []
    assert t.end_transfer("a", 0.2) == []
    assert t.end_transfer("a", 0.3) == [Released("a", None)]


def test_independent_requests() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 1.0)
    t.add("b", 0.0, 3.0)
    assert t.expire(1.0) == [Released("a", R.LEASE_EXPIRED)]
    assert len(t) == 1 and t.is_active("b")


def test_bad_input() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("a", 0.0, 1.0)
    with pytest.raises(ValueError):
        t.add("a", 0.0, 1.0)
    with pytest.raises(ValueError):
        t.add("b", 0.0, 0.0)
    with pytest.raises(ValueError):
        LeaseTable(stuck_grace=0)
    assert len(t) == 1


def test_a_release_from_a_decode_that_no_longer_owns_the_lease_is_ignored() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("r", now=0.0, lease_seconds=10.0)
    assert t.renew("r", 1.0, owner=b"d1")
    assert t.renew("r", 2.0, owner=b"d2")  # a retry on another decode takes the lease over
    assert t.release("r", R.PEER_ABORTED, 3.0, owner=b"d1") == []
    assert t.is_active("r")
    assert t.begin_transfer("r", 4.0, owner=b"d2")
    assert t.end_transfer("r", 5.0) == []
    assert t.release("r", None, 6.0, owner=b"d2") == [Released("r", None)]


def test_prefills_own_abort_applies_whoever_owns_the_lease() -> None:
    t = LeaseTable(stuck_grace=5.0)
    t.add("r", now=0.0, lease_seconds=10.0)
    t.renew("r", 1.0, owner=b"d1")
    assert t.release("r", R.ABORTED, 2.0) == [Released("r", R.ABORTED)]
