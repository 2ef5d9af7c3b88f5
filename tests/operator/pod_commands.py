"""Turn rendered Deployments into local processes: the pod's own command, args and environment,
with only what cannot work outside a cluster substituted.

Pure (no I/O): the live test renders a TandemService's children with the operator, calls
`local_pods`, starts each `LocalPod` and waits on its rendered readiness probe. Substituted:
the image (the local install runs `tandem`), the bind address 0.0.0.0 (loopback), container
ports (free local ports), in-cluster Service URLs (the local router), the downward API
(`metadata.name`, `status.podIP`) and volume mount paths (local directories). Everything else,
envFrom ConfigMaps and Kubernetes' `$(VAR)` expansion included, is applied as a kubelet would.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from local_process import tandem_argv

LOOPBACK = "127.0.0.1"
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True, slots=True)
class LocalPod:
    """One replica of a rendered Deployment, ready to start locally."""

    deployment: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the pod's environment only; the caller adds the host's
    port: int  # local port standing in for the container port named "http"
    readiness_path: str


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names expand, `$$` escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


def _rewrite(value: str, urls: Mapping[str, str], mounts: Mapping[str, str]) -> str:
    for cluster_url, local_url in urls.items():
        value = value.replace(cluster_url, local_url)
    for mount_path, local_dir in mounts.items():
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return local_dir + value[len(mount_path) :]
    return value


def _field(path: str, pod_name: str, namespace: str) -> str:
    fields = {"metadata.name": pod_name, "metadata.namespace": namespace, "status.podIP": LOOPBACK}
    if path not in fields:
        raise ValueError(f"downward API field {path!r} has no local equivalent")
    return fields[path]


def container_env(
    container: Mapping[str, Any],
    config_maps: Mapping[str, Mapping[str, str]],
    pod_name: str,
    namespace: str,
) -> dict[str, str]:
    """envFrom first, then env in order, each `$(VAR)` expanded against what came before."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref is None or ref["name"] not in config_maps:
            raise ValueError(f"envFrom {source!r} names no rendered ConfigMap")
        env.update(config_maps[ref["name"]])
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in (var.get("valueFrom") or {}):
            env[var["name"]] = _field(
                var["valueFrom"]["fieldRef"]["fieldPath"], pod_name, namespace
            )
        else:
            raise ValueError(f"env {var['name']}: unsupported source {var!r}")
    return env


def _local_args(
    args: Sequence[str],
    ports: Mapping[int, int],
    urls: Mapping[str, str],
    mounts: Mapping[str, str],
) -> list[str]:
    out: list[str] = []
    for i, arg in enumerate(args):
        flag = args[i - 1] if i > 0 else ""
        if flag == "--host":
            if arg != "0.0.0.0":
                raise ValueError(f"--host {arg}: expected the pod's 0.0.0.0")
            arg = LOOPBACK
        elif flag in ("--port", "--internal-port", "--kv-events-port", "--kv-side-channel-port",
                      "--kv-data-port"):  # fmt: skip
            arg = str(ports[int(arg)])
        out.append(_rewrite(arg, urls, mounts))
    return out


def local_pod(
    deployment: Mapping[str, Any],
    config_maps: Mapping[str, Mapping[str, str]],
    ports: Mapping[int, int],
    urls: Mapping[str, str],
    mounts: Mapping[str, str],
) -> LocalPod:
    """The first (only) container of `deployment` as a local process.

    ports: container port -> local port; urls: in-cluster URL -> local URL; mounts: volume
    mount path -> local directory.
    """
    meta = deployment["metadata"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    if container.get("command") != ["tandem"]:
        raise ValueError(f"{meta['name']}: command {container.get('command')!r} is not tandem")
    pod_name = f"{meta['name']}-local-0"
    env = container_env(container, config_maps, pod_name, meta["namespace"])
    env = {k: _rewrite(v, urls, mounts) for k, v in env.items()}
    args = [expand(a, env) for a in container.get("args") or []]
    named = {p["name"]: p["containerPort"] for p in container.get("ports") or []}
    probe = container["readinessProbe"]["httpGet"]
    probe_port = probe["port"]
    if named.get(probe_port, probe_port) != named["http"]:
        raise ValueError(f"{meta['name']}: readiness probe is not on the http port")
    return LocalPod(
        deployment=meta["name"],
        argv=tuple(tandem_argv(_local_args(args, ports, urls, mounts))),
        env=env,
        port=ports[named["http"]],
        readiness_path=probe["path"],
    )


def service_urls(
    services: Sequence[Mapping[str, Any]],
    deployments: Sequence[Mapping[str, Any]],
    ports: Mapping[int, int],
) -> dict[str, str]:
    """`http://<svc>.<ns>.svc:<port>` -> the local address of the pod that Service selects."""
    urls: dict[str, str] = {}
    for svc in services:
        selector = svc["spec"].get("selector") or {}
        for d in deployments:
            labels = d["spec"]["template"]["metadata"]["labels"]
            if not selector or any(labels.get(k) != v for k, v in selector.items()):
                continue
            (container,) = d["spec"]["template"]["spec"]["containers"]
            named = {p["name"]: p["containerPort"] for p in container["ports"]}
            for p in svc["spec"]["ports"]:
                target = named.get(p["targetPort"], p["targetPort"])
                host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
                urls[f"http://{host}:{p['port']}"] = f"http://{LOOPBACK}:{ports[int(target)]}"
    return urls
