"""Prefill-side lease bookkeeping: which pinned requests to release, and when (pure, no I/O).

A published request holds its blocks under a short lease that decode renews while it still
intends to pull. The blocks are released on decode's confirmation, on an abort from either side,
or when the lease runs out. A release that arrives while a transfer is still reading the blocks
is deferred until the transfer ends, so the engine never reuses memory that is on the wire; a
transfer that never ends is cut off ``stuck_grace`` seconds later.

The connector owns one ``LeaseTable`` under its lock and feeds it events with the current time;
every method returns the releases it caused, each exactly once per request.

A lease has an owner: the decode peer that last renewed it or pulled from it. A release sent by
another peer is ignored, so a decode that lost the request (it stalled past the router's
heartbeat expiry and the router retried elsewhere) cannot free the blocks its successor is
about to pull. Releases without a peer (prefill's own aborts, expiry) always apply.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.kv_connector import FailureReason


@dataclass(frozen=True, slots=True)
class Released:
    request_id: str
    reason: FailureReason | None  # None: decode confirmed it has the blocks


@dataclass(slots=True)
class _Lease:
    lease_seconds: float
    deadline: float
    in_flight: int = 0
    releasing: bool = False
    reason: FailureReason | None = None
    hard_deadline: float = 0.0
    owner: bytes | None = None  # the decode peer that last renewed or pulled


class LeaseTable:
    """Leases keyed by request id. Not thread-safe: the owner serializes calls."""

    def __init__(self, stuck_grace: float) -> None:
        if stuck_grace <= 0:
            raise ValueError("stuck_grace must be positive")
        self._stuck_grace = stuck_grace
        self._leases: dict[str, _Lease] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def in_flight(self, request_id: str) -> int:
        lease = self._leases.get(request_id)
        return 0 if lease is None else lease.in_flight

    def is_active(self, request_id: str) -> bool:
        """True while decode may still pull: known and not being released."""
        lease = self._leases.get(request_id)
        return lease is not None and not lease.releasing

    def add(self, request_id: str, now: float, lease_seconds: float) -> None:
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} is already published")
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self._leases[request_id] = _Lease(lease_seconds, now + lease_seconds)

    def renew(self, request_id: str, now: float, owner: bytes | None = None) -> bool:
        """Extend the lease by its length from now (``owner``, when given, takes it over);
        False if unknown or already releasing."""
        lease = self._leases.get(request_id)
        if lease is None or lease.releasing:
            return False
        lease.deadline = max(lease.deadline, now + lease.lease_seconds)
        if owner is not None:
            lease.owner = owner
        return True

    def begin_transfer(self, request_id: str, now: float, owner: bytes | None = None) -> bool:
        """A pull starts reading the blocks; counts as a renewal. False if it may not start."""
        if not self.renew(request_id, now, owner):
            return False
        self._leases[request_id].in_flight += 1
        return True

    def end_transfer(self, request_id: str, now: float) -> list[Released]:
        lease = self._leases.get(request_id)
        if lease is None or lease.in_flight == 0:
            return []
        lease.in_flight -= 1
        lease.deadline = max(lease.deadline, now + lease.lease_seconds)
        return self._maybe_release(request_id, lease)

    def release(
        self,
        request_id: str,
        reason: FailureReason | None,
        now: float,
        owner: bytes | None = None,
    ) -> list[Released]:
        """Confirmation (reason None) or abort: release now, or once in-flight reads end. A
        release from a peer (``owner``) other than the lease's owner is ignored."""
        lease = self._leases.get(request_id)
        if lease is None:
            return []
        if owner is not None and lease.owner is not None and owner != lease.owner:
            return []
        if not lease.releasing:
            lease.releasing = True
            lease.reason = reason
            lease.hard_deadline = now + self._stuck_grace
        return self._maybe_release(request_id, lease)

    def expire(self, now: float) -> list[Released]:
        """Leases past their deadline end as LEASE_EXPIRED; stuck transfers are cut off."""
        out: list[Released] = []
        for rid, lease in list(self._leases.items()):
            if lease.releasing:
                if now >= lease.hard_deadline:
                    del self._leases[rid]
                    out.append(Released(rid, lease.reason))
            elif now >= lease.deadline:
                out.extend(self.release(rid, FailureReason.LEASE_EXPIRED, now))
        return out

    def _maybe_release(self, request_id: str, lease: _Lease) -> list[Released]:
        if lease.releasing and lease.in_flight == 0:
            del self._leases[request_id]
            return [Released(request_id, lease.reason)]
        return []
