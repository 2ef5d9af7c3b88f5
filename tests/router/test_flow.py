"""Placement, registry expiry, faults and aborts through the router, with worker doubles."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from router_testlib import MODEL, wait_for
from worker_double import TEST_TOKEN

from tandem.engine.hashing import hash_block_tokens
from tandem.engine.role import Role

LONG = "the quick brown fox jumps over the lazy dog " * 2  # 88 tokens, 22 blocks of 4


def calls(w: Any) -> int:
    return len(w.generate_calls)


async def test_shared_prefix_lands_on_worker_that_cached_it(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("decode", "decode", "decode"))
    client = oai(c.url)
    await client.completions.create(model=MODEL, prompt=LONG + "first", max_tokens=2)
    (owner,) = [w for w in c.workers if calls(w) == 1]
    ids = c.tokenizer.encode(LONG)
    hashes = hash_block_tokens(ids, 4)
    await wait_for(lambda: c.state.index.overlap(owner.engine_id, hashes) == len(hashes),
                   what="blocks indexed from kv events")  # fmt: skip
    for suffix in ("second", "third", "fourth"):
        await client.completions.create(model=MODEL, prompt=LONG + suffix, max_tokens=2)
    assert [calls(w) for w in c.workers if w is not owner] == [0, 0]
    assert calls(owner) == 4
    assert (
        c.metric(
            "tandem_router_placements_total",
            {"pool": "decode", "policy": "prefix-aware", "reason": "prefix_hit"},
        )
        == 3
    )
    assert c.metric("tandem_router_placements_total", {"pool": "prefill", "policy": "prefix-aware",
                    "reason": "local_no_prefill_worker"}) == 4  # fmt: skip


async def test_prefill_pool_placement_follows_cached_prefix(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("prefill", "prefill", "decode"))
    p1, p2, _ = c.workers
    client = oai(c.url)
    await client.completions.create(model=MODEL, prompt=LONG + "a", max_tokens=2)
    owner = p1 if calls(p1) else p2
    hashes = hash_block_tokens(c.tokenizer.encode(LONG), 4)
    await wait_for(lambda: c.state.index.overlap(owner.engine_id, hashes) == len(hashes))
    for suffix in "bcd":
        await client.completions.create(model=MODEL, prompt=LONG + suffix, max_tokens=2)
    assert calls(owner) == 4 and calls(p1) + calls(p2) == 4


async def test_round_robin_policy_spreads(make_cluster: Any, oai: Any) -> None:
    from tandem.router.placement import Policy

    c = await make_cluster(roles=("decode", "decode"), policy=Policy.ROUND_ROBIN)
    for _ in range(4):
        await oai(c.url).completions.create(model=MODEL, prompt=LONG, max_tokens=1)
    assert [calls(w) for w in c.workers] == [2, 2]


async def test_silent_worker_leaves_registry(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("prefill", "decode", "decode"), heartbeat_timeout_s=0.6)
    gone = c.workers[1]
    gone.behaviour.heartbeat = False
    await wait_for(lambda: not c.state.registry.is_live(gone.engine_id), timeout=3.0,
                   what="expiry")  # fmt: skip
    assert c.metric("tandem_router_workers", {"role": "decode"}) == 1
    for _ in range(3):
        r = await oai(c.url).completions.create(model=MODEL, prompt="abc", max_tokens=2)
        assert r.choices[0].text == "cb"
    assert calls(gone) == 0
    gone.behaviour.heartbeat = True  # a 404 on heartbeat makes it register again
    await wait_for(lambda: c.state.registry.is_live(gone.engine_id), what="re-registration")


async def test_prefill_5xx_retries_other_prefill(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("prefill", "prefill", "decode"))
    p1, p2, d = c.workers
    p1.behaviour.fail_status = 500
    for _ in range(2):
        r = await oai(c.url).completions.create(model=MODEL, prompt="hello", max_tokens=3)
        assert r.choices[0].text == "oll"
    assert calls(p2) == 2
    assert all(call["kv_transfer_params"]["engine_id"] == p2.engine_id
               for call in d.generate_calls)  # fmt: skip


async def test_prefill_failures_fall_back_to_local_prefill(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("prefill", "prefill", "decode"))
    p1, p2, d = c.workers
    p1.behaviour.fail_status = 503
    p2.behaviour.crash_after_tokens = 0  # connection dropped before the first token
    r = await oai(c.url).completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert r.choices[0].text == "oll"
    assert (calls(p1), calls(p2)) == (1, 1)
    (d_call,) = d.generate_calls
    assert d_call["kv_transfer_params"] is None and d_call["remote_decode"] is False
    assert c.metric("tandem_router_prefill_failures_total") == 2
    assert c.metric("tandem_router_placements_total", {"pool": "prefill", "policy": "prefix-aware",
                    "reason": "local_fallback"}) == 1  # fmt: skip


async def test_prefill_4xx_goes_back_to_client(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    c.workers[0].behaviour.fail_status = 400
    with pytest.raises(openai.BadRequestError) as e:
        await oai(c.url).completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert "injected 400" in e.value.message
    assert calls(c.workers[0]) == 1 and calls(c.workers[1]) == 0


async def test_local_prefill_threshold(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(local_prefill_threshold=50)
    p, d = c.workers
    await oai(c.url).completions.create(model=MODEL, prompt="short", max_tokens=2)
    assert calls(p) == 0 and d.generate_calls[0]["kv_transfer_params"] is None
    r = await oai(c.url).completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert r.choices[0].text == " g"
    assert calls(p) == 1 and d.generate_calls[1]["kv_transfer_params"] is not None
    assert c.metric("tandem_router_placements_total", {"pool": "prefill", "policy": "prefix-aware",
                    "reason": "local_below_threshold"}) == 1  # fmt: skip


async def test_overloaded_prefill_pool_prefills_on_decode(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(prefill_overload_queue=3)
    p, d = c.workers
    (p_state,) = c.app.state.router.registry.by_role(Role.PREFILL)
    p_state.inflight = 3  # the router's own in-flight count: heartbeats do not overwrite it
    await oai(c.url).completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert calls(p) == 0 and d.generate_calls[0]["kv_transfer_params"] is None
    p_state.inflight = 2
    await oai(c.url).completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert calls(p) == 1 and d.generate_calls[1]["kv_transfer_params"] is not None
    assert c.metric("tandem_router_placements_total", {"pool": "prefill", "policy": "prefix-aware",
                    "reason": "local_prefill_overloaded"}) == 1  # fmt: skip


async def test_colocated_workers_prefill_locally(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("colocated",))
    r = await oai(c.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert r.choices[0].message.content == ">|"
    assert c.workers[0].generate_calls[0]["kv_transfer_params"] is None


async def test_decode_failure_before_output_fails_over(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("decode", "decode"))
    d1, d2 = c.workers
    d1.behaviour.crash_after_tokens = 0
    d2.behaviour.crash_after_tokens = 0
    with pytest.raises(openai.InternalServerError) as e:
        await oai(c.url).completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert e.value.status_code == 503 and calls(d1) == calls(d2) == 1
    d2.behaviour.crash_after_tokens = None
    for _ in range(2):
        r = await oai(c.url).completions.create(model=MODEL, prompt="abc", max_tokens=2)
        assert r.choices[0].text == "cb"


async def test_decode_dying_mid_stream_fails_cleanly(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster()
    c.workers[1].behaviour.crash_after_tokens = 2
    stream = await oai(c.url).completions.create(model=MODEL, prompt="abcdefgh", max_tokens=6,
                                                 stream=True)  # fmt: skip
    texts = []
    with pytest.raises(openai.APIError, match="decode worker failed mid-stream"):
        async for ch in stream:
            texts.append(ch.choices[0].text)
    assert "".join(texts) == "hgf"  # P's token, then D's two before it died
    r = await oai(c.url).completions.create(model=MODEL, prompt="ab", max_tokens=1)
    assert r.choices[0].text == "b"


async def test_client_disconnect_aborts_decode(make_cluster: Any) -> None:
    c = await make_cluster()
    p, d = c.workers
    d.behaviour.token_delay_s = 0.05
    body = {"model": MODEL, "prompt": "abcdef", "max_tokens": 200, "stream": True}
    async with httpx.AsyncClient(timeout=10) as h:
        async with h.stream("POST", f"{c.url}/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break
    await wait_for(lambda: len(d.aborted) == 1, what="abort sent to decode")
    assert d.aborted[0] == d.generate_calls[0]["request_id"]
    assert p.aborted == []  # prefill had finished: nothing to abort there
    await wait_for(lambda: sum(w.inflight for w in c.state.registry.all()) == 0)


async def test_client_disconnect_during_prefill_aborts_prefill(make_cluster: Any) -> None:
    c = await make_cluster()
    p, d = c.workers
    p.behaviour.token_delay_s = 30.0
    body = {"model": MODEL, "prompt": "abcdef", "max_tokens": 5, "stream": True}
    async with httpx.AsyncClient(timeout=10) as h:
        # Headers wait for the first token, so the client gives up while the request is pending.
        request = asyncio.create_task(h.post(f"{c.url}/v1/completions", json=body))
        await wait_for(lambda: calls(p) == 1, what="prefill started")
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
    await wait_for(lambda: len(p.aborted) == 1, what="abort sent to prefill")
    assert p.aborted[0] == p.generate_calls[0]["request_id"] and calls(d) == 0


async def test_lost_kv_events_trigger_resync(make_cluster: Any) -> None:
    c = await make_cluster(roles=("decode",))
    (w,) = c.workers
    hashes = hash_block_tokens(list(range(12)), 4)
    w.stored.update(dict.fromkeys(hashes[:2]))
    w.publish([["stored", hashes[:2]]], deliver=False)  # lost on the wire
    w.stored[hashes[2]] = None
    w.publish([["stored", [hashes[2]]]])  # the router sees a gap and resyncs
    await wait_for(lambda: c.state.index.overlap(w.engine_id, hashes) == 3, what="resync")
    assert c.metric("tandem_router_kv_event_resyncs_total") >= 1
    w.stored.clear()
    w.publish([["cleared"]])
    await wait_for(lambda: c.state.index.overlap(w.engine_id, hashes) == 0, what="cleared")


async def test_registration_endpoints_validate(make_cluster: Any) -> None:
    c = await make_cluster(roles=())
    async with httpx.AsyncClient(base_url=c.internal_url, headers=TEST_TOKEN.headers()) as h:
        r = await h.post("/internal/workers/register", json={"engine_id": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"]
        r = await h.post("/internal/workers/heartbeat", json={"engine_id": "nobody"})
        assert r.status_code == 404
        r = await h.post("/internal/workers/register", content=b"\xff")
        assert r.status_code == 400
        w = await c.add("decode")
        r = await h.post("/internal/workers/deregister", json={"engine_id": w.engine_id})
        assert r.json() == {"deregistered": True}
        listed = json.loads((await h.get("/internal/workers")).text)["workers"]
    assert listed == []


async def test_worker_restart_replaces_old_engine(make_cluster: Any, oai: Any) -> None:
    c = await make_cluster(roles=("decode",))
    (w,) = c.workers
    old_id = w.engine_id
    await oai(c.url).completions.create(model=MODEL, prompt=LONG, max_tokens=1)
    await wait_for(lambda: c.state.index.size(old_id) > 0, what="blocks indexed")
    w.engine_id = "restarted"  # same URL, new engine id: what a restarted worker registers
    w.stored.clear()
    w.seq = -1
    await w.register(c.internal_url)
    assert not c.state.registry.is_live(old_id) and c.state.index.size(old_id) == 0
    await wait_for(lambda: c.state.index.is_synced("restarted"), what="resync of the new engine")
    r = await oai(c.url).completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert r.choices[0].text == "cb"
