"""Router overhead: latency a request gains by going through the router instead of straight to a
worker's internal API. Reports p50/p99 of the added time to first token and end-to-end latency.

Two modes:
  * default: self-contained. Starts a fast worker double (streams tokens with no compute; it is
    benchmark scaffolding, not product code) and a real router (``tandem router``) as processes
    on loopback, then measures. Only the router's own cost remains in the difference.
  * ``--router-url URL --worker-url URL``: against a running deployment (e.g. ``tandem up
    --prefill 0``), where the worker is one colocated worker registered with that router.

    python benchmarks/router_overhead.py [--requests 300] [--max-tokens 16] [--concurrency 1]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tandem.engine.hashing import HASH_ALGORITHM
from tandem.router.tokenizer import _bytes_to_unicode

PROMPT_TOKENS = list(range(97, 123)) * 3  # 78 byte-level tokens


# -- fast worker double (subprocess) ---------------------------------------------------------------
def serve_double(port: int, router_url: str, model: str) -> None:
    import uvicorn

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(heartbeats())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)
    engine_id = uuid.uuid4().hex
    info = {
        "engine_id": engine_id, "role": "colocated", "model": model,
        "url": f"http://127.0.0.1:{port}", "block_size": 16, "hash_algorithm": HASH_ALGORITHM,
        "max_model_len": 4096, "num_blocks": 1024, "kv_events_endpoint": None,
        "kv_side_channel": None,
    }  # fmt: skip

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/internal/abort")
    async def abort() -> dict[str, bool]:
        return {"aborted": False}

    @app.post("/v1/internal/generate")
    async def generate(request: Request) -> StreamingResponse:
        body = await request.json()
        n = body["sampling_params"]["max_tokens"]
        prompt = body["prompt_token_ids"]

        async def stream():  # noqa: ANN202
            for k in range(n):
                tok = prompt[-(1 + k % len(prompt))]
                chunk = {"token_ids": [tok], "text": chr(tok), "logprobs": None,
                         "finish_reason": "length" if k == n - 1 else None, "stop_reason": None,
                         "num_prompt_tokens": len(prompt), "num_cached_tokens": 0,
                         "kv_transfer_params": None, "error": None}  # fmt: skip
                yield json.dumps(chunk).encode() + b"\n"
                await asyncio.sleep(0)

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    async def heartbeats() -> None:
        async with httpx.AsyncClient() as c:
            registered = False
            while True:
                try:
                    if not registered:
                        r = await c.post(f"{router_url}/internal/workers/register", json=info)
                        registered = r.status_code == 200
                    else:
                        hb = {"engine_id": engine_id, "running": 0, "waiting": 0,
                              "kv_usage": 0.0, "num_free_blocks": 1024}  # fmt: skip
                        r = await c.post(f"{router_url}/internal/workers/heartbeat", json=hb)
                        registered = r.status_code == 200
                except httpx.HTTPError:
                    registered = False
                await asyncio.sleep(0.5)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def build_tokenizer(out_dir: Path) -> None:
    """A byte-level tokenizer with a trivial chat template (the router needs one to start)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(out_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- measurement --------------------------------------------------------------------------------
async def one_direct(c: httpx.AsyncClient, worker_url: str, max_tokens: int) -> tuple[float, float]:
    body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": PROMPT_TOKENS,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
            "kv_transfer_params": None, "remote_decode": False}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    async with c.stream("POST", f"{worker_url}/v1/internal/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line and ttft is None:
                ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0


async def one_routed(
    c: httpx.AsyncClient, router_url: str, model: str, max_tokens: int
) -> tuple[float, float]:
    body = {"model": model, "prompt": PROMPT_TOKENS, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    async with c.stream("POST", f"{router_url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and ttft is None and '"text":""' not in line:
                ttft = time.perf_counter() - t0
    return ttft or 0.0, time.perf_counter() - t0


async def measure(fn: Any, n: int, concurrency: int) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    sem = asyncio.Semaphore(concurrency)

    async def run() -> None:
        async with sem:
            out.append(await fn())

    await asyncio.gather(*(run() for _ in range(n)))
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def bench(args: argparse.Namespace, router_url: str, worker_url: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        for _ in range(20):  # warm-up: connections, caches
            await one_direct(c, worker_url, args.max_tokens)
            await one_routed(c, router_url, args.model, args.max_tokens)
        direct = await measure(lambda: one_direct(c, worker_url, args.max_tokens),
                               args.requests, args.concurrency)  # fmt: skip
        routed = await measure(lambda: one_routed(c, router_url, args.model, args.max_tokens),
                               args.requests, args.concurrency)  # fmt: skip
    result: dict[str, Any] = {"requests": args.requests, "max_tokens": args.max_tokens,
                              "concurrency": args.concurrency}  # fmt: skip
    for i, name in enumerate(("ttft", "e2e")):
        d = [x[i] for x in direct]
        r = [x[i] for x in routed]
        for p in (50, 99):
            result[f"{name}_direct_p{p}_ms"] = round(pct(d, p) * 1e3, 3)
            result[f"{name}_router_p{p}_ms"] = round(pct(r, p) * 1e3, 3)
            result[f"{name}_added_p{p}_ms"] = round((pct(r, p) - pct(d, p)) * 1e3, 3)
        result[f"{name}_added_mean_ms"] = round((statistics.mean(r) - statistics.mean(d)) * 1e3, 3)
    return result


def wait_ready(router_url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{router_url}/internal/workers", timeout=2)
            if r.status_code == 200 and r.json()["workers"]:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("router or worker did not come up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--model", default="bench-model")
    p.add_argument("--router-url", default=None)
    p.add_argument("--worker-url", default=None)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--serve-double", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_double is not None:
        serve_double(args.serve_double, args.router_url, args.model)
        return 0
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.router_url and args.worker_url:
            router_url, worker_url = args.router_url, args.worker_url
        else:
            tok_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-tok-"))
            build_tokenizer(tok_dir)
            rport, wport = free_port(), free_port()
            router_url, worker_url = f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{wport}"
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "router", "--model", args.model,
                 "--tokenizer", str(tok_dir), "--host", "127.0.0.1", "--port", str(rport),
                 "--log-level", "warning"],
                start_new_session=True,
            ))  # fmt: skip
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--serve-double", str(wport), "--router-url",
                 router_url, "--model", args.model],
                start_new_session=True,
            ))  # fmt: skip
        wait_ready(router_url)
        result = asyncio.run(bench(args, router_url, worker_url))
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=15)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
