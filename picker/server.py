"""``python -m picker serve``: the picker process, wired together.

ext_proc and gRPC health on one port, Prometheus metrics on another, the read-only admin API
(``fairway.v1.Admin``, with its own gRPC health) on a third, the endpoint scraper, the config
watcher and the admin API's service sampler as background tasks. SIGTERM drains: ext_proc health
turns NOT_SERVING, queued requests are refused with a retryable 503, running requests get
``--grace`` seconds to finish; the admin API answers until the drain is over.

In a cluster (``picker.k8s``) the config comes from a ConfigMap watched through the API, the
endpoints from an InferencePool's ready pods, and with a Lease only the elected leader reports
SERVING and takes requests (a standby refuses them with a retryable 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from picker.admin.service import ADMIN_SERVICE, AdminService
from picker.admin.v1 import admin_pb2_grpc
from picker.config.reload import ConfigWatcher
from picker.config.schema import PickerConfig, load_config
from picker.dispatch import Dispatcher
from picker.extproc import ExternalProcessor, add_to_server
from picker.k8s import (
    ApiError,
    ConfigMapWatcher,
    KubeClient,
    LeaderElector,
    LiveConfig,
    PoolDiscovery,
    fetch_config,
)
from picker.metrics import PickerMetrics
from picker.scrape import Scraper

log = logging.getLogger("picker")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True)
class ServeSettings:
    """Process settings: flags, not config."""

    config_path: Path | None = None
    """The picker config (YAML); watched and hot-reloaded. Unused with ``config_map``."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    grpc_port: int = 9002
    """ext_proc and gRPC health (0: any free port)."""
    metrics_port: int = 9090
    """Prometheus ``/metrics`` (0: any free port)."""
    admin_port: int = 9003
    """The admin API (``fairway.v1.Admin``) and its gRPC health (0: any free port). Read-only, on
    its own port so that the gateway's port does not expose it."""
    grace: float = 10.0
    """Seconds running requests get to finish after SIGTERM."""
    reload_interval: float = 1.0
    """How often the config file is checked for changes."""
    meter_claim_timeout: float = 10.0
    """Seconds a request routed with a meter-stream gateway waits for that stream to open (it
    opens at dispatch) before it is settled as gone; only a misconfigured gateway hits this."""
    config_map: str | None = None
    """``namespace/name`` of a ConfigMap whose ``picker.yaml`` is the config, watched through the
    Kubernetes API (changes apply within seconds)."""
    pool: str | None = None
    """``namespace/name`` of the InferencePool whose ready pods are the endpoints (they replace
    the config's static ones)."""
    lease: str | None = None
    """``namespace/name`` of a coordination.k8s.io Lease: leader election among replicas; only
    the leader serves. Unset: no election, this picker serves."""
    identity: str | None = None
    """This replica's name in the Lease; unset: ``$POD_NAME``, else hostname and pid."""
    lease_duration: float = 15.0
    """Seconds a leader's Lease lasts without renewal (a standby takes over about this long after
    the leader dies; renewed every third of it)."""
    kube_server: str | None = None
    """Kubernetes API URL; unset: in-cluster service account, else kubeconfig."""

    @property
    def uses_kubernetes(self) -> bool:
        return bool(self.config_map or self.pool or self.lease)


class _Runner(Protocol):
    async def run(self, stop: asyncio.Event) -> None: ...


def _split(reference: str, what: str) -> tuple[str, str]:
    namespace, _, name = reference.partition("/")
    if not namespace or not name:
        raise ValueError(f"{what} must be namespace/name, got {reference!r}")
    return namespace, name

async def serve(settings: ServeSettings, stop: asyncio.Event | None = None,
                ready: asyncio.Future[tuple[int, int]] | None = None,
                admin_ready: asyncio.Future[int] | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None).

    Once serving, ``admin_ready`` gets the admin API's port, then ``ready`` gets
    ``(grpc_port, metrics_port)`` (the ports bound, useful with port 0).
    """
    client = KubeClient.from_environment(settings.kube_server) \
        if settings.uses_kubernetes else None
    try:
        await _serve(settings, client, stop, ready, admin_ready)
    finally:
        if client is not None:
            await client.close()


CONFIG_MAP_WAIT = (0.5, 10.0)
"""Seconds between reads of a ConfigMap that does not exist yet: first, and at most."""


async def _initial_config(settings: ServeSettings, client: KubeClient | None,
                          stop: asyncio.Event) -> PickerConfig | None:
    """The config to start with; None when ``stop`` came first.

    A ConfigMap that does not exist yet is waited for (on first install the operator writes it a
    few seconds after the picker starts): exiting instead would put the pod in a restart backoff.
    """
    if not settings.config_map:
        if settings.config_path is None:
            raise ValueError("a config file or a ConfigMap is needed")
        return load_config(settings.config_path)
    assert client is not None
    namespace, name = _split(settings.config_map, "--config-map")
    delay = CONFIG_MAP_WAIT[0]
    while True:
        try:
            return await fetch_config(client, namespace, name)
        except ApiError as error:
            if error.code != 404:
                raise
        log.info("waiting for ConfigMap %s/%s (the operator writes it)", namespace, name)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return None
        delay = min(delay * 2, CONFIG_MAP_WAIT[1])


def _sources(settings: ServeSettings, client: KubeClient | None, live: LiveConfig,
             metrics: PickerMetrics) -> list[_Runner]:
    """What keeps the config and the endpoints current: each has ``run(stop)``."""
    def count(result: str) -> None:
        metrics.config_reloads.labels(result).inc()

    sources: list[_Runner] = []
    if settings.config_map:
        assert client is not None
        namespace, name = _split(settings.config_map, "--config-map")
        sources.append(ConfigMapWatcher(client, namespace, name, live.set_config, count))
    else:
        assert settings.config_path is not None
        sources.append(ConfigWatcher(settings.config_path, live.set_config, count,
                                     interval=settings.reload_interval))
    if settings.pool:
        assert client is not None
        sources.append(PoolDiscovery(client, *_split(settings.pool, "--pool"),
                                     live.set_endpoints))
    return sources


async def _serve(settings: ServeSettings, client: KubeClient | None,
                 stop: asyncio.Event | None, ready: asyncio.Future[tuple[int, int]] | None,
                 admin_ready: asyncio.Future[int] | None) -> None:
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    config = await _initial_config(settings, client, stop)
    if config is None:
        return
    metrics = PickerMetrics()
    dispatcher = Dispatcher(config, metrics=metrics)
    live = LiveConfig(dispatcher.apply_config, config)

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_to_server(ExternalProcessor(dispatcher, lambda: dispatcher.config,
                                    settings.meter_claim_timeout), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    grpc_port = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    admin = AdminService(dispatcher)
    admin_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    admin_pb2_grpc.add_AdminServicer_to_server(admin, admin_server)
    admin_health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(admin_health, admin_server)
    admin_port = admin_server.add_insecure_port(f"{settings.host}:{settings.admin_port}")
    http_server, http_thread = start_http_server(settings.metrics_port, addr=settings.host,
                                                 registry=metrics.registry)
    metrics_port = http_server.server_port
    await server.start()
    await admin_server.start()

    async def set_serving(serving: bool) -> None:
        dispatcher.standby = not serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", EXT_PROC_SERVICE):
            await health.set(service, status)

    elector = None
    if settings.lease:
        assert client is not None

        changes: set[asyncio.Task[None]] = set()

        def on_leading(leading: bool) -> None:
            log.info("leadership %s", "acquired: serving" if leading else "lost: standing by")
            task = asyncio.get_running_loop().create_task(set_serving(leading))
            changes.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(changes.discard)

        elector = LeaderElector(client, *_split(settings.lease, "--lease"), on_leading,
                                identity=settings.identity,
                                lease_duration=settings.lease_duration,
                                retry_period=settings.lease_duration / 3)
    await set_serving(elector is None)
    for service in ("", ADMIN_SERVICE):
        await admin_health.set(service, health_pb2.HealthCheckResponse.SERVING)

    runners: list[_Runner] = [Scraper(dispatcher), admin,
                              *_sources(settings, client, live, metrics)]
    if elector is not None:
        runners.append(elector)
    tasks = [asyncio.create_task(runner.run(stop)) for runner in runners]
    log.info("picker serving ext_proc on %s:%d, metrics on %s:%d, admin on %s:%d, policy %s",
             settings.host, grpc_port, settings.host, metrics_port, settings.host, admin_port,
             config.scheduling.policy)
    # Its own line, before the main one: whoever waits for "picker listening" has both, and the
    # main line keeps the shape that scripts already parse.
    print(f"picker admin listening admin={settings.host}:{admin_port}", flush=True)
    print(f"picker listening grpc={settings.host}:{grpc_port} "
          f"metrics={settings.host}:{metrics_port}", flush=True)
    if admin_ready is not None:
        admin_ready.set_result(admin_port)
    if ready is not None:
        ready.set_result((grpc_port, metrics_port))
    try:
        await stop.wait()
    finally:
        log.info("picker draining: %d requests in flight", dispatcher.busy)
        for service in ("", EXT_PROC_SERVICE):
            await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        dispatcher.close()
        deadline = asyncio.get_running_loop().time() + settings.grace
        while dispatcher.busy and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await server.stop(max(0.1, min(1.0, deadline - asyncio.get_running_loop().time())))
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for service in ("", ADMIN_SERVICE):
            await admin_health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await admin_server.stop(0.5)
        http_server.shutdown()
        http_thread.join(timeout=2)
        log.info("picker stopped")
