"""TLS on the ext_proc port and health like upstream's picker, on real picker processes.

* ``python -m picker serve`` serves ext_proc over TLS by default with a self-signed certificate
  made at start: a gRPC client that trusts whatever the server presents (a gateway's "TLS
  without verification") completes a health check; a plaintext client is refused. Plaintext
  only with ``--secure-serving=false``.
* ``--cert-path DIR`` serves ``tls.crt``/``tls.key``; when the files change (a Kubernetes Secret
  update: an atomic swap of the ``..data`` symlink) new connections get the new certificate,
  established ones keep going, and a broken pair is not taken.
* gRPC health on its own plaintext port answers ``liveness``, ``readiness``, ``""`` and the
  ext_proc service name: readiness only after the InferencePool has synced, only on the leader,
  and not while draining; liveness on every running replica (standbys, a picker waiting for its
  ConfigMap, a draining picker).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtensionOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.server import EXT_PROC_SERVICE, LIVENESS, READINESS, ServeSettings, serve
from picker.sim.server import SimServer, SimServerConfig
from picker.tls import CERT_FILE, KEY_FILE, KeyPair, self_signed, server_certificate
from tests.integration.test_extproc_contract import (
    TENANT_HEADER,
    Picker,
    chat_body,
    relay_response,
    route,
)
from tests.integration.test_k8s_cluster import CONFIGMAPS, NS, PODS, POOLS
from tests.integration.test_picker_in_cluster import (
    LEASE,
    _configmap,
    _next_renewal,
    _pod,
    _until,
    cluster,
)
from tests.integration.test_picker_process import Process, spawn, write_config
from tests.tls import tls_channel

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_NAMES = ("", READINESS, EXT_PROC_SERVICE)


async def _status(channel: grpc.aio.Channel, service: str) -> int:
    answer = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=15)
    return answer.status


async def _health(port: int, service: str) -> int:
    """A service's status on the plaintext health port."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        return await _status(channel, service)


def _served(port: int) -> x509.Certificate:
    return x509.load_pem_x509_certificate(server_certificate("127.0.0.1", port))


def _same(cert: x509.Certificate, pair: KeyPair) -> bool:
    return cert == x509.load_pem_x509_certificate(pair.cert_pem)


@contextlib.asynccontextmanager
async def picker_process(tmp_path: Path, *extra: str) -> AsyncIterator[tuple[Process, int]]:
    """``python -m picker serve`` over one simulated server; yields it and its health port."""
    async with SimServer(SimServerConfig(step_ms=2.0)) as sim:
        path = tmp_path / "picker.yaml"
        write_config(path, {"endpoints": [{"address": f"127.0.0.1:{sim.port}"}],
                            "tenants": [{"id": "a"}]})
        running = await spawn(path, *extra)
        try:
            line = await running.wait_for_output("picker health listening", running.stdout)
            health_port = int(re.search(r"health=\S+:(\d+)", line).group(1))  # type: ignore[union-attr]
            await running.wait_for_output("picker listening", running.stdout)
            yield running, health_port
        finally:
            if running.process.returncode is None:
                running.process.kill()
            await running.exit_code(10)


# -- TLS --


async def test_ext_proc_is_tls_by_default_with_a_self_signed_certificate(tmp_path: Path) -> None:
    async with picker_process(tmp_path, "--identity", "fairway-picker-7") as (running, health):
        cert = await asyncio.to_thread(_served, running.grpc_port)
        assert cert.issuer == cert.subject  # self-signed
        names = cert.extensions.get_extension_for_oid(
            ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value
        assert {"fairway-picker-7", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
        assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}

        # A client that does not verify (it trusts what the server presents) is served, by
        # address and by name.
        for host in ("127.0.0.1", "localhost"):
            async with await tls_channel(running.grpc_port, host) as channel:
                for service in READY_NAMES:
                    assert await _status(channel, service) == SERVING

        # Plaintext on the TLS port is refused.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _status(channel, "")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        # The health port is plaintext, with upstream's service names.
        for service in (LIVENESS, *READY_NAMES):
            assert await _health(health, service) == SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await _status(channel, "no.such.Service")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_plaintext_only_when_asked(tmp_path: Path) -> None:
    async with picker_process(tmp_path, "--secure-serving=false") as (running, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
            assert await _status(channel, EXT_PROC_SERVICE) == SERVING
        with pytest.raises(ssl.SSLError):
            await asyncio.to_thread(server_certificate, "127.0.0.1", running.grpc_port)
        assert any("served in plaintext" in line for line in running.stderr)


def _install(directory: Path, pair: KeyPair, version: str) -> None:
    """Write ``pair`` the way the kubelet updates a mounted Secret: the files in a new
    directory, then the ``..data`` symlink swapped atomically; ``tls.crt``/``tls.key`` are
    symlinks through ``..data``."""
    target = directory / f"..{version}"
    target.mkdir()
    (target / CERT_FILE).write_bytes(pair.cert_pem)
    (target / KEY_FILE).write_bytes(pair.key_pem)
    tmp = directory / "..data_tmp"
    tmp.symlink_to(target.name)
    tmp.replace(directory / "..data")
    for name in (CERT_FILE, KEY_FILE):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


async def test_cert_path_is_served_and_a_rotated_certificate_reaches_new_connections(
        tmp_path: Path) -> None:
    secret = tmp_path / "tls"
    secret.mkdir()
    first, second = self_signed(["first.example"]), self_signed(["second.example"])
    _install(secret, first, "v1")
    async with picker_process(tmp_path, "--cert-path", str(secret)) as (running, _):
        assert _same(await asyncio.to_thread(_served, running.grpc_port), first)
        address = f"127.0.0.1:{running.grpc_port}"
        trusting_first = grpc.ssl_channel_credentials(first.cert_pem)
        async with grpc.aio.secure_channel(address, trusting_first) as established:
            assert await _status(established, "") == SERVING

            _install(secret, second, "v2")  # the Secret is renewed
            assert _same(await asyncio.to_thread(_served, running.grpc_port), second)
            # A new connection that trusts only the new certificate is served ...
            async with grpc.aio.secure_channel(
                    address, grpc.ssl_channel_credentials(second.cert_pem)) as channel:
                assert await _status(channel, "") == SERVING
            # ... one that trusts only the old one is not: the old certificate is gone ...
            async with grpc.aio.secure_channel(address, trusting_first) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _status(channel, "")
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # ... and the connection made before the rotation goes on.
            assert await _status(established, "") == SERVING

        # A broken renewal (a key that is not the certificate's) is not taken.
        _install(secret, KeyPair(first.cert_pem, second.key_pem, first.not_after), "v3")
        assert _same(await asyncio.to_thread(_served, running.grpc_port), second)
        await running.wait_for_output("not loaded", running.stderr, 15)
        assert running.process.returncode is None


async def test_a_cert_path_that_does_not_load_fails_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    async with SimServer(SimServerConfig(step_ms=2.0)) as sim:
        path = tmp_path / "picker.yaml"
        write_config(path, {"endpoints": [{"address": f"127.0.0.1:{sim.port}"}]})
        running = await spawn(path, "--cert-path", str(missing))
        assert await running.exit_code(20) == 1
        assert "cannot start" in "".join(running.stderr)
        assert str(missing / CERT_FILE) in "".join(running.stderr)

        mismatched = tmp_path / "mismatched"
        mismatched.mkdir()
        (mismatched / CERT_FILE).write_bytes(self_signed().cert_pem)
        (mismatched / KEY_FILE).write_bytes(self_signed().key_pem)
        running = await spawn(path, "--cert-path", str(mismatched))
        assert await running.exit_code(20) == 2
        assert "is not the key of" in "".join(running.stderr)

        running = await spawn(path, "--cert-path", str(mismatched), "--secure-serving=false")
        assert await running.exit_code(20) == 2
        assert "--cert-path needs --secure-serving" in "".join(running.stderr)


# -- health like upstream --


@contextlib.asynccontextmanager
async def in_process(tmp_path: Path | None = None, url: str | None = None,
                     **settings: Any) -> AsyncIterator[tuple[asyncio.Event, int, asyncio.Future]]:
    """serve() in-process; yields (stop, health port, ready) as soon as health answers."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[tuple[int, int]] = loop.create_future()
    health_ready: asyncio.Future[int] = loop.create_future()
    source: dict[str, Any] = {"config_map": f"{NS}/fairway-picker-config", "kube_server": url} \
        if url else {}
    task = asyncio.create_task(serve(ServeSettings(
        grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, grace=5.0,
        client_auth="trust-network", **source, **settings), stop, ready,
        health_ready=health_ready))
    try:
        health = await asyncio.wait_for(asyncio.shield(health_ready), 20)
        yield stop, health, ready
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def _is(port: int, service: str, status: int) -> bool:
    return await _health(port, service) == status


async def test_alive_but_not_ready_until_the_config_map_and_the_pool_are_in() -> None:
    async with cluster() as (url, api), \
            in_process(url=url, pool=f"{NS}/llm-pool") as (_, health, ready):
        # No ConfigMap yet: waiting for the operator, alive, not ready.
        assert await _health(health, LIVENESS) == SERVING
        assert await _health(health, READINESS) == NOT_SERVING
        await api.create(CONFIGMAPS, _configmap(1))
        grpc_port, _ = await asyncio.wait_for(asyncio.shield(ready), 15)
        # Serving ext_proc, but the InferencePool does not exist: not ready.
        await api.create(PODS, _pod("llm-0"))
        for service in READY_NAMES:
            assert await _health(health, service) == NOT_SERVING
        await api.create(POOLS, {
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "llm-pool", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "llm"}},
                     "targetPorts": [{"number": 8000}]}})
        await _until(lambda: _is(health, READINESS, SERVING))
        for service in READY_NAMES:
            assert await _health(health, service) == SERVING
        async with await tls_channel(grpc_port) as channel:  # the ext_proc port agrees
            assert await _status(channel, EXT_PROC_SERVICE) == SERVING
        # The pool is deleted: not ready again (upstream forgets its endpoints too).
        await api.delete(f"{POOLS}/llm-pool")
        await _until(lambda: _is(health, READINESS, NOT_SERVING))
        assert await _health(health, LIVENESS) == SERVING


async def test_a_standby_is_alive_but_not_ready() -> None:
    async with cluster() as (url, api):
        await api.create(CONFIGMAPS, _configmap(1))
        lease = {"lease": f"{NS}/fairway-picker", "lease_duration": LEASE}
        async with in_process(url=url, identity="one", **lease) as (_, first, _):
            await _until(lambda: _is(first, READINESS, SERVING))  # "one" leads
            async with in_process(url=url, identity="two", **lease) as (_, second, ready):
                grpc_port, _ = await asyncio.wait_for(asyncio.shield(ready), 15)
                # The standby read the held Lease as it started; one that took it would hold it
                # by the leader's next renewal.
                assert (await _next_renewal(api))["holderIdentity"] == "one"
                await _standing_by(second, grpc_port)


async def _standing_by(health: int, grpc_port: int) -> None:
    for service in READY_NAMES:
        assert await _health(health, service) == NOT_SERVING
    assert await _health(health, LIVENESS) == SERVING
    async with await tls_channel(grpc_port) as channel:
        assert await _status(channel, READINESS) == NOT_SERVING
        assert await _status(channel, LIVENESS) == SERVING


async def test_draining_is_not_ready_but_alive_until_the_running_request_ends(
        tmp_path: Path) -> None:
    async with SimServer(SimServerConfig(step_ms=2.0)) as sim:
        path = tmp_path / "picker.yaml"
        path.write_text(json.dumps({"endpoints": [{"address": f"127.0.0.1:{sim.port}"}],
                                    "tenants": [{"id": "a"}]}))
        async with in_process(config_path=path) as (stop, health, ready):
            grpc_port, metrics_port = await asyncio.wait_for(asyncio.shield(ready), 15)
            await _until(lambda: _is(health, READINESS, SERVING))
            async with await tls_channel(grpc_port) as channel:
                picker = Picker(grpc_port, metrics_port, [f"127.0.0.1:{sim.port}"], channel)
                holder = picker.open()
                await route(holder, chat_body(max_tokens=50, stream=True),
                            headers={TENANT_HEADER: "a"})
                stop.set()  # SIGTERM
                await _until(lambda: _is(health, READINESS, NOT_SERVING))
                for service in READY_NAMES:
                    assert await _health(health, service) == NOT_SERVING
                assert await _health(health, LIVENESS) == SERVING  # not restarted mid-drain
                await relay_response(holder, 200, "text/event-stream", [b"data: [DONE]\n\n"])
                await holder.close()


def test_upstreams_ports_and_a_grace_that_outlasts_a_long_generation() -> None:
    settings = ServeSettings()
    assert (settings.grpc_port, settings.grpc_health_port, settings.metrics_port,
            settings.admin_port) == (9002, 9003, 9090, 9004)
    assert settings.secure_serving and settings.cert_path is None
    assert settings.grace >= 120
