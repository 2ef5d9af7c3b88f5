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
