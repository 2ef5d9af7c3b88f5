"""A real Prometheus server (the `prometheus` binary) scraping local targets, for live tests.

`prometheus_config` is pure: static scrape targets with the labels that Kubernetes service
discovery and the PodMonitor would attach in a cluster (namespace, pod, tandem_service, pool),
so the dashboard's and the autoscaler's selectors match unchanged. `PrometheusServer` runs the
binary on loopback with its TSDB in a test directory and answers HTTP API queries; the fixture
that starts it owns it and stops it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from local_process import LocalProcess
from procs import free_port, wait_for


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    job: str
    address: str  # host:port serving /metrics
    labels: Mapping[str, str] = field(default_factory=dict)


def prometheus_config(targets: Sequence[ScrapeTarget], interval: str = "1s") -> dict[str, Any]:
    """prometheus.yml with one job per distinct `job`, each target with its own labels."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for t in targets:
        jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": dict(t.labels)})
    return {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics", "static_configs": configs}
            for job, configs in jobs.items()
        ],
    }


class PrometheusError(RuntimeError):
    """The HTTP API answered with an error status."""


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


class PrometheusServer:
    """`prometheus` on 127.0.0.1 with its config and TSDB under `workdir`."""

    def __init__(self, binary: str, workdir: Path, targets: Sequence[ScrapeTarget]) -> None:
        self.targets = list(targets)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        # JSON is YAML; no dumper needed.
        config.write_text(json.dumps(prometheus_config(self.targets), indent=1))
        self.process = LocalProcess(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            workdir,
            "prometheus",
        )
        self.http = httpx.Client(base_url=self.url, timeout=5.0)

    def api(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        response = self.http.get(f"/api/v1/{path}", params=params)
        body = response.json()
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of `promql` now; raises PrometheusError if it does not parse."""
        data = self.api("query", {"query": promql})
        if data["resultType"] != "vector":
            raise PrometheusError(f"{promql}: expected a vector, got {data['resultType']}")
        return data["result"]

    def wait_targets_up(self, timeout: float) -> None:
        """Every configured target has been scraped successfully at least once."""
        self.process.wait_http_ok(f"{self.url}/-/ready", timeout)
        expected = {t.address for t in self.targets}

        def all_up() -> bool:
            if not self.process.alive():
                raise RuntimeError(f"prometheus exited:\n{self.process.log_tail()}")
            active = self.api("targets", {"state": "active"})["activeTargets"]
            healthy = {t["labels"]["instance"] for t in active if t["health"] == "up"}
            return expected <= healthy

        wait_for(all_up, timeout, "every prometheus target up", interval=0.25)

    def stop(self) -> None:
        self.http.close()
        self.process.stop()
