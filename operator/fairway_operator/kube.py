"""The few Kubernetes API calls the reconciler makes, as plain dicts, off the event loop.

Built on the official (synchronous) ``kubernetes`` client, each call run in a worker thread.
Errors are sorted for the handlers: ``TransientApiError`` (5xx, 429, 409, timeouts, connection
trouble, and 401/403 that an RBAC fix cures: retry with backoff) and ``PermanentApiError``
(other 4xx: the request itself is wrong, retrying cannot help).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import kubernetes.client
import urllib3
from kubernetes.client.exceptions import ApiException

GROUP = "fairway.dev"
VERSION = "v1alpha1"
PLURAL = "tenantpolicies"
KIND = "TenantPolicy"
COMPONENT = "fairway-operator"
MAX_EVENT_MESSAGE = 1024
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    """A Kubernetes API call failed."""


class TransientApiError(ApiError):
    """Worth retrying: the API server is busy, unreachable or slow, or access is not granted
    yet."""


class PermanentApiError(ApiError):
    """The API refused the request as such (a 4xx other than 401/403/404/409/429)."""


class Kube:
    """Reads and writes of the reconciler. ``configuration`` says how to reach the API server
    (``kubernetes.client.Configuration``, e.g. in-cluster or from a kubeconfig)."""

    def __init__(self, configuration: kubernetes.client.Configuration, timeout: float = 10.0):
        self._client = kubernetes.client.ApiClient(configuration)
        self._core = kubernetes.client.CoreV1Api(self._client)
        self._custom = kubernetes.client.CustomObjectsApi(self._client)
        self._timeout = timeout

    def close(self) -> None:
        self._client.close()

    async def list_policies(self, namespace: str) -> list[dict]:
        listing = await self._call(f"list TenantPolicies in {namespace}",
                                   self._custom.list_namespaced_custom_object,
                                   GROUP, VERSION, namespace, PLURAL)
        return list(listing.get("items") or [])

    async def get_configmap(self, namespace: str, name: str) -> dict | None:
        """The ConfigMap, or None when it does not exist."""
        return await self._call(f"read ConfigMap {namespace}/{name}",
                                self._core.read_namespaced_config_map, name, namespace,
                                missing_ok=True)

    async def get_secret(self, namespace: str, name: str) -> dict | None:
        """The Secret, or None when it does not exist."""
        return await self._call(f"read Secret {namespace}/{name}",
                                self._core.read_namespaced_secret, name, namespace,
                                missing_ok=True)

    async def create_configmap(self, namespace: str, body: dict) -> None:
        await self._call(f"create ConfigMap {namespace}/{body['metadata']['name']}",
                         self._core.create_namespaced_config_map, namespace, body)

    async def patch_configmap(self, namespace: str, name: str, patch: dict) -> None:
        await self._call(f"patch ConfigMap {namespace}/{name}",
                         self._core.patch_namespaced_config_map, name, namespace, patch,
                         _content_type=MERGE_PATCH)

    async def patch_policy_status(self, namespace: str, name: str, status: dict) -> None:
        """Merge ``status`` into the policy's status; a policy gone meanwhile is no error."""
        await self._call(f"patch the status of TenantPolicy {namespace}/{name}",
                         self._custom.patch_namespaced_custom_object_status,
                         GROUP, VERSION, namespace, PLURAL, name, {"status": status},
                         _content_type=MERGE_PATCH, missing_ok=True)

    async def post_event(self, namespace: str, obj: Mapping[str, Any], kind: str, reason: str,
                         message: str) -> None:
        """A core/v1 Event of ``kind`` (Normal, Warning) about the TenantPolicy ``obj``."""
        meta = obj.get("metadata") or {}
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name')}.", "namespace": namespace},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                               "name": meta.get("name"), "namespace": namespace,
                               "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": kind, "reason": reason, "message": message[:MAX_EVENT_MESSAGE],
            "source": {"component": COMPONENT}, "reportingComponent": COMPONENT,
            "reportingInstance": socket.gethostname(),
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        await self._call(f"post an Event about TenantPolicy {namespace}/{meta.get('name')}",
                         self._core.create_namespaced_event, namespace, body)

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any,
                    missing_ok: bool = False, **kwargs: Any) -> Any:
        def call() -> Any:
            response = fn(*args, _preload_content=False, _request_timeout=self._timeout,
                          **kwargs)
            data = response.data
            return json.loads(data) if data else None

        try:
            return await asyncio.to_thread(call)
        except ApiException as exc:
            if exc.status == 404 and missing_ok:
                return None
            raise classify(what, exc.status, exc.reason) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientApiError(f"cannot {what}: {exc}") from None


def classify(what: str, status: int | None, reason: str | None) -> ApiError:
    """The error for an API answer of HTTP ``status``."""
    text = f"cannot {what}: HTTP {status} {reason or ''}".rstrip()
    if status is None or status >= 500 or status in (401, 403, 404, 409, 429):
        return TransientApiError(text)
    return PermanentApiError(text)
