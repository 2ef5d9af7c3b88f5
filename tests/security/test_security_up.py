"""The attacks of issue 10 against one real `tandem up` (router + prefill + decode, KV over TCP).

An attacker on the cluster network holds no secret; some tests also play a compromised peer
that holds the cluster token but not a transfer's secret. Every attack must be refused with the
right status, and afterwards (checked after each test) the service must answer the demo task
correctly from the same registered workers it started with.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import zmq
from secure_up import SecureUp, cmdline, listening, peak_rss_bytes
from zmq.utils.monitor import parse_monitor_message

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.kv_connector import FailureReason, KVTransferParams
from tandem.engine.kv_events import PLAIN_USERNAME, TOPIC
from tandem.engine.kv_layout import KVLayout
from tandem.kvtransfer import create_connector
from tandem.kvtransfer import protocol as p
from tandem.kvtransfer.auth import FrameAuth

# The demo model's KV layout (engine/demo/weights/config.json); num_blocks is not compared.
DEMO_LAYOUT = KVLayout(
    num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32", num_blocks=64
)
WRONG = {"Authorization": "Bearer not-the-cluster-token-at-all"}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureUp]:
    s = SecureUp(tmp_path_factory.mktemp("secure_up"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture(autouse=True)
def service_survives(up: SecureUp) -> Iterator[None]:
    """After every attack: correct answers, from the very workers registered at start."""
    yield
    assert up.answers_correctly(), "the service no longer answers the demo task correctly"
    assert up.worker_set() == up.baseline, "the registered worker set changed"


def registration(up: SecureUp, **overrides: object) -> dict:
    body = {
        "engine_id": "rogue-engine", "role": "decode", "model": "demo",
        "url": "http://127.0.0.1:1", "block_size": 16, "hash_algorithm": "blake2b-128-v1",
        "max_model_len": 256, "num_blocks": 64, "kv_events_endpoint": None,
        "kv_side_channel": None,
    }  # fmt: skip
    body.update(overrides)
    return body


# -- the registry ------------------------------------------------------------------------------


def test_registry_is_not_on_the_public_port_and_needs_the_token(up: SecureUp) -> None:
    for path in ("/internal/workers/register", "/internal/workers/deregister"):
        r = httpx.post(f"{up.url}{path}", json=registration(up))
        assert r.status_code == 404, path
    assert httpx.get(f"{up.url}/internal/workers").status_code == 404
    for headers in ({}, WRONG):
        r = httpx.post(f"{up.internal_url}/internal/workers/register", json=registration(up),
                       headers=headers)  # fmt: skip
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_cluster_token"
        for w in up.baseline:  # deregistering every listed id empties nothing
            r = httpx.post(f"{up.internal_url}/internal/workers/deregister",
                           json={"engine_id": w[0]}, headers=headers)  # fmt: skip
            assert r.status_code == 401
        assert httpx.get(f"{up.internal_url}/internal/workers", headers=headers).status_code == 401


def test_live_engine_id_cannot_be_taken_over(up: SecureUp) -> None:
    (decode,) = [w for w in up.baseline if w[1] == "decode"]
    takeover = registration(up, engine_id=decode[0], url="http://127.0.0.1:9")
    r = httpx.post(f"{up.internal_url}/internal/workers/register", json=takeover, headers=up.auth)
    assert r.status_code == 409 and r.json()["error"]["param"] == "url"


@pytest.mark.parametrize(
    ("overrides", "param"),
    [
        ({"max_model_len": 1}, "max_model_len"),  # made every request context_length_exceeded
        ({"max_model_len": 1 << 20}, "max_model_len"),  # more than the model has
        ({"url": "http://10.0.0.1:80/steal?x="}, "url"),  # SSRF through a path and a query
        ({"url": "http://user@127.0.0.1:1"}, "url"),
        ({"kv_events_endpoint": "ipc:///tmp/x"}, "kv_events_endpoint"),
        ({"hash_algorithm": "md5"}, "hash_algorithm"),
        ({"num_blocks": 1 << 40}, "num_blocks"),  # the prefix index sized by the claim
        ({"model": "another"}, "model"),
    ],
)
def test_bad_registrations_are_refused_naming_the_field(
    up: SecureUp, overrides: dict, param: str
) -> None:
    r = httpx.post(
        f"{up.internal_url}/internal/workers/register",
        json=registration(up, **overrides),
        headers=up.auth,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- the workers' internal API -----------------------------------------------------------------


def test_worker_internal_routes_need_the_token(up: SecureUp) -> None:
    for role in ("prefill", "decode"):
        url = up.worker_url(role)
        for headers in ({}, WRONG):
            # one unauthenticated drain?timeout=0 used to remove the only decode worker for good
            assert (
                httpx.get(f"{url}/v1/internal/drain?timeout=0", headers=headers).status_code == 401
            )
            body = {"request_id": "x", "prompt_token_ids": [1, 2]}
            assert httpx.post(f"{url}/v1/internal/generate", json=body,
                              headers=headers).status_code == 401  # fmt: skip
            assert httpx.get(f"{url}/info", headers=headers).status_code == 401
            assert httpx.get(f"{url}/v1/internal/kv_blocks", headers=headers).status_code == 401
        # probes and Prometheus stay open
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


def test_worker_rechecks_limits_and_refuses_a_duplicate_request_id(up: SecureUp) -> None:
    url = up.worker_url("decode")
    huge_n = {"request_id": "big", "prompt_token_ids": [1, 2], "sampling_params": {"n": 10**9}}
    r = httpx.post(f"{url}/v1/internal/generate", json=huge_n, headers=up.auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    stops = {"stop": ["x" * 1025]}
    r = httpx.post(f"{url}/v1/internal/generate", headers=up.auth, json={
        "request_id": "s", "prompt_token_ids": [1, 2], "sampling_params": stops})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    sampling = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}
    body = {"request_id": "dup", "prompt_token_ids": [1, 2, 3], "sampling_params": sampling}
    with httpx.stream("POST", f"{url}/v1/internal/generate", json=body, headers=up.auth,
                      timeout=60) as first:  # fmt: skip
        lines = first.iter_lines()
        next(lines)
        second = httpx.post(f"{url}/v1/internal/generate", json=body, headers=up.auth)
        assert second.status_code == 409 and second.json()["error"]["param"] == "request_id"
        rest = [json.loads(line) for line in lines if line]
    assert rest[-1]["finish_reason"] == "length"  # the original stream was never taken over


# -- requests that would hurt everyone ----------------------------------------------------------


def test_oversized_body_is_refused_while_it_arrives(up: SecureUp) -> None:
    router = up.pids()["router"]
    before = peak_rss_bytes(router)
    body = b'{"model": "demo", "prompt": "' + b"a" * (64 * 1024 * 1024) + b'"}'

    def chunks() -> Iterator[bytes]:  # chunked: no Content-Length to refuse up front
        for i in range(0, len(body), 1 << 20):
            yield body[i : i + (1 << 20)]

    try:
        r = httpx.post(f"{up.url}/v1/completions", content=chunks(), timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    except httpx.HTTPError:
        pass  # the router answered 413 and closed while we were still sending: also refused
    try:  # a declared length past the cap: refused before a byte is read
        r = httpx.post(f"{up.url}/v1/completions", content=body, timeout=60)
        assert r.status_code == 413
    except httpx.HTTPError:
        pass
    grew = peak_rss_bytes(router) - before
    assert grew < 16 * 1024 * 1024, f"router peak RSS grew {grew / 2**20:.1f} MiB"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["ab"] * 5000, "n": 64, "max_tokens": 1}, "prompt"),
        ({"prompt": "ab", "n": 129, "max_tokens": 1}, "n"),
        ({"prompt": "ab", "stop": ["x" * 100_000] * 16}, "stop"),
        ({"prompt": "ab", "logprobs": 21}, "logprobs"),
        ({"prompt": "ab", "max_tokens": 10_000}, "prompt"),  # past the context
    ],
)
def test_requests_past_a_limit_are_refused_naming_the_field(
    up: SecureUp, body: dict, param: str
) -> None:
    r = httpx.post(f"{up.url}/v1/completions", json={"model": "demo", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_template_kwargs_cannot_replace_the_template(up: SecureUp) -> None:
    # 100 bytes of template froze the router's event loop for 12 s
    bomb = "{% for a in range(9999) %}{% for b in range(9999) %}x{% endfor %}{% endfor %}"
    for kwargs, bad in (({"chat_template": bomb}, "chat_template"),
                        ({"tokenize": True}, "tokenize"),
                        ({"enable_thinking": {"nested": 1}}, "enable_thinking")):  # fmt: skip
        started = time.monotonic()
        r = httpx.post(f"{up.url}/v1/chat/completions", json={
            "model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": kwargs}, timeout=30)  # fmt: skip
        assert r.status_code == 400 and bad in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"
        assert time.monotonic() - started < 5


# -- KV events and the KV side channel ---------------------------------------------------------


def _subscribe(endpoint: str, password: str | None) -> int:
    """Connect a SUB (PLAIN with ``password``, or none); the handshake's outcome event."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
    if password is not None:
        sock.plain_username = PLAIN_USERNAME
        sock.plain_password = password.encode()
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        outcome = 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not outcome:
            if monitor.poll(200):
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                if event in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                             zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):  # fmt: skip
                    outcome = event
        return outcome
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_kv_events_need_the_token(up: SecureUp) -> None:
    info = httpx.get(f"{up.worker_url('decode')}/info", headers=up.auth).json()
    endpoint = info["kv_events_endpoint"]
    assert _subscribe(endpoint, None) != zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert _subscribe(endpoint, "not-the-cluster-token-at-all") == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert _subscribe(endpoint, up.token) == zmq.EVENT_HANDSHAKE_SUCCEEDED


def test_side_channel_refuses_frames_without_the_token(up: SecureUp) -> None:
    prefill = up.worker_url("prefill")
    side = httpx.get(f"{prefill}/info", headers=up.auth).json()["kv_side_channel"]
    before = up.metric(prefill, "tandem_kv_transfer_failures_total", reason="unauthorized")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(side)
    try:
        forged = FrameAuth(ClusterToken(["not-the-cluster-token-at-all"]))
        sock.send(p.seal(p.Hello("rogue", "tcp", DEMO_LAYOUT), forged))
        sock.send(p.encode_message(p.Hello("rogue", "tcp", DEMO_LAYOUT)))  # not sealed at all
        assert sock.poll(5000)
        with pytest.raises(p.ProtocolError):  # nothing we could open: no HelloOk for us
            p.unseal(sock.recv(), forged)
    finally:
        sock.close(0)
    deadline = time.monotonic() + 5
    while up.metric(prefill, "tandem_kv_transfer_failures_total",
                    reason="unauthorized") < before + 2:  # fmt: skip
        assert time.monotonic() < deadline, "refusals not counted"
        time.sleep(0.05)


def test_rogue_decode_with_the_token_but_not_the_secret_gets_nothing(up: SecureUp) -> None:
    prefill = up.worker_url("prefill")
    prompt = list(range(40, 40 + 48))  # three full blocks
    body = {"request_id": "victim", "prompt_token_ids": prompt, "remote_decode": True,
            "sampling_params": {"temperature": 0, "max_tokens": 4}}  # fmt: skip
    r = httpx.post(f"{prefill}/v1/internal/generate", json=body, headers=up.auth, timeout=30)
    chunks = [json.loads(line) for line in r.text.splitlines() if line]
    wire = chunks[-1]["kv_transfer_params"]
    params = KVTransferParams.from_dict(wire)
    guessed = KVTransferParams.from_dict({**wire, "transfer_secret": "0" * 64})
    kv = torch.zeros(DEMO_LAYOUT.shape, dtype=torch.float32)
    rogue = create_connector("tcp", DEMO_LAYOUT, kv, "decode",
                             cluster_token=ClusterToken([up.token]))  # fmt: skip
    try:
        blocks = list(params.block_ids)
        rogue.start_load("r1", guessed, blocks, list(range(len(blocks))))
        result = _finished(rogue, "r1")
        assert (result.ok, result.reason) == (False, FailureReason.UNAUTHORIZED), result
        assert not kv.view(torch.uint8).any(), "a byte reached a block without the secret"
        # With the secret (which only the router carries) the same pull works: the check above
        # refused the secret, not the peer.
        rogue.start_load("r2", params, blocks, list(range(len(blocks))))
        assert _finished(rogue, "r2").ok
        assert kv[: len(blocks)].view(torch.uint8).any()
    finally:
        rogue.close()


def _finished(conn: object, rid: str, timeout: float = 15.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in conn.take_finished_loads():  # type: ignore[attr-defined]
            if r.request_id == rid:
                return r
        time.sleep(0.01)
    raise AssertionError(f"load {rid} never finished")


# -- the token itself, and where things listen ---------------------------------------------------


def test_token_is_in_no_argv_and_no_log(up: SecureUp) -> None:
    assert len(up.token) >= 32
    pids = [up.proc.proc.pid, *up.pids().values()]
    for pid in pids:
        assert up.token not in " ".join(cmdline(pid)), pid
    for log in Path(up.log_dir).glob("*.log"):
        assert up.token not in log.read_text(errors="replace"), log


def test_listeners_bind_the_configured_host(up: SecureUp) -> None:
    """`tandem up` runs everything on 127.0.0.1: no worker socket may listen anywhere else."""
    for role in ("router", "prefill", "decode"):
        addrs = listening(up.pids()[role])
        assert addrs, role
        assert all(ip == "127.0.0.1" for ip, _ in addrs), (role, addrs)


def test_worker_with_a_wrong_token_never_registers_and_says_why(
    up: SecureUp, tmp_path: Path
) -> None:
    from procs import Proc, free_port, wait_for

    port = free_port()
    worker = Proc(
        ["decode", "--port", str(port), "--router-url", up.internal_url, "--kv-transport", "tcp"],
        tmp_path, "wrong-token", env={"TANDEM_CLUSTER_TOKEN": "a-wrong-token-for-this-cluster"},
    )  # fmt: skip
    try:
        wait_for(
            lambda: "refused our cluster token" in worker.log_path.read_text(),
            90, "the refusal in the worker's log",
        )  # fmt: skip
        assert f":{port}" not in json.dumps(up.workers())
        assert "a-wrong-token-for-this-cluster" not in worker.log_path.read_text()
    finally:
        worker.stop()
