"""The Grafana dashboard's PromQL, extracted so tests can check it with promtool now and run
it against a live Prometheus later (`dashboard_queries(namespace, service)`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "manifests/monitoring/tandem-dashboard.json"


def dashboard_panels(path: Path = DASHBOARD) -> list[dict[str, Any]]:
    dashboard = json.loads(path.read_text())
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return [p for p in panels if p.get("targets")]


def dashboard_exprs(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, raw expr with Grafana variables) for every query on the dashboard."""
    return [(p["title"], t["expr"]) for p in dashboard_panels(path) for t in p["targets"]]


def to_promql(
    expr: str, namespace: str = "default", service: str = "demo", rate_interval: str = "1m"
) -> str:
    """Substitute the dashboard's variables the way Grafana does before querying."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__range", "1h")
        .replace("$namespace", namespace)
        .replace("$service", service)
    )


def dashboard_queries(namespace: str = "default", service: str = "demo") -> list[str]:
    return [to_promql(expr, namespace, service) for _, expr in dashboard_exprs()]
