"""The host tier's KV events: an index fed by a tiered engine's events knows exactly which block
hashes each of its pools holds, and a host hit shows where the device pool has lost a prefix."""

from __future__ import annotations

import random
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.engine.hashing import hash_block_tokens
from tandem.engine.kv_events import BlockTier, KVEventBatch, KVEventKind
from tandem.router.prefix_index import PrefixIndex, TieredOverlap

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SMALL = {"num_blocks": 8, "max_model_len": 128, "max_num_seqs": 2}
BLOCK = 16


def test_index_fed_by_tiered_events_mirrors_both_pools(llama_gqa_path: Path) -> None:
    llm = LLM(str(llama_gqa_path), kv_offload_bytes=4 * 8192 * 2, **SMALL)  # 8 host blocks
    engine = llm.engine
    assert engine.kv.tier is not None
    idx = PrefixIndex(lambda: 0.0)
    idx.add_worker("w", engine.pool.num_blocks, engine.kv.tier.host.num_blocks)
    assert idx.load_snapshot("w", "w", 0, [], [])
    rng = random.Random(3)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (40, 47, 55, 44, 60)]
    seen_host_events = {KVEventKind.STORED: 0, KVEventKind.REMOVED: 0}
    for seq, prompt in enumerate(prompts + prompts[:2]):
        llm.generate(prompt, GREEDY)
        events = engine.take_kv_events()
        for e in events:
            if e.tier is BlockTier.HOST:
                seen_host_events[e.kind] += 1
        idx.apply("w", KVEventBatch("w", seq, tuple(events)))
        assert set(idx._workers["w"].hashes) == set(engine.pool.cached_hashes())
        assert set(idx._workers["w"].host) == set(engine.cached_host_hashes())
    # The host tier filled, then evicted (8 host blocks for far more evicted device blocks).
    assert seen_host_events[KVEventKind.STORED] > 0 and seen_host_events[KVEventKind.REMOVED] > 0
    # The first prompts' device blocks are long gone; the index's tiered match is the engine's.
    host_only = 0
    for prompt in prompts:
        hashes = hash_block_tokens(prompt, BLOCK)
        device = 0
        while device < len(hashes) and engine.pool.get_cached_block(hashes[device]) is not None:
            device += 1
        host = device
        while host < len(hashes) and engine.kv.tier.host.lookup(hashes[host]) is not None:
            host += 1
        assert idx.tiered_overlap("w", hashes) == TieredOverlap(device, host - device)
        host_only += host > device
    assert host_only > 0
