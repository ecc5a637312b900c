"""The TenantPolicy CRD and the example manifests on a real API server: every example is accepted
under strict field validation, and every bad fixture is refused with the words the server uses
(the second line of each fixture), including each CEL rule of the CRD."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.kube import ROOT, Kube, KubectlFailed
from tests.expect import server_message

CRD = ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml"
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
BAD = sorted((ROOT / "tests" / "fixtures" / "tenantpolicy" / "bad").glob("*.yaml"))


def _in_namespace(path: Path, namespace: str) -> str:
    """The file's objects, moved to ``namespace`` (the examples name ``inference``)."""
    objects = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for obj in objects:
        obj["metadata"]["namespace"] = namespace
    return "\n".join(json.dumps(obj) for obj in objects)


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
