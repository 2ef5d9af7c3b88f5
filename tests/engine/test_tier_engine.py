"""The host KV tier through the engine: greedy output never changes, hits come from the host,
swaps keep the output, aborts at any point leak nothing, corrupted tier blocks are recomputed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.engine.engine import Engine
from tandem.engine.request import RequestStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
BLOCK = 16
# Four 40..55-token prompts need 18 blocks with their outputs; the device pool holds 8.
LENGTHS = (40, 47, 55, 44)
SMALL = {"num_blocks": 8, "max_model_len": 128, "max_num_seqs": 2}
# Six 30-token prompts with 30 tokens out need 24 blocks at once: 16 force preemption.
SWAPPY = {"num_blocks": 16, "max_model_len": 128}
TIER = 1 << 20  # 128 host blocks of the test model's 8 KiB
SWAP_PROMPTS = [[(7 * i + 13 * j) % 300 for j in range(30)] for i in range(6)]


@pytest.fixture(scope="module")
def uninterrupted(llama_gqa_path: Path) -> list[list[int]]:
    """SWAP_PROMPTS' greedy output with room for everything: no preemption."""
    llm = LLM(str(llama_gqa_path), num_blocks=128)
    return [o.token_ids for o in llm.generate(SWAP_PROMPTS, LONG)]


def prompts_of(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


def two_passes(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone, twice over: (outputs of both passes, second-pass cached tokens)."""
    first = [llm.generate(p, GREEDY)[0] for p in prompts]
    second = [llm.generate(p, GREEDY)[0] for p in prompts]
    return [o.token_ids for o in first + second], [o.num_cached_tokens for o in second]


def assert_drained(engine: Engine) -> None:
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    tier = engine.kv.tier
    if tier is not None:
        assert tier.host.num_free_blocks == tier.host.num_blocks and tier.num_swapped == 0


def test_host_tier_serves_what_the_device_pool_evicted(llama_gqa_path: Path) -> None:
    prompts = prompts_of(0)
    plain = LLM(str(llama_gqa_path), **SMALL)
    expected, plain_cached = two_passes(plain, prompts)
    tiered = LLM(str(llama_gqa_path), kv_offload_bytes=TIER, **SMALL)
    got, cached = two_passes(tiered, prompts)
    assert got == expected
    # Each prompt's blocks are evicted before it comes round again; the tier has every one.
    assert plain_cached == [0] * len(LENGTHS)
    assert cached == [(n - 1) // BLOCK * BLOCK for n in LENGTHS]
    stats = tiered.engine.stats().host_tier
    assert stats is not None and stats.hit_tokens == sum(cached)
    assert stats.loaded_blocks == stats.hit_tokens // BLOCK
    assert dict(stats.integrity_failures) == {"hash_mismatch": 0, "checksum_mismatch": 0}
    assert_drained(tiered.engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swap_preemption_keeps_greedy_output(
    llama_gqa_path: Path, uninterrupted: list[list[int]], prefix_caching: bool
) -> None:
    llm = LLM(
        str(llama_gqa_path), kv_offload_bytes=TIER, enable_prefix_caching=prefix_caching, **SWAPPY
    )
    outs = llm.generate(SWAP_PROMPTS, LONG)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_swap_preemptions == stats.num_preemptions
    assert [o.token_ids for o in outs] == uninterrupted
    assert_drained(llm.engine)


def test_a_full_host_tier_falls_back_to_recompute(
    llama_gqa_path: Path, uninterrupted: list[list[int]]
) -> None:
    # One host block: no victim (2+ blocks) fits, so every preemption recomputes.
    llm = LLM(str(llama_gqa_path), kv_offload_bytes=8192, **SWAPPY)
    outs = llm.generate(SWAP_PROMPTS, LONG)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_swap_preemptions == 0
    assert [o.token_ids for o in outs] == uninterrupted
    assert_drained(llm.engine)


def swap_engine(path: Path) -> Engine:
    return LLM(str(path), kv_offload_bytes=TIER, **SWAPPY).engine


def drain(engine: Engine, limit: int = 2000) -> None:
    for _ in range(limit):
        if not engine.has_unfinished:
            return
        engine.step()
        engine.check_integrity()
    raise AssertionError("the engine did not drain")


def step_until(engine: Engine, cond: object, limit: int = 500) -> None:
    for _ in range(limit):
        engine.step()
        engine.check_integrity()
        if cond():  # type: ignore[operator]
            return
    raise AssertionError("condition never held")


def test_abort_while_swapped_out_or_swapping_in_leaks_nothing(llama_gqa_path: Path) -> None:
    engine = swap_engine(llama_gqa_path)
    sched = engine.scheduler
    for i, p in enumerate(SWAP_PROMPTS):
        engine.add_request(f"a{i}", p, LONG)
    step_until(engine, lambda: any(engine.kv.is_swapped(r) for r in sched.waiting))
    victim = next(r for r in sched.waiting if engine.kv.is_swapped(r))
    assert victim.status == RequestStatus.PREEMPTED
    (out,) = engine.abort([victim.request_id])
    assert out.finish_reason == "abort" and not engine.kv.is_swapped(victim)
    engine.check_integrity()

    def swapping_in() -> bool:
        return any(r.status == RequestStatus.WAITING_FOR_HOST_KV for r in sched.loading.values())

    step_until(engine, swapping_in)
    loading = next(
        r for r in sched.loading.values() if r.status == RequestStatus.WAITING_FOR_HOST_KV
    )
    engine.abort([loading.request_id])
    assert loading.request_id in sched.loading  # its copies may still write: freed on completion
    engine.check_integrity()
    drain(engine)
    assert_drained(engine)


def test_aborts_in_every_state_leak_nothing_in_either_pool(llama_gqa_path: Path) -> None:
    """Aborts land (three times each) while a request is queued, running, swapped out, swapping
    in or loading a prefix from the host tier, with new requests arriving all along."""
    engine = swap_engine(llama_gqa_path)
    sched = engine.scheduler
    rng = random.Random(3)
    prompts = [SWAP_PROMPTS[i % 3][: 20 + 2 * i] for i in range(6)]  # shared prefixes
    states = {
        "waiting": lambda: [r for r in sched.waiting if not engine.kv.is_swapped(r)],
        "swapped": lambda: [r for r in sched.waiting if engine.kv.is_swapped(r)],
        "host_load": lambda: [r for r in sched.loading.values() if not r.is_finished],
        "running": lambda: list(sched.running),
    }
    aborted = dict.fromkeys(states, 0)
    n = 0
    for _ in range(300):
        if min(aborted.values()) >= 3:
            break
        while sched.num_unfinished < 7:
            engine.add_request(f"r{n}", prompts[n % len(prompts)], LONG)
            n += 1
        engine.step()
        engine.check_integrity()
        for name in sorted(states, key=aborted.__getitem__):
            candidates = states[name]()
            if aborted[name] < 3 and candidates and (name != "running" or n % 4 == 0):
                engine.abort([rng.choice(candidates).request_id])
                engine.check_integrity()
                aborted[name] += 1
                break
    assert min(aborted.values()) >= 3, aborted
    engine.abort([r.request_id for r in [*sched.waiting, *sched.running]])
    drain(engine)
    assert_drained(engine)


@pytest.mark.parametrize("corrupt", ["bytes", "tag"])
def test_corrupted_tier_blocks_are_recomputed_never_used(
    llama_gqa_path: Path, corrupt: str
) -> None:
    prompts = prompts_of(0)
    expected = LLM(str(llama_gqa_path), num_blocks=128).generate(prompts[0], GREEDY)[0].token_ids
    llm = LLM(str(llama_gqa_path), kv_offload_bytes=TIER, **SMALL)
    engine = llm.engine
    assert engine.kv.tier is not None and engine.copier is not None
    for p in prompts[:3]:  # the later prompts push the first one's blocks to the host tier
        llm.generate(p, GREEDY)
    req = engine.make_requests("probe", prompts[0], GREEDY)[0]  # only for its block hashes
    hashes = req.block_hashes[: (len(prompts[0]) - 1) // BLOCK]
    assert all(engine.kv.get_computed_blocks(req)[0] == [] for _ in hashes)
    held = [engine.kv.tier.host.lookup(h) for h in hashes]
    for b in held[1:]:  # the first block stays good: the request keeps that hit
        assert b is not None
        if corrupt == "bytes":
            engine.copier.host[b.block_id].view(-1)[7] += 0.5
        else:
            engine.copier.tags[b.block_id] = b"\x00" * 16
    out = llm.generate(prompts[0], GREEDY)[0]
    assert out.token_ids == expected
    assert out.num_cached_tokens == BLOCK
    failures = dict(engine.stats().host_tier.integrity_failures)  # type: ignore[union-attr]
    reason = "checksum_mismatch" if corrupt == "bytes" else "hash_mismatch"
    assert failures[reason] == len(held) - 1
    assert all(engine.kv.tier.host.lookup(h) is None for h in hashes[1:])
    assert_drained(engine)
