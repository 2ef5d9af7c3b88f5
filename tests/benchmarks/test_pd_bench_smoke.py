"""A smoke run of the P/D benchmark runner, guidellm included: one deployment (1 prefill + 1
decode, pinned), the bursty workload at one load for 10 s with the ITL canary, a tiny random
model. Checks that the JSON has every metric and that the plots are written; no timing
assertions (CI machines are shared)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import BENCHMARKS

FIXED_METRICS = ("rate", "requests", "completed", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                 "tpot_p99_ms", "itl_token_p50_ms", "itl_token_p99_ms", "canary_itl_p50_ms",
                 "canary_itl_p99_ms", "canary_itl_max_ms")  # fmt: skip
SAMPLED = ("tandem_requests_waiting", "tandem_requests_running", "tandem_kv_cache_usage_ratio",
           "tandem_kv_transfer_bytes_total")  # fmt: skip


def test_runner_smoke(tmp_path: Path) -> None:
    cpus = "0,1" if (os.cpu_count() or 1) >= 2 else "0,0"
    out = tmp_path / "pd.json"
    argv = [
        sys.executable, str(BENCHMARKS / "pd_vs_colocated.py"), "--deployments", "pd-tcp-t0",
        "--workloads", "bursty", "--rates", "bursty=1.0", "--duration", "10", "--repeats", "1",
        "--calibration-requests", "3", "--canary-alone", "4", "--hidden", "128", "--layers", "2",
        "--cpus", cpus, "--json", str(out), "--plots-dir", str(tmp_path / "img"),
    ]  # fmt: skip
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())

    (rec,) = report["records"]
    assert rec["deployment"] == "pd-tcp-t0" and rec["errors"] == []
    assert [p["workload"] for p in rec["points"]] == ["calibration", "calibration", "bursty"]
    bursty = rec["points"][2]
    assert bursty["requests"] and all(len(r) == 7 for r in bursty["requests"])
    assert bursty["canary"] and any(len(s["chunks"]) > 1 for s in bursty["canary"])
    roles = {name.split("-")[0] for name in rec["metrics"]}
    assert roles == {"router", "prefill", "decode"}
    for name, series in rec["metrics"].items():
        assert series["times"], name
        if name != "router":
            assert set(SAMPLED) <= set(series["values"][-1]), name
    decode = next(v for n, v in rec["metrics"].items() if n.startswith("decode"))
    assert decode["values"][-1]["tandem_kv_transfer_bytes_total"] > 0
    assert decode["values"][-1]["tandem_kv_transfer_seconds_sum"] > 0

    rep = report["summary"]["per_repeat"][0]
    unloaded = rep["unloaded"]["pd-tcp-t0"]
    # The short calibration prompts: 32 tokens of text plus the chat template.
    assert unloaded["itl_ms"] > 0 and 32 <= unloaded["ttft_ms_by_prompt"][0][0] < 48
    dep = rep["workloads"]["bursty"]["deployments"]["pd-tcp-t0"]
    for slo in ("tight-itl", "relaxed"):
        assert len(dep["curve"][slo]) == 1 and 0 <= dep["curve"][slo][0][1] <= 1
        assert slo in dep["goodput"] and slo in dep["goodput_interpolated"]
    assert set(FIXED_METRICS) <= set(dep["fixed"])
    assert dep["fixed"]["completed"] > 0 and dep["fixed"]["ttft_p50_ms"] > 0
    workers = dep["fixed"]["workers"]
    assert {n.split("-")[0] for n in workers} == {"prefill", "decode"}
    decode_stats = next(v for n, v in workers.items() if n.startswith("decode"))
    assert decode_stats["kv_transfer_bytes"] > 0 and decode_stats["kv_transfer_mean_ms"] > 0
    assert dep["canary_unloaded_itl_p99_ms"] > 0 and dep["canary_p99_vs_unloaded"] > 0
    for png in report["plots"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert len(report["plots"]) == 4
    assert "P/D / best colocated" in proc.stdout
