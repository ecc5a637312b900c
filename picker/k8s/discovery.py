"""The pool's endpoints from its InferencePool and the Pods it selects.

It answers: *which model servers may get requests now?* ``PoolDiscovery`` lists and watches the
InferencePool ``inference.networking.k8s.io/v1`` ``namespace/name`` and the Pods of that namespace
(``picker.k8s.client.Reflector``: aiohttp, re-list on 410 or on errors with backoff). The Pods are
watched namespace-wide and matched to the pool's selector here, so a selector change needs no new
watch (and kmock, which ignores label selectors, behaves like a real API server). Endpoints are
``endpoints_of(pool, pods)``: every Ready pod's IP × every target port. The list is published to
``publish`` once both collections have been listed, and again whenever it changes.

``synced`` (and ``on_synced`` when it changes) says whether the pool is known: both collections
listed and the InferencePool found. Upstream's picker is not ready before that, nor after its pool
is deleted; the picker's readiness follows it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from picker.k8s.client import KubeClient, Reflector, name_of

log = logging.getLogger(__name__)

POOL_API = "/apis/inference.networking.k8s.io/v1"


def _match_labels(selector: Any) -> dict[str, str]:
    """``spec.selector``: v1 is ``{matchLabels: {...}}``; v1alpha2 was the map itself."""
    if not isinstance(selector, Mapping):
        return {}
    labels = selector.get("matchLabels") if "matchLabels" in selector else selector
    if not isinstance(labels, Mapping):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


def _target_ports(spec: Mapping[str, Any]) -> list[int]:
    """``spec.targetPorts[].number`` (v1), else ``spec.targetPortNumber`` (v1alpha2)."""
    ports = []
    for entry in spec.get("targetPorts") or []:
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if isinstance(number, int) and not isinstance(number, bool) and 1 <= number <= 65535:
            ports.append(number)
    legacy = spec.get("targetPortNumber")
    if not ports and isinstance(legacy, int) and 1 <= legacy <= 65535:
        ports.append(legacy)
    return list(dict.fromkeys(ports))


def is_serving(pod: Mapping[str, Any]) -> bool:
    """Ready (condition ``Ready`` is ``"True"``), not terminating, and with an IP."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def address(ip: str, port: int) -> str:
    """``ip:port``, IPv6 in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def endpoints_of(pool: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """The sorted ``ip:port`` endpoints of ``pool``: each serving pod the selector matches, once
    per target port. No pool, an empty selector or no target port: no endpoints."""
    spec = (pool or {}).get("spec") or {}
    selector = _match_labels(spec.get("selector"))
    ports = _target_ports(spec)
    if not selector or not ports:
        return []
    found: set[str] = set()
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if all(labels.get(k) == v for k, v in selector.items()) and is_serving(pod):
            ip = str(pod["status"]["podIP"])
            found.update(address(ip, port) for port in ports)
    return sorted(found)


def _slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """What ``endpoints_of`` reads, so a busy namespace costs little memory."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return {"metadata": {"name": metadata.get("name"), "labels": metadata.get("labels") or {},
                         "deletionTimestamp": metadata.get("deletionTimestamp")},
            "status": {"podIP": status.get("podIP"),
                       "conditions": [{"type": c.get("type"), "status": c.get("status")}
                                      for c in status.get("conditions") or []
                                      if isinstance(c, Mapping)]}}


class PoolDiscovery:
    """Publishes the endpoints of InferencePool ``namespace/pool_name`` to ``publish`` whenever
    they change (a list of ``ip:port``, possibly empty when the pool or its pods are gone).

    ``endpoints`` is the last list published (None before the first); ``ready`` is set then.
    ``synced``: both collections listed and the pool exists; ``on_synced(synced)`` is called
    each time that changes.
    """

    def __init__(self, client: KubeClient, namespace: str, pool_name: str,
                 publish: Callable[[list[str]], None], *, retry_min: float = 0.5,
                 retry_max: float = 10.0, watch_timeout: float = 300.0,
                 on_synced: Callable[[bool], None] | None = None) -> None:
        self.namespace = namespace
        self.pool_name = pool_name
        self.publish = publish
        self.on_synced = on_synced
        self.synced = False
        self.endpoints: list[str] | None = None
        self.ready = asyncio.Event()
        options: dict[str, Any] = {"retry_min": retry_min, "retry_max": retry_max,
                                   "watch_timeout": watch_timeout}
        self.pools = Reflector(client, f"{POOL_API}/namespaces/{namespace}/inferencepools",
                               self._changed, params={"fieldSelector":
                                                      f"metadata.name={pool_name}"},
                               keep=lambda obj: name_of(obj) == pool_name, **options)
        self.pods = Reflector(client, f"/api/v1/namespaces/{namespace}/pods", self._changed,
                              transform=_slim_pod, **options)
        self._pool_missing_logged = False

    def _changed(self, _objects: object = None) -> None:
        if not (self.pools.synced and self.pods.synced):
            return
        pool = self.pools.objects.get(self.pool_name)
        if pool is None and not self._pool_missing_logged:
            log.warning("InferencePool %s/%s not found: no endpoints", self.namespace,
                        self.pool_name)
        self._pool_missing_logged = pool is None
        endpoints = endpoints_of(pool, self.pods.objects.values())
        if endpoints != self.endpoints:
            log.info("InferencePool %s/%s endpoints: %s", self.namespace, self.pool_name,
                     ", ".join(endpoints) or "none")
            try:
                self.publish(list(endpoints))
            except Exception:  # published again at the next change
                log.exception("publishing the endpoints of InferencePool %s/%s failed",
                              self.namespace, self.pool_name)
                return
            self.endpoints = endpoints
            self.ready.set()
        # After publishing: ready only once the endpoints are in.
        self._set_synced(pool is not None)

    def _set_synced(self, synced: bool) -> None:
        if synced == self.synced:
            return
        self.synced = synced
        if self.on_synced is not None:
            try:
                self.on_synced(synced)
            except Exception:
                log.exception("reporting the sync of InferencePool %s/%s failed",
                              self.namespace, self.pool_name)

    async def run(self, stop: asyncio.Event) -> None:
        """Watch until ``stop`` is set."""
        await asyncio.gather(self.pools.run(stop), self.pods.run(stop))
