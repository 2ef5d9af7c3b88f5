"""`tandem up` hands its workers ports below the kernel's ephemeral range, so the ephemeral
ports the starting children bind themselves (KV events, side channels) cannot take them."""

from __future__ import annotations

import random
import socket

from tandem.up_config import _ephemeral_range, worker_port


def test_worker_ports_are_free_and_below_the_ephemeral_range() -> None:
    lo, hi = _ephemeral_range()
    assert 1024 <= lo < hi
    rng = random.Random(3)
    ports = {worker_port(rng=rng) for _ in range(50)}
    assert len(ports) > 40 and all(10000 <= p < lo for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", worker_port()))
        s.listen()
        taken = s.getsockname()[1]

        class Scripted(random.Random):
            """Offers the taken port first, then the next one."""

            def __init__(self) -> None:
                super().__init__(0)
                self.offers = [taken, taken + 1]

            def randrange(self, *_: int) -> int:  # type: ignore[override]
                return self.offers.pop(0)

        assert worker_port(rng=Scripted()) == taken + 1
