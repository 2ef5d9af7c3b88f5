"""Prefix pulls between two colocated engines over the KV connector (decode/peer.py), both
transports: the pull happens and the output equals recomputing; a corrupt block, a grant the
source no longer honours, and a source gone mid-pull are misses (recompute, same output); no block
stays pinned or held on either side."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tandem import LLM, SamplingParams
from tandem.decode.peer import PeerColocatedRole
from tandem.engine.builder import build_engine_parts
from tandem.engine.engine import Engine, EngineOutput
from tandem.engine.llm import build_engine_config
from tandem.engine.worker.protocol import parse_generate_request
from tandem.engine.worker.role import RoleContext
from tandem.engine.worker.service import submit as submit_request

GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
NUM_BLOCKS = 32
BS = 16


class Peer:
    def __init__(
        self, path: Path, transport: str, timeout: float = 5.0, lease: float = 5.0
    ) -> None:
        parts = build_engine_parts(build_engine_config(str(path), num_blocks=NUM_BLOCKS))
        self.registry = CollectorRegistry()
        self.role = PeerColocatedRole(
            transport, kv_lease_seconds=lease, kv_transfer_timeout=timeout
        )
        ctx = RoleContext("peer", "127.0.0.1", None, self.registry, "m")
        self.engine = Engine(parts, self.role.attach(parts, ctx))

    def submit(self, rid: str, prompt: list[int], **fields: Any) -> None:
        body = {"request_id": rid, "prompt_token_ids": prompt, "sampling_params": GREEDY, **fields}
        submit_request(self.engine, self.role, parse_generate_request(body))

    def failures(self, reason: str) -> float:
        value = self.registry.get_sample_value(
            "tandem_kv_transfer_failures_total",
            {"model": "m", "role": "colocated", "reason": reason},
        )
        return value or 0.0

    def assert_drained(self) -> None:
        self.engine.check_integrity()
        assert not self.engine.scheduler.pinned
        assert self.engine.pool.num_free_blocks == NUM_BLOCKS


@pytest.fixture(params=["ucx", "tcp"])
def peers(request: pytest.FixtureRequest, llama_gqa_path: Path) -> Iterator[tuple[Peer, Peer]]:
    a, b = Peer(llama_gqa_path, request.param), Peer(llama_gqa_path, request.param)
    yield a, b
    a.role.close()
    b.role.close()


def run_until(peers: list[Peer], done: Callable[[], bool], sink: Callable[[EngineOutput], None],
              timeout: float = 30.0) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for p in peers:
            for out in p.engine.step():
                sink(out)
        time.sleep(0.0005)


def generate(
    target: Peer, others: list[Peer], rid: str, prompt: list[int], **fields: Any
) -> list[int]:
    target.submit(rid, prompt, **fields)
    outs: list[EngineOutput] = []
    everyone = [target, *others]
    run_until(
        everyone,
        lambda: not any(p.engine.has_unfinished or p.engine.scheduler.pinned for p in everyone),
        outs.append,
    )
    tokens: list[int] = []
    for o in outs:
        assert o.error is None, o.error
        tokens += o.new_token_ids
    return tokens


def shared_prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(11)
    prefix = [rng.randrange(300) for _ in range(5 * BS)]
    return prefix + [1, 2, 3], prefix + [rng.randrange(300) for _ in range(9)]


def expected(path: Path, prompt: list[int]) -> list[int]:
    return (
        LLM(str(path), num_blocks=NUM_BLOCKS)
        .generate(prompt, SamplingParams(**GREEDY))[0]
        .token_ids
    )


def pulled_blocks(b: Peer, spy: list[int]) -> None:
    conn = b.role.connector
    assert conn is not None
    start = conn.start_load

    def spying(rid: str, params: Any, remote: list[int], local: list[int]) -> None:
        spy.append(len(remote))
        start(rid, params, remote, local)

    conn.start_load = spying  # type: ignore[method-assign]


def grant(a: Peer, rid: str, prompt: list[int]) -> dict[str, Any] | None:
    n = (len(prompt) - 1) // BS * BS
    return a.role.grant(a.engine, rid, prompt[:n])


def test_pull_from_a_peer_equals_recompute(peers: tuple[Peer, Peer], llama_gqa_path: Path) -> None:
    a, b = peers
    first, second = shared_prompts()
    generate(a, [b], "warm", first)  # a caches the 5 shared blocks
    params = grant(a, "g1", second)
    assert params is not None and len(params["block_ids"]) == 5
    assert len(a.engine.scheduler.pinned) == 1  # pinned for the pull
    a.engine.check_integrity()  # the grant's blocks are accounted for as a pinned request's
    assert a.engine.pool.num_free_blocks == NUM_BLOCKS - 5
    spy: list[int] = []
    pulled_blocks(b, spy)
    got = generate(b, [a], "r", second, kv_prefix_params=params)
    assert got == expected(llama_gqa_path, second)
    assert spy == [5]
    # b now holds the pulled prefix as its own cache: the prompt's 5 shared blocks are hits.
    assert b.engine.kv.hit_tokens == 0 and b.engine.pool.stats().num_cached >= 5
    for p in (a, b):
        p.assert_drained()


def test_a_corrupt_pulled_block_is_a_miss(peers: tuple[Peer, Peer], llama_gqa_path: Path) -> None:
    a, b = peers
    first, second = shared_prompts()
    generate(a, [b], "warm", first)
    params = grant(a, "g1", second)
    assert params is not None
    # The bytes of block 2 as the source saw them differ from what arrives (any corruption on
    # the way reads so): the pull must not be used.
    params["block_checksums"][2] ^= 1
    got = generate(b, [a], "r", second, kv_prefix_params=params)
    assert got == expected(llama_gqa_path, second)
    assert b.failures("checksum_mismatch") == 1
    assert b.engine.kv.hit_tokens == 0  # recomputed from scratch
    for p in (a, b):
        p.assert_drained()


def test_a_grant_the_source_dropped_is_a_miss(
    peers: tuple[Peer, Peer], llama_gqa_path: Path
) -> None:
    a, b = peers
    first, second = shared_prompts()
    generate(a, [b], "warm", first)
    params = grant(a, "g1", second)
    assert params is not None
    a.engine.abort(["g1"])  # the source gives the blocks up before the pull
    # At once, not at the lease's expiry (5 s).
    run_until([a], lambda: not a.engine.scheduler.pinned, lambda o: None, timeout=2.0)
    got = generate(b, [a], "r", second, kv_prefix_params=params)
    assert got == expected(llama_gqa_path, second)
    assert sum(b.failures(r) for r in ("unknown_request", "aborted_by_peer")) == 1
    for p in (a, b):
        p.assert_drained()


def test_nothing_cached_grants_nothing_and_bad_grants_are_refused(peers: tuple[Peer, Peer]) -> None:
    a, b = peers
    first, _ = shared_prompts()
    assert grant(a, "g0", first) is None
    assert not a.engine.scheduler.pinned
    generate(a, [b], "warm", first)
    params = grant(a, "g1", first)
    assert params is not None
    with pytest.raises(ValueError, match="at least one prompt token"):
        b.submit("r", first[: 5 * BS], kv_prefix_params=params)  # nothing left to compute
    with pytest.raises(ValueError, match="block_checksums"):
        b.submit("r", first, kv_prefix_params={**params, "block_checksums": []})
    a.engine.abort(["g1"])
    run_until([a], lambda: not a.engine.scheduler.pinned, lambda o: None, timeout=2.0)
    for p in (a, b):
        p.assert_drained()


def test_a_pull_past_its_deadline_is_a_miss_and_the_source_lets_go(
    llama_gqa_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source's data send hangs: the puller gives up after its transfer timeout (1 s) and
    recomputes; the source frees the blocks once the stuck send is past its grace (the lease
    table never frees blocks a transfer may still read: transfer timeout + 5 s)."""
    from tandem.kvtransfer.tcp_transport import TcpSendTransport

    async def hang(self, *args: Any) -> None:  # noqa: ANN001
        await asyncio.sleep(3600)

    # Short timeouts and leases keep the wait for the grace at about 7 s.
    a = Peer(llama_gqa_path, "tcp", timeout=1.0, lease=1.0)
    b = Peer(llama_gqa_path, "tcp", timeout=1.0, lease=1.0)
    try:
        first, second = shared_prompts()
        generate(a, [b], "warm", first)
        params = grant(a, "g1", second)
        assert params is not None
        monkeypatch.setattr(TcpSendTransport, "send", hang)
        t0 = time.monotonic()
        got = generate(b, [a], "r", second, kv_prefix_params=params)
        assert got == expected(llama_gqa_path, second)
        assert time.monotonic() - t0 < 10
        assert b.failures("transfer_error") == 1  # "tcp transfer timed out"
        for p in (a, b):
            p.assert_drained()
    finally:
        a.role.close()
        b.role.close()


def test_an_unused_grant_is_freed_at_lease_expiry(llama_gqa_path: Path) -> None:
    a = Peer(llama_gqa_path, "tcp", lease=0.5)
    try:
        first, _ = shared_prompts()
        generate(a, [], "warm", first)
        assert grant(a, "g1", first) is not None
        assert len(a.engine.scheduler.pinned) == 1
        run_until([a], lambda: not a.engine.scheduler.pinned, lambda o: None, timeout=5.0)
        a.assert_drained()
    finally:
        a.role.close()


def test_a_puller_pulls_only_what_its_own_cache_lacks(
    peers: tuple[Peer, Peer], llama_gqa_path: Path
) -> None:
    a, b = peers
    first, second = shared_prompts()
    generate(a, [b], "warm", first)
    generate(b, [a], "b-warm", first[: 2 * BS + 1])  # b caches the first 2 of the 5 blocks
    spy: list[int] = []
    pulled_blocks(b, spy)
    params = grant(a, "g1", second)
    assert params is not None
    assert generate(b, [a], "r", second, kv_prefix_params=params) == expected(
        llama_gqa_path, second
    )
    params = grant(a, "g2", second)  # b now has all 5: the pull moves nothing
    assert params is not None
    assert generate(b, [a], "r2", second, kv_prefix_params=params) == expected(
        llama_gqa_path, second
    )
    assert spy == [3, 0]
    assert b.failures("checksum_mismatch") == 0
    for p in (a, b):
        p.assert_drained()
