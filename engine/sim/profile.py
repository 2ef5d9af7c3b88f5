"""The profile JSON that ``tandem profile`` writes and simulated workers and the planner read.

One file holds the facts of the measured deployment (model dimensions, KV capacity in blocks,
the engine's token budget), the fitted models (step execute and host time, KV transfer time per
transport, the serving latencies around the engine) and the raw points they were fitted on, so
a profile can be refitted or inspected. ``load_profile`` validates strictly: a wrong type, a
missing field or a negative time is a ValueError naming the field, never a half-read profile.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.engine.role import Role
from tandem.engine.sim.cost_model import (
    STEP_FEATURES,
    TRANSFER_FEATURES,
    LinearModel,
    StepCost,
    TransferCost,
)

PROFILE_FORMAT = "tandem-profile"
# 2: the step model's seven features (1 had five: one attention feature, no prefill rows, and
# decode points a profiler could time on fewer sequences than they name). A version-1 profile
# is refused: make it again with `tandem profile`.
PROFILE_VERSION = 2
MAX_PROFILE_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class ModelFacts:
    name: str  # what --model named: "demo" or a directory
    architecture: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    # What simulated workers emit: printable tokens, never EOS (see tandem.engine.sim.tokens).
    sim_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineFacts:
    device: str
    block_size: int
    num_blocks: int  # the KV capacity the engine sized on this hardware
    block_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True, slots=True)
class StepPoint:
    """One measured batch shape: rows as ``(num_new_tokens, context, count)`` groups."""

    label: str
    rows: tuple[tuple[int, int, int], ...]
    execute_seconds: float  # the lower quartile of the samples (profiler.py says why)
    host_seconds: float
    samples: tuple[float, ...]

    def expanded(self) -> list[tuple[int, int]]:
        return [(q, ctx) for q, ctx, n in self.rows for _ in range(n)]


@dataclass(frozen=True, slots=True)
class TransferPoint:
    transport: str
    num_bytes: int
    seconds: float  # median
    samples: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ServingCost:
    """Latency outside the engine steps, added by the discrete-event simulator.

    ``request_seconds``: the router receives, tokenizes and places a request and the worker
    queues it; ``token_seconds``: a token from the engine thread to the client; ``handoff_seconds``:
    a prefill's final output back through the router to the decode worker's queue;
    ``step_seconds``: what a serving worker adds to each engine step (its thread's loop, KV event
    publishing); ``row_seconds``: the worker's CPU to stream each token of a step (worker ->
    router), on its HTTP thread after the step: it delays steps only where it takes a core they
    need. Measured by
    ``tandem profile`` through a real `tandem up` (``tandem_pkg/calibrate.py``); these defaults
    are for a profile made without that stage.

    CPU, not latency (read from the processes' CPU times by the same stage): the router's event
    loop is one thread, so its work queues: ``router_request_cpu`` per request it places and
    ``router_token_cpu`` per token it streams are its service times, part of the latencies
    above; ``worker_request_cpu`` is what a worker's HTTP side spends on each request it is
    sent, time its engine thread loses (they share the GIL), ``prefill_request_cpu`` and
    ``decode_request_cpu`` the same in P/D with each side's part of the KV transfer (0: the
    colocated figure); ``router_handoff_cpu`` the router's per request in P/D beyond its
    colocated figure (the hand-off: prefill's final chunk, the decode request it then opens),
    on its loop at the hand-off. ``client_request_cpu`` and ``client_token_cpu`` are the load
    generator's own CPU per request and per streamed token (the calibrating client, one asyncio
    httpx client parsing each chunk, as the validation's does): the simulator counts them
    against the shared cores only when told the load runs on the same machine
    (``SimOptions.client_shares_cores``). 0: not measured (not modelled).
    """

    request_seconds: float = 0.002
    token_seconds: float = 0.001
    handoff_seconds: float = 0.002
    step_seconds: float = 0.0
    row_seconds: float = 0.0
    router_request_cpu: float = 0.0
    router_token_cpu: float = 0.0
    worker_request_cpu: float = 0.0
    prefill_request_cpu: float = 0.0  # the same on a prefill worker, with its side of a transfer
    decode_request_cpu: float = 0.0  # on a decode worker, with its pull
    router_handoff_cpu: float = 0.0  # the router's per P/D request, at the hand-off
    client_request_cpu: float = 0.0
    client_token_cpu: float = 0.0
    # Of each item's CPU above (measured one request at a time, every item waking its thread),
    # the share that is the wake-up: an item reaching a thread already busy costs only the
    # rest (the router's and the client's loops per request and per token, a worker's HTTP
    # thread per streamed row). Measured from the same requests sent several at once; 0: not
    # measured (every item pays it all).
    router_wake_share: float = 0.0
    client_wake_share: float = 0.0
    row_wake_share: float = 0.0
    # A thread that wakes while every shared core is busy waits this long for one: the kernel
    # scheduler lets the running thread finish its time slice first (processor sharing alone
    # spreads that wait thin). ``tandem profile`` records ``wake_shares.mean_run_queue_wait()``,
    # half this host's slice (the mean rest of a slice the woken thread lands in); 0: not
    # modelled.
    run_queue_wait: float = 0.0
    # Variability, measured with one request at a time (empty: none, every latency its value
    # above): ``request_spread``, quantiles of the first token's serving latency (what
    # ``request_seconds + token_seconds`` is the median of); ``pace_spread``, quantiles of a
    # lone request's ITL over the median ITL, how the machine's pace varies over windows of
    # ``pace_seconds`` (the decode time of one such request); ``handoff_spread``, quantiles of
    # the P/D hand-off's gap beyond the predicted pull and decode step (what
    # ``handoff_seconds`` is the lower quartile of). The simulator draws from them.
    request_spread: tuple[float, ...] = ()
    pace_spread: tuple[float, ...] = ()
    pace_seconds: float = 0.0
    handoff_spread: tuple[float, ...] = ()

    def request_cpu(self, role: Role) -> float:
        """A worker of ``role``'s CPU per request sent to it, which the simulator's workers take
        from their next step. A prefill worker's is its request handling alone, the colocated
        figure (its side of the KV transfer comes after the first token: ``transfer_cpu``)."""
        if role is Role.PREFILL and self.prefill_request_cpu and self.worker_request_cpu:
            return min(self.prefill_request_cpu, self.worker_request_cpu)
        measured = {Role.PREFILL: self.prefill_request_cpu, Role.DECODE: self.decode_request_cpu}
        return measured.get(role) or self.worker_request_cpu

    def transfer_cpu(self, role: Role) -> float:
        """A prefill worker's CPU per request beyond its request handling: serving the decode
        worker's pull after it is done, beside the engine thread: a step starting before that work
        ends waits for the rest (SimWorker; 0 for other roles)."""
        if role is Role.PREFILL and self.prefill_request_cpu and self.worker_request_cpu:
            return max(0.0, self.prefill_request_cpu - self.worker_request_cpu)
        return 0.0


@dataclass(frozen=True, slots=True)
class Profile:
    model: ModelFacts
    engine: EngineFacts
    step: StepCost
    transfer: TransferCost
    serving: ServingCost = field(default_factory=ServingCost)
    step_points: tuple[StepPoint, ...] = ()
    transfer_points: tuple[TransferPoint, ...] = ()
    fit: Mapping[str, float] = field(default_factory=dict)
    created: str = ""
    hardware: Mapping[str, Any] = field(default_factory=dict)

    @property
    def threads(self) -> int:
        """The engine threads the steps were timed with (``hardware.torch_threads``; 1 when
        the profile does not say): the workers it predicts run as many."""
        t = self.hardware.get("torch_threads", 1)
        return t if type(t) is int and t > 0 else 1

    def to_dict(self) -> dict[str, Any]:
        m, e, s = self.model, self.engine, self.serving
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "created": self.created,
            "hardware": dict(self.hardware),
            "model": {
                "name": m.name, "architecture": m.architecture, "vocab_size": m.vocab_size,
                "num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
                "head_dim": m.head_dim, "dtype": m.dtype, "max_model_len": m.max_model_len,
                "eos_token_ids": list(m.eos_token_ids), "sim_token_ids": list(m.sim_token_ids),
            },
            "engine": {
                "device": e.device, "block_size": e.block_size, "num_blocks": e.num_blocks,
                "block_bytes": e.block_bytes, "max_num_batched_tokens": e.max_num_batched_tokens,
                "max_num_seqs": e.max_num_seqs,
            },
            "step": {
                "features": list(STEP_FEATURES),
                "execute": list(self.step.execute.coefficients),
                "host": list(self.step.host.coefficients),
                "fit": dict(self.fit),
                "points": [
                    {"label": p.label, "rows": [list(r) for r in p.rows],
                     "execute_seconds": p.execute_seconds, "host_seconds": p.host_seconds,
                     "samples": list(p.samples)}
                    for p in self.step_points
                ],
            },
            "transfer": {
                "features": list(TRANSFER_FEATURES),
                "models": {t: list(lm.coefficients) for t, lm in self.transfer.models.items()},
                "points": [
                    {"transport": p.transport, "bytes": p.num_bytes, "seconds": p.seconds,
                     "samples": list(p.samples)}
                    for p in self.transfer_points
                ],
            },
            "serving": {
                "request_seconds": s.request_seconds, "token_seconds": s.token_seconds,
                "handoff_seconds": s.handoff_seconds, "step_seconds": s.step_seconds,
                "row_seconds": s.row_seconds, "router_request_cpu": s.router_request_cpu,
                "router_token_cpu": s.router_token_cpu,
                "worker_request_cpu": s.worker_request_cpu,
                "prefill_request_cpu": s.prefill_request_cpu,
                "decode_request_cpu": s.decode_request_cpu,
                "router_handoff_cpu": s.router_handoff_cpu,
                "client_request_cpu": s.client_request_cpu,
                "client_token_cpu": s.client_token_cpu,
                "router_wake_share": s.router_wake_share,
                "client_wake_share": s.client_wake_share, "row_wake_share": s.row_wake_share,
                "run_queue_wait": s.run_queue_wait,
                "request_spread": list(s.request_spread), "pace_spread": list(s.pace_spread),
                "pace_seconds": s.pace_seconds, "handoff_spread": list(s.handoff_spread),
            },
        }  # fmt: skip

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


# ---- strict parsing --------------------------------------------------------------------------


def _get(d: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise ValueError(f"profile: {where} must be an object")
    if key not in d:
        raise ValueError(f"profile: {where}.{key} is missing")
    return d[key]


def _int(d: Mapping[str, Any], key: str, where: str, minimum: int = 1) -> int:
    v = _get(d, key, where)
    if type(v) is not int or v < minimum:
        raise ValueError(f"profile: {where}.{key} must be an integer >= {minimum}, got {v!r}")
    return v


def _list(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"profile: {where} must be a list")
    return v


def _seconds(v: Any, where: str) -> float:
    if type(v) not in (int, float) or not 0 <= v < 1e6:
        raise ValueError(f"profile: {where} must be a number of seconds >= 0, got {v!r}")
    return float(v)


def _share(v: Any, where: str) -> float:
    if type(v) not in (int, float) or not 0 <= v <= 1:
        raise ValueError(f"profile: {where} must be a share in [0, 1], got {v!r}")
    return float(v)


def _str(d: Mapping[str, Any], key: str, where: str) -> str:
    v = _get(d, key, where)
    if not isinstance(v, str) or not v:
        raise ValueError(f"profile: {where}.{key} must be a non-empty string")
    return v


def _ints(d: Mapping[str, Any], key: str, where: str, nonempty: bool = False) -> tuple[int, ...]:
    v = _get(d, key, where)
    if not isinstance(v, list) or any(type(x) is not int or x < 0 for x in v):
        raise ValueError(f"profile: {where}.{key} must be a list of integers >= 0")
    if nonempty and not v:
        raise ValueError(f"profile: {where}.{key} must not be empty")
    return tuple(v)


def _coefficients(v: Any, features: tuple[str, ...], where: str) -> LinearModel:
    if not isinstance(v, list) or len(v) != len(features):
        raise ValueError(f"profile: {where} must be a list of {len(features)} coefficients")
    return LinearModel(features, tuple(_seconds(c, f"{where}[{i}]") for i, c in enumerate(v)))


def profile_from_dict(data: Any) -> Profile:
    """Validate and build; ValueError naming the first bad field."""
    if not isinstance(data, Mapping):
        raise ValueError("profile: the document must be a JSON object")
    if data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION:
        raise ValueError(
            f"profile: not a {PROFILE_FORMAT} version {PROFILE_VERSION} document "
            f"(format {data.get('format')!r}, version {data.get('version')!r}); "
            "make it again with `tandem profile`"
        )
    m = _get(data, "model", "")
    model = ModelFacts(
        name=_str(m, "name", "model"),
        architecture=_str(m, "architecture", "model"),
        vocab_size=_int(m, "vocab_size", "model"),
        num_layers=_int(m, "num_layers", "model"),
        num_kv_heads=_int(m, "num_kv_heads", "model"),
        head_dim=_int(m, "head_dim", "model"),
        dtype=_str(m, "dtype", "model"),
        max_model_len=_int(m, "max_model_len", "model", 2),
        eos_token_ids=_ints(m, "eos_token_ids", "model"),
        sim_token_ids=_ints(m, "sim_token_ids", "model", nonempty=True),
    )
    if any(t >= model.vocab_size for t in model.sim_token_ids):
        raise ValueError("profile: model.sim_token_ids must be below vocab_size")
    if set(model.sim_token_ids) & set(model.eos_token_ids):
        raise ValueError("profile: model.sim_token_ids must not contain an EOS token")
    e = _get(data, "engine", "")
    engine = EngineFacts(
        device=_str(e, "device", "engine"),
        block_size=_int(e, "block_size", "engine"),
        num_blocks=_int(e, "num_blocks", "engine"),
        block_bytes=_int(e, "block_bytes", "engine"),
        max_num_batched_tokens=_int(e, "max_num_batched_tokens", "engine"),
        max_num_seqs=_int(e, "max_num_seqs", "engine"),
    )
    if engine.block_size & (engine.block_size - 1):
        raise ValueError(
            f"profile: engine.block_size must be a power of two, got {engine.block_size}"
        )
    st = _get(data, "step", "")
    if _get(st, "features", "step") != list(STEP_FEATURES):
        raise ValueError(f"profile: step.features must be {list(STEP_FEATURES)}")
    step = StepCost(
        execute=_coefficients(_get(st, "execute", "step"), STEP_FEATURES, "step.execute"),
        host=_coefficients(_get(st, "host", "step"), STEP_FEATURES, "step.host"),
    )
    points = []
    for i, p in enumerate(st.get("points") or []):
        where = f"step.points[{i}]"
        rows = _get(p, "rows", where)
        if not isinstance(rows, list) or not all(
            isinstance(r, list) and len(r) == 3 and all(type(x) is int and x >= 0 for x in r)
            for r in rows
        ):
            raise ValueError(f"profile: {where}.rows must be [[tokens, context, count], ...]")
        points.append(
            StepPoint(
                label=str(p.get("label", "")),
                rows=tuple(tuple(r) for r in rows),
                execute_seconds=_seconds(_get(p, "execute_seconds", where), where),
                host_seconds=_seconds(_get(p, "host_seconds", where), where),
                samples=tuple(_seconds(s, where) for s in p.get("samples") or []),
            )
        )
    tr = _get(data, "transfer", "")
    if _get(tr, "features", "transfer") != list(TRANSFER_FEATURES):
        raise ValueError(f"profile: transfer.features must be {list(TRANSFER_FEATURES)}")
    models_raw = _get(tr, "models", "transfer")
    if not isinstance(models_raw, Mapping):
        raise ValueError("profile: transfer.models must be an object")
    transfer = TransferCost(
        {
            str(t): _coefficients(c, TRANSFER_FEATURES, f"transfer.models.{t}")
            for t, c in models_raw.items()
        }
    )
    tpoints = [
        TransferPoint(
            transport=_str(p, "transport", f"transfer.points[{i}]"),
            num_bytes=_int(p, "bytes", f"transfer.points[{i}]", 0),
            seconds=_seconds(_get(p, "seconds", f"transfer.points[{i}]"), "seconds"),
            samples=tuple(_seconds(s, "samples") for s in p.get("samples") or []),
        )
        for i, p in enumerate(tr.get("points") or [])
    ]
    sv = data.get("serving") or {}
    defaults = ServingCost()
    serving = ServingCost(
        **{
            k: _seconds(sv.get(k, getattr(defaults, k)), f"serving.{k}")
            for k in (
                "request_seconds",
                "token_seconds",
                "handoff_seconds",
                "step_seconds",
                "row_seconds",
                "router_request_cpu",
                "router_token_cpu",
                "worker_request_cpu",
                "prefill_request_cpu",
                "decode_request_cpu",
                "router_handoff_cpu",
                "client_request_cpu",
                "client_token_cpu",
                "pace_seconds",
                "run_queue_wait",
            )  # fmt: skip
        },
        **{
            k: _share(sv.get(k, 0.0), f"serving.{k}")
            for k in ("router_wake_share", "client_wake_share", "row_wake_share")
        },
        **{
            k: tuple(_seconds(v, f"serving.{k}") for v in _list(sv.get(k, []), f"serving.{k}"))
            for k in ("request_spread", "pace_spread", "handoff_spread")
        },
    )
    fit = st.get("fit") or {}
    hardware = data.get("hardware") or {}
    if not isinstance(fit, Mapping) or not isinstance(hardware, Mapping):
        raise ValueError("profile: step.fit and hardware must be objects")
    return Profile(
        model=model,
        engine=engine,
        step=step,
        transfer=transfer,
        serving=serving,
        step_points=tuple(points),
        transfer_points=tuple(tpoints),
        fit={str(k): float(v) for k, v in fit.items() if type(v) in (int, float)},
        created=str(data.get("created", "")),
        hardware=dict(hardware),
    )


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; ValueError (or OSError) says what is wrong."""
    p = Path(path)
    if p.stat().st_size > MAX_PROFILE_BYTES:
        raise ValueError(f"profile: {p} is larger than {MAX_PROFILE_BYTES} bytes")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile: {p} is not JSON: {exc}") from None
    return profile_from_dict(data)
