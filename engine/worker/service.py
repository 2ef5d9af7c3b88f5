"""WorkerService: everything one worker process runs, whatever its role.

Built by the app's lifespan (``app.py``) on a worker thread: it assigns the worker's one engine
id, lets the role attach (its hooks and KV connector) before the engine exists, then owns the
engine thread, the KV event publisher and the metrics registry. ``close`` stops them in order.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.engine import fingerprint
from tandem.engine.builder import EngineParts
from tandem.engine.cluster_token import ClusterToken
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.hashing import HASH_ALGORITHM
from tandem.engine.request import Request
from tandem.engine.resume import continue_sequence
from tandem.engine.sim.profile import Profile
from tandem.engine.worker.engine_thread import EngineThread
from tandem.engine.worker.kv_publisher import KVEventPublisher
from tandem.engine.worker.metrics import RequestLatency, worker_registry
from tandem.engine.worker.protocol import GenerateRequest, QueueFull
from tandem.engine.worker.role import RoleContext, WorkerRole


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None  # the address others reach us at (pod IP in Kubernetes)
    router_url: str | None = None  # one router; ``router_urls`` for several
    heartbeat_interval_s: float = 1.0
    router_urls: tuple[str, ...] = ()
    router_resolve_interval_s: float = 5.0  # how often router names are resolved again
    # Required on the internal API, KV events and the KV side channel; None only in-process
    # (tests): the CLI refuses to start without one.
    cluster_token: ClusterToken | None = None
    kv_events_port: int = 0  # fixed listener ports (0: any free one); the operator fixes them
    kv_side_channel_port: int = 0
    kv_data_port: int = 0
    # Requests waiting for the engine beyond which generate answers 503 (None: 4 x max_num_seqs).
    max_waiting_requests: int | None = None
    # ``--simulate``: no weights; the profiled step and KV transfer times (tandem.engine.sim).
    simulate: Profile | None = None


WAITING_PER_SEQ = 4  # default waiting-queue bound, per sequence slot of the batch


class WorkerService:
    def __init__(
        self,
        config: WorkerConfig,
        role: WorkerRole,
        parts: EngineParts,
        on_fatal: Callable[[BaseException], None] | None = None,
        post: Callable[..., object] | None = None,
    ) -> None:
        self.config = config
        self.role = role
        self.engine_id = uuid.uuid4().hex
        self.draining = False
        host = config.advertise_host or config.host
        self.url = f"http://{host}:{config.port}"
        self.model_name = config.engine.served_model_name or config.engine.model
        self.registry = worker_registry(
            lambda: self.thread.stats, self._counters, self.model_name, role.role.label
        )
        self.latency = RequestLatency(self.registry, self.model_name, role.role.label)
        layout = parts.layout
        self.fingerprint = fingerprint.compute(
            parts.model_path, layout.dtype, layout.block_size, layout.num_layers,
            layout.num_kv_heads, layout.head_dim,
        )  # fmt: skip
        ctx = RoleContext(
            self.engine_id,
            config.host,
            config.advertise_host,
            self.registry,
            self.model_name,
            config.cluster_token,
            config.kv_side_channel_port,
            config.kv_data_port,
            self.fingerprint.digest,
            self.fingerprint.describe(),
            wake_engine=self._wake_engine,
        )
        self.engine = Engine(parts, role.attach(parts, ctx))
        self.events = KVEventPublisher(
            self.engine_id, host=config.host, port=config.kv_events_port, token=config.cluster_token
        )
        self.events_endpoint = self.events.endpoint.replace(config.host, host, 1)
        self.thread = EngineThread(
            self.engine, after_step=self._after_step, on_fatal=on_fatal, post=post
        )
        seqs = parts.config.scheduler.max_num_seqs
        self.max_waiting = config.max_waiting_requests or WAITING_PER_SEQ * seqs

    def _wake_engine(self) -> None:
        # The role's connector is built (by attach) before the thread that it wakes.
        thread = getattr(self, "thread", None)
        if thread is not None:
            thread.wake()

    def _counters(self) -> dict[str, float]:
        return {
            "prompt_tokens": self.engine.num_prompt_tokens,
            "generation_tokens": self.engine.num_generation_tokens,
            "busy_seconds": self.engine.busy_seconds,
        }

    def _after_step(self, engine: Engine) -> None:
        self.events.publish(engine.take_kv_events())

    def submit(self, req: GenerateRequest, arrival_time: float | None = None) -> list[Request]:
        """On the engine thread: build, role-check and queue; ValueError (or QueueFull) leaves
        nothing queued. ``arrival_time``: when the HTTP handler got it (``time.monotonic()``)."""
        return submit(self.engine, self.role, req, self.max_waiting, arrival_time)

    def info(self) -> dict[str, Any]:
        """The registration body (docs/internal-api.md WorkerInfo)."""
        return {
            "engine_id": self.engine_id,
            "role": self.role.role.label,
            "model": self.model_name,
            "url": self.url,
            "block_size": self.engine.layout.block_size,
            "hash_algorithm": HASH_ALGORITHM,
            "max_model_len": self.engine.max_model_len,
            "num_blocks": self.engine.layout.num_blocks,
            "max_num_seqs": self.engine.config.scheduler.max_num_seqs,
            "kv_events_endpoint": self.events_endpoint,
            "fingerprint": self.fingerprint.digest,
            "simulated": self.config.simulate is not None,
            **self.role.info(),
        }

    def load(self) -> dict[str, Any]:
        s = self.thread.stats
        return {
            "engine_id": self.engine_id,
            "running": s.num_running,
            "waiting": s.num_waiting,
            "kv_usage": s.kv_usage,
            "num_free_blocks": s.num_free_blocks,
        }

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.thread.stop()
        self.role.close()
        self.events.close()


def submit(
    engine: Engine,
    role: WorkerRole,
    req: GenerateRequest,
    max_waiting: int | None = None,
    arrival_time: float | None = None,
) -> list[Request]:
    """Build the request(s), let the role apply its fields, queue them (engine thread only).

    Raises BadRequest / ValueError (the request is at fault), then QueueFull (more than
    ``max_waiting`` would wait), with nothing queued; a group whose later member fails to queue
    is aborted whole.
    """
    reqs = engine.make_requests(
        req.request_id,
        req.prompt_token_ids,
        req.params,
        priority=req.priority,
        arrival_time=arrival_time,
    )
    waiting = len(engine.scheduler.waiting)
    if max_waiting is not None and waiting + len(reqs) > max_waiting:
        raise QueueFull(f"this worker's queue is full ({waiting} requests waiting)")
    if req.resume_token_ids:
        continue_sequence(reqs[0], req.resume_token_ids, engine.arch.vocab_size)
    role.intake(engine, reqs, req)
    queued: list[Request] = []
    try:
        for r in reqs:
            engine.enqueue(r)
            queued.append(r)
    except BaseException:
        if queued:
            engine.abort([r.request_id for r in queued])
        raise
    return reqs
