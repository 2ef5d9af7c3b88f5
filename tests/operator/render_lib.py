"""What the operator's rendering tests share: the manifests, the samples, an owner, lookups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tandem.operator.children import Owner
from tandem.operator.spec import TandemServiceSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
CRD_FILE = MANIFESTS / "crd" / "tandemservices.tandem.dev.yaml"
K8S_VERSION = "1.32.0"
OWNER = Owner(name="demo", namespace="llm", uid="0b7e1b6c-1111-2222-3333-444455556666")


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def samples() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((MANIFESTS / "samples").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_docs(path):
            found.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return found


SAMPLES = samples()


def by_name(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in children}


def gpu_spec() -> TandemServiceSpec:
    doc = next(d for n, d in SAMPLES if n.startswith("gpu-pvc.yaml:TandemService"))
    return parse_spec(doc["spec"])
