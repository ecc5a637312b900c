"""A client cannot choose its tenant, its lane or its objective through any gateway config fairway
ships: a forged ``x-llm-d-inference-fairness-id: victim`` is charged to the authenticated tenant
(or the default one), never to ``victim``.

Through real Envoy: the stack's own Envoy in each identity mode (``strip`` with the picker's
header and API-key modes, ``jwt`` with locally minted tokens), the committed samples
manifests/gateway/envoy.yaml and envoy-jwt.yaml (addresses and keys substituted, nothing else),
and every gateway flavour of ``picker.stack.gateways``. The test-only ``trusted-client`` mode and a
route-level ``request_headers_to_remove`` show what the checks catch: there the forged tenant is
charged. The Gateway API samples (no Envoy to run) are checked for their header policies.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.identity import hash_api_key
from picker.stack.envoy import (
    CLIENT_CONTROLLED_HEADERS,
    JwtIdentity,
    early_header_removal,
    envoy_config,
)
from picker.stack.gateways import FLAVOURS, Wiring, gateway_config
from picker.stack.launcher import Stack
from scripts import gen_gateway_envoy
from tests.e2e.conftest import chat_body, metric, settled_metric
from tests.faults.helpers import post_with, shipped_envoy

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "manifests" / "gateway"
SMALL_CHAT = chat_body(max_tokens=2)
"""A chat request the engine answers in two tokens."""
FORGED = {"x-llm-d-inference-fairness-id": "victim", "x-gateway-inference-fairness-id": "victim",
          "x-fairway-lane": "batch", "x-gateway-inference-objective": "victim-objective"}
API_KEY = "sk-alice-test-key"
SECRET = b"fairway-forged-identity-test-secret"
TEST_JWKS = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "test",
                       "k": base64.urlsafe_b64encode(SECRET).rstrip(b"=").decode()}]}
JWT = JwtIdentity(issuer="https://issuer.test", jwks=TEST_JWKS, claim="tenant",
                  audiences=("fairway",))


def _picker_config(api_keys: bool = False) -> dict[str, Any]:
    tenant = {"lane": "online", "allowedLanes": ["batch"]}
    config: dict[str, Any] = {
        "lanes": [{"name": "online"}, {"name": "batch"}],
        "tenants": [{"id": t, **tenant} for t in ("victim", "alice", "anonymous")]}
    if api_keys:
        config["tenancy"] = {"mode": "apiKey",
                             "apiKeys": [{"sha256": hash_api_key(API_KEY), "tenant": "alice"}]}
    return config


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def mint(tenant: str, issuer: str = JWT.issuer, secret: bytes = SECRET) -> str:
    """An HS256 JWT naming ``tenant``, signed with ``secret``."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "test"}).encode())
    claims = _b64(json.dumps({"iss": issuer, "aud": "fairway", "tenant": tenant,
                              "exp": int(time.time()) + 3600}).encode())
    signature = hmac.new(secret, f"{header}.{claims}".encode(), hashlib.sha256).digest()
    return f"{header}.{claims}.{_b64(signature)}"


def _requests(stack: Stack, tenant: str, **labels: str) -> float:
    return metric(stack.metrics_url, "fairway_requests_total", tenant=tenant, **labels)


def assert_charged_to(stack: Stack, headers: dict[str, str], tenant: str,
                      lane_stripped: bool = True) -> None:
    """One request with ``headers`` (the forged ones among them) is charged to ``tenant``, and
    nothing to ``victim``; with ``lane_stripped``, in the tenant's own lane (the forged
    ``x-fairway-lane: batch`` never reached the picker)."""
    lane = {"lane": "online"} if lane_stripped else {}
    before = _requests(stack, tenant, **lane)
    assert post_with(stack, headers, SMALL_CHAT)[0] == 200
    assert settled_metric(stack.metrics_url, "fairway_requests_total", before + 1,
                          tenant=tenant, **lane) == before + 1
    assert _requests(stack, "victim") == 0
    if lane_stripped:
        assert _requests(stack, tenant, lane="batch") == 0


def _stack(tmp: Path, **kwargs: Any) -> Stack:
    kwargs.setdefault("picker_config", _picker_config())
    return Stack(tmp, endpoints=1, server_args=["--step-ms", "1"], **kwargs)


# --- the stack's Envoy (picker.stack.envoy) ---------------------------------------------------

def test_strip_charges_a_forged_tenant_to_the_default_tenant(tmp_path: Path) -> None:
    with _stack(tmp_path, identity="strip") as stack:
        assert_charged_to(stack, FORGED, "anonymous")


def test_strip_with_api_keys_charges_the_key_s_tenant(tmp_path: Path) -> None:
    with _stack(tmp_path, identity="strip", picker_config=_picker_config(api_keys=True)) as stack:
        assert_charged_to(stack, {**FORGED, "authorization": f"Bearer {API_KEY}"}, "alice")
        # A forged header is no key: refused, charged to nobody.
        assert post_with(stack, FORGED, SMALL_CHAT)[0] == 401
        assert _requests(stack, "victim") == 0


def test_api_key_mode_ignores_client_tenant_headers_even_when_they_reach_the_picker(
        tmp_path: Path) -> None:
    """The picker's own guarantee, without any stripping in front of it (the lane header then
    chooses among the tenant's allowed lanes, as designed)."""
    with _stack(tmp_path, picker_config=_picker_config(api_keys=True)) as stack:
        assert stack.identity == "trusted-client"
        assert_charged_to(stack, {**FORGED, "authorization": f"Bearer {API_KEY}"}, "alice",
                          lane_stripped=False)


def test_jwt_charges_the_token_s_tenant(tmp_path: Path) -> None:
    with _stack(tmp_path, identity="jwt", jwt=JWT) as stack:
        assert_charged_to(stack, {**FORGED, "authorization": f"Bearer {mint('alice')}"}, "alice")
        assert post_with(stack, FORGED, SMALL_CHAT)[0] == 401  # no token
        forged_token = mint("victim", secret=b"not-the-issuer-s-key")
        assert post_with(stack, {"authorization": f"Bearer {forged_token}"}, SMALL_CHAT)[0] == 401
        assert _requests(stack, "victim") == 0


def test_trusted_client_lets_the_client_choose_which_is_why_it_is_test_only(
        tmp_path: Path) -> None:
    """What every other test here guards against: the forged header chooses the tenant."""
    with _stack(tmp_path) as stack:
        before = _requests(stack, "victim")
        assert post_with(stack, FORGED, SMALL_CHAT)[0] == 200
        assert settled_metric(stack.metrics_url, "fairway_requests_total", before + 1,
                              tenant="victim") == before + 1


def test_a_route_level_removal_is_too_late_for_the_picker(tmp_path: Path) -> None:
    """Why the configs remove the headers early: a route's ``request_headers_to_remove`` (what
    an HTTPRoute RequestHeaderModifier becomes) runs in the router, after ext_proc read them."""
    def build(stack: Stack) -> dict[str, Any]:
        config = envoy_config(listen_port=stack.gateway_port, admin_port=stack.admin_port,
                              picker_port=stack.grpc_port, picker_tls=stack.secure_serving,
                              identity="trusted-client")
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        (host,) = manager["typed_config"]["route_config"]["virtual_hosts"]
        host["request_headers_to_remove"] = list(CLIENT_CONTROLLED_HEADERS)
        return config
    with _stack(tmp_path, envoy_bootstrap=build) as stack:
        assert post_with(stack, FORGED, SMALL_CHAT)[0] == 200
        assert settled_metric(stack.metrics_url, "fairway_requests_total", 1.0,
                              tenant="victim") == 1.0


# --- the committed Envoy samples ---------------------------------------------------------------

_sample = shipped_envoy


def test_shipped_envoy_yaml_charges_a_forged_tenant_to_the_default_tenant(
        tmp_path: Path) -> None:
    with _stack(tmp_path, envoy_bootstrap=_sample("envoy.yaml")) as stack:
        assert_charged_to(stack, FORGED, "anonymous")


def test_shipped_envoy_yaml_with_api_keys_charges_the_key_s_tenant(tmp_path: Path) -> None:
    with _stack(tmp_path, envoy_bootstrap=_sample("envoy.yaml"),
                picker_config=_picker_config(api_keys=True)) as stack:
        assert_charged_to(stack, {**FORGED, "authorization": f"Bearer {API_KEY}"}, "alice")


def test_shipped_envoy_jwt_yaml_charges_the_token_s_tenant(tmp_path: Path) -> None:
    issuer = gen_gateway_envoy.PLACEHOLDER_JWT.issuer
    with _stack(tmp_path, envoy_bootstrap=_sample("envoy-jwt.yaml", TEST_JWKS)) as stack:
        token = mint("alice", issuer=issuer)
        assert_charged_to(stack, {**FORGED, "authorization": f"Bearer {token}"}, "alice")
        assert post_with(stack, FORGED, SMALL_CHAT)[0] == 401
        assert _requests(stack, "victim") == 0


# --- the gateway flavours ----------------------------------------------------------------------

@pytest.fixture(params=sorted(FLAVOURS))
def flavour_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    def build(stack: Stack) -> dict[str, Any]:
        return gateway_config(request.param, Wiring(
            listen_port=stack.gateway_port, admin_port=stack.admin_port,
            picker_port=stack.grpc_port, endpoints=list(stack.endpoint_addresses),
            picker_tls=stack.secure_serving))
    config = {**_picker_config(), "queue": {"maxWait": "4s"}}  # kgateway's 5 s message timeout
    with _stack(tmp_path, envoy_bootstrap=build, picker_config=config) as stack:
        yield stack


def test_each_gateway_flavour_charges_a_forged_tenant_to_the_default_tenant(
        flavour_stack: Stack) -> None:
    assert_charged_to(flavour_stack, FORGED, "anonymous")


# --- the Gateway API samples -------------------------------------------------------------------

def _documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((SAMPLES / name).read_text()) if d]


GATEWAY_API_SAMPLES = ["gateway-api.yaml", "envoy-ai-gateway.yaml", "kgateway.yaml",
                       "istio.yaml"]


@pytest.mark.parametrize("name", GATEWAY_API_SAMPLES)
def test_each_httproute_removes_the_client_controlled_headers(name: str) -> None:
    routes = [d for d in _documents(name) if d["kind"] == "HTTPRoute"]
    assert routes
    for route in routes:
        for rule in route["spec"]["rules"]:
            removed = [h for f in rule.get("filters", [])
                       if f["type"] == "RequestHeaderModifier"
                       for h in f["requestHeaderModifier"].get("remove", [])]
            assert sorted(removed) == sorted(CLIENT_CONTROLLED_HEADERS), route["metadata"]


def _early_removed(name: str) -> list[str]:
    """The headers the sample's implementation-specific policy removes before routing."""
    found: list[str] = []
    for doc in _documents(name):
        if doc["kind"] == "ClientTrafficPolicy":  # Envoy Gateway
            found += doc["spec"]["headers"]["earlyRequestHeaders"]["remove"]
        elif doc["kind"] == "ListenerPolicy":  # kgateway
            found += doc["spec"]["default"]["httpSettings"]["earlyRequestHeaderModifier"][
                "remove"]
        elif doc["kind"] == "EnvoyFilter":  # Istio
            for patch in doc["spec"]["configPatches"]:
                typed = patch["patch"]["value"]["typed_config"]
                for extension in typed["early_header_mutation_extensions"]:
                    found += [m["remove"] for m in extension["typed_config"]["mutations"]]
    return found


@pytest.mark.parametrize("name", ["envoy-ai-gateway.yaml", "kgateway.yaml", "istio.yaml"])
def test_each_implementation_sample_removes_the_headers_before_the_picker(name: str) -> None:
    assert sorted(_early_removed(name)) == sorted(CLIENT_CONTROLLED_HEADERS)


def test_the_istio_envoyfilter_is_what_envoy_accepts() -> None:
    """The EnvoyFilter's extension is exactly the one the flavours run through real Envoy."""
    (envoy_filter,) = [d for d in _documents("istio.yaml") if d["kind"] == "EnvoyFilter"]
    (patch,) = envoy_filter["spec"]["configPatches"]
    assert patch["patch"]["value"]["typed_config"]["early_header_mutation_extensions"] == \
        early_header_removal()
