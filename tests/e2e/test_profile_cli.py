"""`tandem profile` end to end on the demo model (quick grid): the real engine's steps, a real
KV pull over TCP between two processes, the serving stage through simulated workers; the
result loads, fits its own points and drives a simulated worker and `tandem plan`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tandem.child_command import tandem_argv
from tandem.engine.sim.profile import load_profile
from tandem.engine.sim.tokens import printable_token_ids


def test_quick_profile_of_the_demo_model(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    run = subprocess.run(
        [*tandem_argv("profile"), "--model", "demo", "--quick",
         "--repeats", "2", "--passes", "2", "--transports", "tcp", "--output", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tandem profile: 100%" in run.stderr  # the progress bar reached its end
    assert f"wrote {out}" in run.stdout
    profile = load_profile(out)
    assert (profile.model.num_layers, profile.model.num_kv_heads, profile.model.head_dim) == (
        4, 2, 32,
    )  # fmt: skip
    assert profile.model.max_model_len == 256 and profile.engine.block_size == 16
    assert profile.engine.num_blocks == 512 * 1024 * 1024 // profile.engine.block_bytes
    labels = {p.label.split()[0] for p in profile.step_points}
    assert labels == {"prefill", "decode", "mixed"}
    for p in profile.step_points:
        # Two repeats in each of two passes, pooled: the lower quartile of four.
        assert p.execute_seconds > 0 and len(p.samples) == 4
        assert sorted(p.samples)[0] == p.execute_seconds
    # Prefill rows are what the grid asked for: q fresh tokens after a cached prefix of ctx.
    chunk = next(p for p in profile.step_points if p.label == "prefill q=32 ctx=64")
    assert chunk.rows == ((32, 64, 1),)
    # Decode points time the whole batch they name: none of its sequences finished while the
    # budget still prefilled the others (a 32 x 224-token batch takes four prefill steps).
    for p in profile.step_points:
        if p.label.startswith(("decode", "mixed")):
            batch = int(p.label.split()[1].removeprefix("batch="))
            assert sum(n for q, _, n in p.rows if q == 1) == batch, p
            assert sum(n for q, _, n in p.rows if q > 1) == p.label.startswith("mixed"), p
    assert any(p.label == "decode batch=32 ctx=224" for p in profile.step_points)
    assert {p.transport for p in profile.transfer_points} == {"tcp"}
    assert set(profile.transfer.models) == {"tcp"}
    big, small = (
        max(profile.transfer_points, key=lambda p: p.num_bytes),
        min(profile.transfer_points, key=lambda p: p.num_bytes),
    )
    assert big.num_bytes == 16 * profile.engine.block_bytes and small.num_bytes < big.num_bytes
    # The serving stage ran: the router's share of a first token is never free.
    assert profile.serving.request_seconds > 0
    # Its batched phases ran: eight streams at once wake the router's loop for fewer of their
    # tokens than one stream does (measured 0.4-0.7 of a lone token's cost on the demo).
    assert 0 < profile.serving.router_wake_share <= 1
    assert 0 < profile.serving.run_queue_wait <= 0.005  # half this host's scheduler slice
    # The router's CPU for a P/D hand-off is recorded: 0.9-1.3 ms in full profiles of the demo,
    # but a quick profile's few 1P1D requests can measure it below the colocated figure (then
    # 0, as a CI run did); the formula is held exactly in tests/planner/test_calibrate.py.
    assert 0 <= profile.serving.router_handoff_cpu < 0.01
    from transformers import AutoTokenizer

    from tandem.engine.demo import weights_path

    tok = AutoTokenizer.from_pretrained(str(weights_path()))
    assert profile.model.sim_token_ids == printable_token_ids(tok, 262, frozenset([257]))
    plan = subprocess.run(
        [*tandem_argv("plan"), "--profile", str(out), "--isl", "64",
         "--osl", "16", "--rate", "2", "--ttft-p90", "5", "--itl-p90", "1", "--json",
         "--requests", "60", "--max-workers", "4"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    answer = json.loads(plan.stdout)
    assert answer["feasible"] is True and answer["prefill"] + answer["decode"] <= 2


def test_bad_profile_flags_are_refused_before_anything_loads() -> None:
    from tandem.profile import main

    with pytest.raises(SystemExit, match=r"--repeats must be 1 to 12 .*got 13"):
        main(["--model", "demo", "--output", "x.json", "--repeats", "13"])
    with pytest.raises(SystemExit, match=r"--passes must be 1 to 10, got 0"):
        main(["--model", "demo", "--output", "x.json", "--passes", "0"])
    with pytest.raises(SystemExit, match=r"--repeats must be 1 to 12 .*got 0"):
        main(["--model", "demo", "--output", "x.json", "--repeats", "0"])
