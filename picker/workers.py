"""``python -m picker serve --workers N``: one pod's picker over N processes, so that a pod's
throughput grows with its cores.

CPython's gRPC costs most of a request's CPU (``bench/results/profile.md``) and one process runs
its event loop on one core. Here N worker processes each run a whole picker
(``picker.server.serve``) and the supervisor, this process, only starts them, watches them and
answers for the pod:

- **Shared state.** Each worker is a replica of the active-active design (``state.backend:
  redis``, docs/architecture.md): the tenants' counters, budgets and estimates are shared through
  Redis, and each worker dispatches within its lease of every endpoint, so the workers together
  never book an endpoint past its budget. Without Redis, N pickers would each own the endpoints:
  workers refuse to start on the memory backend. The meter-stream response path cannot be used
  (a request's meter stream may reach another worker), as with replicas.
- **One ext_proc port.** Every worker binds it with ``SO_REUSEPORT`` and the kernel spreads the
  gateway's *connections* over them; streams then stay on their connection's worker. A gateway
  opens a few connections (one per Envoy worker thread), so the spread is even only over many:
  each worker ends a connection after ``CONNECTION_AGE`` (GOAWAY; its streams finish, the
  gateway dials again and lands anywhere), so no worker keeps an unlucky share for long.
- **The pod's other ports** are the supervisor's: gRPC health (``liveness`` while the
  supervisor runs; ``readiness`` while some worker is ready and the pod is not draining, the same
  service names as one picker), Prometheus metrics (every worker's, merged with a ``worker``
  label, plus ``fairway_workers_ready`` and ``fairway_worker_restarts_total``). Worker *i*'s
  admin API listens on the admin port + *i* (its queue is its own; counters are shared).
- **Faults.** A worker that dies is started again (back-off 1 s doubling to 30 s); the others go
  on serving, and the dead one's lease lapses in Redis after ``state.maxStaleness``. SIGTERM is
  passed to every worker, each drains as a replica does, and the supervisor exits once they have.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from picker.config.schema import PickerConfig, load_config
from picker.errors import ConfigError
from picker.metrics.http import serve_metrics
from picker.server import (
    HEALTH_SERVICES,
    LIVENESS,
    READINESS,
    WORKERS_NEED_REDIS,
    ServeSettings,
    certificate_source,
    serve,
)

log = logging.getLogger("picker.workers")

CONNECTION_AGE = 30.0
"""Seconds a worker keeps a gateway connection before it asks the gateway to dial again
(gRPC's ``max_connection_age``; running streams finish first): ``SO_REUSEPORT`` spreads
connections, not streams, and a fresh connection lands on any worker."""
RESTART_BACKOFF = (1.0, 30.0)
"""Seconds before a dead worker is started again: first, and at most (doubling in between)."""
HEALTH_POLL = 0.5
"""Seconds between the supervisor's reads of each worker's readiness."""
START_TIMEOUT = 120.0
"""Seconds a worker may take to start serving (a ConfigMap awaited, the shared state loaded)."""

PR_SET_PDEATHSIG = 1
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def workers_problem(settings: ServeSettings, workers: int,
                    connection_age: float = CONNECTION_AGE) -> str | None:
    """Why ``workers`` processes cannot serve with these settings, said as the flags spell it;
    None: they can."""
    if workers < 2:
        return "--workers must be 2 or more (1 is the picker without workers)"
    if settings.lease:
        return "--workers serve active-active on shared state: run them without --lease"
    if connection_age <= 0:
        return "--connection-age must be positive"
    return None


def worker_settings(settings: ServeSettings, index: int, grpc_port: int,
                    connection_age: float = CONNECTION_AGE) -> ServeSettings:
    """Worker ``index``'s settings: the pod's ext_proc port shared, its health and metrics on
    private loopback ports (the supervisor answers for the pod), its admin API on the admin
    port + ``index``, and a name of its own."""
    identity = settings.identity
    return replace(settings, grpc_port=grpc_port, reuse_port=True,
                   grpc_health_port=0, metrics_port=0,
                   admin_port=settings.admin_port + index if settings.admin_port else 0,
                   identity=f"{identity}-w{index}" if identity else None,
                   connection_age=connection_age, announce=False)


def _die_with_parent() -> None:
    """SIGTERM this worker when the supervisor dies, even by SIGKILL (Linux's
    ``PR_SET_PDEATHSIG``): an orphan would keep serving on the shared port, unwatched."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _run_worker(settings: ServeSettings, index: int, log_level: str, report: Connection) -> None:
    """A worker process's main: a whole picker; its ports are reported on ``report``."""
    _die_with_parent()
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s[w{index}]: %(message)s")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        health: asyncio.Future[int] = loop.create_future()
        admin: asyncio.Future[int] = loop.create_future()
        ready: asyncio.Future[tuple[int, int]] = loop.create_future()

        async def tell() -> None:
            health_port = await health
            admin_port = await admin
            grpc_port, metrics_port = await ready
            report.send({"grpc": grpc_port, "health": health_port, "metrics": metrics_port,
                         "admin": admin_port})

        teller = asyncio.create_task(tell())
        try:
            await serve(settings, ready=ready, admin_ready=admin, health_ready=health)
        finally:
            teller.cancel()

    asyncio.run(main())


@dataclass
class Worker:
    """One worker process, as the supervisor knows it."""

    index: int
    settings: ServeSettings
    process: BaseProcess | None = None
    report: Connection | None = None
    """Where a starting worker sends its ports; None once it has (or has died)."""
    ports: dict[str, int] = field(default_factory=dict)
    """Its ports once it serves (``grpc``, ``health``, ``metrics``, ``admin``)."""
    ready: bool = False
    backoff: float = RESTART_BACKOFF[0]
    due: float | None = None
    """When a dead worker is started again (monotonic seconds); None while it runs."""

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def take_report(self) -> bool:
        """Read its ports if it has sent them; True once it serves."""
        if self.report is None:
            return bool(self.ports)
        if self.report.poll():
            with contextlib.suppress(EOFError):
                self.ports = self.report.recv()
        elif self.alive:
            return False
        self.report.close()
        self.report = None
        return bool(self.ports)


class MergedWorkerMetrics(Collector):
    """Every worker's ``/metrics``, read at scrape time and merged: each sample gains a
    ``worker`` label. The text is parsed with prometheus_client's own parser; a worker that does
    not answer is left out of that scrape (``fairway_workers_ready`` says how many do)."""

    def __init__(self, workers: list[Worker], timeout: float = 2.0) -> None:
        self.workers = workers
        self.timeout = timeout

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for worker in list(self.workers):
            port = worker.ports.get("metrics")
            if not port:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                            timeout=self.timeout) as response:
                    text = response.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation,
                                                            family.type, family.unit)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "worker": str(worker.index)},
                                      sample.value, sample.timestamp, sample.exemplar)
        yield from families.values()


class Supervisor:
    """Starts the workers, restarts the ones that die, answers health and metrics for the pod,
    and on SIGTERM passes it on and waits for every worker to drain."""

    def __init__(self, settings: ServeSettings, workers: int, log_level: str = "INFO",
                 connection_age: float = CONNECTION_AGE) -> None:
        problem = workers_problem(settings, workers, connection_age)
        if problem:
            raise ValueError(problem)
        self.settings = settings
        self.count = workers
        self.connection_age = connection_age
        self.log_level = log_level
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[Worker] = []
        self.draining = False
        self._health: dict[int, tuple[int, grpc.aio.Channel]] = {}
        """Each worker's health channel, by index, with the port it dials: one channel per
        worker process, not one per poll."""
        self.registry = CollectorRegistry()
        self.registry.register(MergedWorkerMetrics(self.workers))
        self.ready_gauge = Gauge("fairway_workers_ready", "Worker processes of this pod whose "
                                 "readiness is SERVING.", registry=self.registry)
        self.restarts = Counter("fairway_worker_restarts", "Worker processes of this pod "
                                "started again after they died.", registry=self.registry)

    def _spawn(self, worker: Worker) -> None:
        receive, send = self.context.Pipe(duplex=False)
        worker.process = self.context.Process(
            target=_run_worker, args=(worker.settings, worker.index, self.log_level, send),
            name=f"picker-worker-{worker.index}")
        worker.process.start()
        send.close()  # the child holds the other end: EOF here once it exits
        worker.report, worker.ports, worker.ready, worker.due = receive, {}, False, None

    async def _started(self, worker: Worker) -> bool:
        """Start a worker and wait for its ports; False if it died or took too long."""
        self._spawn(worker)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT
        while worker.report is not None and loop.time() < deadline:
            if worker.take_report():
                return True
            await asyncio.sleep(0.05)
        return bool(worker.ports)

    async def start(self) -> int:
        """Start every worker; returns the ext_proc port. The first binds it (0: any free
        port), the others then share what it bound."""
        first = Worker(0, worker_settings(self.settings, 0, self.settings.grpc_port,
                                          self.connection_age))
        self.workers.append(first)
        if not await self._started(first):
            raise RuntimeError("the first worker did not start (its log says why)")
        port = first.ports["grpc"]
        first.settings = replace(first.settings, grpc_port=port)
        rest = [Worker(i, worker_settings(self.settings, i, port, self.connection_age))
                for i in range(1, self.count)]
        self.workers.extend(rest)
        if not all(await asyncio.gather(*(self._started(w) for w in rest))):
            raise RuntimeError("a worker did not start (its log says why)")
        return port

    def tend(self, now: float) -> None:
        """Note the workers that died and start again those whose back-off is over."""
        for worker in self.workers:
            if worker.report is not None:
                worker.take_report()
            elif worker.alive:
                continue
            elif worker.due is None:
                assert worker.process is not None
                log.error("worker %d exited (status %s); starting it again in %.0f s",
                          worker.index, worker.process.exitcode, worker.backoff)
                worker.ports, worker.ready = {}, False
                worker.due = now + worker.backoff
                worker.backoff = min(worker.backoff * 2, RESTART_BACKOFF[1])
            elif now >= worker.due:
                self.restarts.inc()
                self._spawn(worker)

    async def _readiness(self, worker: Worker) -> bool:
        port = worker.ports.get("health")
        if not port or not worker.alive:
            return False
        held = self._health.get(worker.index)
        if held is None or held[0] != port:  # a restarted worker answers on a new port
            if held is not None:
                await held[1].close()
            held = self._health[worker.index] = (port, grpc.aio.insecure_channel(
                f"127.0.0.1:{port}"))
        try:
            # The stubs declare HealthStub without its generated methods.
            answer = await health_pb2_grpc.HealthStub(held[1]).Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=READINESS), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return bool(answer.status == _SERVING)

    async def close_health_channels(self) -> None:
        for _, channel in self._health.values():
            await channel.close()
        self._health.clear()

    async def watch(self, stop: asyncio.Event, health: health_aio.HealthServicer) -> None:
        """Until ``stop``: restart the dead, read each worker's readiness, publish the pod's."""
        while not stop.is_set():
            self.tend(time.monotonic())
            readiness = await asyncio.gather(*(self._readiness(w) for w in self.workers))
            for worker, ready in zip(self.workers, readiness, strict=True):
                if ready and not worker.ready:
                    worker.backoff = RESTART_BACKOFF[0]  # it served again: a fresh back-off
                worker.ready = ready
            self.ready_gauge.set(sum(readiness))
            await self.publish(health)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_POLL)

    async def publish(self, health: health_aio.HealthServicer) -> None:
        """The pod's health: alive while this process runs, ready while some worker is and the
        pod is not draining (a worker that is starting again does not take the pod out)."""
        ready = not self.draining and any(w.ready for w in self.workers)
        for service in HEALTH_SERVICES:
            await health.set(service, _SERVING if service == LIVENESS or ready else _NOT_SERVING)

    def _signal(self, sig: int) -> None:
        for worker in self.workers:
            if worker.alive:
                assert worker.process is not None and worker.process.pid is not None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, sig)

    async def stop(self, timeout: float) -> None:
        """SIGTERM every worker and wait ``timeout`` for them to drain; SIGKILL what is left."""
        self.draining = True
        self._signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and any(w.alive for w in self.workers):
            await asyncio.sleep(0.1)
        self._signal(signal.SIGKILL)
        for worker in self.workers:
            if worker.process is not None:
                worker.process.join(5)


def _check_backend(config: PickerConfig) -> None:
    if config.state.backend != "redis":
        raise ConfigError("state.backend", WORKERS_NEED_REDIS)


async def run_workers(settings: ServeSettings, workers: int, log_level: str = "INFO",
                      stop: asyncio.Event | None = None,
                      connection_age: float = CONNECTION_AGE) -> None:
    """Serve one pod's picker over ``workers`` processes until SIGTERM/SIGINT (or ``stop``)."""
    if settings.secure_serving:
        certificate_source(settings)  # a bad --cert-path fails here, before any worker starts
    if settings.config_path is not None:
        _check_backend(load_config(settings.config_path))
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    supervisor = Supervisor(settings, workers, log_level, connection_age)
    health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
    health_port = health_server.add_insecure_port(f"{settings.host}:{settings.grpc_health_port}")
    await supervisor.publish(health)  # alive, not ready
    await health_server.start()
    print(f"picker health listening health={settings.host}:{health_port}", flush=True)
    http_server, http_thread = serve_metrics(settings.metrics_port, settings.host,
                                             supervisor.registry, settings.metrics_token_file)
    watcher: asyncio.Task[None] | None = None
    try:
        start = asyncio.create_task(supervisor.start())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            return
        stopped.cancel()
        grpc_port = start.result()
        watcher = asyncio.create_task(supervisor.watch(stop, health))
        admin = supervisor.workers[0].ports["admin"]
        log.info("picker serving ext_proc on %s:%d over %d workers, metrics on %s:%d",
                 settings.host, grpc_port, workers, settings.host, http_server.server_port)
        print(f"picker admin listening admin={settings.host}:{admin}", flush=True)
        print(f"picker listening grpc={settings.host}:{grpc_port} "
              f"metrics={settings.host}:{http_server.server_port}", flush=True)
        await stop.wait()
    finally:
        if watcher is not None:
            await watcher
        supervisor.draining = True
        await supervisor.publish(health)
        await supervisor.stop(settings.grace + 10)
        await supervisor.close_health_channels()
        for service in HEALTH_SERVICES:
            await health.set(service, _NOT_SERVING)
        await health_server.stop(0.5)
        http_server.shutdown()
        http_thread.join(timeout=2)
        log.info("picker stopped")
