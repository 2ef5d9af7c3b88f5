"""End to end: the official `openai` client against a real `tandem up` (demo model, P/D over UCX),
and against `tandem up --prefill 0` (colocated). Answers are checked for being right."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from procs import AUTH, Proc, free_port, up_is_ready, wait_for

from tandem.engine.demo import expected_answer, held_out_inputs, make_user_message


class Up:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.internal_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.internal_url = f"http://127.0.0.1:{self.internal_port}"
        self.proc = Proc(
            ["up", "--port", str(self.port), "--internal-port", str(self.internal_port),
             "--log-dir", str(tmp), *args],
            tmp, "up",
        )  # fmt: skip
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def workers(self) -> list[dict]:
        try:
            r = httpx.get(f"{self.internal_url}/internal/workers", headers=AUTH, timeout=2)
            return r.json()["workers"]
        except (httpx.HTTPError, ValueError):
            return []

    def wait_ready(self, expected: int) -> None:
        def ready() -> bool:
            if not self.proc.alive():
                raise RuntimeError(self.proc.log_tail())
            # Its own start-up done too, or a worker killed by a test would fail the start-up.
            return up_is_ready(self.proc.log_path) and len(self.workers()) == expected

        wait_for(ready, 180, "tandem up ready")

    def worker_metric(self, role: str, name: str) -> list[float]:
        values = []
        for w in self.workers():
            if w["role"] != role:
                continue
            for line in httpx.get(f"{w['url']}/metrics").text.splitlines():
                if line.startswith(name + "{"):
                    values.append(float(line.rsplit(" ", 1)[1]))
        return values


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    up = Up(
        tmp_path_factory.mktemp("up_pd"), "--prefill", "1", "--decode", "2", "--kv-transport", "ucx"
    )
    try:
        up.wait_ready(3)
        yield up
    finally:
        assert up.proc.stop(signal.SIGINT) is not None


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    up = Up(tmp_path_factory.mktemp("up_colo"), "--prefill", "0", "--decode", "1")
    try:
        up.wait_ready(1)
        yield up
    finally:
        up.proc.stop(signal.SIGINT)


def chat(up: Up, content: str, **kw: object) -> openai.types.chat.ChatCompletion:
    return up.client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": content}], **kw
    )


def test_demo_task_answered_correctly_through_the_router(pd: Up) -> None:
    inputs = held_out_inputs(12)
    answers = [chat(pd, make_user_message(s), temperature=0, max_tokens=16) for s in inputs]
    right = [
        a.choices[0].message.content == expected_answer(s)
        for s, a in zip(inputs, answers, strict=True)
    ]
    assert sum(right) >= 11, right
    usage = answers[0].usage
    assert usage.completion_tokens == len(expected_answer(inputs[0])) + 1  # + EOS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_equals_non_streamed_and_usage_chunk(pd: Up) -> None:
    msg = make_user_message("stream42")
    full = chat(pd, msg, temperature=0, max_tokens=16)
    stream = chat(
        pd, msg, temperature=0, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content == "24maerts"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_n_seed_stop(pd: Up) -> None:
    prompt = "<|bos|><|user|>reverse: abcdef<|assistant|>"
    kw = dict(model="demo", prompt=prompt, max_tokens=12, temperature=1.0, seed=11, n=2)
    a = pd.client.completions.create(**kw)
    b = pd.client.completions.create(**kw)
    assert len(a.choices) == 2
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    stopped = pd.client.completions.create(
        model="demo", prompt=prompt, max_tokens=12, temperature=0, stop=["c"]
    )
    assert stopped.choices[0].text == "fed" and stopped.choices[0].finish_reason == "stop"


def test_colocated_and_disaggregated_give_identical_greedy_text(pd: Up, colocated: Up) -> None:
    for s in held_out_inputs(6):
        kw = dict(temperature=0, max_tokens=20)
        assert (
            chat(pd, make_user_message(s), **kw).choices[0].message.content
            == chat(colocated, make_user_message(s), **kw).choices[0].message.content
        )


def test_bad_input_gets_openai_errors_and_service_continues(pd: Up) -> None:
    r = httpx.post(
        f"{pd.url}/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        chat(pd, "x", temperature=-1)
    assert "temperature" in str(err.value)
    with pytest.raises(openai.NotFoundError):
        pd.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "a"}])
    with pytest.raises(openai.BadRequestError):
        chat(pd, "a" * 400, max_tokens=4)
    assert chat(pd, make_user_message("ok1"), temperature=0).choices[0].message.content == "1ko"


def test_shared_prefix_requests_land_on_the_worker_that_cached_it(pd: Up) -> None:
    before = sum(pd.worker_metric("decode", "tandem_prefix_cache_hit_tokens_total"))
    prefix = "<|bos|><|system|>" + "the quick brown fox jumps over the lazy dog " * 2
    for s in ("abc", "abd", "abe", "abf"):
        pd.client.completions.create(
            model="demo", prompt=prefix + f"<|user|>reverse: {s}", max_tokens=4, temperature=0
        )
    hits = pd.worker_metric("decode", "tandem_prefix_cache_hit_tokens_total")
    # Three follow-ups each hit >= 5 cached 16-token blocks, all on one decode worker.
    assert sum(hits) - before >= 3 * 5 * 16
    assert sorted(hits)[0] <= before


def test_client_disconnect_frees_blocks_on_both_workers(pd: Up) -> None:
    stream = chat(
        pd,
        make_user_message("longstream"),
        max_tokens=200,
        temperature=1.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()

    def all_free() -> bool:
        usage = pd.worker_metric("decode", "tandem_kv_cache_usage_ratio")
        usage += pd.worker_metric("prefill", "tandem_kv_cache_usage_ratio")
        running = pd.worker_metric("decode", "tandem_requests_running")
        return all(u == 0.0 for u in usage) and all(r == 0 for r in running)

    wait_for(all_free, 20, "blocks freed on prefill and decode")


def test_killed_decode_worker_leaves_registry_and_traffic_continues(pd: Up) -> None:
    decodes = [w for w in pd.workers() if w["role"] == "decode"]
    assert len(decodes) == 2
    port = decodes[0]["url"].rsplit(":", 1)[1]
    pids = [int(p) for p in os.popen(f"lsof -t -i TCP:{port} -s TCP:LISTEN").read().split()]
    if not pids:
        pytest.skip("lsof could not find the worker's pid")
    os.kill(pids[0], signal.SIGKILL)

    # `tandem up` restarts the worker under a new engine id: what must go is the dead one's id
    # (a count could see the restart register before the dead one expires).
    def dropped() -> bool:
        listed = {w["engine_id"] for w in pd.workers()}
        return bool(listed) and decodes[0]["engine_id"] not in listed

    wait_for(dropped, 15, "dead worker dropped")
    for s in ("kill1", "kill2", "kill3"):
        out = chat(pd, make_user_message(s), temperature=0, max_tokens=16)
        assert out.choices[0].message.content == expected_answer(s)
