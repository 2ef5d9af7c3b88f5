"""Live: the operator's planner drives the autoscaler over simulated workers.

`tandem up --simulate` (router + 1 prefill + 1 decode, simulated: the real router, scheduler,
KV events, metrics and connector protocol, the profiled step times) serves a closed-loop chat
load; kmock's Kubernetes emulator runs the real operator (`tandem operator`) with
`autoscaling.planner` on, the profile in a ConfigMap, metrics scraped directly from the
processes. The profile makes a prompt cost ~0.47 s of prefill, so the observed traffic keeps
one prefill worker ~90% busy: the plan for that rate needs two, while the reactive rules (TTFT
well under its target in a closed loop) would hold at one. Checked: starting replicas come from
the plan for the declared rate; the plan's floor scales prefill up with reason PlannerFloor, and
every decision explains the plan in status and Events.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from chat_load import ChatLoad
from kube_emulator import EmulatorThread
from local_process import LocalProcess, tandem_argv
from procs import AUTH, Proc, free_port, wait_for
from sim_profiles import synthetic_profile

from tandem.engine.sim.profile import ServingCost

REPO = Path(__file__).resolve().parents[2]
NS = "default"
NAME = "sim"
TSVC = f"/apis/tandem.dev/v1alpha1/namespaces/{NS}/tandemservices"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments"
# 20 ms per step + 15 ms per token: a ~30-token demo prompt is ~0.47 s of prefill.
PROFILE = synthetic_profile(execute=(0.02, 0.015, 0, 0, 0, 0, 0), transfer=(0.001, 1e-9),
                            num_blocks=512, serving=ServingCost(0.002, 0.001, 0.002))  # fmt: skip


class SimStack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cleanup = contextlib.ExitStack()
        self.emulator = EmulatorThread()
        self.kube = httpx.Client(timeout=10)
        self.cleanup.callback(self.kube.close)
        self.up_port = free_port()
        self.up_url = f"http://127.0.0.1:{self.up_port}"
        self.up_internal = free_port()
        self.operator: LocalProcess | None = None

    def start(self) -> dict[str, int]:
        PROFILE.save(self.tmp / "profile.json")
        up = Proc(["up", "--simulate", str(self.tmp / "profile.json"), "--prefill", "1",
                   "--decode", "1", "--kv-transport", "tcp", "--port", str(self.up_port),
                   "--internal-port", str(self.up_internal), "--log-dir", str(self.tmp)],
                  self.tmp, "up")  # fmt: skip
        self.cleanup.callback(up.stop, signal.SIGINT)
        self.emulator.start()
        self.cleanup.callback(self.emulator.stop)
        self.kube.base_url = httpx.URL(self.emulator.url)
        kubeconfig = self.tmp / "kubeconfig"
        kubeconfig.write_text(self.emulator.kubeconfig(NS))
        import yaml

        crd = yaml.safe_load((REPO / "manifests/crd/tandemservices.tandem.dev.yaml").read_text())
        self.kube.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                       json=crd).raise_for_status()  # fmt: skip
        self.operator = LocalProcess(
            tandem_argv(["operator", "--all-namespaces", "--standalone", "--resync-seconds", "1"]),
            self.tmp, "operator",
            {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(self.tmp)},
        )  # fmt: skip
        self.cleanup.callback(self.operator.stop)

        def workers() -> list[dict[str, Any]] | None:
            if not up.alive():
                raise RuntimeError(up.log_tail())
            try:
                url = f"http://127.0.0.1:{self.up_internal}/internal/workers"
                found = httpx.get(url, headers=AUTH, timeout=2).json()["workers"]
            except (httpx.HTTPError, ValueError):
                return None
            return found if len(found) == 2 else None

        wait_for(lambda: workers() is not None, 120, "simulated tandem up")
        ports = {w["role"]: int(w["url"].rsplit(":", 1)[1]) for w in workers() or []}
        return {"router": self.up_port, **ports}

    def get(self, path: str) -> dict[str, Any] | None:
        r = self.kube.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def set_ready(self, pool: str) -> None:
        d = self.get(f"{DEPLOY}/{NAME}-{pool}")
        assert d is not None
        n = d["spec"]["replicas"]
        status = {"observedGeneration": d["metadata"]["generation"], "replicas": n,
                  "readyReplicas": n, "availableReplicas": n, "updatedReplicas": n}  # fmt: skip
        self.kube.patch(f"{DEPLOY}/{NAME}-{pool}/status", content=json.dumps({"status": status}),
                        headers={"Content-Type": "application/merge-patch+json"},
                        ).raise_for_status()  # fmt: skip

    def status(self) -> dict[str, Any]:
        return (self.get(f"{TSVC}/{NAME}") or {}).get("status") or {}

    def events(self, reason: str) -> list[str]:
        items = (self.get(f"/api/v1/namespaces/{NS}/events") or {"items": []})["items"]
        return [e["message"] for e in items
                if e.get("reason") == reason and e["involvedObject"]["name"] == NAME]  # fmt: skip


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[SimStack]:
    s = SimStack(tmp_path)
    try:
        yield s
    finally:
        s.cleanup.close()


def pod(pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{NAME}-{pool}-0", "namespace": NS,
                     "labels": {"tandem.dev/service": NAME, "tandem.dev/pool": pool}},
        "spec": {"containers": [{"name": pool, "image": "local"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True",
                                   "lastTransitionTime": "2020-01-01T00:00:00Z"}]},
    }  # fmt: skip


def test_planner_floors_the_autoscaler_over_simulated_workers(stack: SimStack) -> None:
    ports = stack.start()
    stack.kube.post(f"/api/v1/namespaces/{NS}/configmaps", json={
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{NAME}-profile"},
        "data": {"profile.json": json.dumps(PROFILE.to_dict())},
    }).raise_for_status()  # fmt: skip
    for pool in ("router", "prefill", "decode"):
        stack.kube.post(f"/api/v1/namespaces/{NS}/pods", json=pod(pool)).raise_for_status()
    spec = {
        "model": {"name": "demo"},
        "router": {"port": ports["router"], "localPrefillThreshold": 0},
        "prefill": {"port": ports["prefill"]},
        "decode": {"port": ports["decode"]},
        "kvTransfer": {"transport": "tcp"},
        "workload": {"inputTokens": 30, "outputTokens": 16, "requestsPerSecond": 0.2},
        "autoscaling": {
            "enabled": True, "planner": True, "ttftSeconds": 3.0, "itlSeconds": 1.0,
            "prefill": {"minReplicas": 1, "maxReplicas": 3},
            "decode": {"minReplicas": 1, "maxReplicas": 3},
            "intervalSeconds": 5, "warmupSeconds": 0, "scaleDownCooldownSeconds": 600,
        },
    }  # fmt: skip
    body = {"apiVersion": "tandem.dev/v1alpha1", "kind": "TandemService",
            "metadata": {"name": NAME, "namespace": NS}, "spec": spec}  # fmt: skip
    stack.kube.post(TSVC, json=body).raise_for_status()
    log = stack.operator.log_tail if stack.operator else (lambda: "")

    def started() -> dict | None:
        planner = (stack.status().get("autoscaling") or {}).get("planner") or {}
        return planner if "startReplicas" in planner or "active" in planner else None

    try:
        wait_for(lambda: started() is not None, 90, "the planner's starting replicas")
        planner = started() or {}
        assert planner["active"] is True, planner
        # 0.2 requests/s of 30-token prompts: one prefill and one decode worker.
        assert planner["startReplicas"] == {"prefill": 1, "decode": 1}
        for pool in ("router", "prefill", "decode"):
            wait_for(lambda p=pool: stack.get(f"{DEPLOY}/{NAME}-{p}") is not None, 60, pool)
            stack.set_ready(pool)
        assert stack.get(f"{DEPLOY}/{NAME}-prefill")["spec"]["replicas"] == 1
        assert any("started from the plan for 0.2 req/s" in m for m in stack.events(
            "PlannedReplicas"))  # fmt: skip
        with ChatLoad(stack.up_url, concurrency=3) as load:
            wait_for(
                lambda: stack.get(f"{DEPLOY}/{NAME}-prefill")["spec"]["replicas"] >= 2,
                120, "the planner's floor to scale prefill", interval=0.5,
            )  # fmt: skip
            tally = load.snapshot()
    except TimeoutError as exc:
        status = json.dumps(stack.status().get("autoscaling"), indent=1)
        raise AssertionError(
            f"{exc}\n--- status ---\n{status}\n--- operator log ---\n{log()}"
        ) from exc
    assert tally.sent > 0 and tally.failed == 0, tally
    auto = stack.status()["autoscaling"]
    planner = auto["planner"]
    assert planner["active"] is True and planner["observedRate"] > 0.5, planner
    assert planner["floor"]["prefill"] >= 2
    last = auto["lastDecision"]
    assert (last["pool"], last["reason"], last["from"]) == ("prefill", "PlannerFloor", 1), last
    assert last["to"] == planner["floor"]["prefill"]
    assert "req/s" in last["message"] and "prefill floor" in last["message"]
    scaled = [m for m in stack.events("ScaledPool") if m.startswith("prefill: 1 -> ")]
    assert scaled and "(PlannerFloor)" in scaled[0] and "plan for " in scaled[0]
    # The decode pool was evaluated against its floor too, and says so.
    assert "decode floor" in auto["decode"]["lastEvaluation"]["message"]
