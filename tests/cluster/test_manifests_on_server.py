"""The TenantPolicy CRD and the example manifests on a real API server: every example is accepted
under strict field validation, and every bad fixture is refused with the words the server uses
(the second line of each fixture), including each CEL rule of the CRD. The gateway samples
(``manifests/gateway``) too, against upstream's CRDs: every object of a kind the tier installs
(Kubernetes', the InferencePool, the Gateway API's); the vendors' own kinds (Envoy Gateway,
Istio, kgateway) need their CRDs and are left out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.kube import ROOT, Kube, KubectlFailed
from tests.expect import server_message

CRD = ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml"
GATEWAY = sorted((ROOT / "manifests" / "gateway").glob("*.yaml"))
INSTALLED_GROUPS = {"", "inference.networking.k8s.io", "gateway.networking.k8s.io"}
VENDOR_GROUPS = {"gateway.envoyproxy.io", "networking.istio.io", "gateway.kgateway.dev"}
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
BAD = sorted((ROOT / "tests" / "fixtures" / "tenantpolicy" / "bad").glob("*.yaml"))


def _in_namespace(path: Path, namespace: str) -> str:
    """The file's objects, moved to ``namespace`` (the examples name ``inference``)."""
    objects = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
    return "\n".join(json.dumps(obj) for obj in objects)


def _group(obj: dict[str, Any]) -> str:
    api_version = str(obj["apiVersion"])
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def _kubernetes_objects(path: Path) -> list[dict[str, Any]]:
    """The Kubernetes objects of a sample (none in Envoy's own bootstrap files)."""
    return [doc for doc in yaml.safe_load_all(path.read_text())
            if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc]


def _cel_messages(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [rule["message"] for rule in node.get("x-kubernetes-validations") or ()]
        return found + [m for value in node.values() for m in _cel_messages(value)]
    if isinstance(node, list):
        return [m for value in node for m in _cel_messages(value)]
    return []


def test_every_example_is_accepted_with_strict_field_validation(kube: Kube) -> None:
    for path in EXAMPLES:
        kube.apply(_in_namespace(path, kube.namespace))
    policies = {p["metadata"]["name"] for p in kube.items("tenantpolicies")}
    expected = {doc["metadata"]["name"] for path in EXAMPLES
                for doc in yaml.safe_load_all(path.read_text())
                if doc and doc["kind"] == "TenantPolicy"}
    assert policies == expected and len(expected) >= 5


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_a_bad_policy_is_refused_with_the_servers_message(kube: Kube, path: Path) -> None:
    with pytest.raises(KubectlFailed) as refused:
        kube.apply(_in_namespace(path, kube.namespace))
    assert server_message(path) in refused.value.stderr
    assert kube.get("tenantpolicy", "bad") is None


def test_each_cel_rule_of_the_crd_has_a_bad_fixture() -> None:
    crd = yaml.safe_load(CRD.read_text())
    rules = _cel_messages(crd["spec"]["versions"][0]["schema"])
    assert len(rules) >= 2
    promised = [server_message(path) for path in BAD]
    for message in rules:
        assert any(message in text for text in promised), f"no fixture for the rule {message!r}"


def test_the_gateway_samples_are_accepted_with_strict_field_validation(kube: Kube) -> None:
    """inferencepool.yaml, envoy-pool-pods.yaml and gateway-api.yaml whole, and the Gateway API
    objects of the vendor samples, against Gateway API v1.6's experimental channel: their
    HTTPRoutes' ``retry`` is standard only from v1.7 (v1.6's standard CRD refuses it)."""
    applied: dict[tuple[str, str], dict[str, Any]] = {}
    cluster_scoped = []
    try:
        for path in GATEWAY:
            objects = _kubernetes_objects(path)
            groups = {_group(obj) for obj in objects}
            assert groups <= INSTALLED_GROUPS | VENDOR_GROUPS, (path.name, groups)
            mine = [obj for obj in objects if _group(obj) in INSTALLED_GROUPS]
            for obj in mine:
                if "namespace" in obj["metadata"]:  # the placeholder `inference`
                    obj["metadata"]["namespace"] = kube.namespace
                else:
                    cluster_scoped.append(f"{obj['kind']}/{obj['metadata']['name']}")
            if mine:
                kube.apply("\n".join(json.dumps(obj) for obj in mine))
            applied.update({(obj["kind"], obj["metadata"]["name"]): obj for obj in mine})
        kinds = {kind for kind, _ in applied}
        assert {"InferencePool", "Service", "Gateway", "HTTPRoute", "GatewayClass"} <= kinds
        for kind, name in applied:
            assert kube.get(kind, name) is not None, (kind, name)
        # envoy-pool-pods.yaml's headless Service selects the pods inferencepool.yaml pools.
        pool = kube.get("inferencepool", "llm-pool")["spec"]
        pods = kube.get("service", "llm-pool-pods")["spec"]
        assert pods["clusterIP"] == "None"
        assert pods["selector"] == pool["selector"]["matchLabels"]
        assert [p["targetPort"] for p in pods["ports"]] == [p["number"]
                                                            for p in pool["targetPorts"]]
        # gateway-api.yaml's route leads to that pool.
        (route,) = [o for o in _kubernetes_objects(ROOT / "manifests" / "gateway" /
                                                   "gateway-api.yaml") if o["kind"] == "HTTPRoute"]
        (backend,) = route["spec"]["rules"][0]["backendRefs"]
        assert (backend["kind"], backend["name"]) == ("InferencePool", "llm-pool")
    finally:
        for name in cluster_scoped:
            kube.kubectl("delete", name, "--wait=false", namespaced=False, check=False)
