"""Scale-down drain (the worker pods' preStop): a draining decode worker leaves the router's
registry, takes no new requests and finishes its in-flight ones; traffic continues elsewhere."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import openai
from checkpoints import write_random_checkpoint
from procs import AUTH, Proc, free_port, wait_for

from tandem import LLM, SamplingParams


def _running(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tandem_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("tandem_requests_running missing")


def test_drained_worker_finishes_in_flight_and_leaves_registry(tmp_path: Path) -> None:
    # A model whose long request outlasts the drain on the fast CPU path (the demo model decodes
    # its whole context in well under a second); greedy answers are checked against offline.
    model = write_random_checkpoint(
        tmp_path / "model", "llama", hidden_size=512, intermediate_size=1024, num_layers=4,
        num_heads=8, num_kv_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = {"new1": [11, 22, 33, 44], "new2": [55, 66, 77]}
    outs = LLM(str(model), num_blocks=160).generate(list(prompts.values()), greedy)
    expected = {name: o.text for name, o in zip(prompts, outs, strict=True)}
    port, internal = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc(
        ["up", "--port", str(port), "--internal-port", str(internal), "--prefill", "0",
         "--decode", "2", "--model", str(model), "--engine-option", "num_blocks=160",
         "--log-dir", str(tmp_path)],
        tmp_path,
        "up",
    )  # fmt: skip
    try:
        workers = lambda: httpx.get(  # noqa: E731
            f"http://127.0.0.1:{internal}/internal/workers", headers=AUTH
        ).json()["workers"]
        wait_for(lambda: up.alive() and _ok(lambda: len(workers()) == 2), 180, "up ready")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = client.completions.create(
            model=str(model),
            prompt="drain",
            max_tokens=1500,
            temperature=1.0,
            seed=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        busy: list[str] = []

        def one_busy() -> bool:
            busy[:] = [w["url"] for w in workers() if _running(w["url"]) == 1]
            return len(busy) == 1

        wait_for(one_busy, 10, "one worker running the long request")
        result: dict = {}
        drainer = threading.Thread(
            target=lambda: result.update(
                httpx.post(f"{busy[0]}/v1/internal/drain", headers=AUTH, timeout=60).json()
            )
        )
        drainer.start()
        wait_for(lambda: all(w["url"] != busy[0] for w in workers()), 10, "deregistration")
        assert httpx.get(f"{busy[0]}/health").status_code == 503
        for name, ids in prompts.items():
            out = client.completions.create(
                model=str(model), prompt=ids, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.choices[0].text == expected[name]
        chunks = [first, *stream]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert finish == "length"
        drainer.join(60)
        assert result["drained"] is True
    finally:
        up.stop(signal.SIGINT)


def _ok(fn) -> bool:  # noqa: ANN001
    try:
        return fn()
    except (httpx.HTTPError, ValueError, KeyError):
        return False
