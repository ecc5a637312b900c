"""The gateway samples in ``manifests/gateway/`` against the chart rendered by real Helm, and the
Envoy bootstraps of ``picker.stack.gateways`` against real Envoy.

- No sample defines an object (kind, namespace, name) the chart also creates, whatever the chart
  is installed with: a user applying the README's files must not re-point or replace the chart's
  picker Service (the bug of issue 10, point 6). ``inferencepool.yaml`` is applied only when the
  chart does not create the pool; that pair is checked both ways.
- Every sample's InferencePool and routes point at what the chart really renders: the picker
  Service's name and ext_proc port, the pool name.
- Objects of built-in kinds pass Kubernetes' own schema (kubernetes-validate, strict); the
  InferencePool passes the chart test's InferencePool v1 schema; Gateway, GatewayClass and
  HTTPRoute pass small schemas written here from the Gateway API v1 reference for the fields the
  samples set. Istio's DestinationRule is checked only for parseability and the few fields this
  test reads: no schema of it is available offline.
- Each gateway flavour's bootstrap passes ``envoy --mode validate``.
- Each implementation sample's patch objects (EnvoyPatchPolicy, EnvoyFilter, ListenerPolicy
  ``localReplies``) are there, parse, name resources the gateway's flavour really has, and carry
  fairway's local reply mapping; the ``-patched`` flavours are built from these very objects.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python import Chart

from picker.stack import gateways
from picker.stack.envoy import RETRY_POLICY, envoy_binary, local_reply_config
from picker.stack.gateways import (
    FLAVOURS,
    Wiring,
    gateway_config,
    gateway_local_reply_config,
    http_connection_manager,
    kgateway_local_replies,
    patch_target,
)
from scripts import gen_gateway_envoy
from tests.integration.test_chart import INFERENCE_POOL_V1
from tests.tls import sample_with_client_cert

ROOT = Path(__file__).parent.parent.parent
SAMPLES = ROOT / "manifests" / "gateway"
CHART = ROOT / "charts" / "fairway"
NS = "inference"
RELEASE = "fairway"
GATEWAY_SAMPLES = ["gateway-api.yaml", "envoy-ai-gateway.yaml", "kgateway.yaml", "istio.yaml"]
"""The Kubernetes samples, one per gateway (envoy.yaml is an Envoy bootstrap, not applied)."""
POOL_SAMPLE = "inferencepool.yaml"
POD_DNS_SAMPLE = "envoy-pool-pods.yaml"
"""The headless Service the plain-Envoy samples resolve the pool's pods through."""
ENVOY_SAMPLES = ["envoy.yaml", "envoy-jwt.yaml", "envoy-access-log.yaml"]
CHART_VALUES = {"default": {},
                "creates-pool": {"inferencePool": {"create": True,
                                                   "matchLabels": {"app": "vllm"}}}}
K8S_VERSION = "1.31"

_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PARENT_REF = {"type": "object", "additionalProperties": False, "required": ["name"],
               "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                              "name": _NAME, "namespace": _NAME, "sectionName": _NAME,
                              "port": _PORT}}
_CONTROLLER = r"^[a-z0-9.-]+/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$"
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
_HEADER_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9!#$%&'*+\-.^_\x60|~]+$",
                "minLength": 1, "maxLength": 256}
_HEADER_VALUES = {"type": "array", "maxItems": 16, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "value"],
    "properties": {"name": _HEADER_NAME, "value": {"type": "string", "maxLength": 4096}}}}
_HEADER_FILTER = {"type": "object", "additionalProperties": False, "properties": {
    "set": _HEADER_VALUES, "add": _HEADER_VALUES,
    "remove": {"type": "array", "maxItems": 16, "uniqueItems": True, "items": _HEADER_NAME}}}
GATEWAY_API_V1 = {
    "GatewayClass": {"type": "object", "properties": {"spec": {
        "type": "object", "additionalProperties": False, "required": ["controllerName"],
        "properties": {"controllerName": {"type": "string", "pattern": _CONTROLLER},
                       "description": {"type": "string"}}}}},
    "Gateway": {"type": "object", "properties": {"spec": {
        "type": "object", "additionalProperties": False,
        "required": ["gatewayClassName", "listeners"],
        "properties": {
            "gatewayClassName": _NAME,
            "listeners": {"type": "array", "minItems": 1, "maxItems": 64, "items": {
                "type": "object", "additionalProperties": False,
                "required": ["name", "port", "protocol"],
                "properties": {"name": _NAME, "port": _PORT, "hostname": {"type": "string"},
                               "protocol": {"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]}}}}}}}},
    "HTTPRoute": {"type": "object", "properties": {"spec": {
        "type": "object", "additionalProperties": False, "required": ["rules"],
        "properties": {
            "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
                "type": "object", "additionalProperties": False,
                "properties": {
                    "matches": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"path": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"type": {"enum": ["Exact", "PathPrefix",
                                                             "RegularExpression"]},
                                           "value": {"type": "string", "pattern": "^/"}}}}}},
                    "backendRefs": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["name"],
                        "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                       "name": _NAME, "namespace": _NAME, "port": _PORT,
                                       "weight": {"type": "integer", "minimum": 0}}}},
                    "filters": {"type": "array", "maxItems": 16, "items": {
                        "type": "object", "additionalProperties": False, "required": ["type"],
                        "properties": {"type": {"enum": ["RequestHeaderModifier"]},
                                       "requestHeaderModifier": _HEADER_FILTER}}},
                    "timeouts": {"type": "object", "additionalProperties": False,
                                 "properties": {"request": _DURATION,
                                                "backendRequest": _DURATION}},
                    "retry": {"type": "object", "additionalProperties": False, "properties": {
                        "codes": {"type": "array", "items": {"type": "integer",
                                                             "minimum": 400, "maximum": 599}},
                        "attempts": {"type": "integer", "minimum": 0},
                        "backoff": _DURATION}}}}}}}}},
}
PARSE_ONLY_KINDS = {"DestinationRule": "networking.istio.io/v1",
                    "EnvoyFilter": "networking.istio.io/v1alpha3",
                    "ClientTrafficPolicy": "gateway.envoyproxy.io/v1alpha1",
                    "SecurityPolicy": "gateway.envoyproxy.io/v1alpha1",
                    "BackendTrafficPolicy": "gateway.envoyproxy.io/v1alpha1",
                    "EnvoyPatchPolicy": "gateway.envoyproxy.io/v1alpha1",
                    "ListenerPolicy": "gateway.kgateway.dev/v1alpha1"}
"""Kinds of the implementations' own APIs (no schema here): their apiVersion is checked."""


def _load(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((SAMPLES / name).read_text(encoding="utf-8"))
            if doc]


def _render(case: str) -> list[dict]:
    chart = Chart.load(CHART)
    manifests = chart.render(copy.deepcopy(CHART_VALUES[case]), name=RELEASE, namespace=NS,
                             is_install=True)
    return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def _key(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", NS), obj["metadata"]["name"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {case: _render(case) for case in CHART_VALUES}


@pytest.mark.parametrize("case", sorted(CHART_VALUES))
@pytest.mark.parametrize("sample", GATEWAY_SAMPLES)
def test_no_sample_defines_an_object_the_chart_creates(rendered: dict[str, list[dict]],
                                                       case: str, sample: str) -> None:
    creates_pool = bool(CHART_VALUES[case].get("inferencePool", {}).get("create"))
    applied = _load(sample) + ([] if creates_pool else _load(POOL_SAMPLE))
    chart = {_key(o) for o in rendered[case]}
    assert not chart & {_key(o) for o in applied}, (case, sample)
    # What the route needs exists exactly once: the pool, from the chart or from the sample.
    pools = [o for o in rendered[case] + applied if o["kind"] == "InferencePool"]
    assert [p["metadata"]["name"] for p in pools] == ["llm-pool"]


def test_the_pool_sample_is_the_chart_s_pool(rendered: dict[str, list[dict]]) -> None:
    (sample,) = _load(POOL_SAMPLE)
    (chart_pool,) = [o for o in rendered["creates-pool"] if o["kind"] == "InferencePool"]
    (service,) = [o for o in rendered["default"] if o["kind"] == "Service"
                  and o["metadata"]["labels"]["app.kubernetes.io/component"] == "picker"]
    (ext_proc,) = [p for p in service["spec"]["ports"] if p["name"] == "ext-proc"]
    ref = sample["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"]) == \
        ("Service", service["metadata"]["name"], ext_proc["port"])
    assert sample["spec"]["endpointPickerRef"] == chart_pool["spec"]["endpointPickerRef"]
    assert sample["metadata"]["name"] == chart_pool["metadata"]["name"]


@pytest.mark.parametrize("sample", GATEWAY_SAMPLES)
def test_each_sample_routes_to_the_pool_through_its_own_gateway(sample: str) -> None:
    objects = {o["kind"]: o for o in _load(sample)}
    route, gateway = objects["HTTPRoute"], objects["Gateway"]
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": "llm-pool"}]
    if "GatewayClass" in objects:
        assert gateway["spec"]["gatewayClassName"] == objects["GatewayClass"]["metadata"]["name"]
    expected_class = {"kgateway.yaml": "kgateway", "istio.yaml": "istio"}.get(sample)
    if expected_class:
        assert gateway["spec"]["gatewayClassName"] == expected_class


def test_istio_dials_the_chart_s_picker_over_tls_with_the_chart_s_client_certificate(
        rendered: dict[str, list[dict]]) -> None:
    (rule,) = [o for o in _load("istio.yaml") if o["kind"] == "DestinationRule"]
    (service,) = [o for o in rendered["default"] if o["kind"] == "Service"
                  and o["metadata"]["labels"]["app.kubernetes.io/component"] == "picker"]
    assert rule["spec"]["host"] == f"{service['metadata']['name']}.{NS}.svc.cluster.local"
    # The picker not verified (self-signed), the gateway presenting the chart's certificate.
    secrets = {o["metadata"]["name"]: o for o in rendered["default"] if o["kind"] == "Secret"}
    assert rule["spec"]["trafficPolicy"]["tls"] == {
        "mode": "MUTUAL", "credentialName": f"{service['metadata']['name']}-gateway-tls",
        "insecureSkipVerify": True}
    gateway_secret = secrets[rule["spec"]["trafficPolicy"]["tls"]["credentialName"]]
    assert gateway_secret["metadata"]["namespace"] == NS  # the gateway's (Istio reads it there)
    assert set(gateway_secret["data"]) == {"tls.crt", "tls.key"}


@pytest.mark.parametrize("sample", [*GATEWAY_SAMPLES, POOL_SAMPLE, POD_DNS_SAMPLE])
def test_every_sample_object_passes_its_schema(sample: str) -> None:
    for obj in _load(sample):
        assert obj["apiVersion"] and obj["metadata"]["name"], obj
        kind = obj["kind"]
        if kind == "InferencePool":
            jsonschema.Draft7Validator(INFERENCE_POOL_V1).validate(obj)
        elif kind in GATEWAY_API_V1:
            assert obj["apiVersion"] == "gateway.networking.k8s.io/v1"
            jsonschema.Draft7Validator(GATEWAY_API_V1[kind]).validate(obj)
        elif kind in PARSE_ONLY_KINDS:
            assert obj["apiVersion"] == PARSE_ONLY_KINDS[kind]
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if kind != "GatewayClass":  # cluster-scoped
            assert obj["metadata"]["namespace"] == NS


def test_the_gateway_api_schemas_refuse_what_the_api_refuses() -> None:
    route = next(o for o in _load("gateway-api.yaml") if o["kind"] == "HTTPRoute")
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["timeouts"]["request"] = "5 minutes"
    assert not jsonschema.Draft7Validator(GATEWAY_API_V1["HTTPRoute"]).is_valid(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["backendRef"] = bad["spec"]["rules"][0].pop("backendRefs")
    assert not jsonschema.Draft7Validator(GATEWAY_API_V1["HTTPRoute"]).is_valid(bad)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
def test_each_flavour_s_bootstrap_is_valid_envoy_config(tmp_path: Path, flavour: str,
                                                       tls: bool) -> None:
    config = gateway_config(flavour, Wiring(listen_port=18080, admin_port=18081,
                                            picker_port=18082, picker_tls=tls,
                                            endpoints=["127.0.0.1:18001", "127.0.0.1:18002"],
                                            access_log=tmp_path / "access.log"))
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    checked = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]
    assert "OK" in checked.stdout + checked.stderr


def test_unknown_flavour_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown gateway flavour 'nginx'"):
        gateway_config("nginx", Wiring(1, 2, 3, []))


# --- retries ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sample", GATEWAY_SAMPLES)
def test_each_gateway_sample_retries_what_never_reached_an_engine(sample: str) -> None:
    (route,) = [o for o in _load(sample) if o["kind"] == "HTTPRoute"]
    (rule,) = route["spec"]["rules"]
    # 503 (an engine that refused) and, with it, connection errors; twice, as the stack does.
    assert rule["retry"] == {"codes": [503], "attempts": RETRY_POLICY["num_retries"]}


def _route(config: dict) -> dict:
    (host,) = http_connection_manager(config)["route_config"]["virtual_hosts"]
    (route,) = host["routes"]
    return route["route"]


def _route_retry(config: dict) -> dict | None:
    return _route(config).get("retry_policy")


def _pool_cluster(config: dict) -> dict:
    (pool,) = [c for c in config["static_resources"]["clusters"]
               if c["name"] == _route(config)["cluster"]]
    return pool


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_each_flavour_retries_as_its_gateway_does(flavour: str) -> None:
    config = gateway_config(flavour, Wiring(1, 2, 3, ["127.0.0.1:18001", "127.0.0.1:18002"]))
    retry, pool = _route_retry(config), _pool_cluster(config)
    if flavour == "kgateway-v2.0":
        assert retry is None
        return
    assert retry is not None
    assert retry["num_retries"] == 2 and retry["retriable_status_codes"] == [503]
    assert "connect-failure" in retry["retry_on"].split(",")
    overridden = "load_balancing_policy" in pool
    # A retry reaches another endpoint only over override_host, and then must skip the one
    # that failed (previous_hosts); the flavour table says which flavours those are.
    assert FLAVOURS[flavour].retries_elsewhere == overridden
    if overridden:
        (predicate,) = retry["retry_host_predicate"]
        assert predicate["name"] == "envoy.retry_host_predicates.previous_hosts"


@pytest.mark.parametrize("sample", ENVOY_SAMPLES)
def test_plain_envoy_samples_retry_over_the_pool_s_pods_by_dns(sample: str,
                                                              tmp_path: Path) -> None:
    config = yaml.safe_load((SAMPLES / sample).read_text())
    pool = _pool_cluster(config)
    assert pool["type"] == "STRICT_DNS"
    (policy,) = pool["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    (source,) = override["typed_config"]["override_host_sources"]
    assert source == {"metadata": {"key": "envoy.lb",
                                   "path": [{"key": "x-gateway-destination-endpoint"}]}}
    (group,) = pool["load_assignment"]["endpoints"]
    (endpoint,) = group["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert f"{address['address']}:{address['port_value']}" == gen_gateway_envoy.POOL_PODS
    assert _route_retry(config) == RETRY_POLICY
    checked = subprocess.run([envoy_binary(), "--mode", "validate", "-c",
                              str(sample_with_client_cert(SAMPLES / sample, tmp_path))],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]


def test_the_pod_dns_service_lists_the_pool_s_pods(rendered: dict[str, list[dict]]) -> None:
    """The headless Service the Envoy samples resolve: the name they resolve, the pool's
    selector and target port, no cluster IP (one DNS answer per ready pod), and no collision
    with the chart."""
    (service,) = _load(POD_DNS_SAMPLE)
    (pool,) = _load(POOL_SAMPLE)
    (chart_pool,) = [o for o in rendered["creates-pool"] if o["kind"] == "InferencePool"]
    host, port = gen_gateway_envoy.POOL_PODS.rsplit(":", 1)
    meta = service["metadata"]
    assert host == f"{meta['name']}.{meta['namespace']}.svc.cluster.local"
    spec = service["spec"]
    assert spec["clusterIP"] == "None"
    assert not spec.get("publishNotReadyAddresses", False)
    assert spec["selector"] == pool["spec"]["selector"]["matchLabels"]
    (service_port,) = spec["ports"]
    assert [{"number": service_port["targetPort"]}] == pool["spec"]["targetPorts"] \
        == chart_pool["spec"]["targetPorts"]
    assert service_port["port"] == int(port)
    for case in CHART_VALUES:
        assert _key(service) not in {_key(o) for o in rendered[case]}


def test_envoy_ai_gateway_sample_lets_every_retry_run() -> None:
    """Envoy's default of 3 parallel retries per cluster would refuse retries (503) while a dead
    pod fails requests under load; the sample raises it, and the flavour carries the value."""
    objects = _load("envoy-ai-gateway.yaml")
    (policy,) = [o for o in objects if o["kind"] == "BackendTrafficPolicy"]
    (route,) = [o for o in objects if o["kind"] == "HTTPRoute"]
    (target,) = policy["spec"]["targetRefs"]
    assert (target["kind"], target["name"]) == ("HTTPRoute", route["metadata"]["name"])
    retries = policy["spec"]["circuitBreaker"]["maxParallelRetries"]
    config = gateway_config("envoy-ai-gateway-fail-open", Wiring(1, 2, 3, ["127.0.0.1:18001"]))
    (threshold,) = _pool_cluster(config)["circuit_breakers"]["thresholds"]
    assert threshold["max_retries"] == retries > 3


# --- the patches: what each gateway does not generate, added by its sample ---------------------

_FLAVOUR_OF = {"envoy-ai-gateway.yaml": "envoy-ai-gateway", "kgateway.yaml": "kgateway",
               "istio.yaml": "istio"}
"""Each implementation sample and the flavour reproducing its gateway without the patches."""
_WIRING = Wiring(1, 2, 3, ["127.0.0.1:18001", "127.0.0.1:18002"])


def _without_content_type(config: dict) -> dict:
    config = copy.deepcopy(config)
    for mapper in config["mappers"]:
        mapper["body_format_override"].pop("content_type", None)
    return config


def test_the_gateway_local_replies_are_fairway_s_own_plus_the_ext_proc_500() -> None:
    """The samples' mapping is the stack's (``local_reply_config``, whose picker mapper expects
    ``status_on_error: 503``) behind one mapper turning the filter's default 500 into that 503."""
    (first, *rest) = gateway_local_reply_config()["mappers"]
    assert rest == local_reply_config()["mappers"]
    assert first["status_code"] == 503
    assert first["body_format_override"] == rest[-1]["body_format_override"]
    assert first["headers_to_add"] == rest[-1]["headers_to_add"]


def test_envoy_ai_gateway_sample_patches_the_listener_and_the_failclose_pool() -> None:
    objects = _load("envoy-ai-gateway.yaml")
    policies = {o["metadata"]["name"]: o for o in objects if o["kind"] == "EnvoyPatchPolicy"}
    assert sorted(policies) == ["fairway-picker-unavailable", "fairway-pool-retries-elsewhere"]
    (gateway,) = [o for o in objects if o["kind"] == "Gateway"]
    (route,) = [o for o in objects if o["kind"] == "HTTPRoute"]
    base = gateway_config(_FLAVOUR_OF["envoy-ai-gateway.yaml"], _WIRING)
    targets = set()
    for policy in policies.values():
        spec = policy["spec"]
        assert spec["type"] == "JSONPatch"
        # A Gateway in the policy's own namespace (Envoy Gateway's direct attachment).
        assert spec["targetRef"] == {"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                     "name": gateway["metadata"]["name"]}
        assert policy["metadata"]["namespace"] == gateway["metadata"]["namespace"]
        for patch in spec["jsonPatches"]:
            assert set(patch) == {"type", "name", "operation"}
            assert patch["operation"]["op"] in ("add", "remove")
            # Every patch names a resource the gateway generates (Envoy Gateway reports
            # ResourceNotFound otherwise) ...
            patch_target(base, patch["type"], patch["name"])
            targets.add((patch["type"].rsplit(".", 1)[-1], patch["name"]))
            # ... and none the endpoint picker filter: the extension server inserts it after
            # Envoy Gateway has applied every EnvoyPatchPolicy.
            assert "endpointpicker" not in json.dumps(patch)
    pool = f"httproute/{NS}/{route['metadata']['name']}/rule/0"
    assert targets == {("Listener", gateways.ENVOY_GATEWAY_LISTENER), ("Cluster", pool)}
    (local_reply,) = policies["fairway-picker-unavailable"]["spec"]["jsonPatches"]
    assert local_reply["operation"] == {
        "op": "add", "path": "/default_filter_chain/filters/0/typed_config/local_reply_config",
        "value": gateway_local_reply_config()}


def test_the_failclose_pool_patch_makes_the_pool_cluster_the_pool_s_pods() -> None:
    """Before: ORIGINAL_DST on the header (one host, a retry dials it again). After: the pods of
    envoy-pool-pods.yaml by DNS, override_host on the header the FailClose filter leaves as the
    only carrier of the picker's list, round robin past it."""
    before = _pool_cluster(gateway_config("envoy-ai-gateway", _WIRING))
    assert before["type"] == "ORIGINAL_DST" and "load_balancing_policy" not in before
    policy = next(o for o in _load("envoy-ai-gateway.yaml")
                  if o["metadata"]["name"] == "fairway-pool-retries-elsewhere")
    cluster = copy.deepcopy(before)
    for patch in policy["spec"]["jsonPatches"]:
        gateways.apply_json_patch(cluster, patch["operation"])
    assert cluster["type"] == "STRICT_DNS"
    assert "original_dst_lb_config" not in cluster and cluster["lb_policy"] == "ROUND_ROBIN"
    (group,) = cluster["load_assignment"]["endpoints"]
    (endpoint,) = group["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert f"{address['address']}:{address['port_value']}" == gen_gateway_envoy.POOL_PODS
    assert address["address"] == gateways.POOL_PODS_HOST
    (service,) = _load(POD_DNS_SAMPLE)
    assert address["address"].startswith(f"{service['metadata']['name']}.{NS}.svc.")
    (policy_config,) = cluster["load_balancing_policy"]["policies"]
    override = policy_config["typed_extension_config"]
    assert override["name"] == "envoy.load_balancing_policies.override_host"
    assert override["typed_config"]["override_host_sources"] == [
        {"header": "x-gateway-destination-endpoint"}]
    (fallback,) = override["typed_config"]["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"] == \
        "envoy.load_balancing_policies.round_robin"
    # What the FailClose filter gives the cluster to read: the header, no metadata namespace.
    filters = http_connection_manager(gateway_config("envoy-ai-gateway", _WIRING))
    picker = next(f for f in filters["http_filters"] if "endpointpicker" in f["name"])
    assert "metadata_options" not in picker["typed_config"]
    assert picker["typed_config"]["failure_mode_allow"] is False
    # Everything the cluster had besides its routing stays: breakers, protocol, timeout.
    for key in ("circuit_breakers", "typed_extension_protocol_options", "connect_timeout"):
        assert cluster[key] == before[key]


def test_the_istio_sample_merges_the_local_replies_into_the_gateway_s_manager() -> None:
    objects = _load("istio.yaml")
    (gateway,) = [o for o in objects if o["kind"] == "Gateway"]
    (envoy_filter,) = [o for o in objects if o["kind"] == "EnvoyFilter"]
    assert envoy_filter["spec"]["workloadSelector"]["labels"] == {
        "gateway.networking.k8s.io/gateway-name": gateway["metadata"]["name"]}
    (patch,) = envoy_filter["spec"]["configPatches"]
    assert (patch["applyTo"], patch["match"]["context"], patch["patch"]["operation"]) == \
        ("NETWORK_FILTER", "GATEWAY", "MERGE")
    # The filter it matches is the one the gateway's listener has, of the same type.
    name = patch["match"]["listener"]["filterChain"]["filter"]["name"]
    base = gateway_config(_FLAVOUR_OF["istio.yaml"], _WIRING)
    (chain,) = base["static_resources"]["listeners"][0]["filter_chains"]
    (manager,) = [f for f in chain["filters"] if f["name"] == name]
    typed = patch["patch"]["value"]["typed_config"]
    assert typed["@type"] == manager["typed_config"]["@type"]
    assert typed["local_reply_config"] == gateway_local_reply_config()
    assert "local_reply_config" not in manager["typed_config"]  # Istio generates none


def test_the_kgateway_sample_s_local_replies_are_fairway_s() -> None:
    objects = _load("kgateway.yaml")
    (gateway,) = [o for o in objects if o["kind"] == "Gateway"]
    (policy,) = [o for o in objects if o["kind"] == "ListenerPolicy"]
    assert [(t["kind"], t["name"]) for t in policy["spec"]["targetRefs"]] == \
        [("Gateway", gateway["metadata"]["name"])]
    translated = kgateway_local_replies(policy["spec"]["default"]["httpSettings"]["localReplies"])
    # kgateway's JSON body format leaves the content type to Envoy's default for it,
    # application/json (the e2e test reads it off the answer).
    assert translated == _without_content_type(gateway_local_reply_config())
    base = http_connection_manager(gateway_config(_FLAVOUR_OF["kgateway.yaml"], _WIRING))
    assert "local_reply_config" not in base  # kgateway generates none


@pytest.mark.parametrize("sample", sorted(_FLAVOUR_OF))
def test_each_patched_flavour_is_its_gateway_plus_the_sample_s_patch(sample: str) -> None:
    (name,) = [n for n, f in FLAVOURS.items() if f.patched_by == sample]
    base, patched = (gateway_config(n, _WIRING) for n in (_FLAVOUR_OF[sample], name))
    local_reply = http_connection_manager(patched).pop("local_reply_config")
    if sample == "kgateway.yaml":
        local_reply = {"mappers": [{**m, "body_format_override": {
            **m["body_format_override"], "content_type": "application/json"}}
            for m in local_reply["mappers"]]}
    assert local_reply == gateway_local_reply_config()
    # Besides the local replies, only Envoy AI Gateway's pool cluster changed.
    if sample == "envoy-ai-gateway.yaml":
        assert _pool_cluster(patched)["type"] == "STRICT_DNS"
        for config in (base, patched):
            config["static_resources"]["clusters"].remove(_pool_cluster(config))
    assert patched == base


def test_gateway_api_sample_names_each_implementation_s_patch() -> None:
    notes = (SAMPLES / "gateway-api.yaml").read_text(encoding="utf-8")
    for needed in ("status_on_error", "EnvoyPatchPolicy", "enableEnvoyPatchPolicy",
                   "EnvoyFilter", "localReplies", "gateway_local_reply_config"):
        assert needed in notes, needed


def test_json_patch_follows_rfc_6902_as_envoy_gateway_applies_it() -> None:
    doc = {"a": {"b": 1}, "list": [1, 2]}
    gateways.apply_json_patch(doc, {"op": "add", "path": "/x/y/z", "value": 3})  # parents made
    gateways.apply_json_patch(doc, {"op": "add", "path": "/a/b", "value": 2})  # add replaces
    gateways.apply_json_patch(doc, {"op": "add", "path": "/list/-", "value": 4})
    gateways.apply_json_patch(doc, {"op": "remove", "path": "/list/0"})
    gateways.apply_json_patch(doc, {"op": "test", "path": "/a/b", "value": 2})
    assert doc == {"a": {"b": 2}, "list": [2, 4], "x": {"y": {"z": 3}}}
    with pytest.raises(KeyError):
        gateways.apply_json_patch(doc, {"op": "remove", "path": "/missing"})
    with pytest.raises(KeyError):
        gateways.apply_json_patch(doc, {"op": "replace", "path": "/missing", "value": 1})
