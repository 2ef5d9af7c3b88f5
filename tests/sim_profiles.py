"""Hand-made profiles for the simulation tests: known linear costs on the demo model's layout,
so expected times and plans can be worked out by hand. A plain module (as checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

from tandem.engine.sim.cost_model import (
    STEP_FEATURES,
    TRANSFER_FEATURES,
    LinearModel,
    StepCost,
    TransferCost,
)
from tandem.engine.sim.profile import EngineFacts, ModelFacts, Profile, ServingCost

# The demo model (engine/demo/weights/config.json) and its letters/digits.
DEMO_TOKENS = tuple([*range(48, 58), *range(65, 91), *range(97, 123)])


def linear(*coefficients: float) -> LinearModel:
    return LinearModel(STEP_FEATURES, tuple(float(c) for c in coefficients))


def synthetic_profile(
    execute: tuple[float, ...] = (0.002, 1e-5, 0.0, 0, 0.0, 0.0, 0.0),
    host: tuple[float, ...] = (0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0),
    transfer: tuple[float, float] = (0.001, 1e-9),
    num_blocks: int = 1024,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    max_model_len: int = 256,
    serving: ServingCost = ServingCost(0.0, 0.0, 0.0),
) -> Profile:
    """Times: ``execute``/``host`` per STEP_FEATURES; ``transfer`` = (fixed s, s per byte) for
    both tcp and ucx. Serving latencies default to zero so hand computations stay simple."""
    t = LinearModel(TRANSFER_FEATURES, transfer)
    return Profile(
        model=ModelFacts(
            name="demo", architecture="LlamaForCausalLM", vocab_size=262, num_layers=4,
            num_kv_heads=2, head_dim=32, dtype="float32", max_model_len=max_model_len,
            eos_token_ids=(257,), sim_token_ids=DEMO_TOKENS,
        ),
        engine=EngineFacts(
            device="cpu", block_size=16, num_blocks=num_blocks, block_bytes=32768,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        ),
        step=StepCost(linear(*execute), linear(*host)),
        transfer=TransferCost({"tcp": t, "ucx": t}),
        serving=serving,
        created="2026-01-01T00:00:00+00:00",
    )  # fmt: skip


def write_profile(path: Path, **kw: object) -> Path:
    synthetic_profile(**kw).save(path)  # type: ignore[arg-type]
    return path
