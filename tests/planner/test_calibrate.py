"""The serving calibration's pure parts and its per-process CPU reading (a real child)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from sim_profiles import synthetic_profile

from tandem.calibrate import (
    ISL,
    OSL,
    ServingSample,
    children_cpu,
    lone_decode_seconds,
    per_token_cpu,
    process_cpu,
    quantiles,
    segment_quantiles,
    serving_cost,
    steady_quantiles,
)
from tandem.engine.sim.profile import StepPoint
from tandem.wake_shares import BATCH, mean_run_queue_wait, scheduler_slice, wake_share


def test_quantiles_are_evenly_spaced_order_statistics() -> None:
    assert quantiles(range(100)) == (5, 15, 25, 35, 45, 55, 65, 75, 85, 95)
    assert quantiles([3.0, 1.0, 2.0], n=3) == (1.0, 2.0, 3.0)
    assert quantiles([7.0]) == (7.0,) * 10


def test_steady_quantiles_ignore_one_noisy_stretch_of_the_phase() -> None:
    # 40 requests in order: 1 ms each, but ten in a row at 20-29 ms (another tenant's burst).
    steady = [1.0] * 10 + [float(v) for v in range(20, 30)] + [1.0] * 20
    # Pooled, the burst sets the top three deciles; the median over the four parts of ten
    # (one of them the burst) is the steady 1 ms throughout.
    assert quantiles(steady)[-3:] == (20.0, 24.0, 28.0)
    assert steady_quantiles(steady) == (1.0,) * 10
    # Even parts: quantile by quantile, the median of the parts' (the two middle ones' mean).
    parts = [1.0, 2.0] * 2 + [3.0, 4.0] * 2 + [5.0, 6.0] * 2 + [7.0, 8.0] * 2
    assert steady_quantiles(parts, n=2) == (4.0, 5.0)
    # Too few values to split: plain quantiles.
    assert steady_quantiles([3.0, 1.0, 2.0], n=3) == quantiles([3.0, 1.0, 2.0], n=3)


def test_per_token_cpu_is_the_further_tokens_share_and_never_negative() -> None:
    assert per_token_cpu(0.010 + (OSL - 1) * 0.002, 0.010) == pytest.approx(0.002)
    assert per_token_cpu(0.010, 0.010) == 0.0
    # Noise can put a one-token request's CPU above a full one's: no negative cost.
    assert per_token_cpu(0.009, 0.010) == 0.0


def test_process_cpu_counts_threads_that_have_ended() -> None:
    # A child that burns 0.3 s of CPU on a second thread, then waits to be read.
    code = ("import threading, time\n"
            "def burn():\n"
            "    t = time.thread_time()\n"
            "    while time.thread_time() - t < 0.3: pass\n"
            "th = threading.Thread(target=burn); th.start(); th.join()\n"
            "print('done', flush=True); time.sleep(30)\n")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-P", "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        # The burning thread has ended; its CPU still counts (a worker's short-lived threads).
        assert 0.3 <= process_cpu(Path(f"/proc/{child.pid}")) < 2.0
        assert children_cpu(child.pid) == {}  # it has no children
    finally:
        child.kill()
        child.wait()


def _answers(first: float, itl: float, n: int) -> tuple[tuple[float, ...], ...]:
    """``n`` answers of OSL chunks: the first at ``first`` s, then one every ``itl`` s."""
    return tuple(tuple(first + i * itl for i in range(OSL)) for _ in range(n))


def test_serving_cost_takes_the_median_over_segments_and_the_mean_cpu() -> None:
    # Step model: 2 ms a step + 10 us a token, so a lone 32-token prefill takes 2.32 ms and a
    # decode step 2.01 ms.
    profile = synthetic_profile(execute=(0.002, 1e-5, 0.0, 0, 0.0, 0.0, 0.0))
    prefill, decode1 = 0.00232, 0.00201
    slow_itl = decode1 + 0.0005  # 0.5 ms of serving overhead per step
    cpu_long = {"router": 0.003 + 31 * 0.0002, "colocated": 0.00332 + 31 * (decode1 + 0.0003)}
    pd = _answers(0.02, 0.01, 5)

    def segment(served: float, itl: float, router_short: float) -> ServingSample:
        return ServingSample(
            alone=_answers(served + prefill + 0.0005, itl, 10), pd=pd, cpu_long=cpu_long,
            cpu_short={"router": router_short, "colocated": 0.00332}, cpu_pd={},
        )  # fmt: skip

    usual = segment(0.006, slow_itl, 0.003)
    # One segment in a fast stretch of the machine (a step seen between profiles): everything
    # in it is quicker. Pooled, it would pull the first token's quantiles down to 2 ms.
    fast = segment(0.002, slow_itl - 0.001, 0.006)
    cost = serving_cost(profile, [usual, fast, usual], "tcp")
    assert cost.step_seconds == pytest.approx(0.0005)  # the median segment's ITL less the step
    # The first token's serving share: 6 ms less the streaming of its row (0.3 ms, below),
    # which the simulated worker adds itself.
    served = 0.006 - 0.0003
    assert cost.request_spread == pytest.approx((served,) * 10)
    assert cost.pace_spread == pytest.approx((1.0,) * 10)
    assert cost.pace_seconds == pytest.approx(31 * slow_itl)
    # CPU is a mean over segments: the router's per one-token request is (3 + 6 + 3) / 3 ms.
    router_token = (0.0092 - 0.004) / 31
    assert cost.router_token_cpu == pytest.approx(router_token, abs=1e-7)
    assert cost.router_request_cpu == pytest.approx(0.004 - router_token, abs=1e-6)
    assert cost.worker_request_cpu == pytest.approx(0.001)
    assert cost.row_seconds == pytest.approx(0.0003, abs=1e-7)
    # That share: the router's and the worker's CPU per request, the rest the token's.
    request = 0.004 - router_token + 0.001
    assert cost.request_seconds == pytest.approx(request, abs=1e-6)
    assert cost.token_seconds == pytest.approx(served - request, abs=1e-6)
    # The hand-off is each segment's lower quartile; here all the same, so as one segment's.
    assert cost.handoff_seconds == serving_cost(profile, [usual], "tcp").handoff_seconds > 0
    # Its quantiles, per segment then their median: every gap the same here.
    assert cost.handoff_spread == pytest.approx((cost.handoff_seconds,) * 10)
    # A woken thread's wait for a core: half this host's slice (the mean rest of the slice it
    # lands in; docs/planning.md, round 38).
    assert cost.run_queue_wait == mean_run_queue_wait() == round(scheduler_slice() / 2, 6) > 0


def _point(label: str, rows: tuple[tuple[int, int, int], ...], seconds: float) -> StepPoint:
    return StepPoint(label, rows, seconds, 0.0, (seconds,))


def test_step_seconds_is_the_served_itl_less_the_grids_own_lone_decode() -> None:
    # Model: 2 ms a step + 10 us a token + 0.1 us a decode key: a lone decode at context 256
    # is 2.0357 ms on the line, but the grid measured it at 1.5 ms (below the fit's line, as
    # random-512's lone decode runs).
    execute = (0.002, 1e-5, 0.0, 0, 0.0, 0.0, 1e-7)
    points = (
        _point("decode batch=1 ctx=256", ((1, 256, 1),), 0.0015),
        _point("decode batch=1 ctx=1024", ((1, 1024, 1),), 0.0016),
        _point("decode batch=2 ctx=48", ((1, 48, 2),), 0.0001),  # not lone: ignored
        _point("prefill q=16 ctx=0", ((16, 0, 1),), 0.0001),  # not a decode: ignored
    )
    profile = replace(synthetic_profile(execute=execute), step_points=points)
    ctx = ISL + OSL // 2  # 48: nearest lone point 256, moved along the model's 0.1 us a key
    lone = 0.0015 + 1e-7 * (48 - 256)
    assert lone_decode_seconds(profile, ctx) == pytest.approx(lone, abs=1e-12)
    assert lone_decode_seconds(profile, 1000) == pytest.approx(0.0016 - 1e-7 * 24, abs=1e-12)
    # The point's host part counts, as the model's step counts the model's host part.
    hosted = replace(profile, step_points=(replace(points[0], host_seconds=0.0001),))
    assert lone_decode_seconds(hosted, ctx) == pytest.approx(lone + 0.0001, abs=1e-12)
    # No lone decode on the grid: the model's own step.
    bare = synthetic_profile(execute=execute)
    assert lone_decode_seconds(bare, ctx) == pytest.approx(0.002 + 1e-5 + 1e-7 * 49)
    # Served ITL 1.8 ms: under the model's 2.0149 ms (which clamped the overhead to zero), but
    # 0.32 ms over what the grid measured.
    sample = ServingSample(
        alone=_answers(0.01, 0.0018, 10), pd=_answers(0.02, 0.01, 5),
        cpu_long={}, cpu_short={}, cpu_pd={},
    )  # fmt: skip
    assert serving_cost(profile, [sample], "tcp").step_seconds == round(0.0018 - lone, 6)
    assert serving_cost(bare, [sample], "tcp").step_seconds == 0.0


def test_wake_share_is_what_batching_saves_per_item_scaled_to_one_wake_up_per_batch() -> None:
    # alone = c + w = 100 us, batched = c + w / 8 = 44 us: w = 64 us, 64 % of the lone cost.
    assert wake_share(100e-6, 44e-6, 8) == pytest.approx(0.64)
    assert wake_share(100e-6, 100e-6) == 0.0  # batching saved nothing
    assert wake_share(100e-6, 120e-6) == 0.0  # dearer batched (noise): no share, not negative
    assert wake_share(100e-6, 0.0) == 1.0  # clamped
    assert wake_share(0.0, 1e-6) == 0.0 and wake_share(1e-4, 5e-5, batch=1) == 0.0


def test_scheduler_slice_reads_the_kernel_or_takes_its_default(tmp_path: Path) -> None:
    # Linux's default: 0.75 ms x (1 + log2(CPUs)), the CPUs counted up to 8.
    defaults = [scheduler_slice(n, files=()) for n in (1, 2, 3, 4, 8, 64)]
    assert defaults == pytest.approx([0.00075, 0.0015, 0.0015, 0.00225, 0.003, 0.003])
    tuned = tmp_path / "base_slice_ns"
    tuned.write_text("3000000\n")
    garbled = tmp_path / "garbled"
    garbled.write_text("fast\n")
    missing = str(tmp_path / "missing")
    assert scheduler_slice(2, files=(missing, str(garbled), str(tuned))) == 0.003
    assert scheduler_slice(2, files=(missing, str(garbled))) == 0.0015
    # The mean wait of a thread woken onto busy cores is half the slice it lands in.
    assert mean_run_queue_wait(2, files=(str(tuned),)) == 0.0015
    assert mean_run_queue_wait(8, files=()) == 0.0015
    assert mean_run_queue_wait(1, files=()) == 0.000375


def test_serving_cost_derives_each_threads_wake_share_from_the_batched_phases() -> None:
    profile = synthetic_profile(execute=(0.002, 1e-5, 0.0, 0, 0.0, 0.0, 0.0))
    decode1 = 0.00201
    # Alone: the router 200 us a token, the client 80, the worker's row 300 beyond its step.
    cpu_long = {"router": 0.003 + 31 * 0.0002, "colocated": 0.00332 + 31 * (decode1 + 0.0003),
                "client": 0.001 + 31 * 0.00008}  # fmt: skip
    cpu_short = {"router": 0.003, "colocated": 0.00332, "client": 0.001}
    # Batched: the router 60 us a token, the client 80 (nothing saved), the worker's row 90.
    decode_b = profile.step.step_seconds([(1, ISL + OSL // 2)] * BATCH) / BATCH
    b_long = {"router": 0.002 + 31 * 0.00006, "colocated": 0.001 + 31 * (decode_b + 0.00009),
              "client": 0.0005 + 31 * 0.00008}  # fmt: skip
    b_short = {"router": 0.002, "colocated": 0.001, "client": 0.0005}
    sample = ServingSample(
        alone=_answers(0.01, 0.0025, 10), pd=_answers(0.02, 0.01, 5), cpu_long=cpu_long,
        cpu_short=cpu_short, cpu_pd={}, cpu_batch_long=b_long, cpu_batch_short=b_short,
    )  # fmt: skip
    cost = serving_cost(profile, [sample], "tcp")
    assert cost.router_wake_share == pytest.approx((1 - 60 / 200) * 8 / 7, abs=1e-3)
    assert cost.client_wake_share == 0.0
    assert cost.row_wake_share == pytest.approx((1 - 90 / 300) * 8 / 7, abs=1e-3)
    # The lone figures are what they were without the batched phases.
    lone = serving_cost(profile, [replace(sample, cpu_batch_long={}, cpu_batch_short={})], "tcp")
    assert lone.router_wake_share == lone.client_wake_share == lone.row_wake_share == 0.0
    assert replace(cost, router_wake_share=0.0, row_wake_share=0.0) == lone


def test_serving_cost_charges_the_router_its_pd_cpu_over_the_colocated_figure() -> None:
    profile = synthetic_profile(execute=(0.002, 1e-5, 0.0, 0, 0.0, 0.0, 0.0))
    cpu_long = {"router": 0.003 + 31 * 0.0002, "colocated": 0.00332 + 31 * 0.00231}
    cpu_short = {"router": 0.003, "colocated": 0.00332}

    def cost(cpu_pd: dict[str, float]) -> float:
        sample = ServingSample(
            alone=_answers(0.01, 0.0025, 10), pd=_answers(0.02, 0.01, 5), cpu_long=cpu_long,
            cpu_short=cpu_short, cpu_pd=cpu_pd,
        )  # fmt: skip
        return serving_cost(profile, [sample], "tcp").router_handoff_cpu

    # The same OSL-token requests cost the router 1.25 ms more each in P/D: the hand-off.
    pd = {"router": cpu_long["router"] + 0.00125, "prefill": 0.006, "decode": 0.07}
    assert cost(pd) == pytest.approx(0.00125)
    assert cost(pd | {"router": cpu_long["router"] - 0.0001}) == 0.0  # never below nothing
    assert cost({"prefill": 0.006, "decode": 0.07}) == 0.0  # not measured


def test_the_handoff_is_the_gaps_lower_quartile_and_its_spread_their_quantiles() -> None:
    profile = synthetic_profile(execute=(0.002, 1e-5, 0.0, 0, 0.0, 0.0, 0.0))
    cpu_long = {"router": 0.003 + 31 * 0.0002, "colocated": 0.00332 + 31 * 0.00231}
    cpu_short = {"router": 0.003, "colocated": 0.00332}
    # Seven 1P1D answers (too few to split in parts: plain quantiles) whose second chunk
    # (decode's first token) follows the prefill's by 4, 5, ..., 10 ms, sent in that order.
    pd = tuple(tuple(0.02 + (i > 0) * (0.004 + k * 0.001) + max(0, i - 1) * 0.002
                     for i in range(OSL)) for k in range(7))  # fmt: skip
    sample = ServingSample(alone=_answers(0.01, 0.0025, 10), pd=pd, cpu_long=cpu_long,
                           cpu_short=cpu_short, cpu_pd={})  # fmt: skip
    cost = serving_cost(profile, [sample], "tcp")
    # What the profile predicts of a gap (the pull and decode's first step) is what the lower
    # quartile (the 2nd of 7 gaps, 5 ms) is beyond it; every quantile is beyond it alike.
    predicted = 0.005 - cost.handoff_seconds
    assert 0 < predicted < 0.004
    gaps = [0.004 + k * 0.001 - predicted for k in range(7)]
    assert cost.handoff_spread == pytest.approx(quantiles(gaps), abs=2e-6)
    assert cost.handoff_spread[0] == pytest.approx(0.004 - predicted, abs=2e-6)
    assert cost.handoff_spread[-1] == pytest.approx(0.010 - predicted, abs=2e-6)
    # A gap shorter than the prediction counts as none beyond it, never below.
    quick = ((0.02, 0.02 + predicted / 2) + (0.03,) * (OSL - 2),) * 7
    fast = serving_cost(profile, [replace(sample, pd=quick)], "tcp")
    assert (fast.handoff_seconds, fast.handoff_spread) == (0.0, (0.0,) * 10)


def test_serving_cost_of_no_complete_answers_is_refused() -> None:
    empty = ServingSample(alone=((0.01,),), pd=(), cpu_long={}, cpu_short={}, cpu_pd={})
    with pytest.raises(ValueError, match="no complete answers"):
        serving_cost(synthetic_profile(), [empty], "tcp")


def test_segment_quantiles_drop_one_segment_in_another_pace() -> None:
    steady, fast = [5.0] * 8, [2.0] * 8
    assert segment_quantiles([steady, fast, steady]) == (5.0,) * 10
    # Two segments (or one) cannot outvote: the values in order, as steady_quantiles reads them.
    assert segment_quantiles([steady, fast]) == steady_quantiles(steady + fast)
    assert segment_quantiles([fast]) == steady_quantiles(fast)
