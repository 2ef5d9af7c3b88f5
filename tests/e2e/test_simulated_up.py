"""`tandem up --simulate`: ten simulated workers (2 prefill + 8 decode) behind the real router
answer through the real P/D path (placement, KV hand-off over the real side channel, decode),
with the profiled timing and no model weights."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from procs import AUTH, Proc, free_port, wait_for
from sim_profiles import DEMO_TOKENS, synthetic_profile

from tandem.engine.sim.tokens import next_token

PROMPT = "the quick brown fox jumps over the lazy dog, again and again and again"


class SimUp:
    def __init__(self, tmp: Path) -> None:
        self.profile = tmp / "profile.json"
        profile = synthetic_profile(execute=(0.004, 1e-5, 0, 0, 0, 0, 0), transfer=(0.002, 1e-9))
        profile.save(self.profile)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.internal = free_port()
        self.proc = Proc(["up", "--simulate", str(self.profile), "--prefill", "2", "--decode",
                          "8", "--kv-transport", "tcp", "--port", str(self.port),
                          "--internal-port", str(self.internal), "--log-dir", str(tmp)],
                         tmp, "up")  # fmt: skip

    def workers(self) -> list[dict]:
        try:
            url = f"http://127.0.0.1:{self.internal}/internal/workers"
            return httpx.get(url, headers=AUTH, timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError):
            return []


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimUp]:
    sim = SimUp(tmp_path_factory.mktemp("sim_up"))
    try:

        def ready() -> bool:
            if not sim.proc.alive():
                raise RuntimeError(sim.proc.log_tail())
            return len(sim.workers()) == 10

        wait_for(ready, 300, "ten simulated workers")
        yield sim
    finally:
        sim.proc.stop(signal.SIGINT)


def complete(up: SimUp, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(f"{up.url}/v1/completions", timeout=60,
                   json={"model": "demo", "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def metric_sum(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_ten_simulated_workers_answer_through_prefill_and_decode(up: SimUp) -> None:
    workers = up.workers()
    assert sorted(w["role"] for w in workers) == ["decode"] * 8 + ["prefill"] * 2
    info = httpx.get(f"{workers[0]['url']}/info", headers=AUTH, timeout=5).json()
    assert info["simulated"] is True
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: complete(up, f"{PROMPT} #{i}", 12), range(24)))
    for a in answers:
        assert a["choices"][0]["finish_reason"] == "length"
        assert a["usage"]["completion_tokens"] == 12
        assert len(a["choices"][0]["text"]) == 12  # one printable letter or digit per token
    # Each answer is the deterministic rule applied to the prompt's tokens, wherever it ran:
    # the same prompt twice gives the same text (the prefill and decode worker may differ).
    again = complete(up, f"{PROMPT} #3", 12)
    assert again["choices"][0]["text"] == answers[3]["choices"][0]["text"]
    remote = metric_sum(up.url, "tandem_router_placements_total", pool="prefill", reason="remote")
    assert remote >= 25
    moved = sum(
        metric_sum(w["url"], "tandem_kv_transfer_bytes_total", direction="recv", transport="sim")
        for w in workers
        if w["role"] == "decode"
    )
    assert moved >= 25 * 32768  # every hand-off pulled its prompt's blocks (simulated bytes)


def test_simulated_tokens_follow_the_rule(up: SimUp) -> None:
    r = httpx.post(f"{up.url}/v1/completions", timeout=60,
                   json={"model": "demo", "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 6,
                         "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    seq = [5, 6, 7, 8, 9, 10, 11, 12]
    for _ in range(6):
        seq.append(next_token(seq, DEMO_TOKENS))
    assert r.json()["choices"][0]["text"] == "".join(chr(t) for t in seq[8:])
