"""A gateway that dials the picker over TLS without verifying it, presenting its client
certificate (the picker takes ext_proc only from it), gets fair service.

Envoy AI Gateway and kgateway always reach an Endpoint Picker through an ``UpstreamTlsContext``
with no validation context, and stream the response through it inline. Here real Envoy is
configured that way in front of a picker that serves its default self-signed certificate and
requires a client certificate of the stack's CA (``--client-ca``); the test checks that Envoy
presented it, that a client without one is refused at the handshake, that Envoy really spoke TLS
to it (its TLS handshake counters on the ``picker``
cluster) and that two backlogged tenants with weights 1 and 3 split the service 1:3.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import yaml
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.sim.load import run_traffic
from picker.sim.traffic import load_traffic
from picker.stack.envoy import UPSTREAM_TLS
from picker.stack.launcher import Stack
from picker.tls import server_certificate, unverified_channel_credentials
from tests.e2e.conftest import metric, wait_until, window_shares

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {"tenants": [{"id": "light", "weight": 1}, {"id": "heavy", "weight": 3}],
              "queue": {"maxWait": "60s"}}
    with Stack(tmp_path_factory.mktemp("tls"), policy="vtc", endpoints=2,
               server_args=["--kv-budget-tokens", "1024", "--step-ms", "5"],
               picker_config=config, response_path="inline") as running:
        yield running


def _envoy_stats(stack: Stack) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.admin_port}/stats?format=json",
                                timeout=5) as response:
        stats = json.load(response)["stats"]
    return {s["name"]: s["value"] for s in stats if "value" in s}


def test_envoy_dials_the_picker_over_tls_without_verification(stack: Stack) -> None:
    config = yaml.safe_load((stack.workdir / "envoy.yaml").read_text())
    (picker,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "picker"]
    socket = picker["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    context = socket["typed_config"]
    assert context["@type"] == UPSTREAM_TLS
    assert "validation_context" not in context["common_tls_context"]  # nothing verified
    # Envoy presents the stack's gateway certificate, which the picker requires.
    assert stack.picker_client_auth == "mtls"
    (pair,) = context["common_tls_context"]["tls_certificates"]
    assert (pair["certificate_chain"]["filename"], pair["private_key"]["filename"]) == \
        tuple(map(str, stack.gateway_client_cert))
    # What the picker presents is self-signed: nothing could have verified it.
    cert = x509.load_pem_x509_certificate(server_certificate("127.0.0.1", stack.grpc_port))
    assert cert.issuer == cert.subject


def test_backlogged_tenants_split_service_by_weight_over_tls(stack: Stack) -> None:
    spec = {"backlog": 24, "prompt_tokens": [40, 120], "output_tokens": [20, 60],
            "stream_fraction": 0.5, "include_usage": True}
    traffic = load_traffic({"duration_s": 8, "seed": 5, "timeout_s": 30, "tenants": [
        {"name": "light", **spec}, {"name": "heavy", **spec}]})
    result = asyncio.run(run_traffic(traffic, stack.gateway_url))
    tenants = result.summary["tenants"]
    assert tenants["light"]["ok"] > 0 and tenants["heavy"]["ok"] > 0
    # Weights 1:3; without fairness (FCFS) each would get one half: the bound is a quarter of the
    # way from 3/4 to that.
    shares = window_shares(result.records, 1.0, traffic.duration_s)
    assert shares["heavy"] == pytest.approx(3 / 4, abs=1 / 16), (shares, tenants)
    # Every request went through the picker (one ext_proc stream each), over TLS.
    stats = _envoy_stats(stack)
    assert stats.get("cluster.picker.ssl.handshake", 0) >= 1
    assert stats.get("cluster.picker.ssl.connection_error", 0) == 0
    assert stats["cluster.picker.upstream_rq_total"] >= sum(t["sent"] for t in tenants.values())
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_running_requests") == 0)


def test_a_client_without_the_gateway_certificate_is_refused(stack: Stack) -> None:
    async def check() -> grpc.StatusCode:
        credentials = await asyncio.to_thread(unverified_channel_credentials, "127.0.0.1",
                                              stack.grpc_port)
        async with grpc.aio.secure_channel(f"127.0.0.1:{stack.grpc_port}", credentials) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        return refused.value.code()

    assert asyncio.run(check()) == grpc.StatusCode.UNAVAILABLE
    # The refused handshake left Envoy's own connection alone: it still routes.
    assert _envoy_stats(stack).get("cluster.picker.ssl.connection_error", 0) == 0
