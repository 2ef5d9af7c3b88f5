"""The worker processes' internal API (docs/internal-api.md), run as real `tandem` processes."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import write_random_checkpoint
from procs import AUTH, Proc, free_port, wait_healthy

from tandem import LLM, SamplingParams
from tandem.engine.output_processor import SequenceOutput

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def start(role: str, model: Path, tmp: Path, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(
        [
            role,
            "--model",
            str(model),
            "--port",
            str(port),
            "--engine-option",
            "num_blocks=64",
            *extra,
        ],
        tmp,
        f"{role}-{port}",
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


@pytest.fixture(scope="module")
def workers(llama_gqa_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("workers")
    procs = {}
    try:
        for role in ("colocated", "prefill", "decode"):
            procs[role] = start(role, llama_gqa_path, tmp, "--kv-transport", "ucx")
        yield {role: url for role, (_, url) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.stop()


def generate(url: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", f"{url}/v1/internal/generate", json=body, headers=AUTH, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(n)]


def test_info_and_health(workers: dict) -> None:
    info = httpx.get(f"{workers['prefill']}/info", headers=AUTH).json()
    assert info["role"] == "prefill" and info["block_size"] == 16
    assert info["hash_algorithm"] == "blake2b-128-v1"
    assert info["kv_side_channel"].startswith("tcp://")
    assert info["kv_events_endpoint"].startswith("tcp://")


def test_colocated_and_disaggregated_match_offline(workers: dict, llama_gqa_path: Path) -> None:
    p = prompt(0, 37)
    llm = LLM(str(llama_gqa_path), num_blocks=64)
    expected = llm.generate([p], SamplingParams(**GREEDY))
    chunks = generate(
        workers["colocated"], {"request_id": "c1", "prompt_token_ids": p, "sampling_params": GREEDY}
    )
    assert [t for c in chunks for t in c["token_ids"]] == expected[0].token_ids
    assert chunks[-1]["finish_reason"] == "length"

    first = generate(
        workers["prefill"],
        {
            "request_id": "pd1",
            "prompt_token_ids": p,
            "sampling_params": GREEDY,
            "remote_decode": True,
        },
    )
    assert first[-1]["finish_reason"] == "remote_decode"
    kv = first[-1]["kv_transfer_params"]
    rest = generate(
        workers["decode"],
        {
            "request_id": "pd1",
            "prompt_token_ids": p,
            "sampling_params": GREEDY,
            "kv_transfer_params": kv,
        },
    )
    tokens = [t for c in first + rest for t in c["token_ids"]]
    assert tokens == expected[0].token_ids
    # Workers stream token ids; text is made where output leaves the system (the router).
    seq = SequenceOutput.create(llm.tokenizer, p, SamplingParams(**GREEDY))
    text = "".join(seq.process(c["token_ids"], (), c["finish_reason"]).text for c in first + rest)
    assert text == expected[0].text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"request_id": "x", "prompt_token_ids": [], "sampling_params": {}}, "prompt_token_ids"),
        (
            {"request_id": "x", "prompt_token_ids": [1], "sampling_params": {"top_p": 7}},
            "sampling_params",
        ),
        ({"request_id": "x", "prompt_token_ids": [1], "bogus": 1}, "bogus"),
        ({"request_id": 5, "prompt_token_ids": [1]}, "request_id"),
        ({"request_id": "x", "prompt_token_ids": [1] * 600}, "prompt_token_ids"),
    ],
)
def test_bad_requests_get_400_naming_the_field(workers: dict, body: dict, param: str) -> None:
    r = httpx.post(f"{workers['colocated']}/v1/internal/generate", json=body, headers=AUTH)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_garbage_body_is_400_and_worker_keeps_serving(workers: dict) -> None:
    r = httpx.post(
        f"{workers['colocated']}/v1/internal/generate", content=b"\x00\xffnot json", headers=AUTH
    )
    assert r.status_code == 400
    chunks = generate(
        workers["colocated"],
        {"request_id": "after", "prompt_token_ids": [1, 2], "sampling_params": GREEDY},
    )
    assert chunks[-1]["finish_reason"] == "length"


def test_metrics_expose_the_design_names(workers: dict) -> None:
    text = httpx.get(f"{workers['decode']}/metrics").text
    for name in (
        "tandem_requests_running",
        "tandem_requests_waiting",
        "tandem_kv_cache_usage_ratio",
        "tandem_prefix_cache_queried_tokens_total",
        "tandem_prefix_cache_hit_tokens_total",
        "tandem_prompt_tokens_total",
        "tandem_generation_tokens_total",
        "tandem_preemptions_total",
        "tandem_kv_transfer_bytes_total",
    ):
        assert name in text, name
    assert 'role="decode"' in text


def test_latency_histograms_count_each_finished_request(workers: dict) -> None:
    url = workers["colocated"]
    names = [
        f"tandem_worker_{n}_count"
        for n in ("queue_time_seconds", "time_to_first_token_seconds", "request_duration_seconds")
    ]
    before = {n: _gauge(url, n) for n in names}  # exported from the start, at 0
    busy = _gauge(url, "tandem_worker_busy_seconds_total")
    body = {"request_id": "timed", "prompt_token_ids": prompt(7, 20), "sampling_params": GREEDY}
    assert generate(url, body)[-1]["finish_reason"] == "length"
    for n in names:
        assert _gauge(url, n) == before[n] + 1, n
    assert _gauge(url, "tandem_worker_time_to_first_token_seconds_sum") > 0
    assert _gauge(url, "tandem_worker_busy_seconds_total") > busy  # its steps ran the model


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def long_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A colocated worker whose requests can outlast a client: 2k context and a model large enough
    that 2000 tokens take seconds (the fixture model decodes 400 tokens in well under a second on
    the CPU fast path, before the test can look)."""
    tmp = tmp_path_factory.mktemp("long_worker")
    path = write_random_checkpoint(
        tmp / "model", "llama", hidden_size=512, intermediate_size=1024, num_layers=4,
        num_heads=8, num_kv_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    proc, url = start("colocated", path, tmp, "--engine-option", "num_blocks=160")
    try:
        yield url
    finally:
        proc.stop()


def test_client_disconnect_aborts_and_frees_blocks(long_worker: str) -> None:
    from procs import wait_for

    url = long_worker
    body = {
        "request_id": "gone",
        "prompt_token_ids": prompt(3, 40),
        "sampling_params": {"temperature": 0.0, "max_tokens": 2000, "ignore_eos": True},
    }
    with httpx.stream(
        "POST", f"{url}/v1/internal/generate", json=body, headers=AUTH, timeout=60
    ) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
        assert _gauge(url, "tandem_requests_running") == 1
    wait_for(lambda: _gauge(url, "tandem_requests_running") == 0, 10, "abort after disconnect")
    wait_for(lambda: _gauge(url, "tandem_kv_cache_usage_ratio") == 0.0, 10, "blocks freed")


def test_kv_snapshot_names_both_tiers_and_grants_need_a_peer_worker(workers: dict) -> None:
    url = workers["colocated"]
    generate(
        url, {"request_id": "snap", "prompt_token_ids": prompt(9, 40), "sampling_params": GREEDY}
    )
    snap = httpx.get(f"{url}/v1/internal/kv_blocks", headers=AUTH).json()
    assert len(snap["block_hashes"]) >= 2 and snap["host_block_hashes"] == []  # no host tier
    grant = {"request_id": "g", "prompt_token_ids": prompt(9, 32)}
    for role in ("colocated", "prefill", "decode"):  # none started with --kv-peer-pull
        r = httpx.post(f"{workers[role]}/v1/internal/kv_grant", json=grant, headers=AUTH)
        assert r.status_code == 400 and "prefix pulls" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/internal/kv_grant", json=grant).status_code == 401
    bad = httpx.post(f"{url}/v1/internal/kv_grant", json={"request_id": "g"}, headers=AUTH)
    assert bad.status_code == 400
