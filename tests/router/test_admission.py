"""Admission (pure): in-flight slots, the priority queue, shedding, timeouts, Retry-After."""

from __future__ import annotations

import pytest

from tandem.router.admission import Admission, Rejection, capacity_limit


def test_admits_within_the_limit_then_queues_fifo_within_a_priority() -> None:
    a = Admission(max_queued=4, queue_timeout_s=10)
    t1, d1 = a.offer(0, 1, 0.0, limit=2)
    t2, _ = a.offer(0, 1, 0.0, limit=2)
    t3, d3 = a.offer(0, 1, 0.0, limit=2)
    t4, _ = a.offer(0, 1, 0.0, limit=2)
    assert d1.admitted == [t1] and t2.admitted and d3.admitted == [] and a.depth == 2
    assert (a.inflight, t3.admitted, t4.admitted) == (2, False, False)
    d = a.release(t1, 1.0, limit=2)
    assert d.admitted == [t3] and a.inflight == 2 and a.depth == 1


def test_lower_priority_value_is_served_first() -> None:
    a = Admission(max_queued=8, queue_timeout_s=10)
    running, _ = a.offer(0, 1, 0.0, limit=1)
    low, _ = a.offer(5, 1, 0.1, limit=1)
    high, _ = a.offer(-3, 1, 0.2, limit=1)
    mid, _ = a.offer(0, 1, 0.3, limit=1)
    assert a.release(running, 1.0, limit=1).admitted == [high]
    assert a.release(high, 1.0, limit=1).admitted == [mid]
    assert a.release(mid, 1.0, limit=1).admitted == [low]


def test_full_queue_sheds_the_lowest_priority_newest_first() -> None:
    a = Admission(max_queued=2, queue_timeout_s=10)
    a.offer(0, 1, 0.0, limit=1)
    old_low, _ = a.offer(3, 1, 0.0, limit=1)
    new_low, _ = a.offer(3, 1, 0.1, limit=1)
    high, d = a.offer(1, 1, 0.2, limit=1)
    assert d.rejected == [new_low] and new_low.rejected is Rejection.SHED
    assert old_low.rejected is None and a.depth == 2
    # A newcomer no better than the worst queued is refused itself.
    same, d = a.offer(3, 1, 0.3, limit=1)
    assert d.rejected == [same] and same.rejected is Rejection.QUEUE_FULL and a.depth == 2
    assert high.rejected is None


def test_no_queue_refuses_at_once_when_full() -> None:
    a = Admission(max_queued=0, queue_timeout_s=10)
    a.offer(0, 1, 0.0, limit=1)
    t, d = a.offer(-100, 1, 0.0, limit=1)
    assert d.rejected == [t] and t.rejected is Rejection.QUEUE_FULL


def test_queue_timeout_refuses_the_late_and_keeps_the_rest() -> None:
    a = Admission(max_queued=4, queue_timeout_s=2)
    a.offer(0, 1, 0.0, limit=1)
    early, _ = a.offer(0, 1, 0.5, limit=1)
    late, _ = a.offer(0, 1, 1.5, limit=1)
    d = a.expire(2.6, limit=1)
    assert d.rejected == [early] and early.rejected is Rejection.QUEUE_TIMEOUT
    assert a.depth == 1 and late.rejected is None


def test_slots_count_choices_and_a_big_request_runs_alone() -> None:
    a = Admission(max_queued=4, queue_timeout_s=10)
    small, _ = a.offer(0, 3, 0.0, limit=4)
    big, d = a.offer(0, 10, 0.0, limit=4)
    assert d.admitted == [] and a.inflight == 3
    assert a.release(small, 1.0, limit=4).admitted == [big] and a.inflight == 10
    blocked, d = a.offer(0, 1, 1.0, limit=4)
    assert d.admitted == []  # nobody jumps the limit while the big one runs
    assert a.release(big, 2.0, limit=4).admitted == [blocked]


def test_a_growing_limit_admits_on_expire_and_cancel_frees_the_place() -> None:
    a = Admission(max_queued=4, queue_timeout_s=10)
    a.offer(0, 1, 0.0, limit=1)
    gone, _ = a.offer(0, 1, 0.0, limit=1)
    waiting, _ = a.offer(0, 1, 0.0, limit=1)
    assert a.cancel(gone, 0.5, limit=1).admitted == [] and a.depth == 1
    assert a.expire(1.0, limit=2).admitted == [waiting] and a.inflight == 2


def test_retry_after_follows_the_queue_and_service_time() -> None:
    a = Admission(max_queued=10, queue_timeout_s=30)
    assert a.retry_after_s(limit=4) == 1
    ts = [a.offer(0, 1, 0.0, limit=1)[0] for _ in range(6)]
    for i, t in enumerate(ts[:5]):
        a.release(t, 20.0 + i, limit=1)  # long requests raise the service-time average
    assert a.retry_after_s(limit=1) > 1
    assert a.retry_after_s(limit=10**6) == 1


def test_capacity_limit_and_bad_config() -> None:
    assert capacity_limit([256, 64]) == 640 and capacity_limit([]) == 0
    with pytest.raises(ValueError):
        Admission(max_queued=-1, queue_timeout_s=1)
