"""A kmock Kubernetes emulator with the three things a real API server does that kmock lacks.

1. Every write stamps metadata.resourceVersion (global counter), and a create also uid,
   creationTimestamp and generation 1; generation grows only when .spec changes.
2. A JSON-patch whose `test` fails (or that cannot apply) answers 422, not 500, so Kopf's
   optimistic finalizer patches retry instead of looping on server errors.
3. Creating a CustomResourceDefinition serves its resource (kind, singular, short names,
   namespaced, subresources), as the API server does once the CRD is established.

It also keeps status-subresource writes to .status (as a real server does), and strips
strategic-merge directives (`$setElementOrder/...`) that kubectl sends for built-in kinds.
`EmulatorThread` serves it over loopback HTTP from a background thread so that tests can
drive it with kubectl and a separate operator process.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import aiohttp.web
import jsonpatch
import jsonpointer
import kmock
from kmock._internal.dicts import merge_patch_dict


def _strip_directives(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _strip_directives(v) for k, v in value.items() if not str(k).startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


class StampingEmulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1000)
        self.resources.load_bundled()

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _register_crd(self, crd: Mapping[str, Any]) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            resource = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[resource] = kmock.ResourceInfo(
                kind=names.get("kind"),
                singular=names.get("singular"),
                namespaced=spec.get("scope") == "Namespaced",
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])),
                subresources=set(version.get("subresources", {})),
            )

    def _stamp(self, request: kmock.Request) -> None:
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            data = _strip_directives(data)
            meta = data.setdefault("metadata", {})
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta["uid"] = str(uuid.uuid4())
            meta["resourceVersion"] = str(next(self._versions))
            meta["generation"] = 1
            now = datetime.datetime.now(tz=datetime.UTC).replace(microsecond=0)
            meta["creationTimestamp"] = now.isoformat().replace("+00:00", "Z")
            if data.get("kind") == "CustomResourceDefinition":
                self._register_crd(data)
        elif request.action == kmock.action.UPDATE and request.name is not None:
            current = self._current(request)
            if current is None:
                return  # kmock answers 404
            if isinstance(data, list):
                try:
                    patched = jsonpatch.apply_patch(current, data, in_place=False)
                except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                    raise kmock.KubernetesError(
                        status=422, reason="Invalid", message=f"json patch failed: {exc}"
                    ) from exc
                # Kubernetes replaces the object with the patched one; so does this.
                patch = self._full_replacement(current, patched)
            else:
                patch = _strip_directives(data)
                if request.subresource == "status":
                    patch = {"status": patch["status"]} if "status" in patch else {}
                patched = merge_patch_dict(current, patch)
            meta_patch = patch.setdefault("metadata", {}) or {}
            patch["metadata"] = meta_patch
            meta_patch["resourceVersion"] = str(next(self._versions))
            if patched.get("spec") != current.get("spec"):
                meta_patch["generation"] = int(current["metadata"].get("generation", 1)) + 1
            data = patch
        object.__setattr__(request, "data", data)

    @staticmethod
    def _full_replacement(current: dict[str, Any], patched: dict[str, Any]) -> dict[str, Any]:
        """A merge patch that turns `current` into `patched` exactly."""

        def diff(a: Any, b: Any) -> Any:
            if isinstance(a, dict) and isinstance(b, dict):
                out = {k: None for k in a if k not in b}
                for k, v in b.items():
                    if k not in a or a[k] != v:
                        out[k] = diff(a.get(k), v)
                return out
            return b

        return diff(current, patched)

    async def _serve_version(self, request: kmock.Request) -> Any:
        # kmock repeats names on subresources ("services/status"), which confuses kubectl's
        # short names; the API server lists them on the main resource only...
        result = dict(await super()._serve_version(request))
        # ...and calls the core group version "/v1" instead of "v1".
        result["groupVersion"] = result["groupVersion"].lstrip("/")
        result["resources"] = [
            {**r, "singularName": "", "shortNames": [], "categories": []} if "/" in r["name"] else r
            for r in result.get("resources", [])
        ]
        return result

    async def _serve_list(self, request: kmock.Request) -> Any:
        # kubectl decodes lists by their kind; kmock leaves apiVersion and kind out.
        result = dict(await super()._serve_list(request))
        resource = request.resource
        assert resource is not None
        info = self.resources[resource]
        group_version = f"{resource.group}/{resource.version}" if resource.group else "v1"
        kind = info.kind or "List"
        result.setdefault("apiVersion", group_version)
        result.setdefault("kind", f"{kind}List")
        result["metadata"] = {"resourceVersion": str(next(self._versions))}
        return result

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None:
            async with self._lock:
                self._stamp(request)
        return await super()._handle(request)


class EmulatorThread:
    """Runs a StampingEmulator on 127.0.0.1 in its own event loop and thread.

    The test thread only talks to it over HTTP (kubectl, httpx, the operator process).
    """

    def __init__(self) -> None:
        self.url = ""
        self.emulator: StampingEmulator | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced to the test thread in start()
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with StampingEmulator() as emulator, kmock.Server(emulator) as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"emulator did not start: {self._error!r}")

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def kubeconfig(self, namespace: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": "test-token"}}],
                "contexts": [
                    {
                        "name": "kmock",
                        "context": {"cluster": "kmock", "user": "tester", "namespace": namespace},
                    }
                ],
                "current-context": "kmock",
            }
        )

    def requests(self) -> list[tuple[str, str, str]]:
        """(method, path with query, User-Agent) of every request served so far."""
        assert self.emulator is not None
        future = asyncio.run_coroutine_threadsafe(self._requests(), self._loop)
        return future.result(10)

    async def _requests(self) -> list[tuple[str, str, str]]:
        assert self.emulator is not None
        return [
            (str(r.method.value), str(r.url.path_qs), r.headers.get("User-Agent", ""))
            for r in list(self.emulator)
        ]
