"""The router's half of prefix pulls, with worker doubles: a grant from the peer holding the
longer prefix travels with the request as ``kv_prefix_params``; a refused grant is a plain
local prefill; a grant the chosen worker never used is aborted on the source."""

from __future__ import annotations

from typing import Any

from router_testlib import MODEL, wait_for

from tandem.engine.hashing import hash_block_tokens
from tandem.router.placement import Policy

LONG = "the quick brown fox jumps over the lazy dog " * 2  # 88 tokens, 22 blocks of 4
PEER = {"pool": "peer", "policy": "round-robin"}


async def two_peers(make_cluster: Any, oai: Any, **config: Any) -> tuple[Any, Any, Any]:
    c = await make_cluster(roles=(), policy=Policy.ROUND_ROBIN, peer_pull_min_tokens=8, **config)
    a = await c.add("colocated", peer=True)
    b = await c.add("colocated", peer=True)
    client = oai(c.url)
    await client.completions.create(model=MODEL, prompt=LONG + "one", max_tokens=2)  # on a
    hashes = hash_block_tokens(c.tokenizer.encode(LONG), 4)
    await wait_for(lambda: c.state.index.overlap(a.engine_id, hashes) == len(hashes),
                   what="a's blocks indexed")  # fmt: skip
    return c, a, b


async def test_the_chosen_worker_gets_the_peers_grant(make_cluster: Any, oai: Any) -> None:
    c, a, b = await two_peers(make_cluster, oai)
    await oai(c.url).completions.create(model=MODEL, prompt=LONG + "two", max_tokens=2)
    (grant,) = a.grant_calls
    prompt = c.tokenizer.encode(LONG + "two")
    n = len(grant["prompt_token_ids"])
    assert n % 4 == 0 and n >= len(c.tokenizer.encode(LONG)) - 4
    assert grant["prompt_token_ids"] == prompt[:n]
    (call,) = b.generate_calls
    assert call["kv_prefix_params"] == {"grant_of": grant["request_id"]}
    assert c.metric("tandem_router_placements_total", {**PEER, "reason": "pull"}) == 1
    # The next turn goes back to a, which holds the prefix itself: no grant is asked for.
    await oai(c.url).completions.create(model=MODEL, prompt=LONG + "three", max_tokens=2)
    assert len(a.grant_calls) == 1 and "kv_prefix_params" not in a.generate_calls[-1]


async def test_a_refused_grant_is_a_local_prefill(make_cluster: Any, oai: Any) -> None:
    c, a, b = await two_peers(make_cluster, oai)
    a.grant_status = 503
    r = await oai(c.url).completions.create(model=MODEL, prompt=LONG + "two", max_tokens=2)
    assert r.choices[0].text
    assert len(a.grant_calls) == 1 and "kv_prefix_params" not in b.generate_calls[0]
    assert c.metric("tandem_router_placements_total", {**PEER, "reason": "pull_refused"}) == 1


async def test_a_grant_the_failed_worker_never_used_is_aborted(make_cluster: Any, oai: Any) -> None:
    c, a, b = await two_peers(make_cluster, oai)
    b.behaviour.crash_after_tokens = 0  # b fails before its first token
    r = await oai(c.url).completions.create(model=MODEL, prompt=LONG + "two", max_tokens=2)
    assert r.choices[0].text
    (grant,) = a.grant_calls
    await wait_for(lambda: grant["request_id"] in a.aborted, what="the grant aborted on a")
    # The retry went to a itself (it has the prefix): no second grant.
    assert "kv_prefix_params" not in a.generate_calls[-1]
