"""``tandem up``: command lines, and supervision (ready, Ctrl-C, start-up failure) with real
router and worker-double processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem.child_command import subcommand, tandem_argv
from tandem.up import UpConfig, build_specs, curl_line, parse_config

HARNESS = Path(__file__).parent / "up_harness.py"
PY = "/py"


def test_specs_disaggregated() -> None:
    cfg = UpConfig(model="/m", port=9000, prefill=1, decode=2, kv_transport="tcp",
                   local_prefill_threshold=64, prefill_overload_queue=6,
                   engine_options=("max_num_seqs=8",))  # fmt: skip
    specs = build_specs(cfg, iter([9001, 7001, 7002, 7003]), python=PY, token="t" * 32)
    base = tandem_argv(python=PY)
    assert [s.name for s in specs] == ["router", "prefill-0", "decode-0", "decode-1"]
    assert specs[0].argv == base + (
        "router", "--model", "/m", "--host", "127.0.0.1", "--port", "9000",
        "--internal-port", "9001",
        "--policy", "prefix-aware", "--local-prefill-threshold", "64",
        "--prefill-overload-queue", "6", "--peer-pull-min-tokens", "0",
    )  # fmt: skip
    # The cluster token reaches every child through its environment only.
    assert all(s.env == (("TANDEM_CLUSTER_TOKEN", "t" * 32),) for s in specs)
    assert not any("t" * 32 in " ".join(s.argv) for s in specs)
    assert specs[0].internal_url == "http://127.0.0.1:9001"
    assert specs[1].argv == base + (
        "prefill", "--model", "/m", "--host", "127.0.0.1", "--port", "7001",
        "--router-url", "http://127.0.0.1:9001", "--kv-transport", "tcp",
        "--engine-option", "max_num_seqs=8",
    )  # fmt: skip
    assert [s.url for s in specs[1:]] == [f"http://127.0.0.1:{p}" for p in (7001, 7002, 7003)]
    assert [s.role for s in specs] == ["router", "prefill", "decode", "decode"]


def test_specs_colocated_and_api_key_in_env() -> None:
    # A key no flag contains (the argv spells "--peer-pull-min-tokens").
    key = "K3Y"
    cfg = UpConfig(prefill=0, decode=2, api_key=key, internal_port=8001)
    specs = build_specs(cfg, iter([1, 2]), python=PY)
    assert [s.role for s in specs] == ["router", "colocated", "colocated"]
    assert subcommand(specs[1].argv) == "colocated"
    assert specs[0].env == (("TANDEM_API_KEY", key),)
    assert key not in repr(specs[0])
    assert key not in specs[0].argv
    assert f"Authorization: Bearer {key}" in curl_line(cfg)
    assert "--kv-peer-pull" not in specs[1].argv  # UpConfig's own default: pulls off


def test_peer_pulls_are_opt_in_and_for_several_colocated_workers_only() -> None:
    from tandem.up_config import DEFAULT_PEER_PULL_MIN_TOKENS

    assert DEFAULT_PEER_PULL_MIN_TOKENS == 0  # off until a pull is measured to win
    off = parse_config(["--prefill", "0", "--decode", "2"])
    assert off.peer_pull_min_tokens == 0
    assert all("--kv-peer-pull" not in s.argv for s in build_specs(off, iter([1, 2, 3]), PY))
    on = parse_config(["--prefill", "0", "--decode", "2", "--peer-pull-min-tokens", "256"])
    specs = build_specs(on, iter([1, 2, 3]), python=PY)
    router = specs[0].argv
    i = router.index("--peer-pull-min-tokens")
    assert router[i + 1] == "256"
    assert all(s.argv[-1] == "--kv-peer-pull" for s in specs[1:])
    for argv in (["--prefill", "0", "--decode", "1"], ["--prefill", "1", "--decode", "2"], []):
        assert parse_config(argv).peer_pull_min_tokens == 0
    assert parse_config(["--prefill", "0", "--decode", "3", "--peer-pull-min-tokens", "0"]
                        ).peer_pull_min_tokens == 0  # fmt: skip
    assert parse_config(["--prefill", "0", "--decode", "2", "--peer-pull-min-tokens", "64"]
                        ).peer_pull_min_tokens == 64  # fmt: skip
    for bad in (["--prefill", "0", "--decode", "2", "--peer-pull-min-tokens", "-1"],
                ["--decode", "2", "--peer-pull-min-tokens", "64"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_config(bad)


def test_parse_config_defaults_and_errors() -> None:
    cfg = parse_config([])
    assert (cfg.model, cfg.port, cfg.prefill, cfg.decode, cfg.kv_transport) == (
        "demo", 8000, 1, 1, "ucx")  # fmt: skip
    assert parse_config(["--prefill", "0", "--local-prefill-threshold", "32"]).prefill == 0
    for bad in (["--decode", "0"], ["--prefill", "-1"], ["--model", "/does/not/exist"],
                ["--kv-transport", "smoke"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_config(bad)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tokenizer_dir: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), "--tokenizer", str(tokenizer_dir), "--port", str(port),
         "--log-dir", str(tmp_path), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )  # fmt: skip
    return proc, port


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_serves_then_ctrl_c_leaves_no_process(tokenizer_dir: Path, tmp_path: Path) -> None:
    proc, port = _start(tokenizer_dir, tmp_path)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "READY":
                break
        pids = [int(m.group(1)) for m in (re.search(r" pid (\d+)", s) for s in lines) if m]
        assert len(pids) == 3, "".join(lines)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "test-model", "prompt": "abc", "max_tokens": 3},
            timeout=30,
        )
        assert r.json()["choices"][0]["text"] == "cba"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_up_worker_dying_at_startup_fails_with_log_tail(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    proc, _ = _start(tokenizer_dir, tmp_path, "--fail-worker")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "decode-1 exited with code 3" in out
    assert "boom: cannot load weights" in out
    assert "READY" not in out


def test_specs_with_several_routers() -> None:
    cfg = UpConfig(port=9000, prefill=1, decode=1, routers=3, internal_port=9100)
    specs = build_specs(cfg, iter([7001, 7002]), python=PY, token="t" * 32)
    routers = [s for s in specs if s.role == "router"]
    assert [s.name for s in routers] == ["router-0", "router-1", "router-2"]
    assert [s.url for s in routers] == [f"http://127.0.0.1:{p}" for p in (9000, 9001, 9002)]
    assert [s.internal_url for s in routers] == [
        f"http://127.0.0.1:{p}" for p in (9100, 9101, 9102)
    ]
    for w in specs[3:]:
        urls = [w.argv[i + 1] for i, a in enumerate(w.argv) if a == "--router-url"]
        assert urls == [r.internal_url for r in routers]  # every worker, every router
    assert {s.env for s in specs} == {(("TANDEM_CLUSTER_TOKEN", "t" * 32),)}
    with pytest.raises(SystemExit):
        parse_config(["--routers", "0"])


def test_specs_pass_admission_flags_to_the_router_only_when_given() -> None:
    cfg = parse_config(["--max-inflight-requests", "64", "--request-timeout", "30",
                        "--migration-limit", "0"])  # fmt: skip
    router_argv = build_specs(cfg, iter([1, 2, 3]), python=PY)[0].argv
    assert router_argv[-6:] == (
        "--max-inflight-requests", "64", "--request-timeout", "30.0", "--migration-limit", "0",
    )  # fmt: skip
    assert "--max-queued-requests" not in router_argv
    with pytest.raises(SystemExit):
        parse_config(["--max-queued-requests", "-1"])


def test_up_restarts_a_worker_that_dies(tokenizer_dir: Path, tmp_path: Path) -> None:
    import threading

    proc, port = _start(tokenizer_dir, tmp_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def wait_line(pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(lines):
                if m := re.search(pattern, line):
                    return m
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(lines)}")

    url = f"http://127.0.0.1:{port}"
    try:
        wait_line("^READY")
        pid = int(wait_line(r"decode-0\s+pid (\d+)").group(1))
        os.kill(pid, signal.SIGKILL)
        wait_line(r"decode-0 exited with code -9 after \d+ s; restarting in 1 s")
        new_pid = int(wait_line(r"restarted decode-0 \(restart 1\), pid (\d+)").group(1))
        assert new_pid != pid

        def served() -> bool:
            try:
                r = httpx.post(
                    f"{url}/v1/completions",
                    timeout=30,
                    json={"model": "test-model", "prompt": "abc", "max_tokens": 3},
                )
            except httpx.HTTPError:
                return False  # fmt: skip
            return r.status_code == 200 and r.json()["choices"][0]["text"] == "cba"

        deadline = time.monotonic() + 30
        while not served():
            assert time.monotonic() < deadline, "the restarted worker never served"
            time.sleep(0.1)
        # Two lives in its log, under two engine ids (it registered anew).
        log = (tmp_path / "decode-0.log").read_text()
        ids = re.findall(r"worker (\w+) serving at", log)
        assert len(ids) == 2 and ids[0] != ids[1] and "--- tandem up: restart 1 ---" in log
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert not _alive(new_pid)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_worker_threads_split_the_machine_and_reach_every_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tandem.up_config as up_config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(up_config, "available_cpus", lambda: 16)
    cfg = parse_config(["--prefill", "1", "--decode", "2", "--kv-transport", "tcp"])
    assert cfg.worker_threads == 5  # (16 CPUs - 1 for the router) // 3 workers
    assert any("5 CPU thread(s)" in n and "16 CPUs" in n for n in cfg.notes)
    specs = build_specs(cfg, iter(range(9001, 9010)), python=PY)
    for s in specs[1:]:
        assert s.argv[-2:] == ("--threads", "5")
    assert "--threads" not in specs[0].argv  # the router runs no engine
    assert parse_config(["--worker-threads", "3"]).worker_threads == 3
    monkeypatch.setattr(up_config, "available_cpus", lambda: 2)
    assert parse_config(["--prefill", "0"]).worker_threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice: workers read it themselves
    cfg = parse_config([])
    assert cfg.worker_threads is None
    assert all("--threads" not in s.argv for s in build_specs(cfg, iter(range(9001, 9010))))
    with pytest.raises(SystemExit):
        parse_config(["--worker-threads", "0"])
