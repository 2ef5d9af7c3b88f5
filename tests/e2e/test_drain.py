"""Scale-down drain (the worker pods' preStop): a draining decode worker leaves the router's
registry, takes no new requests and finishes its in-flight ones; traffic continues elsewhere."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx
import openai
from procs import AUTH, Proc, free_port, wait_for

from tandem.engine.demo import expected_answer, make_user_message


def _running(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tandem_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("tandem_requests_running missing")


def test_drained_worker_finishes_in_flight_and_leaves_registry(tmp_path: Path) -> None:
    port, internal = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    up = Proc(
        ["up", "--port", str(port), "--internal-port", str(internal), "--prefill", "0",
         "--decode", "2", "--log-dir", str(tmp_path)],
        tmp_path,
        "up",
    )  # fmt: skip
    try:
        workers = lambda: httpx.get(  # noqa: E731
            f"http://127.0.0.1:{internal}/internal/workers", headers=AUTH
        ).json()["workers"]
        wait_for(lambda: up.alive() and _ok(lambda: len(workers()) == 2), 180, "up ready")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "reverse: drain"}],
            max_tokens=150,
            temperature=1.0,
            seed=1,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        busy = [w["url"] for w in workers() if _running(w["url"]) == 1]
        assert len(busy) == 1
        result: dict = {}
        drainer = threading.Thread(
            target=lambda: result.update(
                httpx.post(f"{busy[0]}/v1/internal/drain", headers=AUTH, timeout=60).json()
            )
        )
        drainer.start()
        wait_for(lambda: all(w["url"] != busy[0] for w in workers()), 10, "deregistration")
        assert httpx.get(f"{busy[0]}/health").status_code == 503
        for s in ("new1", "new2"):
            out = client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": make_user_message(s)}],
                max_tokens=16,
                temperature=0,
            )
            assert out.choices[0].message.content == expected_answer(s)
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
