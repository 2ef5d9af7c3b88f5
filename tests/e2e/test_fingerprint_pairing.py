"""Version-safe pairing with real processes: a prefill and a decode serving the same model name
from two checkpoints (random weights, same shapes, as in a half-done rollout) are never paired:
every answer is the decode checkpoint's own output, with the placement counted as
``incompatible``. Workers of one checkpoint are paired (P/D used)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import write_random_checkpoint
from procs import AUTH, Proc, free_port, wait_for

from tandem import LLM, SamplingParams

SERVED = "rollout-model"
PROMPTS = ["<|bos|><|user|>reverse: fingerprint<|assistant|>", "hello there, general", "x" * 40]


class Stack:
    """A router and workers started by hand (one `tandem up` takes one --model)."""

    def __init__(self, tmp: Path, tokenizer_dir: Path) -> None:
        self.tmp = tmp
        self.port, self.internal = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.registry = f"http://127.0.0.1:{self.internal}"
        self.procs = [Proc(["router", "--model", str(tokenizer_dir), "--served-model-name", SERVED,
                            "--host", "127.0.0.1", "--port", str(self.port), "--internal-port",
                            str(self.internal)], tmp, "router")]  # fmt: skip

    def worker(self, role: str, model: Path) -> None:
        self.procs.append(Proc([role, "--model", str(model), "--served-model-name", SERVED,
                                "--port", str(free_port()), "--router-url", self.registry,
                                "--kv-transport", "tcp", "--engine-option", "num_blocks=128"],
                               self.tmp, f"{role}-{model.name}"))  # fmt: skip

    def workers(self) -> list[dict]:
        try:
            return httpx.get(f"{self.registry}/internal/workers", headers=AUTH,
                             timeout=2).json()["workers"]  # fmt: skip
        except (httpx.HTTPError, ValueError):
            return []

    def wait(self, n: int) -> None:
        def ready() -> bool:
            for p in self.procs:
                if not p.alive():
                    raise RuntimeError(p.log_tail())
            return len(self.workers()) == n

        wait_for(ready, 180, f"{n} workers registered", interval=0.3)

    def complete(self, prompt: str) -> str:
        r = httpx.post(f"{self.url}/v1/completions", json={
            "model": SERVED, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def placements(self, reason: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("tandem_router_placements_total{")
            and 'pool="prefill"' in line
            and f'reason="{reason}"' in line
        )

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("rollout")
    # The demo byte tokenizer's vocabulary, so every sampled id is one the router can decode.
    a = write_random_checkpoint(base / "ckpt-a", "llama", vocab_size=262, seed=11)
    b = write_random_checkpoint(base / "ckpt-b", "llama", vocab_size=262, seed=12)
    return a, b


def offline(model: Path) -> list[str]:
    llm = LLM(str(model), num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params)]


@pytest.fixture
def stack(tmp_path: Path, checkpoints: tuple[Path, Path]) -> Iterator[Stack]:
    s = Stack(tmp_path, checkpoints[1])
    try:
        yield s
    finally:
        s.stop()


def test_mismatched_checkpoints_are_never_paired(
    stack: Stack, checkpoints: tuple[Path, Path]
) -> None:
    a, b = checkpoints
    expected_b, expected_a = offline(b), offline(a)
    assert expected_a != expected_b  # the two checkpoints really answer differently
    stack.worker("prefill", a)
    stack.worker("decode", b)
    stack.wait(2)
    prints = {w["role"]: w["fingerprint"] for w in stack.workers()}
    assert prints["prefill"] != prints["decode"]
    answers = [stack.complete(p) for p in PROMPTS]
    assert answers == expected_b  # decode's own output, never KV computed by checkpoint A
    assert stack.placements("incompatible") == len(PROMPTS)
    assert stack.placements("remote") == 0


def test_matching_checkpoints_use_prefill_and_decode(
    stack: Stack, checkpoints: tuple[Path, Path]
) -> None:
    _, b = checkpoints
    stack.worker("prefill", b)
    stack.worker("decode", b)
    stack.wait(2)
    answers = [stack.complete(p) for p in PROMPTS]
    assert answers == offline(b)
    assert stack.placements("remote") == len(PROMPTS)
    assert stack.placements("incompatible") == 0
