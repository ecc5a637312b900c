"""Only the gateway speaks ext_proc, and only with credentials does anyone list the tenants.

On real picker processes:

* ``--client-ca``: a client certificate of that CA is required at the handshake. The gateway's
  routes and is charged; a client without a certificate, or with one of another CA (naming the
  gateway), cannot open a stream; one of the right CA whose name is not ``--client-name`` is
  refused before a message is read. None of them routes or charges ``victim``.
* Without a CA (``--client-auth=none``, the default) and the config in header mode, every
  stream is refused, counted in ``fairway_ext_proc_peers_refused_total``; in API-key mode the
  picker authenticates each request itself and serves.
* ``--admin-token-file``: ``ListTenants`` without the token, or with another, is
  UNAUTHENTICATED; with it, answered; the admin port's health needs none; ``picker.ctl`` sends
  the token from ``--token-file``. A picker told to listen beyond loopback without a token does
  not start. With ``--metrics-token-file`` the metrics page (tenant labels) asks for its token
  too.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.identity import hash_api_key
from picker.sim.server import SimServer, SimServerConfig
from picker.tls import KeyPair, certificate_authority, issue, unverified_channel_credentials
from tests.integration.test_extproc_contract import (
    TENANT_HEADER,
    Picker,
    chat_body,
    relay_response,
    request_body,
    request_headers,
    route,
)
from tests.integration.test_picker_process import ROOT, Process, spawn, write_config

pytestmark = pytest.mark.integration

GATEWAY = "fairway-gateway"
TOKEN = "s3cret-admin-token-of-forty-characters-x"


def _credentials(port: int, client: KeyPair | None) -> grpc.ChannelCredentials:
    return unverified_channel_credentials("127.0.0.1", port, 5.0, client)


@contextlib.asynccontextmanager
async def _picker(tmp_path: Path, *flags: str, **config: object
                  ) -> AsyncIterator[tuple[Process, str, int]]:
    """A picker over one simulated server; yields it, the server's address and the admin
    port."""
    async with SimServer(SimServerConfig(step_ms=2.0)) as sim:
        address = f"127.0.0.1:{sim.port}"
        path = tmp_path / "picker.yaml"
        write_config(path, {"endpoints": [{"address": address}],
                            "tenants": [{"id": "victim"}, {"id": "gateway-user"}], **config})
        running = await spawn(path, *flags)
        try:
            line = await running.wait_for_output("picker admin listening", running.stdout)
            admin = int(line.rsplit(":", 1)[1])
            await running.wait_for_output("picker listening", running.stdout)
            yield running, address, admin
        finally:
            if running.process.returncode is None:
                running.process.kill()
            await running.exit_code(10)


async def _open_and_send(port: int, client: KeyPair | None, tenant: str) -> grpc.StatusCode:
    """An ext_proc client of our own naming ``tenant``, which must get no answer (no route);
    returns what the picker says to this peer.

    That status is read from a second stream that writes nothing: the picker refuses a stream
    before reading a message, and a client write racing that refusal reaches the client as
    INTERNAL ("Internal error from Core") now and then, whatever the picker sent."""
    credentials = await asyncio.to_thread(_credentials, port, client)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await call.write(request_headers(headers={TENANT_HEADER: tenant}))
            await call.write(request_body(chat_body(max_tokens=30), True))
            reply = await asyncio.wait_for(call.read(), 15)
            assert reply is grpc.aio.EOF, reply  # never a route
        probe = stub.Process()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(probe.read(), 15)
        return refused.value.code()


async def test_only_a_client_certificate_of_the_gateway_ca_routes_and_charges(
        tmp_path: Path) -> None:
    ca = certificate_authority("gateway-ca")
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    gateway = issue(ca, [GATEWAY])
    stranger = issue(certificate_authority("another-ca"), [GATEWAY])  # same name, other CA
    wrong_name = issue(ca, ["someone-else"])
    async with _picker(tmp_path, "--client-ca", str(ca_file), "--client-name", GATEWAY) \
            as (running, address, _):
        port = running.grpc_port
        assert await _open_and_send(port, None, "victim") == grpc.StatusCode.UNAVAILABLE
        assert await _open_and_send(port, stranger, "victim") == grpc.StatusCode.UNAVAILABLE
        assert await _open_and_send(port, wrong_name, "victim") == \
            grpc.StatusCode.PERMISSION_DENIED
        # The gateway routes (and its request is charged once settled).
        credentials = await asyncio.to_thread(_credentials, port, gateway)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            picker = Picker(port, running.metrics_port, [address], channel)
            stream = picker.open()
            routed = await route(stream, chat_body(max_tokens=4),
                                 headers={TENANT_HEADER: "gateway-user"})
            assert routed.destinations[0] == address
            await relay_response(stream, 200, "application/json", [
                b'{"usage": {"prompt_tokens": 6, "completion_tokens": 4}}'])
            await stream.close()
            await picker.eventually("fairway_requests_total", 1, tenant="gateway-user")
            # The impostors: nothing admitted, routed or charged for victim, and each refusal
            # past the handshake counted.
            assert await picker.metric("fairway_requests_total", tenant="victim") == 0
            assert await picker.metric("fairway_weighted_service_total", tenant="victim") == 0
            # (each _open_and_send is two streams: the impostor's and the probe)
            assert await picker.metric("fairway_ext_proc_peers_refused_total",
                                       reason="name") == 2


async def test_without_a_ca_header_mode_is_refused_and_api_keys_are_served(
        tmp_path: Path) -> None:
    async with _picker(tmp_path, "--client-auth=none") as (running, address, _):
        port = running.grpc_port
        assert await _open_and_send(port, None, "victim") == grpc.StatusCode.PERMISSION_DENIED
        credentials = await asyncio.to_thread(_credentials, port, None)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            picker = Picker(port, running.metrics_port, [address], channel)
            assert await picker.metric("fairway_ext_proc_peers_refused_total",
                                       reason="unauthenticated") == 2
            assert await picker.metric("fairway_requests_total", tenant="victim") == 0
        assert "every ext_proc stream is refused" in "".join(running.stderr)
    key = "k-" + "7" * 40
    async with _picker(tmp_path, "--client-auth=none", tenancy={
            "mode": "apiKey", "apiKeys": [{"sha256": hash_api_key(key), "tenant": "victim"}]}) \
            as (running, address, _):
        port = running.grpc_port
        credentials = await asyncio.to_thread(_credentials, port, None)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            picker = Picker(port, running.metrics_port, [address], channel)
            routed = await route(picker.open(), chat_body(max_tokens=4),
                                 headers={"authorization": f"Bearer {key}"})
            assert routed.destinations[0] == address


async def test_listing_tenants_needs_the_admin_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with _picker(tmp_path, "--admin-token-file", str(token_file)) as (_, _, admin):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{admin}") as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            for metadata in (None, (("authorization", "Bearer wrong"),),
                             (("authorization", TOKEN),)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ListTenants(admin_pb2.ListTenantsRequest(), timeout=10,
                                           metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ListEndpoints(admin_pb2.ListEndpointsRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = await stub.ListTenants(admin_pb2.ListTenantsRequest(), timeout=10,
                                            metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert {t.tenant for t in answer.tenants} == {"victim", "gateway-user"}
            # Health needs no token and says nothing of tenants.
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        # picker.ctl sends it from --token-file; without, it says what is missing.
        ctl = [sys.executable, "-m", "picker.ctl", "top", "--admin", f"127.0.0.1:{admin}",
               "--once"]
        shown = await asyncio.to_thread(subprocess.run, [*ctl, "--token-file", str(token_file)],
                                        capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert shown.returncode == 0 and "victim" in shown.stdout, shown.stderr
        refused_ctl = await asyncio.to_thread(subprocess.run, ctl, capture_output=True,
                                              text=True, timeout=30, cwd=ROOT)
        assert refused_ctl.returncode == 1 and "admin token" in refused_ctl.stderr


def test_an_admin_api_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    write_config(path, {"endpoints": [{"address": "127.0.0.1:9"}]})
    started = subprocess.run(
        [sys.executable, "-m", "picker", "serve", "--config", str(path), "--host", "0.0.0.0",
         "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
         "--admin-port", "0"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert started.returncode == 2
    assert "--admin-token-file" in started.stderr and "lists every tenant" in started.stderr


async def test_the_metrics_page_needs_its_token(tmp_path: Path) -> None:
    """The page names every tenant: without the token (or with another) 401 and no page."""
    token_file = tmp_path / "metrics-token"
    token_file.write_text("metrics-" + "9" * 40)
    async with _picker(tmp_path, "--metrics-token-file", str(token_file)) as (running, _, _):
        url = f"http://127.0.0.1:{running.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": token_file.read_text()}):
                async with session.get(url, headers=headers) as refused:
                    assert refused.status == 401
                    assert "victim" not in await refused.text()
            async with session.get(url, headers={
                    "Authorization": f"Bearer {token_file.read_text()}"}) as page:
                assert page.status == 200
                assert "fairway_" in await page.text()
