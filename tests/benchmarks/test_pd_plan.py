"""What the P/D benchmark runs: deployments and their pinning, workloads, guidellm's command line
and report parsing, and the per-repeat summary. Pure, exact."""

import dataclasses
from pathlib import Path

import pytest
from benchlib.launch import Placement, cpu_count, place
from pd_bench import deployments, guidellm_driver, report, summary
from pd_bench.workloads import BURSTY, CHAT, PREFILL_HEAVY, bursty_trace, poisson_trace

from tandem.up import UpConfig, build_specs


def test_deployments_give_every_one_the_same_two_cores() -> None:
    specs = deployments.build(None, "0,1", "0", (128, 2048), 512, (0, 256), ("tcp", "ucx"))
    assert [s.name for s in specs] == [
        "colo-b128", "colo-b2048", "colo2", "pd-tcp-t0", "pd-tcp-t256", "pd-ucx-t0", "pd-ucx-t256",
    ]  # fmt: skip
    by = {s.name: s for s in specs}
    assert by["colo-b128"].placement == Placement("0", 1, ("0,1",), (2,))
    assert by["colo-b128"].engine_options == ("max_num_batched_tokens=128",)
    assert by["colo2"].placement.worker_cpus == ("0", "1")
    assert by["pd-ucx-t256"].local_prefill_threshold == 256
    assert by["pd-ucx-t256"].kv_transport == "ucx"
    chosen = deployments.build(["colo2", "colo-b128"], "2,3", "0", (128,), 512, (0,), ("tcp",))
    assert [s.name for s in chosen] == ["colo2", "colo-b128"]
    with pytest.raises(ValueError, match="unknown deployment"):
        deployments.build(["nope"], "0,1", "0", (128,), 512, (0,), ("tcp",))
    with pytest.raises(ValueError, match="two distinct"):
        deployments.cores("0,0")


def test_placement_pins_router_and_workers_with_matching_threads() -> None:
    cfg = UpConfig(model="demo", port=9, prefill=1, decode=1, kv_transport="tcp")
    specs = build_specs(cfg, iter(range(20000, 20100)))
    placed = place(specs, Placement("0", 1, ("0", "1"), (1, 1)))
    assert placed[0].argv[:3] == ("taskset", "-c", "0")
    assert placed[0].argv[3:] == specs[0].argv
    assert dict(placed[1].env)["OMP_NUM_THREADS"] == "1"
    assert placed[2].argv[:3] == ("taskset", "-c", "1")
    assert [s.role for s in placed] == ["router", "prefill", "decode"]
    unpinned = place(specs, Placement(router_threads=None))
    assert [s.argv for s in unpinned] == [s.argv for s in specs]
    with pytest.raises(ValueError, match="names 1 workers"):
        place(specs, Placement(worker_cpus=("0",)))
    assert cpu_count("0-3,6") == 5


def test_bursty_trace_shape() -> None:
    w = dataclasses.replace(BURSTY, burst_every_s=4.0)
    rows = bursty_trace(w, 10.0, seed=3)
    bursts = [r for r in rows if r["input_length"] == BURSTY.burst_prompt]
    # Bursts at 1, 5 and 9 s (a quarter period, then every period), burst_size each.
    assert sorted({r["timestamp"] for r in bursts}) == [1.0, 5.0, 9.0]
    assert len(bursts) == 3 * BURSTY.burst_size
    assert all(r["output_length"] == BURSTY.background_output for r in rows if r not in bursts)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    assert rows == bursty_trace(w, 10.0, seed=3)
    assert BURSTY.rate(1.0) == BURSTY.background_rate + BURSTY.burst_size / BURSTY.burst_every_s


def test_poisson_trace_offers_exactly_its_rate() -> None:
    rows = poisson_trace(PREFILL_HEAVY.lengths, 0.4, 8, seed=5)
    assert len(rows) == 8 and rows[0]["timestamp"] == 0.0
    ts = [r["timestamp"] for r in rows]
    assert ts == sorted(ts) and len(set(ts)) == 8
    # The 8 gaps (the last one ends the window at n / rate = 20 s) are rescaled to add up to it:
    # the last arrival is one gap short of 20 s, and no raw sample's rate leaks through.
    assert 0.0 < ts[-1] < 20.0
    for seed in range(20):
        tail = poisson_trace(PREFILL_HEAVY.lengths, 0.4, 8, seed=seed)[-1]["timestamp"]
        assert tail < 20.0
    assert all(1024 <= r["input_length"] <= 2048 and 64 <= r["output_length"] <= 256
               for r in rows)  # fmt: skip
    assert rows == poisson_trace(PREFILL_HEAVY.lengths, 0.4, 8, seed=5)
    assert rows != poisson_trace(PREFILL_HEAVY.lengths, 0.4, 8, seed=6)
    chat = poisson_trace(CHAT.lengths, 2.0, 200, seed=1)
    assert all(128 <= r["input_length"] <= 384 for r in chat)
    assert len({r["input_length"] for r in chat}) > 50  # a normal, not a constant
    with pytest.raises(ValueError):
        poisson_trace(CHAT.lengths, 0.0, 8, seed=1)


def test_guidellm_command_line() -> None:
    target = guidellm_driver.Target("http://127.0.0.1:9", "m", "/tok")
    run = guidellm_driver.Run(PREFILL_HEAVY.lengths.data_arg(), "kind=poisson,rate=0.5", 10,
                              100.0)  # fmt: skip
    argv = guidellm_driver.argv(target, run, Path("/o.json"), "guidellm", seed=1)
    assert argv[:2] == ["guidellm", "run"]
    opts = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert opts["--backend"].startswith("kind=openai_http,target=http://127.0.0.1:9/v1,model=m,")
    assert "extras.body.temperature=0" in opts["--backend"]
    assert opts["--profile"] == "kind=poisson,rate=0.5"
    assert opts["--data"] == ("kind=synthetic_text,prompt_tokens=1536,prompt_tokens_min=1024,"
                              "prompt_tokens_max=2048,output_tokens=160,output_tokens_min=64,"
                              "output_tokens_max=256")  # fmt: skip
    assert "--disable-console-interactive" in argv
    assert "kind=max_requests,count=10" in argv and "kind=max_duration,seconds=100.0" in argv
    trace = guidellm_driver.replay(Path("/t.jsonl"), 2.0, 10.0)
    assert trace.profile == "kind=replay,time_scale=0.5,schedule_turn=timestamp"
    assert trace.max_requests is None
    env = guidellm_driver.environment({"GUIDELLM__X": "1", "PATH": "/bin"}, workers=2)
    assert env["PYTHONSAFEPATH"] == "1" and env["GUIDELLM__MAX_WORKER_PROCESSES"] == "2"
    assert "GUIDELLM__X" not in env


def _greq(start: float, prompt: int, ttft: float, itl: float) -> dict:
    return {"info": {"timings": {"request_start": start}}, "prompt_tokens": prompt,
            "output_tokens": 16, "time_to_first_token_ms": ttft, "inter_token_latency_ms": itl,
            "request_latency": 1.0, "input_metrics": {}}  # fmt: skip


def test_guidellm_report_parsing() -> None:
    report = {"benchmarks": [{
        "config": {"strategy": {"type_": "poisson"}}, "start_time": 10.0, "end_time": 20.0,
        "requests": {"successful": [_greq(12.0, 100, 50.0, 5.0)],
                     "incomplete": [_greq(11.0, 200, 1.0, 1.0)], "errored": []},
    }]}  # fmt: skip
    (b,) = guidellm_driver.benchmarks(report)
    assert (b.strategy, b.start, b.end) == ("poisson", 10.0, 20.0)
    first, second = b.requests  # by start time
    assert (first.start, first.completed, first.ttft_ms) == (11.0, False, None)
    assert (second.prompt_tokens, second.ttft_ms, second.itl_ms, second.completed) == (
        100, 50.0, 5.0, True)  # fmt: skip


def _point(workload: str, x: float, rows: list[list]) -> dict:
    return {"workload": workload, "x": x, "start": 0.0, "end": 1.0, "requests": rows,
            "router_itl_buckets": [[0.01, 4.0], [float("inf"), 4.0]]}  # fmt: skip


def test_summary_goodput_ratio_against_the_best_colocated() -> None:
    # Calibration: TTFT 10 ms flat, ITL 5 ms for both. SLO tight: TTFT <= 20, ITL <= 7.5.
    cal = _point("calibration", 0.0, [[0.0, 100, 16, 10.0, 5.0, 1.0, True],
                                      [1.0, 200, 16, 10.0, 5.0, 1.0, True]])  # fmt: skip
    ok, slow = [0.0, 100, 16, 15.0, 5.0, 1.0, True], [0.0, 100, 16, 15.0, 9.0, 1.0, True]
    colo = {
        "deployment": "colo-b512",
        "kind": "colocated",
        "points": [cal, _point("chat", 1.0, [ok] * 10), _point("chat", 2.0, [ok] * 5 + [slow] * 5)],
    }
    pd = {"deployment": "pd-tcp-t0", "kind": "pd", "points": [
        cal, _point("chat", 1.0, [ok] * 10), _point("chat", 2.0, [ok] * 10)]}  # fmt: skip
    s = summary.summarize_repeat([colo, pd], [summary.SloSetting("t", 2, 1.5)], 0.9,
                                 {"chat": 1.0})  # fmt: skip
    chat = s["workloads"]["chat"]
    assert chat["deployments"]["colo-b512"]["curve"]["t"] == [[1.0, 1.0], [2.0, 0.5]]
    assert chat["deployments"]["colo-b512"]["goodput"]["t"] == 1.0
    # Colocated crosses 0.9 at 1 + 0.1 / 0.5 = 1.2; P/D passes everything: 2.0.
    assert chat["deployments"]["colo-b512"]["goodput_interpolated"]["t"] == 1.2
    assert chat["best_colocated"]["t"] == "colo-b512" and chat["best_pd"]["t"] == "pd-tcp-t0"
    assert chat["ratio"]["t"] == round(2.0 / 1.2, 3)
    fixed = chat["deployments"]["pd-tcp-t0"]["fixed"]
    assert fixed["ttft_p50_ms"] == 15.0 and fixed["itl_token_p99_ms"] == 9.9
    assert summary.spread([s, s])["chat"]["t"] == {"values": [1.667, 1.667], "min": 1.667,
                                                    "max": 1.667, "pd_only": 0}  # fmt: skip
    assert chat["slo"]["t"]["itl_ms_by_prompt"][0] == [32, 7.5]  # 1.5 x the flat 5 ms


def test_summary_says_when_only_pd_meets_the_slo() -> None:
    cal = _point("calibration", 0.0, [[0.0, 100, 16, 10.0, 5.0, 1.0, True],
                                      [1.0, 200, 16, 10.0, 5.0, 1.0, True]])  # fmt: skip
    ok, slow = [0.0, 100, 16, 15.0, 5.0, 1.0, True], [0.0, 100, 16, 15.0, 9.0, 1.0, True]
    colo = {"deployment": "colo2", "kind": "colocated-x2",
            "points": [cal, _point("chat", 1.0, [slow] * 10)]}  # fmt: skip
    pd = {"deployment": "pd-tcp-t64", "kind": "pd",
          "points": [cal, _point("chat", 1.0, [ok] * 10)]}  # fmt: skip
    s = summary.summarize_repeat([colo, pd], [summary.SloSetting("t", 2, 1.5)], 0.9, {})
    chat = s["workloads"]["chat"]
    assert chat["ratio"]["t"] is None and chat["pd_only"]["t"] is True
    assert summary.spread([s])["chat"]["t"]["pd_only"] == 1
    table = report.workload_table("chat", chat, ["t"])
    assert "P/D / best colocated **P/D only**" in table
    assert dataclasses.asdict(summary.SloSetting("t", 2, 1.5)) == {"name": "t", "ttft_x": 2,
                                                                   "itl_x": 1.5}  # fmt: skip


def test_every_point_of_a_deployment_gets_its_own_prompts() -> None:
    from pd_bench.runner import point_seed

    seeds = {point_seed(0, w, x) for w in ("chat", "prefill-heavy", "calibration")
             for x in (0.0, 0.5, 1.0)}  # fmt: skip
    assert len(seeds) == 9
    assert point_seed(0, "chat", 0.5) == point_seed(0, "chat", 0.5)


def test_worker_stats_over_the_run_window() -> None:
    def sample(waiting: float, nbytes: float, secs: float, count: float) -> dict:
        return {
            "tandem_requests_waiting": waiting,
            "tandem_requests_running": 1.0,
            "tandem_kv_cache_usage_ratio": 0.5,
            "tandem_kv_transfer_bytes_total": nbytes,
            "tandem_kv_transfer_seconds_sum": secs,
            "tandem_kv_transfer_seconds_count": count,
        }

    metrics = {
        "router": {"times": [1.0], "values": [{}]},
        "decode-ab": {"times": [0.0, 1.0, 2.0, 3.0],
                      "values": [sample(9, 0, 0, 0), sample(1, 100, 0.5, 1),
                                 sample(3, 400, 0.8, 3), sample(7, 900, 2.0, 9)]},
    }  # fmt: skip
    ((name, stats),) = summary.worker_stats(metrics, 1.0, 2.0).items()
    assert name == "decode-ab"
    assert stats == {"max_waiting": 3, "max_running": 1.0, "max_kv_usage": 0.5,
                     "kv_transfer_bytes": 300, "kv_transfer_mean_ms": 150.0,
                     "preemptions": 0.0}  # fmt: skip
