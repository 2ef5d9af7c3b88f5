"""Router overhead: latency a request gains by going through the router instead of straight to a
worker's internal API. Reports p50/p99 of the added time to first token and end-to-end latency,
with the cluster token on (as ``tandem router`` always runs) and off, measured in one run.

Two modes:
  * default: self-contained. Starts, on loopback, two pairs of a real router and a fast worker
    double (streams tokens with no compute; benchmark scaffolding, not product code): one pair
    with a cluster token (the router presents it on every worker call, the double checks it,
    registration needs it), one without (the router app built with no token, as only
    in-process use allows). Requests alternate between the pairs in rounds, so drift on a
    shared machine hits both alike; only the router's own cost remains in each difference, and
    ``auth_cost_*`` is the difference of the differences.
  * ``--router-url URL --worker-url URL``: against a running deployment (e.g. ``tandem up
    --prefill 0``), where the worker is one colocated worker registered with that router;
    ``TANDEM_CLUSTER_TOKEN`` must hold the deployment's token (it calls the worker directly).

    python benchmarks/router_overhead.py [--requests 300] [--max-tokens 16] [--concurrency 1]
        [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
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

from tandem.engine.cluster_token import CLUSTER_TOKEN_ENV, ClusterToken, generate_token
from tandem.engine.hashing import HASH_ALGORITHM
from tandem.engine.internal_auth import ClusterAuth
from tandem.router.tokenizer import _bytes_to_unicode

PROMPT_TOKENS = list(range(97, 123)) * 3  # 78 byte-level tokens


# -- fast worker double (subprocess) ---------------------------------------------------------------
def serve_double(port: int, router_url: str, model: str) -> None:
    """The worker double; with $TANDEM_CLUSTER_TOKEN it requires and presents the token."""
    import uvicorn

    token = ClusterToken.load(None)
    headers = token.headers() if token is not None else {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(heartbeats())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(ClusterAuth, token=token,
                       protects=lambda path: path.startswith("/v1/internal/"))  # fmt: skip
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
        async with httpx.AsyncClient(headers=headers) as c:
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


def serve_router(port: int, internal_port: int, model: str, tokenizer: str) -> None:
    """The real router app and both its listeners; the cluster token from the environment, or
    none at all (the unauthenticated baseline ``tandem router`` itself refuses to run)."""
    from tandem.router.app import RouterConfig, create_app
    from tandem.router.cli import serve_both

    cfg = RouterConfig(model=model, model_path=tokenizer, cluster_token=ClusterToken.load(None))
    app = create_app(cfg)
    asyncio.run(serve_both(app, ("127.0.0.1", port), ("127.0.0.1", internal_port), "warning"))


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
async def one_direct(
    c: httpx.AsyncClient, worker_url: str, max_tokens: int, headers: dict[str, str]
) -> tuple[float, float]:
    body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": PROMPT_TOKENS,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
            "kv_transfer_params": None, "remote_decode": False}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    async with c.stream(
        "POST", f"{worker_url}/v1/internal/generate", json=body, headers=headers
    ) as r:
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


@dataclasses.dataclass(frozen=True)
class Target:
    """One router + worker pair to measure."""

    name: str
    router_url: str
    worker_url: str
    headers: dict[str, str]  # what a direct call to the worker needs (the cluster token)


async def bench(args: argparse.Namespace, targets: list[Target]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    samples = {t.name: {"direct": [], "routed": []} for t in targets}
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        for t in targets:
            for _ in range(20):  # warm-up: connections, caches
                await one_direct(c, t.worker_url, args.max_tokens, t.headers)
                await one_routed(c, t.router_url, args.model, args.max_tokens)
        per_round = max(1, args.requests // args.rounds)
        for _ in range(args.rounds):  # alternate, so drift affects every target alike
            for t in targets:
                s = samples[t.name]
                s["direct"] += await measure(
                    lambda t=t: one_direct(c, t.worker_url, args.max_tokens, t.headers),
                    per_round, args.concurrency,
                )  # fmt: skip
                s["routed"] += await measure(
                    lambda t=t: one_routed(c, t.router_url, args.model, args.max_tokens),
                    per_round, args.concurrency,
                )  # fmt: skip
    result: dict[str, Any] = {"requests_per_target": per_round * args.rounds,
                              "max_tokens": args.max_tokens,
                              "concurrency": args.concurrency}  # fmt: skip
    for t in targets:
        direct, routed = samples[t.name]["direct"], samples[t.name]["routed"]
        for i, name in enumerate(("ttft", "e2e")):
            d = [x[i] for x in direct]
            r = [x[i] for x in routed]
            key = f"{t.name}_{name}"
            for p in (50, 99):
                result[f"{key}_direct_p{p}_ms"] = round(pct(d, p) * 1e3, 3)
                result[f"{key}_router_p{p}_ms"] = round(pct(r, p) * 1e3, 3)
                result[f"{key}_added_p{p}_ms"] = round((pct(r, p) - pct(d, p)) * 1e3, 3)
            result[f"{key}_added_mean_ms"] = round(
                (statistics.mean(r) - statistics.mean(d)) * 1e3, 3
            )
    if {t.name for t in targets} == {"auth", "noauth"}:
        for name in ("ttft", "e2e"):
            result[f"auth_cost_{name}_p50_ms"] = round(
                result[f"auth_{name}_added_p50_ms"] - result[f"noauth_{name}_added_p50_ms"], 3
            )
    return result


def wait_ready(internal_url: str, headers: dict[str, str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{internal_url}/internal/workers", headers=headers, timeout=2)
            if r.status_code == 200 and r.json()["workers"]:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("router or worker did not come up")


def launch_pair(
    name: str, args: argparse.Namespace, tok_dir: Path, token: str | None
) -> tuple[Target, str, list[subprocess.Popen[bytes]]]:
    """A router and a worker double as processes; the token (or none) in their environment."""
    rport, iport, wport = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_TOKEN_ENV}
    if token is not None:
        env[CLUSTER_TOKEN_ENV] = token
    internal = f"http://127.0.0.1:{iport}"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve-router", str(rport), str(iport),
             "--model", args.model, "--tokenizer", str(tok_dir)],
            start_new_session=True, env=env,
        ),
        subprocess.Popen(
            [sys.executable, __file__, "--serve-double", str(wport), "--router-url", internal,
             "--model", args.model],
            start_new_session=True, env=env,
        ),
    ]  # fmt: skip
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    target = Target(name, f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{wport}", headers)
    return target, internal, procs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=300, help="per target")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--model", default="bench-model")
    p.add_argument("--router-url", default=None)
    p.add_argument("--worker-url", default=None)
    p.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--serve-double", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--serve-router", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_double is not None:
        serve_double(args.serve_double, args.router_url, args.model)
        return 0
    if args.serve_router is not None:
        serve_router(*args.serve_router, args.model, args.tokenizer)
        return 0
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.router_url and args.worker_url:
            token = ClusterToken.load(None)
            headers = token.headers() if token is not None else {}
            targets = [Target("deployment", args.router_url, args.worker_url, headers)]
        else:
            tok_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-tok-"))
            build_tokenizer(tok_dir)
            targets, ready = [], []
            for name, token in (("auth", generate_token()), ("noauth", None)):
                target, internal, started = launch_pair(name, args, tok_dir, token)
                procs += started
                targets.append(target)
                ready.append((internal, target.headers))
            for internal, headers in ready:
                wait_ready(internal, headers)
        result = asyncio.run(bench(args, targets))
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
