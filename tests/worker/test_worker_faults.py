"""A worker fails loudly and recovers, as real processes: a failed step fails only its request
and the worker keeps serving; a dead engine thread ends every stream at once, leaves the router,
fails /health and exits non-zero; duplicate ids and a full queue are refused; the integrity
endpoint reports an idle, consistent engine afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import AUTH, CLUSTER_TOKEN, Proc, free_port, wait_for, wait_healthy

HERE = Path(__file__).parent
POISON = 7  # a prompt starting with this token id trips the planted fault
LONG = {"temperature": 0.0, "max_tokens": 120, "ignore_eos": True}


class FaultyWorker:
    def __init__(self, tmp: Path, role: str, mode: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / f"{role}-{mode}-{self.port}.log").open("wb")
        env = {**os.environ, "TANDEM_TEST_FAULT": f"{mode}:{POISON}", "PYTHONUNBUFFERED": "1",
               "TANDEM_TEST_STEP_DELAY": "0.01",
               "TANDEM_CLUSTER_TOKEN": CLUSTER_TOKEN}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "faulty_worker.py"), role, "--model", "demo",
             "--port", str(self.port), "--kv-transport", "tcp", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp),
            start_new_session=True,
        )  # fmt: skip

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_healthy(self) -> None:
        def ok() -> bool:
            assert self.alive(), Path(self.log.name).read_text()[-3000:]
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ok, 90, "faulty worker healthy")

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def body(rid: str, prompt: list[int], params: dict, **kw: object) -> dict:
    return {"request_id": rid, "prompt_token_ids": prompt, "sampling_params": params, **kw}


def integrity(url: str) -> dict:
    return httpx.get(f"{url}/v1/internal/integrity", headers=AUTH, timeout=5).json()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyWorker]:
    flags = ("--max-waiting-requests", "1", "--engine-option", "max_num_seqs=2")
    w = FaultyWorker(tmp_path_factory.mktemp("faults"), "colocated", "once", *flags)
    try:
        w.wait_healthy()
        yield w
    finally:
        w.stop()


def generate(url: str, b: dict) -> list[dict]:
    r = httpx.post(f"{url}/v1/internal/generate", json=b, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines() if line]


def test_a_failed_step_fails_its_batch_and_the_worker_keeps_serving(colocated) -> None:
    url = colocated.url
    expected = [t for c in generate(url, body("ref", [256, 3, 4], LONG)) for t in c["token_ids"]]
    last = generate(url, body("b", [POISON, 3, 4], LONG))[-1]
    assert last["finish_reason"] == "error" and "injected fault" in last["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    report = integrity(url)
    assert report["ok"] and report["idle"] and report["blocks_in_use"] == 0, report
    # Served again, exactly as before the failure.
    after = generate(url, body("c", [256, 3, 4], LONG))
    assert [t for c in after for t in c["token_ids"]] == expected
    assert after[-1]["finish_reason"] == "length"


def test_duplicate_ids_and_a_full_queue_are_refused(colocated) -> None:
    url = colocated.url
    streams = []
    try:
        for rid in ("r1", "r2", "w1"):  # two run (max_num_seqs=2), one waits (the bound is 1)
            s = httpx.stream("POST", f"{url}/v1/internal/generate", headers=AUTH,
                             json=body(rid, [256, 9, 9], LONG), timeout=60)  # fmt: skip
            streams.append(s)
            s.__enter__()
        gen = f"{url}/v1/internal/generate"
        # A live stream's id is refused by the shell (409); an id whose request still holds
        # blocks after its stream ended, by the engine (400: tests/prefill/...engine_abort.py).
        dup = httpx.post(gen, json=body("r1", [256, 5], LONG), headers=AUTH)
        assert dup.status_code == 409 and "already in use" in dup.json()["error"]["message"]
        full = httpx.post(gen, json=body("x", [256, 5], LONG), headers=AUTH)
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    wait_for(lambda: integrity(url)["idle"], 20, "aborted on disconnect")
    assert integrity(url)["ok"] and integrity(url)["blocks_in_use"] == 0


def test_a_dead_engine_ends_every_stream_leaves_the_router_and_exits(tmp_path: Path) -> None:
    router_port, internal = free_port(), free_port()
    router = Proc(["router", "--model", "demo", "--port", str(router_port), "--internal-port",
                   str(internal), "--heartbeat-timeout", "60"], tmp_path, "router")  # fmt: skip
    router_url = f"http://127.0.0.1:{router_port}"
    internal_url = f"http://127.0.0.1:{internal}"
    w = FaultyWorker(tmp_path, "colocated", "fatal", "--router-url", internal_url)
    try:
        wait_healthy(router_url, router)
        w.wait_healthy()

        def listed() -> list:
            r = httpx.get(f"{internal_url}/internal/workers", headers=AUTH, timeout=2)
            return r.json()["workers"]

        wait_for(lambda: len(listed()) == 1, 30, "registration")
        with httpx.stream("POST", f"{w.url}/v1/internal/generate", headers=AUTH,
                          json=body("a", [256, 3, 4], LONG), timeout=60) as a:  # fmt: skip
            lines = a.iter_lines()
            next(lines)
            started = time.monotonic()
            httpx.post(f"{w.url}/v1/internal/generate", json=body("b", [POISON, 1], LONG),
                       headers=AUTH, timeout=30)  # fmt: skip
            last = json.loads([x for x in lines if x][-1])
            assert time.monotonic() - started < 10
        assert last["finish_reason"] == "error" and "engine thread died" in last["error"]["message"]
        # Deregistered (the router would wait 60 s to expire it), and the process exits 1.
        wait_for(lambda: listed() == [], 10, "deregistration")
        assert w.proc.wait(30) == 1
    finally:
        w.stop()
        router.stop()
