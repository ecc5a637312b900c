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
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python import Chart

from picker.stack.envoy import RETRY_POLICY, envoy_binary
from picker.stack.gateways import FLAVOURS, Wiring, gateway_config
from scripts import gen_gateway_envoy
from tests.integration.test_chart import INFERENCE_POOL_V1

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
ENVOY_SAMPLES = ["envoy.yaml", "envoy-jwt.yaml"]
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


def test_istio_dials_the_chart_s_picker_over_tls_without_verification(
        rendered: dict[str, list[dict]]) -> None:
    (rule,) = [o for o in _load("istio.yaml") if o["kind"] == "DestinationRule"]
    (service,) = [o for o in rendered["default"] if o["kind"] == "Service"
                  and o["metadata"]["labels"]["app.kubernetes.io/component"] == "picker"]
    assert rule["spec"]["host"] == f"{service['metadata']['name']}.{NS}.svc.cluster.local"
    assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}


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
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (host,) = manager["typed_config"]["route_config"]["virtual_hosts"]
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
def test_plain_envoy_samples_retry_over_the_pool_s_pods_by_dns(sample: str) -> None:
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
    checked = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(SAMPLES / sample)],
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
