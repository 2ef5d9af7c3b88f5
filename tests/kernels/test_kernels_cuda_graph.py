"""DecodeGraphRunner: padding logic on CPU; capture and replay on CUDA (skipped without it)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from tandem.kernels.cuda_graph import (
    DecodeGraphRunner,
    GraphInput,
    capture_batch_sizes,
    padded_batch_size,
)

INPUTS = [
    GraphInput("x", (3,), torch.float32, 0.0),
    GraphInput("slot", (), torch.int64, -1),
]


def step(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A stand-in decode step: rows with slot -1 (padding) come out as -1."""
    x, slot = inputs["x"], inputs["slot"]
    return torch.where(slot[:, None] >= 0, x * 2 + slot[:, None], torch.full_like(x, -1.0))


def batch(n: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {
        "x": torch.randn((n, 3), generator=gen).to(device),
        "slot": torch.randint(0, 100, (n,), generator=gen).to(device),
    }


def test_capture_sizes_and_padding() -> None:
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_batch_sizes(1) == [1]
    sizes = capture_batch_sizes(48)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 33, 48, 49)] == [1, 4, 8, 48, 48, None]
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def test_runner_pads_into_static_buffers_on_cpu() -> None:
    seen: list[torch.Tensor] = []

    def spy(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        seen.append(inputs["slot"].clone())
        return step(inputs)

    runner = DecodeGraphRunner(spy, INPUTS, max_batch_size=8, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        runner.capture()
    for n in (3, 8, 1, 11):
        inputs = batch(n)
        assert torch.equal(runner.run(inputs), step(inputs))
    padded = [s.tolist() for s in seen]
    assert padded[0][3:] == [-1]  # 3 rows padded to 4
    assert len(padded[1]) == 8 and len(padded[2]) == 1
    assert len(padded[3]) == 11  # beyond every size: eager on the caller's tensors
    with pytest.raises(ValueError, match="batch size"):
        runner.run({"x": torch.zeros((2, 3)), "slot": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="expected inputs"):
        runner.run({"x": torch.zeros((2, 3))})


@pytest.mark.gpu
def test_runner_captures_and_replays_on_cuda() -> None:
    runner = DecodeGraphRunner(step, INPUTS, max_batch_size=16, device="cuda")
    runner.capture()
    assert runner.captured_sizes == [1, 2, 4, 8, 16]
    for n in (5, 16, 1, 5, 20):  # repeated size with new data proves replay reads the buffers
        inputs = batch(n, "cuda")
        torch.testing.assert_close(runner.run(inputs), step(inputs))
    disabled = DecodeGraphRunner(step, INPUTS, max_batch_size=4, device="cuda", enabled=False)
    disabled.capture()
    assert disabled.captured_sizes == []
    inputs = batch(3, "cuda")
    torch.testing.assert_close(disabled.run(inputs), step(inputs))


@pytest.mark.gpu
def test_triton_decode_attention_inside_a_cuda_graph() -> None:
    from tandem.kernels.decode_attention import paged_decode_attention
    from tandem.kernels.kv_cache_write import kv_cache_write

    torch.manual_seed(0)
    hq, hkv, d, bs, max_blocks = 8, 2, 128, 16, 8
    kv_cache = torch.randn((64, 2, 2, bs, hkv, d), device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = kv_cache[:, 1, 0], kv_cache[:, 1, 1]
    specs = [
        GraphInput("q", (hq, d), torch.bfloat16, 0.0),
        GraphInput("k", (hkv, d), torch.bfloat16, 0.0),
        GraphInput("slot", (), torch.int64, -1),
        GraphInput("block_tables", (max_blocks,), torch.int32, 0),
        GraphInput("seq_lens", (), torch.int32, 0),
    ]

    def decode(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        kv_cache_write(inputs["k"], inputs["k"], k_cache, v_cache, inputs["slot"])
        return paged_decode_attention(
            inputs["q"], k_cache, v_cache, inputs["block_tables"], inputs["seq_lens"],
            d**-0.5, num_splits=4,
        )  # fmt: skip

    runner = DecodeGraphRunner(decode, specs, max_batch_size=8, device="cuda")
    runner.capture()
    n = 5
    seq_lens = torch.tensor([1, 17, 33, 100, 128], dtype=torch.int32, device="cuda")
    tables = torch.randperm(64, device="cuda")[: n * max_blocks].reshape(n, max_blocks).int()
    last = (seq_lens - 1).long()
    slots = tables.gather(1, (last // bs)[:, None])[:, 0].long() * bs + last % bs
    inputs = {
        "q": torch.randn((n, hq, d), device="cuda", dtype=torch.bfloat16),
        "k": torch.randn((n, hkv, d), device="cuda", dtype=torch.bfloat16),
        "slot": slots,
        "block_tables": tables,
        "seq_lens": seq_lens,
    }
    replayed = runner.run(inputs).clone()
    eager = decode(inputs)
    torch.testing.assert_close(replayed, eager, atol=0, rtol=0)
