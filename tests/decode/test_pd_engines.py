"""Prefill -> decode over the KV connector, at the engine level: parity, prefix reuse, faults."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpoints import write_random_checkpoint

from tandem import LLM, SamplingParams
from tandem.decode.hooks import DecodeHooks
from tandem.decode.role import DecodeRole
from tandem.engine.builder import build_engine_parts
from tandem.engine.engine import Engine, EngineOutput
from tandem.engine.llm import build_engine_config
from tandem.engine.worker.protocol import parse_generate_request
from tandem.engine.worker.service import submit as submit_request
from tandem.kvtransfer.factory import create_connector
from tandem.prefill.hooks import PrefillHooks
from tandem.prefill.role import PrefillRole

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
NUM_BLOCKS = 64


def make_engine(
    path: Path,
    role: str,
    transport: str,
    lease: float = 10.0,
    policy: str = "recompute",
    **options: Any,
) -> Engine:
    """An engine with the role's hooks over a real connector (``engine.hooks.connector``)."""
    options.setdefault("num_blocks", NUM_BLOCKS)
    parts = build_engine_parts(build_engine_config(str(path), **options))
    conn = create_connector(
        transport, parts.layout, parts.runner.kv_cache, role, lease_seconds=lease
    )
    hooks = PrefillHooks(conn) if role == "prefill" else DecodeHooks(conn, policy)
    return Engine(parts, hooks)


@pytest.fixture(params=["ucx", "tcp"])
def pair(request: pytest.FixtureRequest, llama_gqa_path: Path) -> Iterator[tuple[Engine, Engine]]:
    p = make_engine(llama_gqa_path, "prefill", request.param)
    d = make_engine(llama_gqa_path, "decode", request.param)
    yield p, d
    p.hooks.connector.close()
    d.hooks.connector.close()


def submit(engine: Engine, rid: str, prompt: list[int], **fields: Any) -> None:
    body = {"request_id": rid, "prompt_token_ids": prompt, "sampling_params": GREEDY, **fields}
    role = PrefillRole() if isinstance(engine.hooks, PrefillHooks) else DecodeRole()
    submit_request(engine, role, parse_generate_request(body))


def run_until(
    engines: list[Engine],
    done: Callable[[], bool],
    sink: Callable[[EngineOutput], None],
    timeout: float = 30.0,
) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for e in engines:
            for out in e.step():
                sink(out)
        time.sleep(0.0005)


def prefill(p: Engine, prompts: dict[str, list[int]]) -> dict[str, EngineOutput]:
    finals: dict[str, EngineOutput] = {}
    for rid, prompt in prompts.items():
        submit(p, rid, prompt, remote_decode=True)
    run_until([p], lambda: not p.has_unfinished, lambda o: finals.__setitem__(o.request_id, o))
    return finals


def disagg(p: Engine, d: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    firsts = prefill(p, prompts)
    tokens = {rid: list(o.new_token_ids) for rid, o in firsts.items()}
    for rid, prompt in prompts.items():
        assert firsts[rid].finish_reason == "remote_decode"
        submit(d, rid, prompt, kv_transfer_params=firsts[rid].kv_transfer_params)

    outs: list[EngineOutput] = []
    run_until([d, p], lambda: not d.has_unfinished and not p.scheduler.pinned, outs.append)
    for o in outs:
        assert o.error is None, o.error
        tokens[o.request_id] += o.new_token_ids
    return tokens


def prompts_of(seed: int, lengths: tuple[int, ...]) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(300) for _ in range(n)] for i, n in enumerate(lengths)}


def colocated(path: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    outs = LLM(str(path), num_blocks=NUM_BLOCKS).generate(
        list(prompts.values()), SamplingParams(**GREEDY)
    )
    return {rid: o.token_ids for rid, o in zip(prompts, outs, strict=True)}


def test_disaggregated_equals_colocated(pair: tuple[Engine, Engine], llama_gqa_path: Path) -> None:
    p, d = pair
    prompts = prompts_of(0, (1, 5, 15, 16, 17, 33, 40))
    assert disagg(p, d, prompts) == colocated(llama_gqa_path, prompts)
    for e in (p, d):
        e.check_integrity()
        assert e.pool.num_free_blocks == NUM_BLOCKS


def test_decode_pulls_only_what_its_prefix_cache_lacks(
    pair: tuple[Engine, Engine], llama_gqa_path: Path
) -> None:
    p, d = pair
    pulled: list[int] = []
    start_load = d.hooks.connector.start_load

    def spy(rid: str, params: Any, remote: list[int], local: list[int]) -> None:
        pulled.append(len(remote))
        start_load(rid, params, remote, local)

    d.hooks.connector.start_load = spy  # type: ignore[method-assign]
    rng = random.Random(5)
    prefix = [rng.randrange(300) for _ in range(48)]
    first = {"a": prefix + [1, 2, 3]}
    second = {"b": prefix + [7, 8, 9, 10, 11]}
    got = disagg(p, d, first)
    got.update(disagg(p, d, second))
    assert pulled == [4, 1]  # 51 tokens = 4 blocks; then 3 full blocks hit locally
    expected = colocated(llama_gqa_path, {**first, **second})
    assert got == expected
    d.check_integrity()
    p.check_integrity()


def test_prefill_releases_blocks_when_decode_never_pulls(llama_gqa_path: Path) -> None:
    p = make_engine(llama_gqa_path, "prefill", "tcp", lease=0.3)
    try:
        prefill(p, prompts_of(1, (40,)))
        assert p.pool.num_free_blocks < NUM_BLOCKS  # pinned for the decode worker
        run_until([p], lambda: not p.scheduler.pinned, lambda o: None, timeout=10)
        assert p.pool.num_free_blocks == NUM_BLOCKS
        p.check_integrity()
    finally:
        p.hooks.connector.close()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_dead_prefill_fails_or_recomputes_and_frees(llama_gqa_path: Path, policy: str) -> None:
    p = make_engine(llama_gqa_path, "prefill", "tcp")
    d = make_engine(llama_gqa_path, "decode", "tcp", policy=policy)
    try:
        prompts = prompts_of(2, (33,))
        first = prefill(p, prompts)["r0"]
        p.hooks.connector.close()  # the prefill worker dies before decode pulls
        submit(d, "r0", prompts["r0"], kv_transfer_params=first.kv_transfer_params)
        outs: list[EngineOutput] = []
        run_until([d], lambda: not d.has_unfinished, outs.append)
        if policy == "fail":
            assert outs[-1].finish_reason == "error"
            assert "KV transfer" in outs[-1].error
        else:
            tokens = first.new_token_ids + [t for o in outs for t in o.new_token_ids]
            assert tokens == colocated(llama_gqa_path, prompts)["r0"]
        assert d.pool.num_free_blocks == NUM_BLOCKS
        d.check_integrity()
    finally:
        d.hooks.connector.close()


def test_abort_on_either_side_restores_both_pools(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    prompts = prompts_of(3, (40, 40))
    firsts = prefill(p, prompts)
    # Prefill side aborts r0 while pinned; decode side aborts r1 while it is loading or running.
    p.abort(["r0"])
    for rid in prompts:
        submit(d, rid, prompts[rid], kv_transfer_params=firsts[rid].kv_transfer_params)
    d.step()
    d.abort(["r1"])
    run_until([d, p], lambda: not d.has_unfinished and not p.scheduler.pinned, lambda o: None)
    for e in (p, d):
        assert e.pool.num_free_blocks == NUM_BLOCKS
        e.check_integrity()


def test_two_prefill_two_decode_crossing_traffic(llama_gqa_path: Path) -> None:
    ps = [make_engine(llama_gqa_path, "prefill", "ucx") for _ in range(2)]
    ds = [make_engine(llama_gqa_path, "decode", "ucx") for _ in range(2)]
    try:
        prompts = prompts_of(7, (20, 35, 18, 50, 9, 33, 40, 17))
        firsts: dict[str, EngineOutput] = {}
        for i, (rid, prompt) in enumerate(prompts.items()):
            submit(ps[i % 2], rid, prompt, remote_decode=True)
        run_until(
            ps,
            lambda: not any(p.has_unfinished for p in ps),
            lambda o: firsts.__setitem__(o.request_id, o),
        )
        # P0's requests go to D0 and D1 alike, and so do P1's: every pair transfers at once.
        tokens = {rid: list(o.new_token_ids) for rid, o in firsts.items()}
        for i, (rid, prompt) in enumerate(prompts.items()):
            submit(ds[(i // 2) % 2], rid, prompt, kv_transfer_params=firsts[rid].kv_transfer_params)
        outs: list[EngineOutput] = []
        run_until(
            ds + ps,
            lambda: (
                not any(e.has_unfinished for e in ds) and not any(p.scheduler.pinned for p in ps)
            ),
            outs.append,
        )
        for o in outs:
            assert o.error is None
            tokens[o.request_id] += o.new_token_ids
        assert tokens == colocated(llama_gqa_path, prompts)
        for e in ps + ds:
            assert e.pool.num_free_blocks == NUM_BLOCKS
            e.check_integrity()
    finally:
        for e in ps + ds:
            e.hooks.connector.close()


def test_sliding_window_model_disaggregated_equals_colocated(tmp_path: Path) -> None:
    """Mistral with a 16-token window: the prompt's blocks outside the window still move (they
    stay allocated and cached), and decode on the pulled KV gives the colocated tokens, with a
    prefix hit on the second prompt."""
    path = write_random_checkpoint(tmp_path, "mistral", sliding_window=16)
    p, d = make_engine(path, "prefill", "tcp"), make_engine(path, "decode", "tcp")
    try:
        rng = random.Random(9)
        shared = [rng.randrange(300) for _ in range(48)]
        prompts = {"w0": shared + [5, 6], "w1": shared + [rng.randrange(300) for _ in range(22)]}
        got = disagg(p, d, {"w0": prompts["w0"]})
        got.update(disagg(p, d, {"w1": prompts["w1"]}))
        assert got == colocated(path, prompts)
        for e in (p, d):
            e.check_integrity()
            assert e.pool.num_free_blocks == NUM_BLOCKS
    finally:
        p.hooks.connector.close()
        d.hooks.connector.close()


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_host_tier_on_both_sides_equals_colocated(llama_gqa_path: Path, transport: str) -> None:
    """Small device pools on both sides: prefill reloads evicted prefixes from its host tier;
    decode, two pulled requests at a time in 8 blocks, offloads evictions and swaps."""
    tier = {"kv_offload_bytes": 1 << 20, "max_model_len": 128}
    p = make_engine(llama_gqa_path, "prefill", transport, num_blocks=12, **tier)
    d = make_engine(llama_gqa_path, "decode", transport, num_blocks=8, **tier)
    try:
        prompts = prompts_of(11, (58, 60, 57, 62))
        expected = colocated(llama_gqa_path, prompts)
        pairs = [dict(list(prompts.items())[i : i + 2]) for i in (0, 2)]
        # Twice over (new ids the second time): prefill's device pool holds two prompts at most.
        got = {rid: toks for pair in pairs for rid, toks in disagg(p, d, pair).items()}
        again = [{f"{rid}b": prompt for rid, prompt in pair.items()} for pair in pairs]
        got_again = {rid: toks for pair in again for rid, toks in disagg(p, d, pair).items()}
        assert got == expected
        assert got_again == {f"{rid}b": toks for rid, toks in expected.items()}
        ps, ds = p.stats(), d.stats()
        assert ps.host_tier is not None and ps.host_tier.hit_tokens > 0
        assert ds.host_tier is not None and ds.host_tier.offloaded_blocks > 0
        assert ds.num_swap_preemptions > 0
        for e in (p, d):
            e.check_integrity()
            assert e.pool.num_free_blocks == e.pool.num_blocks
            assert e.kv.tier is not None
            assert e.kv.tier.host.num_free_blocks == e.kv.tier.host.num_blocks
    finally:
        p.hooks.connector.close()
        d.hooks.connector.close()
