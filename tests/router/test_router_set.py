"""RouterSet: a worker registers with every address a router name resolves to (a headless
Service's pods), follows DNS as routers come and go, and deregisters from all on stop. Two real
router apps listen on the same port of 127.0.0.1 and 127.0.0.2, standing for two router pods."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from router_testlib import MODEL, router_config, wait_for
from worker_double import TEST_TOKEN, free_port, serve

from tandem.engine.hashing import HASH_ALGORITHM
from tandem.engine.worker.router_set import RouterSet, endpoints
from tandem.router.app import create_app
from tandem.router.internal_app import create_internal_app


def test_endpoints_expand_every_address() -> None:
    table = {"routers.ns.svc": ["10.0.0.2", "10.0.0.1"], "v6.ns.svc": ["fd00::1"]}

    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError("NXDOMAIN")
        return sorted(table[host])

    urls = ["http://routers.ns.svc:8001", "http://10.0.0.9:8001/", "https://v6.ns.svc",
            "http://missing.ns.svc:8001", "http://routers.ns.svc:8001"]  # fmt: skip
    assert endpoints(urls, resolve) == [
        "http://10.0.0.1:8001", "http://10.0.0.2:8001", "http://10.0.0.9:8001",
        "https://[fd00::1]:443",
    ]  # fmt: skip


def info() -> dict[str, Any]:
    return {
        "engine_id": ENGINE_ID, "role": "decode", "model": MODEL, "url": "http://127.0.0.1:1",
        "block_size": 4, "hash_algorithm": HASH_ALGORITHM, "max_model_len": 256,
        "num_blocks": 64, "kv_events_endpoint": None, "kv_side_channel": None,
    }  # fmt: skip


def load() -> dict[str, Any]:
    return {"engine_id": ENGINE_ID, "running": 0, "waiting": 0, "kv_usage": 0.0,
            "num_free_blocks": 64}  # fmt: skip


ENGINE_ID = uuid.uuid4().hex


async def test_registers_with_every_router_and_follows_dns(tokenizer_dir: Path) -> None:
    port = free_port()
    routers, served = [], []
    try:
        for host in ("127.0.0.1", "127.0.0.2"):
            app = create_app(router_config(tokenizer_dir, heartbeat_timeout_s=5.0))
            served.append(await serve(app))
            served.append(await serve(create_internal_app(app), port, lifespan="off", host=host))
            routers.append(app)
        addresses = ["127.0.0.1", "127.0.0.2"]
        rs = RouterSet([f"http://routers.test:{port}"], info, load, interval_s=0.1,
                       token=TEST_TOKEN, resolve_interval_s=0.1,
                       resolve=lambda host, p: list(addresses))  # fmt: skip
        rs.start()

        def live(app: Any) -> bool:
            return app.state.router.registry.is_live(ENGINE_ID)

        await wait_for(lambda: all(live(a) for a in routers), 10, "registered with both")
        assert sorted(rs.registered) == [f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"]
        addresses.remove("127.0.0.2")  # that router pod went away
        await wait_for(lambda: not live(routers[1]), 10, "deregistered from the gone router")
        assert live(routers[0])
        addresses.append("127.0.0.2")  # and came back (a restart)
        await wait_for(lambda: live(routers[1]), 10, "registered again")
        await rs.stop()
        assert not live(routers[0]) and not live(routers[1])
    finally:
        for s in reversed(served):
            await s.stop()


@pytest.mark.parametrize("transient", [[], ["10.255.255.1"]])
async def test_a_failed_resolution_keeps_the_known_routers(transient: list[str]) -> None:
    known = ["127.0.0.1"]
    rs = RouterSet(["http://r.test:1"], info, load, resolve=lambda h, p: list(known))
    await rs.refresh()
    assert list(rs.registrars) == ["http://127.0.0.1:1"]
    known[:] = transient
    if not transient:  # nothing resolves: a DNS hiccup must not deregister everywhere
        await rs.refresh()
        assert list(rs.registrars) == ["http://127.0.0.1:1"]
    await rs.stop()
