"""The cluster token of one TandemService: a Secret the operator creates once and never rewrites.

``ensure_cluster_token`` runs before every apply pass: it creates ``<name>-cluster-token``
(owned by the TandemService, so deletion cascades) holding 256 random bits when it does not
exist, and otherwise leaves it alone, so an administrator can rotate it in place (docs/security.md:
add the new token as a second line, then swap, then drop the old one; pods re-read the mounted
file). The token never leaves this module except inside that Secret: no rendered Deployment,
ConfigMap, status, Event or log line carries it; API errors about the Secret are reported
without the server's text, which could echo the object.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping
from typing import Any

from tandem.operator.kube import KubeAPIError, KubeClient, object_path

TOKEN_KEY = "token"
TOKEN_DIR = "/etc/tandem/cluster-token"
TOKEN_PATH = f"{TOKEN_DIR}/{TOKEN_KEY}"
MIN_TOKEN_CHARS = 16  # as the components require (engine/cluster_token.py)


class ClusterTokenProblem(RuntimeError):
    """The Secret exists but is not usable, or could not be created; the message is safe."""


def secret_name(owner_name: str) -> str:
    return f"{owner_name}-cluster-token"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def render_secret(metadata: Mapping[str, Any], token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": dict(metadata),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def usable(secret: Mapping[str, Any]) -> bool:
    """Whether the Secret holds a token the components will accept (its first line)."""
    raw = (secret.get("data") or {}).get(TOKEN_KEY)
    if not isinstance(raw, str):
        return False
    try:
        text = base64.b64decode(raw, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return False
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return bool(lines) and all(len(line) >= MIN_TOKEN_CHARS for line in lines)


def _owned_by(secret: Mapping[str, Any], uid: str) -> bool:
    refs = secret.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


async def ensure_cluster_token(
    client: KubeClient, metadata: Mapping[str, Any], owner_uid: str
) -> bool:
    """Create the Secret if missing; True when this call created it. Raises
    ClusterTokenProblem when one exists that another owner controls or that holds no token."""
    name, namespace = metadata["name"], metadata["namespace"]
    path = object_path("v1", "Secret", namespace, name)
    try:
        live = await client.get(path)
        if live is None:
            try:
                await client.create(
                    object_path("v1", "Secret", namespace), render_secret(metadata, new_token())
                )
                return True
            except KubeAPIError as exc:
                if exc.status != 409:
                    raise
                live = await client.get(path)  # created concurrently by another pass
                if live is None:
                    raise
    except KubeAPIError as exc:
        raise ClusterTokenProblem(
            f"could not create or read Secret {name} (HTTP {exc.status})"
        ) from None
    if not _owned_by(live, owner_uid):
        raise ClusterTokenProblem(
            f"Secret {name} exists but is not owned by this TandemService; delete or rename it"
        )
    if not usable(live):
        raise ClusterTokenProblem(
            f"Secret {name} has no usable '{TOKEN_KEY}' (one token of >= {MIN_TOKEN_CHARS} "
            "characters per line); delete it and the operator makes a new one"
        )
    return False


async def delete_cluster_token(
    client: KubeClient, namespace: str, owner_name: str, owner_uid: str
) -> bool:
    """Delete the Secret if this TandemService owns it (the garbage collector would too)."""
    path = object_path("v1", "Secret", namespace, secret_name(owner_name))
    live = await client.get(path)
    if live is None or not _owned_by(live, owner_uid):
        return False
    return await client.delete(path)
