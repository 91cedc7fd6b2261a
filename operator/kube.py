"""The operator's own Kubernetes API calls: a small async client, and the table of every
call it may make.

kopf watches the resources and patches them; everything else the operator does to the API
(the engine objects, the scale subresource) goes through `KubeApi`, which refuses any call
that `PERMISSIONS` does not list. The Helm chart's RBAC rules are checked against that
table, so the table, not a hand-kept list, says what the operator needs.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Kind:
    group: str  # "" for the core API
    version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


DEPLOYMENTS = Kind("apps", "v1", "deployments")
SERVICES = Kind("", "v1", "services")
PDBS = Kind("policy", "v1", "poddisruptionbudgets")
INFERENCE_DEPLOYMENTS = Kind("pagefleet.io", "v1alpha1", "inferencedeployments")
KINDS_BY_API_KIND = {"Deployment": DEPLOYMENTS, "Service": SERVICES, "PodDisruptionBudget": PDBS}

# Every (group, resource) the operator touches and the verbs it uses: KubeApi's own calls,
# and kopf's (watching and patching the resources, posting events). The chart's RBAC must
# grant all of these (tests/charts checks it).
PERMISSIONS: dict[tuple[str, str], frozenset[str]] = {
    ("pagefleet.io", "inferencedeployments"): frozenset({"list", "watch", "patch"}),  # kopf
    ("pagefleet.io", "inferencedeployments/status"): frozenset({"patch"}),  # kopf, writing our status
    ("pagefleet.io", "inferencedeployments/scale"): frozenset({"patch"}),  # the autoscaler
    ("apps", "deployments"): frozenset({"get", "create", "patch", "delete"}),  # delete: a pool layout given up
    ("", "services"): frozenset({"get", "create", "patch"}),
    ("policy", "poddisruptionbudgets"): frozenset({"get", "create", "patch"}),
    ("", "events"): frozenset({"create"}),  # kopf.event, kopf.info, kopf.warn
}


class ApiError(Exception):
    """A Kubernetes API call failed; `status` is the HTTP status (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status

    @property
    def is_transient(self) -> bool:
        return self.status == 0 or self.status == 409 or self.status == 429 or self.status >= 500


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context(
        cafile=info.ca_path,  # type: ignore[arg-type]
        cadata=info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data,
    )
    if info.certificate_path and info.private_key_path:
        context.load_cert_chain(info.certificate_path, info.private_key_path)  # type: ignore[arg-type]
    return context


class KubeApi:
    """Get, create and merge-patch namespaced objects; nothing outside PERMISSIONS."""

    def __init__(self, login: Callable[[], kopf.ConnectionInfo | None]) -> None:
        self._login = login
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._closed = False  # after close(), no call opens a new session (operator shutdown)

    def _open(self) -> aiohttp.ClientSession:
        info = self._login()
        if info is None:
            raise ApiError(0, "no Kubernetes credentials (no service account, no kubeconfig)")
        headers = {"Accept": "application/json", "User-Agent": "pagefleet-operator"}
        auth = None
        if info.token:
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username and info.password:
            auth = aiohttp.BasicAuth(info.username, info.password)
        self._server = info.server.rstrip("/")
        connector = aiohttp.TCPConnector(ssl=_ssl_context(info) if info.server.startswith("https") else False)
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=5)
        return aiohttp.ClientSession(headers=headers, auth=auth, connector=connector, timeout=timeout)

    async def close(self) -> None:
        self._closed = True
        await self._drop_session()

    async def _drop_session(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, verb: str, kind: Kind, path: str, sub: str | None, body: Any = None) -> Any:
        resource = kind.plural + (f"/{sub}" if sub else "")
        if verb not in PERMISSIONS.get((kind.group, resource), frozenset()):
            raise AssertionError(f"{verb} {kind.group}/{resource} is not in kube.PERMISSIONS (nor in the RBAC)")
        if self._closed:
            raise ApiError(0, "the operator is shutting down")
        if self._session is None:
            self._session = self._open()
        headers = {"Content-Type": "application/merge-patch+json" if method == "PATCH" else "application/json"}
        try:
            async with self._session.request(method, self._server + path, data=json.dumps(body), headers=headers) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(0, f"{method} {path}: {exc!r}") from exc
        if r.status == 401:
            await self._drop_session()  # a rotated service-account token: log in again next time
        if r.status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except ValueError:
                message = text
            raise ApiError(r.status, f"{method} {path}: {message}")
        return json.loads(text) if text else None

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None if it does not exist."""
        try:
            return await self._call("GET", "get", kind, kind.path(namespace, name), None)  # type: ignore[no-any-return]
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", "create", kind, kind.path(namespace), None, body)  # type: ignore[no-any-return]

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete the object (its dependents in the background); a missing one is fine."""
        try:
            await self._call(
                "DELETE", "delete", kind, kind.path(namespace, name), None, {"propagationPolicy": "Background"}
            )
        except ApiError as error:
            if error.status != 404:
                raise

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any], sub: str | None = None
    ) -> dict[str, Any]:
        return await self._call("PATCH", "patch", kind, kind.path(namespace, name, sub), sub, body)  # type: ignore[no-any-return]
