"""The multi-turn chat workload and its session runner (closed or open loop)."""

from __future__ import annotations

import asyncio
import random
import string
import time
from dataclasses import dataclass

import httpx
from benchlib.client import chat_body, stream_chat


@dataclass(slots=True, frozen=True)
class WorkloadConfig:
    sessions: int
    turns: int
    user_chars: int
    max_tokens: int
    concurrency: int
    seed: int
    session_rate: float = 0.0  # new sessions per second (Poisson); 0 = closed loop
    think_s: float = 0.0  # mean think time between a session's turns (open loop)


@dataclass(slots=True, frozen=True)
class Workload:
    """``messages[s][t]`` is session s's user message at turn t. ``schedule`` lists session ids,
    each ``turns`` times: its k-th occurrence is that session's turn k (closed loop). Open loop:
    session s starts at ``arrivals[s]`` seconds and waits ``think[s][t]`` before turn t."""

    messages: tuple[tuple[str, ...], ...]
    schedule: tuple[int, ...]
    arrivals: tuple[float, ...]
    think: tuple[tuple[float, ...], ...]


def make_workload(cfg: WorkloadConfig) -> Workload:
    if cfg.sessions < 1 or cfg.turns < 1 or cfg.user_chars < 8:
        raise ValueError("need sessions >= 1, turns >= 1 and user_chars >= 8")
    if cfg.session_rate < 0 or cfg.think_s < 0:
        raise ValueError("session_rate and think_s must be >= 0")
    rng = random.Random(cfg.seed)
    letters = string.ascii_lowercase

    def message() -> str:
        n = rng.randint(cfg.user_chars * 3 // 4, cfg.user_chars * 5 // 4)
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < n:
            words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
        return " ".join(words)[:n]

    messages = tuple(tuple(message() for _ in range(cfg.turns)) for _ in range(cfg.sessions))
    schedule = [s for s in range(cfg.sessions) for _ in range(cfg.turns)]
    rng.shuffle(schedule)
    # Its own stream: the messages stay the same whatever the arrival settings.
    timing = random.Random(cfg.seed + 1)
    arrivals, clock = [], 0.0
    for _ in range(cfg.sessions):
        arrivals.append(clock)
        clock += timing.expovariate(cfg.session_rate) if cfg.session_rate > 0 else 0.0
    think = tuple(
        tuple(0.0 if t == 0 or cfg.think_s == 0 else timing.expovariate(1 / cfg.think_s)
              for t in range(cfg.turns))
        for _ in range(cfg.sessions)
    )  # fmt: skip
    return Workload(messages, tuple(schedule), tuple(arrivals), think)


@dataclass(slots=True, frozen=True)
class TurnResult:
    session: int
    turn: int
    messages: tuple[tuple[str, str], ...]  # (role, content) sent, ending with this turn's user
    reply: str
    start_s: float  # perf_counter when the request was sent
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens: the worker's prefix hit


async def run_sessions(
    url: str, model: str, wl: Workload, cfg: WorkloadConfig, headers: dict[str, str]
) -> list[TurnResult]:
    """Closed loop (``session_rate`` 0): dispatch the schedule, the earliest pending turn whose
    session is idle, up to ``concurrency`` in flight. Open loop: each session starts at its arrival
    time and sends each turn a think time after the previous one finished, up to ``concurrency``
    in flight."""
    history: list[list[tuple[str, str]]] = [[] for _ in wl.messages]
    next_turn = [0] * len(wl.messages)
    busy: set[int] = set()
    pending = list(wl.schedule)
    results: list[TurnResult] = []
    errors: list[Exception] = []
    done = asyncio.Condition()

    async def one(client: httpx.AsyncClient, s: int) -> None:
        t = next_turn[s]
        msgs = (*history[s], ("user", wl.messages[s][t]))
        try:
            body = chat_body(model, msgs, cfg.max_tokens)
            start = time.perf_counter()
            res = await stream_chat(client, url, body)
        except Exception as exc:  # noqa: BLE001 - re-raised by the dispatcher
            errors.append(exc)
        else:
            usage = res.usage
            details = usage.get("prompt_tokens_details") or {}
            results.append(
                TurnResult(s, t, msgs, res.reply, start, res.ttft_s, res.e2e_s,
                           int(usage.get("prompt_tokens", -1)),
                           int(usage.get("completion_tokens", -1)),
                           int(details.get("cached_tokens", 0)))
            )  # fmt: skip
            history[s] = [*msgs, ("assistant", res.reply)]
            next_turn[s] = t + 1
        async with done:
            busy.discard(s)
            done.notify_all()

    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(timeout=900, headers=headers, limits=limits) as client:
        if cfg.session_rate > 0:
            slots = asyncio.Semaphore(cfg.concurrency)
            t0 = time.perf_counter()

            async def session(s: int) -> None:
                # Pacing, not synchronization: the workload's own arrival and think times.
                await asyncio.sleep(max(0.0, t0 + wl.arrivals[s] - time.perf_counter()))
                for t in range(len(wl.messages[s])):
                    await asyncio.sleep(wl.think[s][t])
                    if errors:
                        return
                    async with slots:
                        await one(client, s)

            await asyncio.gather(*(session(s) for s in range(len(wl.messages))))
        else:
            tasks: list[asyncio.Task[None]] = []
            while pending and not errors:
                async with done:
                    await done.wait_for(
                        lambda: (
                            bool(errors)
                            or (len(busy) < cfg.concurrency and any(s not in busy for s in pending))
                        )
                    )
                    if errors:
                        break
                    s = next(s for s in pending if s not in busy)
                    pending.remove(s)
                    busy.add(s)
                tasks.append(asyncio.create_task(one(client, s)))
            await asyncio.gather(*tasks)
    if errors:
        raise errors[0]
    return sorted(results, key=lambda r: (r.session, r.turn))
