"""An asyncio Kubernetes API client for plain dicts: GET, create and merge-patch by path.

The operator's handlers run on kopf's event loop, so its API calls must not block it. The
kubernetes package's ``Configuration`` still says where the API server is and who we are (its
loaders read in-cluster service accounts and kubeconfig files); the requests go through one
aiohttp session. The bearer token is asked of the configuration on every request, so its
refresh hook (in-cluster: the rotated service-account token) keeps working. A refused request
raises ``kubernetes.client.exceptions.ApiException`` with the server's status and body, as the
synchronous client did.
"""

from __future__ import annotations

import json
import ssl
from typing import Any

import aiohttp
import kubernetes.client
from kubernetes.client.exceptions import ApiException
from kubernetes.client.rest import should_bypass_proxies

MERGE_PATCH = "application/merge-patch+json"
# No answer within this is an error (kopf or the healer retries); an API server that accepted
# the connection and then went silent must not hold a handler forever.
REQUEST_TIMEOUT_S = 60.0


def object_path(api_version: str, plural: str, namespace: str, name: str = "") -> str:
    """The REST path of a namespaced object (or of its collection, without ``name``)."""
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


def _ssl_context(configuration: kubernetes.client.Configuration) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, keyfile=configuration.key_file)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class KubeApi:
    """Requests to one API server as one identity; objects in and out are JSON dicts."""

    def __init__(self, configuration: kubernetes.client.Configuration, *, user_agent: str) -> None:
        self._configuration = configuration
        self._host = configuration.host.rstrip("/")
        self._user_agent = user_agent
        self._ssl = _ssl_context(configuration) if self._host.startswith("https:") else None
        # The proxy the synchronous client would use (kubeconfig's proxy-url or the environment's).
        bypass = should_bypass_proxies(configuration.host, configuration.no_proxy or "")
        self._proxy = configuration.proxy if configuration.proxy and not bypass else None
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use: a session belongs to the loop it was made on (kopf's).
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(self, path: str) -> dict[str, Any]:
        return await self._request("GET", path)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", path, body)

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self._request("PATCH", path, patch, content_type=MERGE_PATCH)

    async def delete(self, path: str, *, uid: str) -> dict[str, Any]:
        """Delete the object at ``path`` if it is still the one with ``uid`` (409 otherwise)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        return await self._request("DELETE", path, body)

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        bearer = self._configuration.auth_settings().get("BearerToken")
        if bearer is not None and bearer["value"]:
            headers["Authorization"] = bearer["value"]
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        async with self._client().request(
            method,
            self._host + path,
            data=data,
            headers=headers,
            ssl=self._ssl if self._ssl is not None else True,
            server_hostname=self._configuration.tls_server_name or None,
            proxy=self._proxy,
            proxy_headers=self._configuration.proxy_headers if self._proxy else None,
        ) as response:
            text = await response.text()
            if not 200 <= response.status < 300:
                error = ApiException(status=response.status, reason=response.reason)
                error.body = text
                error.headers = response.headers
                raise error
        return dict(json.loads(text)) if text else {}


def api_message(error: ApiException) -> str:
    """The message the API server gave for refusing a request, else its HTTP reason."""
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except ValueError:
        return str(error.reason)
