"""Can a hostile pod read the tenants off a picker started as the chart starts it?

The attack (issue 26): from any pod, the metrics page, the admin API (``ListTenants``) and
health gave every tenant's name, weight, budget and share, with no credentials. Here a real
picker process gets the chart's arguments (``--host=0.0.0.0``, ``--admin-token-file``,
``--metrics-token-file``, mTLS on ext_proc with the gateway CA), and a client that holds none of
the tokens dials it at this machine's own address, as a pod dials the picker's pod IP:

* every ``fairway.v1.Admin`` call (``ListTenants``, ``ListEndpoints``, ``RecentRequests``)
  without a token, with a wrong one, or with the token not in the Bearer form is refused
  UNAUTHENTICATED, and the refusal names no tenant;
* ``/metrics`` without the token, or with another, is 401 and its body names no tenant;
* health (its own port and the admin port's) answers SERVING and names no tenant;
* with the right tokens both listings name the tenants, so the refusals above are refusals.
"""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import grpc
import pytest
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.admin.auth import bearer
from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.tls import certificate_authority
from tests.integration.test_gateway_auth import GATEWAY, TOKEN
from tests.integration.test_gateway_auth import _picker as picker_process

pytestmark = pytest.mark.faults

TENANTS = ("victim", "gateway-user")  # the tenants test_gateway_auth's picker is configured with
METRICS_TOKEN = "metrics-" + "4" * 40
TIMEOUT = 10.0
WRONG = (None, bearer("wrong"), bearer(TOKEN[:-1]), (("authorization", TOKEN),))


def _pod_address() -> str:
    """This machine's own non-loopback address (a pod reaches the picker at its pod IP, not on
    loopback); 127.0.0.1 where the machine has no route out. Connecting a UDP socket sends
    nothing: it only picks the source address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def _names_no_tenant(text: str | bytes) -> bool:
    raw = text.encode() if isinstance(text, str) else text
    return not any(tenant.encode() in raw for tenant in TENANTS)


async def test_a_pod_without_the_tokens_reads_no_tenant(tmp_path: Path) -> None:
    admin_token, metrics_token, ca_file = (tmp_path / "admin-token", tmp_path / "metrics-token",
                                           tmp_path / "ca.crt")
    admin_token.write_text(TOKEN + "\n")  # as a Secret mounts it, newline and all
    metrics_token.write_text(METRICS_TOKEN)
    ca_file.write_bytes(certificate_authority("gateway-ca").cert_pem)
    chart_args = ("--host=0.0.0.0", "--client-ca", str(ca_file), "--client-name", GATEWAY,
                  "--admin-token-file", str(admin_token),
                  "--metrics-token-file", str(metrics_token))
    host = _pod_address()
    async with picker_process(tmp_path, *chart_args) as (running, _, admin):
        health_line = await running.wait_for_output("picker health listening", running.stdout)
        health_port = int(health_line.rsplit(":", 1)[1])
        async with grpc.aio.insecure_channel(f"{host}:{admin}") as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            calls = ((stub.ListTenants, admin_pb2.ListTenantsRequest()),
                     (stub.ListEndpoints, admin_pb2.ListEndpointsRequest()),
                     (stub.RecentRequests, admin_pb2.RecentRequestsRequest()))
            for call, request in calls:
                for metadata in WRONG:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call(request, timeout=TIMEOUT, metadata=metadata)
                    error = refused.value
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (call, metadata)
                    assert _names_no_tenant(f"{error.details()} {error.trailing_metadata()} "
                                            f"{error.debug_error_string()}"), error
            # Health on the admin port is open and says only SERVING.
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            _assert_serving_and_silent(answer)
            # The operator's and picker.ctl's token lists them: the refusals were refusals.
            listed = await stub.ListTenants(admin_pb2.ListTenantsRequest(), timeout=TIMEOUT,
                                            metadata=bearer(TOKEN))
            assert {t.tenant for t in listed.tenants} == set(TENANTS)
        async with grpc.aio.insecure_channel(f"{host}:{health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "liveness", "readiness"):
                _assert_serving_and_silent(await health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT))
        url = f"http://{host}:{running.metrics_port}/metrics"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) \
                as session:
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": f"Bearer {TOKEN}"},  # the admin token is not it
                            {"Authorization": METRICS_TOKEN}):
                async with session.get(url, headers=headers) as page:
                    body = await page.read()
                    assert page.status == 401, (headers, page.status)
                    assert _names_no_tenant(body), body[:300]
            async with session.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}) \
                    as page:
                assert page.status == 200
                # The page names the configured tenants even before any traffic.
                assert not _names_no_tenant(await page.read())


def _assert_serving_and_silent(answer: Message) -> None:
    assert isinstance(answer, health_pb2.HealthCheckResponse)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    assert _names_no_tenant(answer.SerializeToString()) and _names_no_tenant(str(answer))
