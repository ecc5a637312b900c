"""The admin API over real gRPC, and ``python -m picker.ctl top`` against it.

Most tests share one local stack (real Envoy, the picker as a process started by
``picker.stack.launcher.Stack``, one simulated vLLM server): requests go through the gateway, then
the picker's admin port is asked who it served. One test runs ``serve()`` in-process to check the
admin server's own port, health and shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from picker.admin.service import ADMIN_SERVICE
from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.server import ServeSettings, serve
from picker.sim.server import SimServer, SimServerConfig
from picker.stack.launcher import Stack, hold_port
from tests.e2e.conftest import wait_until
from tests.tls import gateway_pair, tls_channel

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TENANT_HEADER = "x-gateway-inference-fairness-id"
#: For one request, RPC or scrape, and for the settlement of a request: on the meter-stream path
#: the picker settles a request when its meter stream comes, or when ``--meter-claim-timeout``
#: (10 s) runs out on a CPU-starved machine.
TIMEOUT = 15.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {"tenants": [{"id": "alice", "weight": 2}, {"id": "idle"}]}
    with Stack(tmp_path_factory.mktemp("admin"), policy="vtc", endpoints=1,
               server_args=["--step-ms", "2"], picker_config=config) as running:
        for tenant, count in (("alice", 3), ("bob", 1)):
            for _ in range(count):
                assert _post(running, tenant) == 200
        _settled(running, 4)
        yield running


def _settled(stack: Stack, requests: int) -> None:
    """Until the picker has settled ``requests`` requests: on the meter-stream path it settles
    each just after the client has its answer."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        with urllib.request.urlopen(stack.metrics_url, timeout=TIMEOUT) as response:
            text = response.read().decode()
        done = sum(s.value for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == "fairway_requests_total")
        if done >= requests:
            return
        time.sleep(0.02)
    raise AssertionError(f"the picker settled fewer than {requests} requests")


def _post(stack: Stack, tenant: str) -> int:
    body = json.dumps({"model": "sim-model", "max_tokens": 8, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "the cat sat on a mat " * 8}]})
    request = urllib.request.Request(
        stack.gateway_url + "/v1/chat/completions", data=body.encode(), method="POST",
        headers={TENANT_HEADER: tenant, "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        response.read()
        return response.status


async def _tenants(address: str, *only: str) -> dict[str, admin_pb2.TenantState]:
    async with grpc.aio.insecure_channel(address) as channel:
        answer = await admin_pb2_grpc.AdminStub(channel).ListTenants(
            admin_pb2.ListTenantsRequest(tenants=only), timeout=TIMEOUT)
    return {t.tenant: t for t in answer.tenants}


def _ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "picker.ctl", "top", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30, check=False)


def test_the_launcher_reports_the_admin_port_the_picker_printed(stack: Stack) -> None:
    assert stack.admin_grpc_port not in (0, stack.grpc_port, stack.metrics_port, stack.admin_port,
                                         stack.health_port)
    log = (stack.workdir / "picker.log").read_text()
    assert f"picker admin listening admin={stack.admin_address}\n" in log


async def test_tenants_served_through_the_gateway_are_listed_with_their_service(
        stack: Stack) -> None:
    tenants = await _tenants(stack.admin_address)
    assert set(tenants) == {"alice", "bob", "idle"}
    alice, bob, idle = tenants["alice"], tenants["bob"], tenants["idle"]
    assert (alice.configured, alice.weight, bob.configured, bob.weight) == (True, 2, False, 1)
    assert alice.total_service > bob.total_service > 0  # three requests against one
    assert alice.window_service == pytest.approx(alice.total_service)
    assert alice.virtual_counter == pytest.approx(alice.total_service / 2)
    assert (idle.total_service, idle.service_share) == (0, 0)
    assert alice.service_share + bob.service_share == pytest.approx(1)
    assert alice.service_share == pytest.approx(
        alice.total_service / (alice.total_service + bob.total_service))
    assert set(await _tenants(stack.admin_address, "bob", "nobody")) == {"bob"}


async def test_endpoints_and_health_are_served_on_the_admin_port(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.admin_address) as channel:
        answer = await admin_pb2_grpc.AdminStub(channel).ListEndpoints(
            admin_pb2.ListEndpointsRequest(), timeout=TIMEOUT)
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", ADMIN_SERVICE):
            status = await health.Check(health_pb2.HealthCheckRequest(service=service),
                                        timeout=TIMEOUT)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert [e.address for e in answer.endpoints] == stack.endpoint_addresses
    endpoint = answer.endpoints[0]
    assert endpoint.budget_tokens > 0 and not endpoint.draining
    assert endpoint.inflight_requests == 0  # every request above has finished
    assert 0 <= endpoint.kv_usage <= 1  # scraped from the simulated server


async def test_the_gateways_port_does_not_serve_the_admin_api(stack: Stack) -> None:
    # TLS with the gateway's certificate, as the gateway dials it.
    async with await tls_channel(stack.grpc_port,
                                 client=gateway_pair(*stack.gateway_client_cert)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin_pb2_grpc.AdminStub(channel).ListTenants(admin_pb2.ListTenantsRequest(),
                                                                timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- picker.ctl top --


def test_top_once_prints_the_tenants_busiest_first_and_the_endpoints(stack: Stack) -> None:
    done = _ctl("--once", "--admin", stack.admin_address, "--timeout", str(TIMEOUT))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout  # --once is for scripts: no terminal escapes
    lines = done.stdout.splitlines()
    assert stack.admin_address in lines[0]
    assert lines[1].split()[:4] == ["TENANT", "LANE", "WEIGHT", "SHARE"]
    rows = {line.split()[0]: line.split() for line in lines[2:5]}
    assert [line.split()[0] for line in lines[2:5]] == ["alice", "bob", "idle"]
    assert rows["alice"][1:3] == ["default", "2"]
    assert float(rows["alice"][3].rstrip("%")) > float(rows["bob"][3].rstrip("%")) > 0
    assert rows["idle"][3] == "0.0%"
    assert any(line.startswith(stack.endpoint_addresses[0]) for line in lines[5:])


def test_top_refreshes_with_escapes_until_stopped(stack: Stack) -> None:
    clear = b"\x1b[H\x1b[2J"
    process = subprocess.Popen([sys.executable, "-m", "picker.ctl", "top", "--interval", "0.2",
                                "--admin", stack.admin_address, "--timeout", str(TIMEOUT)],
                               cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    out = bytearray()
    reader = threading.Thread(target=_read_all, args=(process.stdout, out), daemon=True)
    reader.start()
    try:
        # Two frames, each cleared and drawn, then still running until told to stop.
        refreshed = wait_until(lambda: out.count(clear) >= 2 and out.count(b"alice") >= 2,
                               timeout=20)
        assert process.poll() is None, process.stderr.read().decode()
    finally:
        process.terminate()
        process.wait(timeout=10)
        reader.join(timeout=10)
    assert refreshed, (bytes(out), process.stderr.read().decode())


def _read_all(stream: IO[bytes], into: bytearray) -> None:
    while chunk := os.read(stream.fileno(), 4096):
        into += chunk


def test_top_names_the_address_it_cannot_reach() -> None:
    with hold_port(0) as held:  # bound, never listening: refused, and nobody else's meanwhile
        address = f"127.0.0.1:{held.getsockname()[1]}"
        done = _ctl("--once", "--admin", address, "--timeout", "3")
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"cannot reach the picker's admin API at {address}" in done.stderr
    assert "Traceback" not in done.stderr


def test_top_says_when_the_address_is_not_an_admin_api(stack: Stack) -> None:
    address = f"127.0.0.1:{stack.health_port}"  # gRPC, plaintext, but only health
    done = _ctl("--once", "--admin", address, "--timeout", str(TIMEOUT))
    assert done.returncode == 1
    assert address in done.stderr and "does not serve fairway.v1.Admin" in done.stderr


def test_top_refuses_an_address_without_a_port() -> None:
    done = _ctl("--once", "--admin", "localhost")
    assert done.returncode == 2
    assert "not HOST:PORT" in done.stderr


# -- serve() in-process --


async def test_serve_binds_the_admin_api_on_its_own_port_and_closes_it_on_stop(
        tmp_path: Path) -> None:
    async with SimServer(SimServerConfig(step_ms=2.0)) as sim:
        path = tmp_path / "picker.yaml"
        path.write_text(json.dumps({"endpoints": [{"address": f"127.0.0.1:{sim.port}"}],
                                    "tenants": [{"id": "a"}]}))
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[tuple[int, int]] = loop.create_future()
        admin_ready: asyncio.Future[int] = loop.create_future()
        stop = asyncio.Event()
        settings = ServeSettings(path, grpc_port=0, grpc_health_port=0, metrics_port=0,
                                 admin_port=0, grace=1.0, client_auth="trust-network")
        task = asyncio.create_task(serve(settings, stop, ready, admin_ready))
        try:
            grpc_port, metrics_port = await asyncio.wait_for(asyncio.shield(ready), TIMEOUT)
            admin_port = admin_ready.result()
            assert admin_port not in (0, grpc_port, metrics_port)
            tenants = await _tenants(f"127.0.0.1:{admin_port}")
            assert list(tenants) == ["a"] and tenants["a"].configured
            assert _listens(admin_port)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
        # Asked of this process's sockets rather than by dialling the port: once closed, the port
        # may already be another process's (tests run in parallel).
        assert not _listens(admin_port)


def _listens(port: int) -> bool:
    """Whether this process has a TCP socket listening on ``port``."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                mine.add(target.removeprefix("socket:[").removesuffix("]"))
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()  # local address HEX:PORT, state 0A = LISTEN, inode
            if (int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A"
                    and fields[9] in mine):
                return True
    return False
