"""``python -m picker serve``: the picker process, wired together.

ext_proc and gRPC health on one port, Prometheus metrics on another, the read-only admin API
(``fairway.v1.Admin``, with its own gRPC health) on a third, the endpoint scraper, the config
watcher and the admin API's service sampler as background tasks. SIGTERM drains: ext_proc health
turns NOT_SERVING, queued requests are refused with a retryable 503, running requests get
``--grace`` seconds to finish; the admin API answers until the drain is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server

from picker.admin.service import ADMIN_SERVICE, AdminService
from picker.admin.v1 import admin_pb2_grpc
from picker.config.reload import ConfigWatcher
from picker.config.schema import load_config
from picker.dispatch import Dispatcher
from picker.extproc import ExternalProcessor, add_to_server
from picker.metrics import PickerMetrics
from picker.scrape import Scraper

log = logging.getLogger("picker")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass(frozen=True)
class ServeSettings:
    """Process settings: flags, not config."""

    config_path: Path
    """The picker config (YAML); watched and hot-reloaded."""
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


async def serve(settings: ServeSettings, stop: asyncio.Event | None = None,
                ready: asyncio.Future[tuple[int, int]] | None = None,
                admin_ready: asyncio.Future[int] | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None).

    Once serving, ``admin_ready`` gets the admin API's port, then ``ready`` gets
    ``(grpc_port, metrics_port)`` (the ports bound, useful with port 0).
    """
    config = load_config(settings.config_path)
    metrics = PickerMetrics()
    dispatcher = Dispatcher(config, metrics=metrics)
    watcher = ConfigWatcher(settings.config_path, dispatcher.apply_config,
                            lambda result: metrics.config_reloads.labels(result).inc(),
                            interval=settings.reload_interval)

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
    for service in ("", EXT_PROC_SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    for service in ("", ADMIN_SERVICE):
        await admin_health.set(service, health_pb2.HealthCheckResponse.SERVING)

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(Scraper(dispatcher).run(stop)),
             asyncio.create_task(watcher.run(stop)),
             asyncio.create_task(admin.run(stop))]
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
