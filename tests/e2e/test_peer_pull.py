"""Prefix pulls between real colocated workers (``--kv-peer-pull``) behind a real router: the
router sends a request to the worker without its prefix, which pulls it from the one that has it
(counted) and answers exactly as recomputing would; a source killed mid-pull, and blocks
corrupted on the way, are misses (recomputed, same answer, counted). Nothing stays pinned or
held on either worker afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import write_random_checkpoint
from procs import AUTH, Proc, wait_for

from tandem import LLM, SamplingParams
from tandem.up_config import worker_port

HERE = Path(__file__).parent
SERVED = "peer-model"
PREFIX = "<|bos|><|user|>" + "a long shared system prompt, " * 6  # ~190 tokens: 11 blocks
FIRST, SECOND = PREFIX + "first question?", PREFIX + "and the second one"
MAX_TOKENS = 8


class Stack:
    """A router (round-robin, so the second request goes to the other worker) and two peers."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp, self.model = tmp, model
        self.taken: set[int] = set()
        port, internal = self._port(), self._port()
        self.url, self.registry = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{internal}"
        self.procs = {"router": Proc(
            ["router", "--model", str(model), "--served-model-name", SERVED, "--port", str(port),
             "--internal-port", str(internal), "--policy", "round-robin",
             "--peer-pull-min-tokens", "32"], tmp, "router")}  # fmt: skip
        self.worker_urls: dict[str, str] = {}

    def _port(self) -> int:
        """A free port below the ephemeral range the workers' own sockets bind in, distinct
        from this stack's others (two random probes can draw the same one: seen in CI)."""
        port = worker_port()
        while port in self.taken:
            port = worker_port()
        self.taken.add(port)
        return port

    def worker(self, name: str, fault: str | None = None) -> None:
        port = self._port()
        self.worker_urls[name] = f"http://127.0.0.1:{port}"
        env = {"TANDEM_TEST_PEER_FAULT": fault} if fault else None
        self.procs[name] = Proc(
            ["colocated", "--kv-peer-pull", "--model", str(self.model), "--served-model-name",
             SERVED, "--port", str(port), "--router-url", self.registry, "--kv-transport", "tcp",
             "--kv-transfer-timeout", "5", "--engine-option", "num_blocks=64"],
            self.tmp, name, env, script=HERE / "peer_fault_worker.py" if fault else None,
        )  # fmt: skip

    def wait_registered(self, n: int) -> None:
        def ready() -> bool:
            for p in self.procs.values():
                if not p.alive():
                    raise RuntimeError(p.log_tail())
            try:
                r = httpx.get(f"{self.registry}/internal/workers", headers=AUTH, timeout=2)
                return len(r.json()["workers"]) == n
            except (httpx.HTTPError, ValueError):
                return False

        wait_for(ready, 180, f"{n} workers registered", interval=0.3)

    def complete(self, prompt: str) -> str:
        r = httpx.post(f"{self.url}/v1/completions", json={
            "model": SERVED, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def metric(self, url: str, name: str, *labels: str) -> float:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and all(lb in line for lb in labels))  # fmt: skip

    def pulls(self, reason: str) -> float:
        return self.metric(self.url, "tandem_router_placements_total", 'pool="peer"',
                           f'reason="{reason}"')  # fmt: skip

    def assert_drained(self, *names: str) -> None:
        for name in names:
            url = self.worker_urls[name]

            def idle(url: str = url) -> bool:
                r = httpx.get(f"{url}/v1/internal/integrity", headers=AUTH, timeout=10).json()
                return r["idle"]

            wait_for(idle, 30, f"{name} idle")
            r = httpx.get(f"{url}/v1/internal/integrity", headers=AUTH, timeout=10).json()
            assert r["ok"] and r["pinned"] == 0 and r["blocks_in_use"] == 0, r

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The demo byte tokenizer's vocabulary, so every sampled id is one the router can decode.
    return write_random_checkpoint(tmp_path_factory.mktemp("peer"), "llama", vocab_size=262)


@pytest.fixture(scope="module")
def expected(model: Path) -> str:
    llm = LLM(str(model), num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(SECOND, params)[0].text


@pytest.fixture
def stack(tmp_path: Path, model: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, model)
    try:
        yield s
    finally:
        s.stop()


def test_the_worker_without_the_prefix_pulls_it(stack: Stack, expected: str) -> None:
    stack.worker("a")
    stack.worker("b")
    stack.wait_registered(2)
    stack.complete(FIRST)  # one worker caches the prefix
    assert stack.complete(SECOND) == expected  # round-robin: the other one, which pulls it
    assert stack.pulls("pull") == 1 and stack.pulls("pull_refused") == 0
    received = sum(stack.metric(u, "tandem_kv_transfer_bytes_total", 'direction="recv"')
                   for u in stack.worker_urls.values())  # fmt: skip
    assert received > 0
    stack.assert_drained("a", "b")


def test_a_source_killed_mid_pull_is_recomputed(
    stack: Stack, expected: str, tmp_path: Path
) -> None:
    marker = tmp_path / "sending"
    stack.worker("a", fault=f"stall:{marker}")
    stack.wait_registered(1)
    stack.complete(FIRST)  # only a is registered: it caches the prefix
    stack.worker("b")
    stack.wait_registered(2)
    # round-robin's next turn is the second worker; b pulls from a, whose send stalls; a dies.
    import threading

    answer: list[str] = []
    t = threading.Thread(target=lambda: answer.append(stack.complete(SECOND)))
    t.start()
    wait_for(marker.exists, 30, "the pull to start")
    stack.procs["a"].stop()
    t.join(60)
    assert answer == [expected]
    assert stack.pulls("pull") == 1
    b = stack.worker_urls["b"]
    assert stack.metric(b, "tandem_kv_transfer_failures_total") == 1
    stack.assert_drained("b")


def test_blocks_corrupted_on_the_way_are_a_miss(stack: Stack, expected: str) -> None:
    stack.worker("a", fault="corrupt")
    stack.wait_registered(1)
    stack.complete(FIRST)
    stack.worker("b")
    stack.wait_registered(2)
    assert stack.complete(SECOND) == expected
    assert stack.pulls("pull") == 1
    b = stack.worker_urls["b"]
    assert stack.metric(b, "tandem_kv_transfer_failures_total", 'reason="checksum_mismatch"') == 1
    stack.assert_drained("a", "b")
