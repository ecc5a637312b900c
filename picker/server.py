"""``python -m picker serve``: the picker process, wired together.

Ports, as upstream's picker has them: ext_proc (9002, TLS unless ``--secure-serving=false``; gRPC
health answers there too, for gateways that health-check it), gRPC health (9003, plaintext: the
kubelet's probes), the read-only admin API ``fairway.v1.Admin`` (9004, plaintext, with its own
gRPC health) and Prometheus metrics (9090). The endpoint scraper, the config watcher and the
admin API's service sampler run as background tasks.

Health (``HealthState``) answers the service names upstream's picker answers: ``liveness`` is
SERVING while the process runs (standbys included, so the kubelet does not restart them);
``readiness``, ``""`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` are SERVING only when
this replica leads (or there is no election), its endpoints have synced (static endpoints at
once; an InferencePool after its first list) and it is not draining.

SIGTERM drains: readiness turns NOT_SERVING, new requests are refused with a retryable 503,
running requests get ``--grace`` seconds (default 130, a long generation) to finish; liveness and
the admin API answer until the drain is over. Queued requests are refused too with the memory
backend; with shared state (other replicas beside it) the replica first keeps admitting for
``ADMITTING_WHILE_DRAINING`` (the gateway's time to stop sending to it), and its queue is served
within the grace.

In a cluster (``picker.k8s``) the config comes from a ConfigMap watched through the API, the
endpoints from an InferencePool's ready pods, and with a Lease only the elected leader is ready
and takes requests (a standby refuses them with a retryable 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from picker.admin.auth import AdminAuth, TokenFile
from picker.admin.service import ADMIN_SERVICE, AdminService
from picker.admin.v1 import admin_pb2_grpc
from picker.config.reload import ConfigWatcher
from picker.config.schema import PickerConfig, load_config
from picker.dispatch import Dispatcher
from picker.dispatch.trace import PickerTrace
from picker.errors import ConfigError
from picker.extproc import (
    AccessLogReceiver,
    ExternalProcessor,
    add_access_log_to_server,
    add_to_server,
)
from picker.k8s import (
    UNREACHABLE,
    ApiError,
    ConfigMapWatcher,
    KubeClient,
    LeaderElector,
    LiveConfig,
    PoolDiscovery,
    fetch_config,
)
from picker.metrics import PickerMetrics
from picker.metrics.http import serve_metrics
from picker.scrape import Scraper
from picker.state import RedisSync
from picker.tls import CertificateSource, ClientAuth

log = logging.getLogger("picker")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
HEALTH_SERVICES = ("", LIVENESS, READINESS, EXT_PROC_SERVICE)
"""The gRPC health service names answered (upstream's; ``""`` is the server as a whole, which a
load balancer asks: it follows readiness)."""
RUNNERS_GRACE = 5.0
"""Seconds the background runners get to end by themselves at shutdown (a Lease release is
two API calls) before they are cancelled."""

ADMITTING_WHILE_DRAINING = 5.0
"""Seconds (at most half the grace) a draining replica beside others (shared state) still admits
what reaches it: a gateway stops sending to it only once the removal of its endpoint has reached
the gateway (Kubernetes removes a terminating pod's endpoint as it sends SIGTERM, in no set
order), and what it sends meanwhile would be refused."""

WORKERS_NEED_REDIS = ("worker processes (--workers) need the redis backend: each dispatches on "
                      "the shared counters within its lease of the endpoints; on their own "
                      "they would each book every endpoint")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class HealthState:
    """What the health answers are computed from."""

    leading: bool = True
    """Holds the Lease, or there is no leader election."""
    synced: bool = False
    """The endpoints are known: static ones from the config, or the InferencePool has been
    listed (and exists)."""
    draining: bool = False
    """SIGTERM came: no new requests."""
    alive: bool = True
    """The process is up; False only at the very end of shutdown."""

    @property
    def ready(self) -> bool:
        return self.alive and self.leading and self.synced and not self.draining

    def statuses(self) -> dict[str, int]:
        """``HealthCheckResponse`` status by service name (``HEALTH_SERVICES``)."""
        ready = _SERVING if self.ready else _NOT_SERVING
        return {"": ready, READINESS: ready, EXT_PROC_SERVICE: ready,
                LIVENESS: _SERVING if self.alive else _NOT_SERVING}


class Health:
    """Publishes a ``HealthState`` to gRPC health servicers (the health port's and the ext_proc
    port's), so both answer alike and ``Watch`` sees every change."""

    def __init__(self, *servicers: health_aio.HealthServicer,
                 state: HealthState | None = None) -> None:
        self.servicers = servicers
        self.state = state or HealthState()
        self._pending: set[asyncio.Task[None]] = set()

    async def update(self, **changes: bool) -> None:
        """Change the state and publish it."""
        self.state = replace(self.state, **changes)
        await self._publish()

    def change(self, **changes: bool) -> None:
        """``update`` from synchronous code on the event loop (published in a task)."""
        self.state = replace(self.state, **changes)
        task = asyncio.get_running_loop().create_task(self._publish())
        self._pending.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._pending.discard)

    async def _publish(self) -> None:
        # Reads the state when it runs, so publications that interleave end on the latest.
        for service, status in self.state.statuses().items():
            for servicer in self.servicers:
                await servicer.set(service, status)


@dataclass(frozen=True)
class ServeSettings:
    """Process settings: flags, not config."""

    config_path: Path | None = None
    """The picker config (YAML); watched and hot-reloaded. Unused with ``config_map``."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    grpc_port: int = 9002
    """ext_proc, and gRPC health as on ``grpc_health_port`` (0: any free port)."""
    grpc_health_port: int = 9003
    """gRPC health, plaintext (the kubelet's probes): ``liveness``, ``readiness``, the ext_proc
    service name and ``""``, as upstream's picker (0: any free port)."""
    metrics_port: int = 9090
    """Prometheus ``/metrics`` (0: any free port)."""
    admin_port: int = 9004
    """The admin API (``fairway.v1.Admin``) and its gRPC health, plaintext (0: any free port).
    Read-only, on its own port so that the gateway's port does not expose it."""
    secure_serving: bool = True
    """Serve ext_proc over TLS (upstream's ``--secure-serving``): the gateways that implement the
    Inference Extension dial the picker over TLS without verifying it. False: plaintext (h2c)."""
    cert_path: Path | None = None
    """A directory with ``tls.crt`` and ``tls.key`` (a mounted TLS Secret), reloaded when they
    change; unset: a self-signed certificate generated at start. Only with ``secure_serving``."""
    client_ca: Path | None = None
    """PEM CA certificates a client of the ext_proc port must present a certificate of (mTLS:
    the gateway's); reloaded when the file changes. Only with ``secure_serving``."""
    client_names: tuple[str, ...] = ()
    """With ``client_ca``: the client certificate must carry one of these names (SAN or CN)."""
    client_auth: str | None = None
    """Who may speak ext_proc (``picker.tls.ClientAuth``): ``mtls`` (needs ``client_ca``),
    ``none`` (no client certificate; header mode refused) or ``trust-network`` (the explicit
    development mode: tenant headers believed from anyone). None: ``mtls`` with a CA, else
    ``none``."""
    admin_token_file: Path | None = None
    """A file (a mounted Secret) with the bearer token every admin API call must carry."""
    metrics_token_file: Path | None = None
    """A file (a mounted Secret) with the bearer token a scrape of ``/metrics`` must send (the
    page names every tenant); unset: served to whoever reaches it."""
    admin_auth: str | None = None
    """``token`` (needs ``admin_token_file``) or ``none``: the admin API open to whoever reaches
    it, which only a loopback ``host`` allows without saying so (a pod's other containers)."""
    grace: float = 130.0
    """Seconds running requests get to finish after SIGTERM: long enough for a long generation
    (upstream gives its picker 130 s too); the pod's terminationGracePeriodSeconds must exceed
    it."""
    reload_interval: float = 1.0
    """How often the config file is checked for changes."""
    meter_claim_timeout: float = 10.0
    """Seconds a request routed with a meter-stream gateway waits for that stream to open (it
    opens at dispatch) before it is settled as gone; only a misconfigured gateway hits this."""
    log_claim_timeout: float = 330.0
    """Seconds a request routed with an access-log gateway waits for its log entry, which comes
    once it has ended (longer than the gateway's route timeout), before it is settled on its
    estimate."""
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
    reuse_port: bool = False
    """Bind the ext_proc port with ``SO_REUSEPORT``, beside the pod's other worker processes
    (``picker.workers``); such a picker needs the shared state backend (``state.backend``)."""
    connection_age: float | None = None
    """Seconds after which the ext_proc server asks a gateway connection to be dialled again
    (gRPC's ``max_connection_age``; its streams finish first). None: never."""
    announce: bool = True
    """Print the ``listening`` lines that scripts wait for; a worker's supervisor prints the
    pod's instead."""
    trace: Path | None = None
    """Write the picker's view of its endpoints to this file, a JSON line every 5 ms
    (``picker.dispatch.trace``, for benchmarks); None: no trace."""

    def __post_init__(self) -> None:
        # Said as the flags spell it: the command line shows this message as its usage error.
        if self.cert_path is not None and not self.secure_serving:
            raise ValueError("--cert-path needs --secure-serving")
        if self.client_ca is not None and not self.secure_serving:
            raise ValueError("--client-ca needs --secure-serving")
        if self.client_auth == "mtls" and self.client_ca is None:
            raise ValueError("--client-auth=mtls needs --client-ca")
        if self.client_ca is not None and self.client_auth not in (None, "mtls"):
            raise ValueError(f"--client-ca means --client-auth=mtls, not {self.client_auth}")
        self.client_authentication()  # a bad mode or name list is a usage error
        if self.admin_auth not in (None, "token", "none"):
            raise ValueError("--admin-auth must be token or none")
        if self.admin_auth == "token" and self.admin_token_file is None:
            raise ValueError("--admin-auth=token needs --admin-token-file")

    def client_authentication(self) -> ClientAuth:
        """The ext_proc port's rule for its peers."""
        mode = self.client_auth or ("mtls" if self.client_ca is not None else "none")
        return ClientAuth(mode, frozenset(self.client_names))

    def exposure_problem(self) -> str | None:
        """Why these settings would serve tenants' figures to anyone, said as the flags spell
        it: the admin API without a token on an address beyond loopback, unless asked for."""
        if self.admin_token_file is not None or self.admin_auth == "none":
            return None
        if self.host in ("127.0.0.1", "::1", "localhost"):
            return None
        return (f"the admin API lists every tenant: on {self.host} it needs --admin-token-file "
                "(a mounted Secret), or --admin-auth=none to serve it to whoever reaches it")

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
                admin_ready: asyncio.Future[int] | None = None,
                health_ready: asyncio.Future[int] | None = None) -> None:
    """Run until ``stop`` is set (or SIGTERM/SIGINT when ``stop`` is None).

    ``health_ready`` gets the health port as soon as it answers (before the config is loaded:
    liveness holds while a ConfigMap is awaited). Once serving, ``admin_ready`` gets the admin
    API's port, then ``ready`` gets ``(grpc_port, metrics_port)`` (the ports bound, useful with
    port 0).
    """
    client = KubeClient.from_environment(settings.kube_server) \
        if settings.uses_kubernetes else None
    try:
        await _serve(settings, client, stop, ready, admin_ready, health_ready)
    finally:
        if client is not None:
            await client.close()


CONFIG_MAP_WAIT = (0.5, 10.0)
"""Seconds between reads of a ConfigMap that does not exist yet: first, and at most."""


async def _initial_config(settings: ServeSettings, client: KubeClient | None,
                          stop: asyncio.Event) -> PickerConfig | None:
    """The config to start with; None when ``stop`` came first.

    A ConfigMap that does not exist yet is waited for (on first install the operator writes it a
    few seconds after the picker starts), and so is an API server that is briefly unreachable,
    overloaded (429, 5xx) or slow: exiting instead would put the pod in a restart backoff. A
    refusal (401, 403, other 4xx) or a bad config is permanent and ends the start.
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
            if error.code != 404 and error.code != 429 and error.code < 500:
                raise
            reason = "the operator writes it" if error.code == 404 else f"API status {error.code}"
        except UNREACHABLE as error:
            reason = f"{type(error).__name__}: {error}"
        log.info("waiting for ConfigMap %s/%s (%s)", namespace, name, reason)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return None
        delay = min(delay * 2, CONFIG_MAP_WAIT[1])


def _sources(settings: ServeSettings, client: KubeClient | None, live: LiveConfig,
             metrics: PickerMetrics, health: Health) -> list[_Runner]:
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
                                     live.set_endpoints,
                                     on_synced=lambda synced: health.change(synced=synced)))
    return sources


def certificate_source(settings: ServeSettings) -> CertificateSource:
    """The ext_proc port's certificate: ``--cert-path``, else self-signed for this replica's
    name (``--identity``, ``$POD_NAME``) and the loopback names."""
    name = settings.identity or os.environ.get("POD_NAME")
    return CertificateSource(settings.cert_path, [name] if name else [],
                             client_ca=settings.client_ca)


async def _serve(settings: ServeSettings, client: KubeClient | None,
                 stop: asyncio.Event | None, ready: asyncio.Future[tuple[int, int]] | None,
                 admin_ready: asyncio.Future[int] | None,
                 health_ready: asyncio.Future[int] | None) -> None:
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    problem = settings.exposure_problem()
    if problem:
        raise ValueError(problem)
    # TLS first: a bad --cert-path fails the start before anything listens.
    certificates = certificate_source(settings) if settings.secure_serving else None
    admin_token = TokenFile(settings.admin_token_file) \
        if settings.admin_token_file is not None else None
    # The health port first: alive (not ready) while the config is awaited.
    health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    probe_health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(probe_health, health_server)
    health_port = health_server.add_insecure_port(f"{settings.host}:{settings.grpc_health_port}")
    ext_proc_health = health_aio.HealthServicer()
    health = Health(probe_health, ext_proc_health,
                    state=HealthState(leading=not settings.lease, synced=False))
    await health.update()
    await health_server.start()
    if settings.announce:
        print(f"picker health listening health={settings.host}:{health_port}", flush=True)
    if health_ready is not None:
        health_ready.set_result(health_port)
    try:
        await _serve_config(settings, client, stop, ready, admin_ready, health, certificates,
                            admin_token)
    finally:
        await health.update(alive=False)
        await health_server.stop(0.5)


async def _serve_config(settings: ServeSettings, client: KubeClient | None,
                        stop: asyncio.Event, ready: asyncio.Future[tuple[int, int]] | None,
                        admin_ready: asyncio.Future[int] | None, health: Health,
                        certificates: CertificateSource | None,
                        admin_token: TokenFile | None = None) -> None:
    config = await _initial_config(settings, client, stop)
    if config is None:
        return
    metrics = PickerMetrics()
    metrics.add_role_collector(lambda: health.state.leading, lambda: health.state.ready)
    dispatcher = Dispatcher(config, metrics=metrics)
    live = LiveConfig(dispatcher.apply_config, config)
    if settings.reuse_port and config.state.backend != "redis":
        raise ConfigError("state.backend", WORKERS_NEED_REDIS)
    sync = None
    if config.state.backend == "redis":
        # Before serving: counters and budgets as the replicas (or the process before this
        # one) left them, not fresh ones.
        sync = RedisSync(dispatcher, config.state, metrics)
        dispatcher.reserve_in_store = sync.reserve
        if await sync.load(stop):
            log.info("shared state loaded from %s (key prefix %s)", config.state.redis.url,
                     config.state.redis.key_prefix)

    server = grpc.aio.server(options=_ext_proc_options(settings))
    client_auth = settings.client_authentication()
    processor = ExternalProcessor(dispatcher, lambda: dispatcher.config,
                                  settings.meter_claim_timeout, settings.log_claim_timeout,
                                  client_auth=client_auth)
    add_to_server(processor, server)
    # The access-log response path: the gateway's access log on the same port.
    add_access_log_to_server(AccessLogReceiver(processor), server)
    # The ext_proc port answers health too (gateways may check it there), the same answers.
    health_pb2_grpc.add_HealthServicer_to_server(health.servicers[1], server)
    address = f"{settings.host}:{settings.grpc_port}"
    grpc_port = server.add_insecure_port(address) if certificates is None else \
        server.add_secure_port(address, certificates.credentials())
    admin = AdminService(dispatcher)
    admin_server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0)],
        interceptors=[AdminAuth(admin_token)] if admin_token is not None else None)
    admin_pb2_grpc.add_AdminServicer_to_server(admin, admin_server)
    admin_health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(admin_health, admin_server)
    admin_port = admin_server.add_insecure_port(f"{settings.host}:{settings.admin_port}")
    http_server, http_thread = serve_metrics(settings.metrics_port, settings.host,
                                             metrics.registry, settings.metrics_token_file)
    metrics_port = http_server.server_port
    await server.start()
    await admin_server.start()

    elector = None
    if settings.lease:
        assert client is not None

        def on_leading(leading: bool) -> None:
            log.info("leadership %s", "acquired: serving" if leading else "lost: standing by")
            dispatcher.standby = not leading
            health.change(leading=leading)

        lease_namespace, lease_name = _split(settings.lease, "--lease")
        config_namespace, config_name = (_split(settings.config_map, "--config-map")
                                         if settings.config_map else ("", ""))
        elector = LeaderElector(client, lease_namespace, lease_name, on_leading,
                                identity=settings.identity,
                                lease_duration=settings.lease_duration,
                                retry_period=settings.lease_duration / 3,
                                owner_config_map=config_name
                                if config_namespace == lease_namespace else None)
    dispatcher.standby = elector is not None
    # Static endpoints are known now; an InferencePool's once PoolDiscovery has listed it.
    await health.update(synced=not settings.pool)
    for service in ("", ADMIN_SERVICE):
        await admin_health.set(service, _SERVING)

    runners: list[_Runner] = [Scraper(dispatcher), admin,
                              *_sources(settings, client, live, metrics, health)]
    if settings.trace is not None:
        dispatcher.trace = PickerTrace(dispatcher, settings.trace)
        runners.append(dispatcher.trace)
    if sync is not None:
        runners.append(sync)
    if elector is not None:
        runners.append(elector)
    # What keeps the view of the endpoints, the config and the shared state current runs until
    # the drain is over, not just until SIGTERM: a draining replica still holds requests (and
    # with shared state dispatches its queue), and a lease no longer renewed would expire in the
    # store, its room granted to the other replicas while still in use. Only the elector ends
    # on SIGTERM, so that a standby takes over at once.
    drained = asyncio.Event()
    tasks = [asyncio.create_task(runner.run(stop if runner is elector else drained))
             for runner in runners]
    failed: list[BaseException] = []
    for runner, task in zip(runners, tasks, strict=True):
        task.add_done_callback(functools.partial(_runner_ended, runner, stop, failed))
    if certificates is None:
        log.warning("ext_proc served in plaintext (--secure-serving=false): gateways that dial "
                    "TLS (Envoy AI Gateway, kgateway) cannot reach it")
    else:
        log.info("ext_proc served over TLS: %s certificate, sha256 %s",
                 "self-signed" if settings.cert_path is None else str(settings.cert_path),
                 certificates.current.fingerprint)
    _log_client_auth(client_auth, settings, config)
    if admin_token is None:
        log.warning("admin API without a token on %s (--admin-token-file unset): whoever "
                    "reaches port %d can list every tenant", settings.host, admin_port)
    log.info("picker serving ext_proc on %s:%d, metrics on %s:%d, admin on %s:%d, policy %s",
             settings.host, grpc_port, settings.host, metrics_port, settings.host, admin_port,
             config.scheduling.policy)
    # Its own line, before the main one: whoever waits for "picker listening" has both, and the
    # main line keeps the shape that scripts already parse.
    if settings.announce:
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
        await health.update(draining=True)
        deadline = asyncio.get_running_loop().time() + settings.grace
        await _drain(dispatcher, settings.grace, deadline,
                     shared=sync is not None and not failed)
        await server.stop(max(0.1, min(1.0, deadline - asyncio.get_running_loop().time())))
        drained.set()
        # Each runner ends by itself, some with a last word to say (the elector releases its
        # Lease, so a standby takes over at its next retry instead of after a whole lease
        # duration): give them that, then cancel whatever still hangs.
        await asyncio.wait(tasks, timeout=RUNNERS_GRACE)
        for task in tasks:
            task.cancel()
        # A failed one's error is in ``failed`` already.
        await asyncio.gather(*tasks, return_exceptions=True)
        if sync is not None:
            await sync.flush()  # after its runner: one exchange at a time
        for service in ("", ADMIN_SERVICE):
            await admin_health.set(service, _NOT_SERVING)
        await admin_server.stop(0.5)
        http_server.shutdown()
        http_thread.join(timeout=2)
        # Said last, for the pod's log: whether the drain left requests unsettled (its grace ran
        # out on them): the metrics page is gone by now.
        log.info("picker stopped, %d requests left unsettled", dispatcher.busy)
    if failed:
        raise RunnerFailed("a background task of the picker failed") from failed[0]


def _log_client_auth(auth: ClientAuth, settings: ServeSettings, config: PickerConfig) -> None:
    if auth.mode == "mtls":
        log.info("ext_proc clients authenticated: a certificate of %s%s", settings.client_ca,
                 f" naming one of {sorted(auth.names)}" if auth.names else "")
    elif auth.mode == "trust-network":
        log.warning("ext_proc clients NOT authenticated (--client-auth=trust-network): whoever "
                    "reaches port %d can route and name any tenant; development only, or a "
                    "network only the gateway reaches", settings.grpc_port)
    elif config.tenancy.mode == "header":
        log.warning("ext_proc clients not authenticated (no --client-ca) and tenancy.mode is "
                    "header: every ext_proc stream is refused until the gateway presents a "
                    "client certificate (--client-ca) or --client-auth=trust-network is given")


def _ext_proc_options(settings: ServeSettings) -> list[tuple[str, int]]:
    options = [("grpc.so_reuseport", 1 if settings.reuse_port else 0)]
    if settings.connection_age is not None:
        options.append(("grpc.max_connection_age_ms", int(settings.connection_age * 1000)))
    return options


async def _drain(dispatcher: Dispatcher, grace: float, deadline: float, shared: bool) -> None:
    """The drain after SIGTERM. Beside other replicas (``shared``) requests are admitted on for
    ``ADMITTING_WHILE_DRAINING`` (at most half the grace); then new ones are refused (a
    retryable 503) until nothing is left in the picker or ``deadline``, when what is still
    queued is refused too."""
    if shared:
        await asyncio.sleep(min(ADMITTING_WHILE_DRAINING, grace / 2))
    # Beside other replicas (shared state) the lease keeps this one within every endpoint's
    # budget: its queue is served in its fair order within the grace, where refusing it sent
    # those clients a 503 at every step of a rolling update. Alone (memory), its successor
    # shares the endpoints without knowing of it, and dispatching the queue would double-book
    # them: the queue is refused.
    dispatcher.close(keep_queued=shared)
    while dispatcher.busy and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    dispatcher.close()


class RunnerFailed(RuntimeError):
    """A background task (scraper, config or pool watch, shared state sync, leader election)
    ended with an error: the picker stops rather than serve on without it."""


def _runner_ended(runner: _Runner, stop: asyncio.Event, failed: list[BaseException],
                  task: asyncio.Task[None]) -> None:
    # Runners end only on ``stop``; one that ends before would leave the picker serving on a
    # view that no longer changes (a sync loop gone: charges never reach the store). Crash
    # instead, loudly: the restart gets a fresh one.
    if stop.is_set() or task.cancelled():
        return
    error = task.exception() or RuntimeError("it returned before the picker stopped")
    log.critical("%s ended: %s: %s; the picker stops", type(runner).__name__,
                 type(error).__name__, error, exc_info=error)
    failed.append(error)
    stop.set()
