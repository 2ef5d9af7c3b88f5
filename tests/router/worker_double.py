"""Test doubles for the router tests: a byte-level tokenizer and a worker speaking the internal API.

``WorkerDouble`` implements docs/internal-api.md (generate, abort, kv_blocks, info, health),
streaming token ids only (the router detokenizes),
registers and heartbeats with a router, and publishes KV events over ZMQ. Its output is
deterministic: output token k is the prompt's token at position -(k + 1 + seed) (cycling), so a test
knows the exact answer; a prefill->decode handoff checks ``first_token_id`` against that rule.
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgpack
import uvicorn
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.engine.cluster_token import ClusterToken
from tandem.engine.hashing import HASH_ALGORITHM, hash_block_tokens
from tandem.engine.internal_auth import ClusterAuth
from tandem.engine.worker.kv_publisher import TokenAuthenticator
from tandem.router.tokenizer import _bytes_to_unicode

# The cluster token the router tests run with: the router presents it to the doubles, which
# refuse internal calls without it, and the doubles present it when they register.
TEST_TOKEN = ClusterToken(["router-tests-cluster-token-0001"])

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(out_dir: Path) -> Path:
    """A byte-level tokenizer (256 byte tokens + eos) with a chat template, saved in HF form."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}  # token id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", bos_token=None)
    fast.add_special_tokens({"eos_token": "<|eos|>"})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Behaviour:
    """Knobs a test flips to inject faults."""

    fail_status: int | None = None  # answer generate with this status
    crash_after_tokens: int | None = None  # drop the connection after this many tokens
    # How many of those faults fire before the worker behaves (None: always). One Behaviour
    # may be shared by several doubles: "the first worker chosen fails once".
    faults_left: int | None = None

    def take_fault(self) -> bool:
        if self.faults_left is None:
            return True
        if self.faults_left <= 0:
            return False
        self.faults_left -= 1
        return True

    token_delay_s: float = 0.0
    publish_events: bool = True
    heartbeat: bool = True


@dataclass
class Served:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 10)


async def serve(app: Any, port: int = 0, lifespan: str = "on", host: str = "127.0.0.1") -> Served:
    """Serve an ASGI app on a loopback port in this event loop; returns once it accepts."""
    sock = socket.socket()
    # A restarted worker takes its predecessor's port, which may still have TIME_WAIT sockets.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    deadline = asyncio.get_running_loop().time() + 10
    while not server.started:
        if task.done():
            task.result()
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("server did not start")
        await asyncio.sleep(0.01)
    return Served(server, task, port)


@dataclass
class WorkerDouble:
    role: str
    tokenizer: Any
    model: str = "test-model"
    block_size: int = 4
    max_model_len: int = 256
    num_blocks: int = 64
    behaviour: Behaviour = field(default_factory=Behaviour)
    token: ClusterToken | None = TEST_TOKEN
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    generate_calls: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    # A colocated worker started with --kv-peer-pull: it registers a side channel and answers
    # kv_grant with ``grant_status`` (200: a grant naming the request when it caches the prefix).
    peer: bool = False
    grant_status: int = 200
    grant_calls: list[dict[str, Any]] = field(default_factory=list)
    stored: dict[bytes, None] = field(default_factory=dict)
    seq: int = -1
    served: Served | None = None
    _pub: Any = None
    _ctx: Any = None
    _auth: Any = None
    _events_port: int = 0
    _active: dict[str, asyncio.Event] = field(default_factory=dict)
    _hb_task: asyncio.Task[None] | None = None

    # -- deterministic "model" ------------------------------------------------------------------
    @staticmethod
    def token_at(prompt: list[int], k: int, seed: int | None) -> int:
        return prompt[-(1 + (k + (seed or 0)) % len(prompt))]

    def info(self) -> dict[str, Any]:
        assert self.served is not None
        return {
            "engine_id": self.engine_id,
            "role": self.role,
            "model": self.model,
            "url": self.served.url,
            "block_size": self.block_size,
            "hash_algorithm": HASH_ALGORITHM,
            "max_model_len": self.max_model_len,
            "num_blocks": self.num_blocks,
            "kv_events_endpoint": f"tcp://127.0.0.1:{self._events_port}",
            "kv_side_channel": "tcp://127.0.0.1:1" if self.role == "prefill" or self.peer else None,
        }

    def publish(self, events: list[list[Any]], deliver: bool = True) -> None:
        self.seq += 1
        if not (deliver and self.behaviour.publish_events):
            return
        payload = {"v": 1, "engine_id": self.engine_id, "seq": self.seq, "events": events}
        self._pub.send_multipart([b"kv", msgpack.packb(payload, use_bin_type=True)])

    def _store_prompt(self, prompt: list[int]) -> int:
        hashes = hash_block_tokens(prompt, self.block_size)
        cached = 0
        for h in hashes:
            if h not in self.stored:
                break
            cached += 1
        new = [h for h in hashes if h not in self.stored]
        for h in new:
            self.stored[h] = None
        if new:
            self.publish([["stored", new]])
        return cached * self.block_size

    # -- app ------------------------------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        return self.token.headers() if self.token is not None else {}

    def app(self) -> FastAPI:
        app = FastAPI()
        app.add_middleware(
            ClusterAuth,
            token=self.token,
            protects=lambda path: path == "/info" or path.startswith("/v1/internal/"),
        )

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/info")
        async def info() -> dict[str, Any]:
            return self.info()

        @app.post("/v1/internal/abort")
        async def abort(request: Request) -> dict[str, bool]:
            rid = (await request.json())["request_id"]
            self.aborted.append(rid)
            ev = self._active.get(rid)
            if ev is not None:
                ev.set()
            return {"aborted": ev is not None}

        @app.get("/v1/internal/kv_blocks")
        async def kv_blocks() -> dict[str, Any]:
            return {
                "engine_id": self.engine_id,
                "seq": self.seq + 1,  # the next message's number, as the engine reports it
                "block_hashes": [h.hex() for h in self.stored],
            }

        @app.post("/v1/internal/kv_grant")
        async def kv_grant(request: Request) -> Any:
            body = await request.json()
            self.grant_calls.append(body)
            hashes = hash_block_tokens(body["prompt_token_ids"], self.block_size)
            if self.grant_status != 200 or not all(h in self.stored for h in hashes):
                status = 404 if self.grant_status == 200 else self.grant_status
                error = {"message": "no grant", "type": "x", "param": None, "code": "no_prefix"}
                return JSONResponse({"error": error}, status_code=status)
            return {"kv_transfer_params": {"grant_of": body["request_id"]}}

        @app.post("/v1/internal/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            self.generate_calls.append(body)
            b = self.behaviour
            if b.fail_status is not None and b.take_fault():
                return JSONResponse(
                    {"error": {"message": f"injected {b.fail_status}",
                               "type": "invalid_request_error", "param": None, "code": None}},
                    status_code=b.fail_status,
                )  # fmt: skip
            rid = body["request_id"]
            self._active[rid] = asyncio.Event()
            return StreamingResponse(self._generate(body), media_type="application/x-ndjson")

        return app

    async def _generate(self, body: dict[str, Any]):  # noqa: ANN202 - async generator
        """Token ids only, as a real worker streams them: the router makes text and applies
        stop strings (a worker ignores ``stop``)."""
        rid, prompt = body["request_id"], body["prompt_token_ids"]
        sp = body["sampling_params"]
        kv = body.get("kv_transfer_params")
        seed, max_tokens = sp.get("seed"), sp["max_tokens"]
        cached = self._store_prompt(prompt)
        start = 0
        if kv is not None:
            expected = self.token_at(prompt, 0, seed)
            if kv["first_token_id"] != expected or kv["num_tokens"] != len(prompt):
                yield _line(error_chunk("kv_transfer_params do not match the prompt"))
                return
            start = 1
        resume = body.get("resume_token_ids") or []
        if resume:  # a migrated stream: outputs 0..k-1 were generated elsewhere
            if resume != [self.token_at(prompt, k, seed) for k in range(len(resume))]:
                yield _line(error_chunk("resume_token_ids do not match the prompt"))
                return
            start = len(resume)
        aborted = self._active[rid]
        try:
            for k in range(start, max_tokens):
                if aborted.is_set():
                    yield _line(chunk([], "abort", len(prompt), cached))
                    return
                crash = self.behaviour.crash_after_tokens
                if crash is not None and k - start >= crash and self.behaviour.take_fault():
                    raise ConnectionResetError("injected crash")
                if self.behaviour.token_delay_s:
                    await asyncio.sleep(self.behaviour.token_delay_s)
                tok = self.token_at(prompt, k, seed)
                lps = None
                if sp.get("logprobs") is not None:
                    top = [[tok, -0.25], [(tok + 1) % 256, -1.5]][: sp["logprobs"]]
                    lps = [{"token_id": tok, "logprob": -0.25, "top": top}]
                last = k == max_tokens - 1
                if body.get("remote_decode"):
                    params = {
                        "engine_id": self.engine_id,
                        "side_channel": "tcp://127.0.0.1:1",
                        "remote_request_id": rid,
                        "block_ids": list(range(len(prompt) // self.block_size)),
                        "num_tokens": len(prompt),
                        "first_token_id": tok,
                        "lease_seconds": 30.0,
                    }
                    c = chunk([tok], "length" if last else "remote_decode", len(prompt), cached)
                    c["logprobs"] = lps
                    c["kv_transfer_params"] = None if last else params
                    yield _line(c)
                    return
                c = chunk([tok], "length" if last else None, len(prompt), cached)
                c["logprobs"] = lps
                yield _line(c)
        finally:
            self._active.pop(rid, None)

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, router_url: str | None, port: int = 0) -> WorkerDouble:
        # As the worker's publisher: its own context, a PLAIN server checking the token.
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if self.token is not None:
            self._auth = TokenAuthenticator(self._ctx, self.token)
            self._auth.start()
            self._pub.plain_server = True
            self._pub.zap_domain = b"tandem"
        self._events_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.served = await serve(self.app(), port)
        if router_url is not None:
            self._hb_task = asyncio.create_task(self._heartbeats(router_url))
        return self

    async def register(self, router_url: str) -> None:
        async with httpx.AsyncClient() as c:
            r = await c.post(
                f"{router_url}/internal/workers/register", json=self.info(), headers=self.headers()
            )
            r.raise_for_status()

    async def _heartbeats(self, router_url: str) -> None:
        """Register (retrying until the router listens), then heartbeat; re-register on a 404."""
        async with httpx.AsyncClient() as c:
            registered = False
            while not registered:
                try:
                    await self.register(router_url)
                    registered = True
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
            while True:
                if self.behaviour.heartbeat:
                    hb = {
                        "engine_id": self.engine_id,
                        "running": len(self._active),
                        "waiting": 0,
                        "kv_usage": 0.0,
                        "num_free_blocks": self.num_blocks,
                    }
                    try:
                        r = await c.post(
                            f"{router_url}/internal/workers/heartbeat",
                            json=hb,
                            headers=self.headers(),
                        )
                        if r.status_code == 404:
                            await self.register(router_url)
                    except httpx.HTTPError:
                        pass
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            await asyncio.gather(self._hb_task, return_exceptions=True)
        if self.served is not None:
            await self.served.stop()
        self._pub.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def chunk(
    token_ids: list[int],
    finish: str | None,
    num_prompt: int,
    cached: int,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    return {
        "token_ids": token_ids,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "num_prompt_tokens": num_prompt,
        "num_cached_tokens": cached,
        "kv_transfer_params": None,
        "error": None,
    }


def error_chunk(message: str) -> dict[str, Any]:
    c = chunk([], "error", 0, 0)
    c["error"] = {"message": message, "type": "internal_error", "code": None}
    return c


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode() + b"\n"
