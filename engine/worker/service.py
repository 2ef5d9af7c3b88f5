"""WorkerService: everything one worker process runs, whatever its role.

Built by the app's lifespan (``app.py``) on a worker thread: it assigns the worker's one engine
id, lets the role attach (its hooks and KV connector) before the engine exists, then owns the
engine thread, the KV event publisher and the metrics registry. ``close`` stops them in order.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tandem.engine.builder import EngineParts
from tandem.engine.cluster_token import ClusterToken
from tandem.engine.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.hashing import HASH_ALGORITHM
from tandem.engine.request import Request
from tandem.engine.sim.profile import Profile
from tandem.engine.worker.engine_thread import EngineThread
from tandem.engine.worker.kv_publisher import KVEventPublisher
from tandem.engine.worker.metrics import worker_registry
from tandem.engine.worker.protocol import GenerateRequest
from tandem.engine.worker.role import RoleContext, WorkerRole


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8100
    advertise_host: str | None = None  # the address others reach us at (pod IP in Kubernetes)
    router_url: str | None = None
    heartbeat_interval_s: float = 1.0
    # Required on the internal API, KV events and the KV side channel; None only in-process
    # (tests): the CLI refuses to start without one.
    cluster_token: ClusterToken | None = None
    kv_events_port: int = 0  # fixed listener ports (0: any free one); the operator fixes them
    kv_side_channel_port: int = 0
    kv_data_port: int = 0
    # ``--simulate``: no weights; the profiled step and KV transfer times (tandem.engine.sim).
    simulate: Profile | None = None


class WorkerService:
    def __init__(self, config: WorkerConfig, role: WorkerRole, parts: EngineParts) -> None:
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
        ctx = RoleContext(
            self.engine_id,
            config.host,
            config.advertise_host,
            self.registry,
            self.model_name,
            config.cluster_token,
            config.kv_side_channel_port,
            config.kv_data_port,
        )
        self.engine = Engine(parts, role.attach(parts, ctx))
        self.events = KVEventPublisher(
            self.engine_id, host=config.host, port=config.kv_events_port, token=config.cluster_token
        )
        self.events_endpoint = self.events.endpoint.replace(config.host, host, 1)
        self.thread = EngineThread(self.engine, after_step=self._after_step)

    def _counters(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.engine.num_prompt_tokens,
            "generation_tokens": self.engine.num_generation_tokens,
        }

    def _after_step(self, engine: Engine) -> None:
        self.events.publish(engine.take_kv_events())

    def submit(self, req: GenerateRequest) -> list[Request]:
        """On the engine thread: build, role-check and queue; ValueError leaves nothing queued."""
        return submit(self.engine, self.role, req)

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
            "kv_events_endpoint": self.events_endpoint,
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


def submit(engine: Engine, role: WorkerRole, req: GenerateRequest) -> list[Request]:
    """Build the request(s), let the role apply its fields, queue them (engine thread only).

    Raises BadRequest / ValueError with nothing queued.
    """
    reqs = engine.make_requests(
        req.request_id, req.prompt_token_ids, req.params, priority=req.priority
    )
    role.intake(engine, reqs, req)
    for r in reqs:
        engine.enqueue(r)
    return reqs
