"""The chaos suite's harness: a real ``tandem up`` with its children's pids, a load driver that
classifies how every request ended, and the end-of-run checks (issue: failure containment).

Every scenario ends with ``Cluster.assert_clean``: every request ended within its deadline
(success, an OpenAI error object, or a stream error event; never hung), and every worker, once
idle, holds no block and no request and passes its accounting check (``/v1/internal/integrity``).
``benchmarks/soak.py`` drives the same harness for longer.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from procs import AUTH, CLUSTER_TOKEN

from tandem.child_command import tandem_argv
from tandem.engine.demo import make_user_message

_CHILD_LINE = re.compile(r"^\s+(\S+)\s+pid (\d+)\s+(http://\S+)")
_RESTART_LINE = re.compile(r"restarted (\S+) \(restart (\d+)\), pid (\d+)")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Any, timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for {pid}")


class Cluster:
    """``tandem up`` in its own process group; its output is read continuously so the children's
    pids (including restarted ones) are always known."""

    def __init__(self, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.internal_port = free_port()
        self.internal_url = f"http://127.0.0.1:{self.internal_port}"  # registry: needs the token
        self.log_dir = log_dir
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}  # child name -> current pid
        self.urls: dict[str, str] = {}  # child name -> URL
        self._out = (log_dir / "up.log").open("w")
        self.proc = subprocess.Popen(
            [*tandem_argv("up"), "--port", str(self.port),
             "--internal-port", str(self.internal_port), "--log-dir", str(log_dir), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(log_dir),
            env={**os.environ, "PYTHONUNBUFFERED": "1", "TANDEM_CLUSTER_TOKEN": CLUSTER_TOKEN,
                 **(env or {})},
            start_new_session=True,
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out.write(line)
            self._out.flush()
            self.lines.append(line)
            if m := _CHILD_LINE.match(line):
                self.pids[m.group(1)] = int(m.group(2))
                self.urls[m.group(1)] = m.group(3)
            elif m := _RESTART_LINE.search(line):
                self.pids[m.group(1)] = int(m.group(3))

    def wait_ready(self, timeout: float = 240) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError("tandem up exited:\n" + "".join(self.lines[-40:]))
            return any(line.startswith("Tandem is ready") for line in self.lines)

        wait_for(ready, timeout, "tandem up ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()

    # -- state ----------------------------------------------------------------------------------
    def workers(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.internal_url}/internal/workers", headers=AUTH, timeout=5)
        return r.json()["workers"]

    def busiest(self, role: str) -> str:
        """The child name of the ``role`` worker with the most sub-requests in flight now."""
        names = {url: name for name, url in self.urls.items()}
        ws = [w for w in self.workers() if w["role"] == role and w["url"] in names]
        return names[max(ws, key=lambda w: w["inflight"])["url"]]

    def freeze_busiest(self, role: str, timeout: float = 30) -> str:
        """Stop (SIGSTOP) every ``role`` worker at once, then resume all but the one the router
        has the most streams open to and return that one, still stopped (the fault's to end);
        while the router has none open to any, all resume and it tries again.

        Frozen first, looked at second: a frozen worker writes no more tokens, so streams open
        to it cannot end before the fault aimed at it lands. Looking first, then acting, took
        1-2 s on a loaded 2-core machine (the router answers a poll late while it relays a wave),
        longer than the demo model needs to decode a wave: a decode worker was killed between
        waves with no stream to move (CI, stop 25). The freeze lasts one poll, well inside the
        router's heartbeat timeout (3 s) on an idle router.
        """
        names = [n for n in self.pids if n.startswith(f"{role}-")]
        kept: list[str] = []

        def frozen() -> bool:
            for n in names:
                self.signal(n, signal.SIGSTOP)
            try:
                inflight = {w["url"]: w["inflight"] for w in self.workers()}
                top = max(names, key=lambda n: inflight.get(self.urls[n], 0))
                kept[:] = [top] if inflight.get(self.urls[top], 0) > 0 else []
            finally:
                for n in names:
                    if n not in kept:
                        self.signal(n, signal.SIGCONT)
            return bool(kept)

        wait_for(frozen, timeout, f"a {role} worker with streams", interval=0.02)
        return kept[0]

    def worker_urls(self) -> list[str]:
        return [u for name, u in self.urls.items() if name != "router"]

    def integrity(self, url: str) -> dict[str, Any]:
        return httpx.get(f"{url}/v1/internal/integrity", headers=AUTH, timeout=10).json()

    def router_metric(self, name: str, labels: str = "") -> float:
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + "{") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def restarts(self, name: str) -> int:
        return sum(1 for line in self.lines if f"restarted {name} " in line)

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.pids[name], sig)

    def wait_registered(self, count: int, timeout: float = 120) -> None:
        wait_for(lambda: len(self.workers()) == count, timeout, f"{count} workers registered")

    def rss(self) -> dict[str, int]:
        return {n: rss_bytes(p) for n, p in self.pids.items() if n != "router"}

    def assert_clean(self, outcomes: list[Outcome], timeout: float = 30) -> None:
        """Every request ended (none hung); every worker idle, consistent, holding no block; the
        router holds no admission slot."""
        hung = [o for o in outcomes if o.kind == "hung"]
        assert not hung, f"{len(hung)} requests hung, e.g. {hung[0]}"

        def idle() -> bool:
            reports = [self.integrity(u) for u in self.worker_urls()]
            ok = all(r["idle"] and r["blocks_in_use"] == 0 and r["ok"] for r in reports)
            return ok and self.router_metric("tandem_router_inflight_requests") == 0

        try:
            wait_for(idle, timeout, "every worker idle with no block held")
        except TimeoutError:
            reports = {u: self.integrity(u) for u in self.worker_urls()}
            raise AssertionError(f"not clean after {timeout} s: {reports}") from None


# -- load ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Spec:
    """One request of a scenario."""

    word: str  # the demo task's input: the answer is its reversal
    stream: bool = True
    chat: bool = True
    n: int = 1
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    priority: int = 0
    drop_after_chunks: int | None = None  # the client goes away after this many chunks
    abort_after_s: float | None = None  # the client gives up after this long (any kind)

    def body(self) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "demo", "max_tokens": self.max_tokens,
                             "temperature": self.temperature, "n": self.n,
                             "priority": self.priority}  # fmt: skip
        if self.chat:
            b["messages"] = [{"role": "user", "content": make_user_message(self.word)}]
            if self.logprobs:
                b.update(logprobs=True, top_logprobs=2)
        else:
            b["prompt"] = f"<|bos|><|user|>{make_user_message(self.word)}<|assistant|>"
            if self.logprobs:
                b["logprobs"] = 2
        if self.stream:
            b.update(stream=True, stream_options={"include_usage": True})
        for key in ("seed", "stop"):
            if getattr(self, key) is not None:
                b[key] = getattr(self, key)
        if self.ignore_eos:
            b["ignore_eos"] = True
        return b


@dataclass(slots=True)
class Outcome:
    spec: Spec
    kind: str  # ok | error (OpenAI error object) | stream_error | dropped | hung
    status: int = 0
    texts: list[str] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    completion_tokens: int | None = None
    ttft_s: float | None = None
    error: dict[str, Any] | None = None
    elapsed_s: float = 0.0


@dataclass(slots=True)
class Progress:
    """Content chunks streamed so far in a run, across its requests (read from another thread:
    a fault can be timed by what the client has seen, without asking the busy router)."""

    chunks: int = 0


async def run_one(
    client: httpx.AsyncClient, spec: Spec, deadline_s: float, progress: Progress
) -> Outcome:
    start = time.monotonic()
    try:
        work = _request(client, spec, start, progress)
        if spec.abort_after_s is not None:
            try:
                return await asyncio.wait_for(work, spec.abort_after_s)
            except TimeoutError:
                return Outcome(spec, "dropped", elapsed_s=time.monotonic() - start)
        return await asyncio.wait_for(work, deadline_s)
    except TimeoutError:
        return Outcome(spec, "hung", elapsed_s=time.monotonic() - start)


async def _request(
    client: httpx.AsyncClient, spec: Spec, start: float, progress: Progress
) -> Outcome:
    path = "/v1/chat/completions" if spec.chat else "/v1/completions"
    out = Outcome(spec, "ok", texts=[""] * spec.n, finish=[None] * spec.n)
    if not spec.stream:
        r = await client.post(path, json=spec.body())
        out.status, out.elapsed_s = r.status_code, time.monotonic() - start
        body = r.json()
        if r.status_code != 200:
            out.kind, out.error = "error", body.get("error")
            assert isinstance(out.error, dict) and out.error.get("message"), body
            return out
        for ch in body["choices"]:
            i = ch["index"]
            out.texts[i] = ch["message"]["content"] if spec.chat else ch["text"]
            out.finish[i] = ch["finish_reason"]
        out.completion_tokens = body["usage"]["completion_tokens"]
        return out
    async with client.stream("POST", path, json=spec.body()) as r:
        out.status = r.status_code
        if r.status_code != 200:
            body = json.loads(await r.aread())
            out.kind, out.error = "error", body.get("error")
            assert isinstance(out.error, dict) and out.error.get("message"), body
            return out
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out.kind, out.error = "stream_error", obj["error"]
                break
            if obj.get("usage"):
                out.completion_tokens = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if spec.chat else ch.get("text")
                if piece:
                    progress.chunks += 1
                    if out.ttft_s is None:
                        out.ttft_s = time.monotonic() - start
                out.texts[ch["index"]] += piece or ""
                out.finish[ch["index"]] = ch.get("finish_reason") or out.finish[ch["index"]]
            chunks += 1
            if spec.drop_after_chunks is not None and chunks >= spec.drop_after_chunks:
                out.kind = "dropped"
                break
    out.elapsed_s = time.monotonic() - start
    return out


async def drive(
    url: str,
    specs: list[Spec],
    concurrency: int,
    deadline_s: float = 90.0,
    progress: Progress | None = None,
) -> list[Outcome]:
    """Run ``specs`` with at most ``concurrency`` in flight; every outcome is classified."""
    progress = progress or Progress()
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

        async def one(spec: Spec) -> Outcome:
            async with sem:
                return await run_one(client, spec, deadline_s, progress)

        return list(await asyncio.gather(*(one(s) for s in specs)))


def run_load(
    url: str,
    specs: list[Spec],
    concurrency: int,
    deadline_s: float = 90.0,
    progress: Progress | None = None,
) -> list[Outcome]:
    return asyncio.run(drive(url, specs, concurrency, deadline_s, progress))


def reference_answers(url: str, words: list[str]) -> dict[str, str]:
    """Each word's greedy answer from the healthy cluster (the demo model is right on most, not
    all: chaos runs are compared with it, not with the task's exact answer)."""
    specs = [Spec(w, stream=False, max_tokens=24) for w in dict.fromkeys(words)]
    outs = run_load(url, specs, concurrency=16)
    assert all(o.kind == "ok" for o in outs), summary(outs)
    return {o.spec.word: o.texts[0] for o in outs}


def check_answers(outcomes: list[Outcome], refs: dict[str, str]) -> None:
    """Greedy answers that completed equal the healthy cluster's, cut where a stop string
    matches and where max_tokens ends them (one byte token per character)."""
    for o in outcomes:
        s = o.spec
        if o.kind != "ok" or s.temperature != 0 or s.ignore_eos:
            continue
        want = refs[s.word]
        if s.stop:
            cuts = [want.find(x) for x in s.stop if x in want]
            want = want[: min(cuts)] if cuts else want
        for text, finish in zip(o.texts, o.finish, strict=True):
            if finish == "length":
                assert want.startswith(text) and len(text) == s.max_tokens, (s, text, want)
            else:
                assert (text, finish) == (want, "stop"), (s, text, finish, want)


def mixed_specs(n: int, rng: random.Random, abort_fraction: float = 0.1) -> list[Spec]:
    """Requests of mixed shapes: chat or completion, stream or not, n, stop strings, logprobs,
    greedy or seeded, and a fraction the client abandons at a random moment."""
    from tandem.engine.demo import sample_inputs

    words = sample_inputs(n, seed=rng.randrange(1 << 30))
    specs = []
    for w in words:
        s = Spec(
            w, stream=rng.random() < 0.6, chat=rng.random() < 0.5, n=rng.choice((1, 1, 1, 2, 3)),
            max_tokens=rng.choice((4, 8, 16, 24)), logprobs=rng.random() < 0.2,
            priority=rng.choice((0, 0, 1, -1)),
        )  # fmt: skip
        if rng.random() < 0.3:
            s.stop = [rng.choice(w)]
        if rng.random() < 0.3:
            s.temperature, s.seed = 1.0, rng.randrange(1000)
        if rng.random() < abort_fraction:
            s.abort_after_s = rng.uniform(0.0, 0.5)
        specs.append(s)
    return specs


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(Counter(o.kind for o in outcomes))
