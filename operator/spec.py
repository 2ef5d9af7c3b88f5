"""The TandemService spec as typed, validated dataclasses.

The CRD's openAPIV3Schema (manifests/crd/) catches what a schema can (types, bounds, enums) and
applies defaults on a real API server. `parse_spec` applies the same defaults again, because the
operator must also work against servers that do not default (tests' emulator, old objects), and
checks what a schema cannot express (min <= max, a URL when the source is prometheus, ...).
A test keeps the two sets of defaults equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any
from urllib.parse import urlsplit

DEFAULT_IMAGE = "ghcr.io/tandem-llm/tandem:0.1.0"
# PromQL label matchers that select one service's series; {namespace} and {name} expand.
DEFAULT_SELECTOR = 'namespace="{namespace}",tandem_service="{name}"'
ROUTER_POLICIES = ("prefix-aware", "least-load", "round-robin")
TRANSPORTS = ("ucx", "tcp")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DTYPES = ("float32", "bfloat16", "float16")
GPU_RESOURCE = "nvidia.com/gpu"
# engineOptions that first-class flags already set: passing them twice made the worker exit
# ("got multiple values for keyword argument 'device'").
RESERVED_ENGINE_OPTIONS = ("device", "dtype", "model", "served_model_name")
# A worker pool's KV listeners take the ports right after its HTTP port (naming.kv_ports).
KV_PORT_OFFSETS = {"kv-events": 1, "kv-side": 2, "kv-data": 3}


class SpecError(ValueError):
    """A spec the schema let through but the operator refuses; the message says which field."""


class MetricsSource(IntEnum):
    DIRECT = 1
    PROMETHEUS = 2


@dataclass(frozen=True, slots=True)
class PVCSpec:
    claim_name: str
    mount_path: str = "/models"
    read_only: bool = True


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str = "demo"
    path: str = ""
    pvc: PVCSpec | None = None

    @property
    def argument(self) -> str:
        """What `--model` receives: the path when one is given, else the served name."""
        return self.path or self.name


@dataclass(frozen=True, slots=True)
class Resources:
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class APIKeySecret:
    name: str
    key: str = "api-key"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    replicas: int = 1
    policy: str = "prefix-aware"
    local_prefill_threshold: int = 64
    prefill_overload_queue: int = 0
    port: int = 8000
    internal_port: int = 8001  # the workers' registry listener, never on the public Service
    service_type: str = "ClusterIP"
    api_key_secret: APIKeySecret | None = None
    resources: Resources = field(default_factory=Resources)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    replicas: int = 1
    port: int = 8100
    resources: Resources = field(default_factory=Resources)
    engine_options: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    device: str = "cpu"  # default cuda when the pool requests nvidia.com/gpu
    dtype: str = "float32"  # default bfloat16 on a GPU pool


@dataclass(frozen=True, slots=True)
class Bounds:
    min_replicas: int = 1
    max_replicas: int = 4

    def clamp(self, n: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, n))


@dataclass(frozen=True, slots=True)
class MetricsSpec:
    source: MetricsSource = MetricsSource.DIRECT
    prometheus_url: str = ""
    window_seconds: int = 60
    selector: str = DEFAULT_SELECTOR


@dataclass(frozen=True, slots=True)
class ProfileRef:
    """The ConfigMap key holding a `tandem profile` JSON."""

    config_map: str
    key: str = "profile.json"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """The traffic the service is planned for (`tandem plan`'s inputs)."""

    input_tokens: int
    output_tokens: int
    requests_per_second: float
    prefix_share: float = 0.0
    profile: ProfileRef | None = None  # None: the ConfigMap `<name>-profile`, key profile.json

    def profile_ref(self, service: str) -> ProfileRef:
        return self.profile or ProfileRef(f"{service}-profile")


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    enabled: bool = False
    # Floors from `tandem plan` for the observed rate, under the reactive rules (needs workload).
    planner: bool = False
    prefill: Bounds = field(default_factory=Bounds)
    decode: Bounds = field(default_factory=Bounds)
    ttft_seconds: float = 1.0
    itl_seconds: float = 0.05
    prefill_queue_per_replica: float = 4.0
    decode_running_per_replica: float = 32.0
    kv_cache_usage: float = 0.8
    tolerance: float = 0.1
    interval_seconds: int = 15
    scale_up_cooldown_seconds: int = 30
    scale_down_cooldown_seconds: int = 120
    warmup_seconds: int = 60
    metrics: MetricsSpec = field(default_factory=MetricsSpec)


@dataclass(frozen=True, slots=True)
class TandemServiceSpec:
    model: ModelSpec = field(default_factory=ModelSpec)
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    router: RouterSpec = field(default_factory=RouterSpec)
    prefill: PoolSpec = field(default_factory=lambda: PoolSpec(port=8100))
    decode: PoolSpec = field(default_factory=lambda: PoolSpec(port=8200))
    kv_transport: str = "ucx"
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    workload: WorkloadSpec | None = None


def _section(raw: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}.{key} must be an object, got {type(value).__name__}")
    return value


def _int(raw: Mapping[str, Any], key: str, default: int, where: str, minimum: int = 0) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}.{key} must be an integer, got {value!r}")
    if value < minimum:
        raise SpecError(f"{where}.{key} must be >= {minimum}, got {value}")
    return value


def _float(raw: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(f"{where}.{key} must be a number, got {value!r}")
    if value <= 0:
        raise SpecError(f"{where}.{key} must be > 0, got {value}")
    return float(value)


def _str(
    raw: Mapping[str, Any], key: str, default: str, where: str, choices: tuple[str, ...] = ()
) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise SpecError(f"{where}.{key} must be a string, got {value!r}")
    if choices and value not in choices:
        raise SpecError(f"{where}.{key} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _str_map(raw: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = _section(raw, key, where)
    out: dict[str, str] = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise SpecError(f"{where}.{key}.{k} must be a string or number, got {v!r}")
        out[str(k)] = str(v)
    return out


def _resources(raw: Mapping[str, Any], where: str) -> Resources:
    section = _section(raw, "resources", where)
    return Resources(
        requests=_str_map(section, "requests", f"{where}.resources"),
        limits=_str_map(section, "limits", f"{where}.resources"),
    )


def _pool(raw: Mapping[str, Any], where: str, port: int) -> PoolSpec:
    options = _str_map(raw, "engineOptions", where)
    for key in options:
        if not key or "=" in key or key.startswith("-"):
            raise SpecError(f"{where}.engineOptions key {key!r} must be a bare option name")
        if key.replace("-", "_") in RESERVED_ENGINE_OPTIONS:
            field_name = {"served_model_name": "model.name", "model": "model"}.get(
                key.replace("-", "_"), f"{where}.{key.replace('-', '_')}"
            )
            raise SpecError(
                f"{where}.engineOptions.{key} collides with a first-class field: set "
                f"{field_name} instead"
            )
    resources = _resources(raw, where)
    gpu = GPU_RESOURCE in resources.requests or GPU_RESOURCE in resources.limits
    device = _str(raw, "device", "cuda" if gpu else "cpu", where)
    if not (device == "cpu" or device == "cuda" or
            (device.startswith("cuda:") and device[5:].isdigit())):  # fmt: skip
        raise SpecError(f"{where}.device must be cpu, cuda or cuda:N; got {device!r}")
    tolerations = raw.get("tolerations", [])
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        raise SpecError(f"{where}.tolerations must be a list of objects")
    return PoolSpec(
        replicas=_int(raw, "replicas", 1, where),
        port=_int(raw, "port", port, where, minimum=1),
        resources=resources,
        engine_options=options,
        node_selector=_str_map(raw, "nodeSelector", where),
        tolerations=tuple(dict(t) for t in tolerations),
        device=device,
        dtype=_str(raw, "dtype", "bfloat16" if gpu else "float32", where, DTYPES),
    )


def _bounds(raw: Mapping[str, Any], where: str) -> Bounds:
    bounds = Bounds(
        min_replicas=_int(raw, "minReplicas", 1, where),
        max_replicas=_int(raw, "maxReplicas", 4, where, minimum=1),
    )
    if bounds.min_replicas > bounds.max_replicas:
        raise SpecError(
            f"{where}.minReplicas ({bounds.min_replicas}) is greater than "
            f"{where}.maxReplicas ({bounds.max_replicas})"
        )
    return bounds


def _metrics(raw: Mapping[str, Any], where: str) -> MetricsSpec:
    source_name = _str(raw, "source", "direct", where, choices=("direct", "prometheus"))
    source = MetricsSource[source_name.upper()]
    url = _str(raw, "prometheusUrl", "", where)
    if source is MetricsSource.PROMETHEUS:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise SpecError(
                f"{where}.prometheusUrl must be an http(s) URL when source is prometheus"
            )
    return MetricsSpec(
        source=source,
        prometheus_url=url.rstrip("/"),
        window_seconds=_int(raw, "windowSeconds", 60, where, minimum=10),
        selector=_str(raw, "selector", DEFAULT_SELECTOR, where),
    )


def _autoscaling(raw: Mapping[str, Any], where: str) -> AutoscalingSpec:
    defaults = AutoscalingSpec()
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise SpecError(f"{where}.enabled must be a boolean")
    planner = raw.get("planner", False)
    if not isinstance(planner, bool):
        raise SpecError(f"{where}.planner must be a boolean")
    tolerance = raw.get("tolerance", defaults.tolerance)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
        raise SpecError(f"{where}.tolerance must be a number")
    if not 0 <= tolerance < 1:
        raise SpecError(f"{where}.tolerance must be in [0, 1), got {tolerance}")
    kv = _float(raw, "kvCacheUsage", defaults.kv_cache_usage, where)
    if kv > 1:
        raise SpecError(f"{where}.kvCacheUsage must be <= 1, got {kv}")
    return AutoscalingSpec(
        enabled=enabled,
        planner=planner,
        prefill=_bounds(_section(raw, "prefill", where), f"{where}.prefill"),
        decode=_bounds(_section(raw, "decode", where), f"{where}.decode"),
        ttft_seconds=_float(raw, "ttftSeconds", defaults.ttft_seconds, where),
        itl_seconds=_float(raw, "itlSeconds", defaults.itl_seconds, where),
        prefill_queue_per_replica=_float(
            raw, "prefillQueuePerReplica", defaults.prefill_queue_per_replica, where
        ),
        decode_running_per_replica=_float(
            raw, "decodeRunningPerReplica", defaults.decode_running_per_replica, where
        ),
        kv_cache_usage=kv,
        tolerance=float(tolerance),
        interval_seconds=_int(raw, "intervalSeconds", defaults.interval_seconds, where, 5),
        scale_up_cooldown_seconds=_int(
            raw, "scaleUpCooldownSeconds", defaults.scale_up_cooldown_seconds, where
        ),
        scale_down_cooldown_seconds=_int(
            raw, "scaleDownCooldownSeconds", defaults.scale_down_cooldown_seconds, where
        ),
        warmup_seconds=_int(raw, "warmupSeconds", defaults.warmup_seconds, where),
        metrics=_metrics(_section(raw, "metrics", where), f"{where}.metrics"),
    )


def _workload(raw: Mapping[str, Any], where: str) -> WorkloadSpec | None:
    if not raw:
        return None
    for key in ("inputTokens", "outputTokens", "requestsPerSecond"):
        if key not in raw:
            raise SpecError(f"{where}.{key} is required when {where} is set")
    share = raw.get("prefixShare", 0.0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share < 1:
        raise SpecError(f"{where}.prefixShare must be a number in [0, 1), got {share!r}")
    profile_raw = raw.get("profile")
    profile = None
    if profile_raw is not None:
        if not isinstance(profile_raw, Mapping) or not profile_raw.get("configMap"):
            raise SpecError(f"{where}.profile.configMap is required when {where}.profile is set")
        profile = ProfileRef(
            config_map=_str(profile_raw, "configMap", "", f"{where}.profile"),
            key=_str(profile_raw, "key", "profile.json", f"{where}.profile"),
        )
    return WorkloadSpec(
        input_tokens=_int(raw, "inputTokens", 1, where, minimum=1),
        output_tokens=_int(raw, "outputTokens", 1, where, minimum=1),
        requests_per_second=_float(raw, "requestsPerSecond", 1.0, where),
        prefix_share=float(share),
        profile=profile,
    )


def parse_spec(raw: Mapping[str, Any]) -> TandemServiceSpec:
    """Parse a TandemService `.spec` (camelCase, possibly undefaulted) or raise SpecError.

    Called by every handler before it renders anything, so a bad spec changes no child.
    """
    if not isinstance(raw, Mapping):
        raise SpecError("spec must be an object")
    model_raw = _section(raw, "model", "spec")
    pvc_raw = model_raw.get("pvc")
    pvc = None
    if pvc_raw is not None:
        if not isinstance(pvc_raw, Mapping) or not pvc_raw.get("claimName"):
            raise SpecError("spec.model.pvc.claimName is required when spec.model.pvc is set")
        pvc = PVCSpec(
            claim_name=_str(pvc_raw, "claimName", "", "spec.model.pvc"),
            mount_path=_str(pvc_raw, "mountPath", "/models", "spec.model.pvc"),
            read_only=bool(pvc_raw.get("readOnly", True)),
        )
    model = ModelSpec(
        name=_str(model_raw, "name", "demo", "spec.model"),
        path=_str(model_raw, "path", "", "spec.model"),
        pvc=pvc,
    )
    if not model.name:
        raise SpecError("spec.model.name must not be empty")
    if pvc is not None and model.path and not model.path.startswith(pvc.mount_path):
        raise SpecError(
            f"spec.model.path {model.path!r} is outside the PVC mount {pvc.mount_path!r}"
        )
    router_raw = _section(raw, "router", "spec")
    secret_raw = router_raw.get("apiKeySecret")
    secret = None
    if secret_raw is not None:
        if not isinstance(secret_raw, Mapping) or not secret_raw.get("name"):
            raise SpecError("spec.router.apiKeySecret.name is required when apiKeySecret is set")
        secret = APIKeySecret(
            name=_str(secret_raw, "name", "", "spec.router.apiKeySecret"),
            key=_str(secret_raw, "key", "api-key", "spec.router.apiKeySecret"),
        )
    router = RouterSpec(
        replicas=_int(router_raw, "replicas", 1, "spec.router"),
        policy=_str(router_raw, "policy", "prefix-aware", "spec.router", ROUTER_POLICIES),
        local_prefill_threshold=_int(router_raw, "localPrefillThreshold", 64, "spec.router"),
        prefill_overload_queue=_int(router_raw, "prefillOverloadQueue", 0, "spec.router"),
        port=_int(router_raw, "port", 8000, "spec.router", minimum=1),
        internal_port=_int(router_raw, "internalPort", 8001, "spec.router", minimum=1),
        service_type=_str(router_raw, "serviceType", "ClusterIP", "spec.router", SERVICE_TYPES),
        api_key_secret=secret,
        resources=_resources(router_raw, "spec.router"),
    )
    prefill = _pool(_section(raw, "prefill", "spec"), "spec.prefill", 8100)
    decode = _pool(_section(raw, "decode", "spec"), "spec.decode", 8200)
    # Each worker pool also listens on the three ports after its own (KV events, side
    # channel, data: children.kv_ports), so the pools' ranges may not overlap.
    ports = [router.port, router.internal_port]
    for pool in (prefill, decode):
        ports += [pool.port, *(pool.port + off for off in KV_PORT_OFFSETS.values())]
    if len(set(ports)) != len(ports) or max(ports) > 65535:
        raise SpecError(
            "spec.router.port, spec.router.internalPort, spec.prefill.port and spec.decode.port "
            "must differ (each pool also uses the 3 ports after its own for KV)"
        )
    kv_raw = _section(raw, "kvTransfer", "spec")
    autoscaling = _autoscaling(_section(raw, "autoscaling", "spec"), "spec.autoscaling")
    if decode.replicas == 0 and not autoscaling.enabled:
        raise SpecError("spec.decode.replicas must be >= 1: decode workers serve every request")
    if autoscaling.enabled and autoscaling.decode.min_replicas == 0:
        raise SpecError("spec.autoscaling.decode.minReplicas must be >= 1")
    workload = _workload(_section(raw, "workload", "spec"), "spec.workload")
    if autoscaling.planner and (workload is None or not autoscaling.enabled):
        raise SpecError(
            "spec.autoscaling.planner needs spec.autoscaling.enabled and spec.workload "
            "(inputTokens, outputTokens, requestsPerSecond)"
        )
    return TandemServiceSpec(
        model=model,
        image=_str(raw, "image", DEFAULT_IMAGE, "spec"),
        image_pull_policy=_str(raw, "imagePullPolicy", "IfNotPresent", "spec", PULL_POLICIES),
        router=router,
        prefill=prefill,
        decode=decode,
        kv_transport=_str(kv_raw, "transport", "ucx", "spec.kvTransfer", TRANSPORTS),
        autoscaling=autoscaling,
        workload=workload,
    )
