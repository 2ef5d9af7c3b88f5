"""A small async Kubernetes REST client for the children the operator manages.

Kopf watches and patches the TandemService itself; this client creates, patches, lists and
deletes the children and writes status. It is built once at operator startup (the startup
handler owns it and closes it at cleanup) from the same credentials Kopf logs in with.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

MERGE_PATCH = "application/merge-patch+json"
PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Deployment": "deployments",
    "Pod": "pods",
    "Event": "events",
    "TandemService": "tandemservices",
}


class KubeAPIError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {message}")
        self.status = status


def object_path(
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path of a collection (name None) or of one object."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = base + (f"/namespaces/{quote(namespace)}" if namespace else "") + f"/{PLURALS[kind]}"
    if name is not None:
        path += f"/{quote(name)}"
    if subresource is not None:
        path += f"/{subresource}"
    return path


def _ssl_context(info: kopf.ConnectionInfo, workdir: str) -> ssl.SSLContext | bool:
    if not info.server.startswith("https"):
        return False
    if info.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif info.ca_data:
        data = info.ca_data.encode() if isinstance(info.ca_data, str) else info.ca_data
        ctx = ssl.create_default_context(cadata=base64.b64decode(data).decode())
    else:
        ctx = ssl.create_default_context(cafile=info.ca_path and os.fsdecode(info.ca_path))

    def materialize(path: Any, data: str | bytes | None, name: str) -> str | None:
        if path:
            return os.fsdecode(path)
        if data:
            raw = base64.b64decode(data.encode() if isinstance(data, str) else data)
            file = os.path.join(workdir, name)
            with open(file, "wb") as f:
                f.write(raw)
            os.chmod(file, 0o600)
            return file
        return None

    cert = materialize(info.certificate_path, info.certificate_data, "client.crt")
    key = materialize(info.private_key_path, info.private_key_data, "client.key")
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class KubeClient:
    """Async JSON client over one aiohttp session; `login` re-supplies credentials on 401."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo]) -> None:
        self._login = login
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._workdir = tempfile.TemporaryDirectory(prefix="tandem-operator-")

    def _connect(self) -> aiohttp.ClientSession:
        info = self._login()
        self._server = info.server.rstrip("/")
        headers = {"Accept": "application/json", "User-Agent": "tandem-operator"}
        auth = None
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username and info.password:
            auth = aiohttp.BasicAuth(info.username, info.password)
        connector = aiohttp.TCPConnector(ssl=_ssl_context(info, self._workdir.name))
        return aiohttp.ClientSession(
            connector=connector,
            headers=headers,
            auth=auth,
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._workdir.cleanup()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        for attempt in range(2):
            if self._session is None:
                self._session = self._connect()
            async with self._session.request(
                method,
                self._server + path,
                json=body,
                params=params,
                headers={"Content-Type": content_type} if body is not None else None,
            ) as resp:
                if resp.status == 401 and attempt == 0:
                    # Service-account tokens rotate: log in again once.
                    await self._session.close()
                    self._session = None
                    continue
                if resp.status >= 400:
                    text = await resp.text()
                    raise KubeAPIError(resp.status, method, path, text[:500])
                return await resp.json(content_type=None)
        raise AssertionError("unreachable")

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except KubeAPIError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, path: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        result = await self.request("GET", path, params=params)
        return list(result.get("items") or [])

    async def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, dict(body))

    async def merge_patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, dict(body), content_type=MERGE_PATCH)

    async def delete(self, path: str) -> bool:
        """Delete one object (background propagation); False if it was already gone."""
        try:
            await self.request(
                "DELETE",
                path,
                {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except KubeAPIError as exc:
            if exc.status == 404:
                return False
            raise
        return True
