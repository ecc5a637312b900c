"""A client that sends a tenant header beside its API key cannot choose its tenant, whichever of
the SDKs' key headers it uses (``Authorization: Bearer``, Anthropic's ``x-api-key``, Azure's
``api-key``), and no client's key reaches the model server, whatever Envoy is in front: the
stack's own (``strip``), the committed manifests/gateway/envoy.yaml, and one that removes nothing
(``trusted-client``: only the picker's own header mutation is left to hold), and Envoy AI
Gateway's buffered form (the removal rides on the picker's answer to the body). The model server
here records every request's headers.

And the strip list follows the picker's config: a picker told to read ``x-tenant-id`` behind an
Envoy generated for its config charges a forged ``x-tenant-id`` to the default tenant; behind the
shipped envoy.yaml (which removes the default names only) the forged tenant is charged, which is
what ``python -m picker.config check --gateway`` refuses.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config.schema import load_config
from picker.config.trusted import check_stripped, early_removed
from picker.errors import ConfigError
from picker.identity import KEY_HEADERS, hash_api_key
from picker.stack.gateways import Wiring, gateway_config
from picker.stack.launcher import Stack
from tests.e2e.conftest import metric, settled_metric, wait_until
from tests.e2e.test_policy import RecordingUpstream
from tests.faults.helpers import SAMPLES, post_with, shipped_envoy

FORGED = {"x-llm-d-inference-fairness-id": "victim", "x-gateway-inference-fairness-id": "victim"}
KEY = "sk-keyed-0123456789abcdef"
OTHER = "sk-other-0123456789abcdef"
CONFIG: dict[str, Any] = {
    "tenancy": {"mode": "apiKey", "apiKeys": [
        {"sha256": hash_api_key(KEY), "tenant": "keyed"},
        {"sha256": hash_api_key(OTHER), "tenant": "other-keyed"}]},
    "capacity": {"kvBudgetTokens": 4096},
    "tenants": [{"id": "keyed"}, {"id": "other-keyed"}, {"id": "victim"}, {"id": "anonymous"}],
}


def _key(name: str, key: str = KEY) -> dict[str, str]:
    return {name: f"Bearer {key}" if name == "authorization" else key}


def _body(marker: str) -> bytes:
    return json.dumps({"model": "rec-model", "max_tokens": 2, "user": marker,
                       "messages": [{"role": "user", "content": "hello there"}]}).encode()


def _requests(stack: Stack, tenant: str) -> float:
    return metric(stack.metrics_url, "fairway_requests_total", tenant=tenant)


@pytest.fixture(scope="module")
def upstream() -> Iterator[RecordingUpstream]:
    recording = RecordingUpstream().start()
    try:
        yield recording
    finally:
        recording.stop()


def _buffered_flavour(stack: Stack) -> dict[str, Any]:
    """Envoy AI Gateway with buffered bodies: the picker answers on the body, and its removal
    of the key headers rides on that answer."""
    return gateway_config("envoy-ai-gateway-buffered", Wiring(
        listen_port=stack.gateway_port, admin_port=stack.admin_port,
        picker_port=stack.grpc_port, endpoints=list(stack.endpoint_addresses),
        picker_tls=stack.secure_serving))


GATEWAYS: dict[str, dict[str, Any]] = {
    "stack-strip": {"identity": "strip"},
    "shipped-envoy-yaml": {"envoy_bootstrap": shipped_envoy("envoy.yaml")},
    "removes-nothing": {"identity": "trusted-client"},
    "envoy-ai-gateway-buffered": {"envoy_bootstrap": _buffered_flavour},
}


@pytest.fixture(scope="module", params=sorted(GATEWAYS))
def keyed_stack(request: pytest.FixtureRequest, upstream: RecordingUpstream,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("key-headers"), policy="vtc", endpoints=0,
               external_endpoints=[upstream.address], picker_config=CONFIG,
               **GATEWAYS[request.param]) as stack:
        yield stack


@pytest.mark.parametrize("name", KEY_HEADERS)
def test_a_spoofed_tenant_beside_each_key_header_is_ignored_and_no_key_reaches_the_engine(
        keyed_stack: Stack, upstream: RecordingUpstream, name: str) -> None:
    marker = uuid.uuid4().hex
    before = _requests(keyed_stack, "keyed")
    status, _, body = post_with(keyed_stack, {**FORGED, **_key(name)}, _body(marker))
    assert status == 200, body
    assert settled_metric(keyed_stack.metrics_url, "fairway_requests_total", before + 1,
                          tenant="keyed") == before + 1
    assert _requests(keyed_stack, "victim") == 0
    (received,) = upstream.find(marker)
    assert not set(KEY_HEADERS) & set(received["headers"]), received["headers"]
    assert KEY not in json.dumps(received["headers"])


@pytest.mark.parametrize(("first", "second"), [("authorization", "x-api-key"),
                                               ("x-api-key", "api-key")])
def test_two_different_keys_are_refused_and_reach_nothing(
        keyed_stack: Stack, upstream: RecordingUpstream, first: str, second: str) -> None:
    marker = uuid.uuid4().hex
    before = (_requests(keyed_stack, "keyed"), _requests(keyed_stack, "other-keyed"))
    status, _, body = post_with(keyed_stack, {**FORGED, **_key(first), **_key(second, OTHER)},
                                _body(marker))
    assert status == 401, body
    assert "two different API keys" in body["error"]["message"]
    assert upstream.find(marker) == []
    assert (_requests(keyed_stack, "keyed"), _requests(keyed_stack, "other-keyed")) == before
    assert _requests(keyed_stack, "victim") == 0


# -- the strip list follows the picker's config --

OWN_HEADER = {"tenancy": {"header": "x-tenant-id", "alsoAccept": []},
              "tenants": [{"id": "victim"}, {"id": "anonymous"}]}


def _forged_own_header_lands_on(tmp_path: Path, **gateway: Any) -> str:
    """Where a request with a forged ``x-tenant-id: victim`` is charged, behind ``gateway``."""
    with Stack(tmp_path, endpoints=1, server_args=["--step-ms", "1"], picker_config=OWN_HEADER,
               **gateway) as stack:
        status, _, body = post_with(stack, {"x-tenant-id": "victim"}, json.dumps({
            "model": "sim-model", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}).encode())
        assert status == 200, body
        charged = {t: 0.0 for t in ("victim", "anonymous")}

        def settled() -> bool:
            charged.update({t: _requests(stack, t) for t in charged})
            return sum(charged.values()) >= 1
        assert wait_until(settled, timeout=15.0), charged
    (tenant,) = [t for t, n in charged.items() if n == 1]
    return tenant


def test_an_envoy_generated_for_the_config_removes_the_config_s_tenant_header(
        tmp_path: Path) -> None:
    assert _forged_own_header_lands_on(tmp_path, identity="strip") == "anonymous"


def test_behind_the_shipped_list_the_forged_header_chooses_which_the_check_refuses(
        tmp_path: Path) -> None:
    """What the generated list and the check guard against: envoy.yaml removes the default
    names only, so behind it a picker reading x-tenant-id takes the client's word."""
    assert _forged_own_header_lands_on(
        tmp_path, envoy_bootstrap=shipped_envoy("envoy.yaml")) == "victim"
    documents = [d for d in yaml.safe_load_all((SAMPLES / "envoy.yaml").read_text()) if d]
    with pytest.raises(ConfigError) as caught:
        check_stripped(load_config(OWN_HEADER), early_removed(documents), "envoy.yaml")
    assert caught.value.path == "tenancy.header"
