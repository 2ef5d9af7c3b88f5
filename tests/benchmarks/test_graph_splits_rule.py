"""The CUDA-graph path's decode split count, and the candidate rule its GPU benchmark times
against it (the SM count stubbed, so this runs without a GPU)."""

from __future__ import annotations

import pytest
import torch
from graph_splits_gpu import _occupancy

from tandem.engine import model_runner
from tandem.kernels import decode_attention


def test_graphs_split_about_sixty_four_ways_per_head_whatever_the_context() -> None:
    cuda = torch.device("cuda", 0)
    got = [model_runner.graph_decode_splits(b, 2, 256, cuda) for b in (1, 8, 64, 128)]
    assert got == [64, 8, 1, 1]


def test_the_candidate_is_the_eager_rule_at_the_longest_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    # The demo's 256 positions: never split.
    assert [_occupancy(b, 2, 256, cuda) for b in (1, 8, 64)] == [1, 1, 1]
    # 8192 positions, 2 KV heads: the length allows 8; the occupancy (528 programs) limits
    # batch 64 to 4; from 4096 positions always at least 2.
    assert [_occupancy(b, 2, 8192, cuda) for b in (1, 32, 64, 512)] == [8, 8, 4, 2]
