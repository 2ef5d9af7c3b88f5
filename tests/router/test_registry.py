"""WorkerRegistry with an injected clock: registration, heartbeats, expiry, restarts."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.engine.role import Role
from tandem.router.errors import OpenAIError
from tandem.router.registry import Heartbeat, WorkerInfo, WorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def info(engine_id: str = "e1", url: str = "http://w1:1", role: str = "decode", **kw: Any) -> dict:
    return {
        "engine_id": engine_id, "role": role, "model": "m", "url": url, "block_size": 16,
        "hash_algorithm": "h", "max_model_len": 2048, "num_blocks": 100,
        "kv_events_endpoint": "tcp://w1:2", "kv_side_channel": None, **kw,
    }  # fmt: skip


def test_register_heartbeat_and_expire_after_timeout() -> None:
    clock = Clock()
    reg = WorkerRegistry(clock, heartbeat_timeout_s=3.0, model="m")
    reg.register(WorkerInfo.from_json(info()))
    assert [w.info.engine_id for w in reg.by_role(Role.DECODE)] == ["e1"]
    clock.now += 2.9
    hb = {"engine_id": "e1", "running": 2, "waiting": 1, "kv_usage": 0.5, "num_free_blocks": 50}
    assert reg.heartbeat(Heartbeat.from_json(hb))
    w = reg.get("e1")
    assert (w.running, w.waiting, w.kv_usage, w.num_free_blocks) == (2, 1, 0.5, 50)
    clock.now += 3.0
    assert reg.expire() == []
    clock.now += 0.01
    assert [w.info.engine_id for w in reg.expire()] == ["e1"]
    assert not reg.is_live("e1")
    assert reg.heartbeat(Heartbeat.from_json({"engine_id": "e1"})) is False


def test_restart_with_new_engine_id_replaces_old_entry() -> None:
    reg = WorkerRegistry(Clock(), model="m")
    reg.register(WorkerInfo.from_json(info("old")))
    replaced = reg.register(WorkerInfo.from_json(info("new")))
    assert [w.info.engine_id for w in replaced] == ["old"]
    assert [w.info.engine_id for w in reg.all()] == ["new"]
    assert reg.losses("old") == 1 and reg.losses("new") == 0


def test_only_expired_or_replaced_workers_count_as_lost_not_deregistered_ones() -> None:
    clock = Clock()
    reg = WorkerRegistry(clock, heartbeat_timeout_s=3.0, model="m")
    reg.register(WorkerInfo.from_json(info("drains", "http://a:1")))
    reg.register(WorkerInfo.from_json(info("dies", "http://b:1")))
    assert reg.deregister("drains") is not None
    assert not reg.is_live("drains") and reg.losses("drains") == 0  # it finishes its streams
    clock.now += 3.01
    assert [w.info.engine_id for w in reg.expire()] == ["dies"]
    assert reg.losses("dies") == 1
    reg.register(WorkerInfo.from_json(info("dies", "http://b:1")))  # it came back: streams
    assert reg.is_live("dies") and reg.losses("dies") == 1  # begun before stay given up
    clock.now += 3.01
    reg.expire()
    assert reg.losses("dies") == 2


def test_deregister_and_roles_and_max_len() -> None:
    reg = WorkerRegistry(Clock(), model="m")
    reg.register(WorkerInfo.from_json(info("p", "http://p:1", "prefill", max_model_len=512)))
    reg.register(WorkerInfo.from_json(info("d", "http://d:1", "decode")))
    assert reg.max_model_len() == 512
    assert [w.info.engine_id for w in reg.by_role(Role.PREFILL)] == ["p"]
    assert reg.deregister("p") is not None
    assert reg.deregister("p") is None
    assert reg.max_model_len() == 2048


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"role": "chef"}, "role"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"engine_id": ""}, "engine_id"),
        ({"url": "ftp://x"}, "url"),
        ({"kv_events_endpoint": 5}, "kv_events_endpoint"),
    ],
)
def test_bad_registration_is_rejected_naming_field(patch: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        WorkerInfo.from_json(info(**patch))
    assert (e.value.status, e.value.param) == (400, param)


def test_registration_for_another_model_is_rejected() -> None:
    reg = WorkerRegistry(Clock(), model="served")
    with pytest.raises(OpenAIError) as e:
        reg.register(WorkerInfo.from_json(info()))
    assert e.value.param == "model"
    assert reg.all() == []


@pytest.mark.parametrize("bad", [{"kv_usage": 1.5}, {"running": -1}, {"waiting": "2"}, {}])
def test_bad_heartbeat_is_rejected(bad: dict) -> None:
    body = {"engine_id": "e1", **bad} if bad else {"running": 1}
    with pytest.raises(OpenAIError):
        Heartbeat.from_json(body)


def test_live_engine_id_stays_bound_to_its_registration() -> None:
    clock = Clock()
    reg = WorkerRegistry(clock, heartbeat_timeout_s=3.0, model="m")
    reg.register(WorkerInfo.from_json(info("d1", "http://w1:1")))
    reg.register(WorkerInfo.from_json(info("d1", "http://w1:1")))  # the same again: a refresh
    for patch, param in (({"url": "http://rogue:1"}, "url"), ({"role": "prefill"}, "role"),
                         ({"num_blocks": 7}, "engine_id")):  # fmt: skip
        with pytest.raises(OpenAIError) as e:
            reg.register(WorkerInfo.from_json(info("d1", **{"url": "http://w1:1", **patch})))
        assert (e.value.status, e.value.param) == (409, param)
    assert reg.get("d1").info.url == "http://w1:1"
    # until it expires (or deregisters): then the id is free again
    clock.now += 3.5
    reg.expire()
    reg.register(WorkerInfo.from_json(info("d1", "http://w2:1")))
    assert reg.get("d1").info.url == "http://w2:1"


@pytest.mark.parametrize(
    "url",
    [
        "http://w1", "http://w1:0", "http://w1:99999", "http://w1:1/path", "http://w1:1?q=1",
        "http://w1:1#f", "http://u:p@w1:1", "http://w1:1/?", "http://:1", "http://w 1:1",
        "file:///etc/passwd", "http://w1:1/x/../y",
    ],
)  # fmt: skip
def test_worker_url_is_scheme_host_port_only(url: str) -> None:
    with pytest.raises(OpenAIError) as e:
        WorkerInfo.from_json(info(url=url))
    assert (e.value.status, e.value.param) == (400, "url")


def test_good_urls_and_endpoints() -> None:
    for url in ("http://10.1.2.3:8100", "https://w-1.ns.svc.cluster.local:443/", "http://[::1]:80"):
        assert WorkerInfo.from_json(info(url=url)).url == url.rstrip("/")
    for bad in ("tcp://w1", "ipc:///x", "tcp://w1:2/x", "udp://w1:2"):
        with pytest.raises(OpenAIError) as e:
            WorkerInfo.from_json(info(kv_events_endpoint=bad))
        assert e.value.param == "kv_events_endpoint"


def test_router_checks_hash_algorithm_and_context() -> None:
    from tandem.router.registry import check_against_router

    good = WorkerInfo.from_json(info(hash_algorithm="h", max_model_len=2048))
    check_against_router(good, "h", 4096)
    check_against_router(good, "h", None)  # a bare tokenizer directory: no model limit known
    for w, algo, ctx, param in (
        (good, "other", 4096, "hash_algorithm"),
        (good, "h", 2047, "max_model_len"),
        (WorkerInfo.from_json(info(hash_algorithm="h", max_model_len=8, block_size=16)), "h",
         None, "max_model_len"),
    ):  # fmt: skip
        with pytest.raises(OpenAIError) as e:
            check_against_router(w, algo, ctx)
        assert (e.value.status, e.value.param) == (400, param)


def test_registration_sizes_are_bounded() -> None:
    for key, value in (("num_blocks", 1 << 40), ("max_model_len", 1 << 30), ("block_size", 4096),
                       ("engine_id", "e" * 257)):  # fmt: skip
        with pytest.raises(OpenAIError) as e:
            WorkerInfo.from_json(info(**{key: value}))
        assert e.value.param == key
