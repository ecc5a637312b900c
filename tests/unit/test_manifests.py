"""The TenantPolicy CRD and the example manifests.

The CRD must be a valid, structural ``CustomResourceDefinition``; every example ``TenantPolicy``
must pass its schema (and its CEL rules), every other example object Kubernetes' own schema; each
bad fixture must be refused with its expected message; and what the operator will build from the
examples (the base config plus one tenant entry per listed tenant) must load in the picker.

The API server refuses unknown fields (kubectl's default ``fieldValidation=Strict``) and repeated
items of ``x-kubernetes-list-type: set`` lists, but a CRD may not say so in JSON Schema terms
(``additionalProperties: false`` and ``uniqueItems`` are forbidden there), so the schema is
validated here with both added. The API server also applies defaults before its CEL rules run;
the CEL rules are evaluated by a tiny translator that knows only the few constructs they use.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from openapi_schema_validator import OAS30Validator, oas30_format_checker

from picker.config.schema import (
    Budget,
    Budgets,
    OverBudget,
    PickerConfig,
    Tenant,
    TenantLimits,
    load_config,
)
from picker.config.strict import parse_duration
from picker.errors import ConfigError
from tests.expect import expected_message

ROOT = Path(__file__).parent.parent.parent
CRD_PATH = ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml"
EXAMPLES = ROOT / "manifests" / "examples"
BAD = sorted((ROOT / "tests" / "fixtures" / "tenantpolicy" / "bad").glob("*.yaml"))
K8S_VERSIONS = ["1.31", latest_version()]

SCENARIO_FILES = ["platform-departments.yaml", "saas-plans.yaml", "lanes-chat-and-batch.yaml",
                  "heavy-user-demoted.yaml", "api-keys.yaml", "picker-base-config.yaml"]
# The spec fields that name who the policy is for; every other spec field is a picker tenant field.
IDENTITY_FIELDS = {"poolRef", "tenants", "apiKeySecretRef"}


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


CRD = _load_all(CRD_PATH)[0]
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
STATUS = SCHEMA["properties"]["status"]

EXAMPLE_DOCS = [(path.name, i, doc) for path in sorted(EXAMPLES.glob("*.yaml"))
                for i, doc in enumerate(_load_all(path))]
POLICIES = [(f"{name}[{i}]", doc) for name, i, doc in EXAMPLE_DOCS
            if doc["kind"] == "TenantPolicy"]
OTHERS = [(f"{name}[{i}]", doc) for name, i, doc in EXAMPLE_DOCS if doc["kind"] != "TenantPolicy"]


def _base_config_data() -> dict:
    (configmap,) = [doc for _, doc in OTHERS if doc["kind"] == "ConfigMap"
                    and doc["metadata"]["name"] == "fairway-base"]
    return yaml.safe_load(configmap["data"]["base.yaml"])


# --- schema helpers -------------------------------------------------------------------------


def _nodes(node: dict, path: str = "") -> typing.Iterator[tuple[str, dict]]:
    """Every schema node under ``node`` (itself included), with its path."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def _as_api_server(schema: dict) -> dict:
    """The schema plus what the API server enforces beyond JSON Schema: no unknown fields, sets
    without repeats."""
    schema = copy.deepcopy(schema)
    for _, node in _nodes(schema):
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        if node.get("x-kubernetes-list-type") == "set":
            node["uniqueItems"] = True
    return schema


VALIDATOR = OAS30Validator(_as_api_server(SCHEMA), format_checker=oas30_format_checker)


def _with_defaults(node: dict, value: Any) -> Any:
    """``value`` with the schema's defaults filled in, as the API server stores it."""
    if isinstance(value, dict) and node.get("type") == "object":
        value = dict(value)
        for name, child in node.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = _with_defaults(child, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [_with_defaults(node["items"], item) for item in value]
    return value


def _schema_errors(obj: dict) -> list[str]:
    return [error.message for error in VALIDATOR.iter_errors(_with_defaults(SCHEMA, obj))]


# --- CEL: the little the rules use ----------------------------------------------------------

_CEL_TOKEN = re.compile(r"\s*(?:(?P<has>has\(self((?:\.[A-Za-z_]\w*)+)\))"
                        r"|(?P<field>self((?:\.[A-Za-z_]\w*)*))"
                        r"|(?P<string>'[^'\\]*')"
                        r"|(?P<number>-?\d+(?:\.\d+)?)"
                        r"|(?P<op>\|\||&&|!=|==|>=|<=|!(?=has\()))")
_MISSING = object()


def _get(value: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        if not isinstance(value, dict) or name not in value:
            return _MISSING
        value = value[name]
    return value


def _cel(rule: str) -> typing.Callable[[dict], bool]:
    """A Python predicate for ``rule``; refuses CEL it does not know rather than guess."""
    parts, pos = [], 0
    rule = rule.strip()
    while pos < len(rule):
        match = _CEL_TOKEN.match(rule, pos)
        if not match:
            raise ValueError(f"CEL construct not supported by this test at {rule[pos:]!r}")
        pos = match.end()
        kind = match.lastgroup
        text = match.group(kind)
        if kind == "has":
            names = tuple(text.removeprefix("has(self.").removesuffix(")").split("."))
            parts.append(f"(_get(self, {names!r}) is not _MISSING)")
        elif kind == "field":
            names = tuple(text.removeprefix("self").split(".")[1:])
            parts.append(f"_field(self, {names!r})")
        elif kind == "string":
            parts.append(repr(text[1:-1]))
        elif kind == "number":
            parts.append(repr(float(text)))
        else:
            parts.append({"||": "or", "&&": "and", "!=": "!=", "==": "==", ">=": ">=",
                          "<=": "<=", "!": "not"}[text])
    code = compile(" ".join(parts), "<cel>", "eval")

    def _field(self: dict, names: tuple[str, ...]) -> Any:
        value = _get(self, names)
        if value is _MISSING:  # CEL: "no such key", an evaluation error, which refuses the object
            raise LookupError(".".join(names))
        return value

    def predicate(self: dict) -> bool:
        scope = {"_get": _get, "_MISSING": _MISSING, "_field": _field, "self": self}
        try:
            return bool(eval(code, scope))
        except LookupError:
            return False

    return predicate


def _cel_failures(obj: dict) -> list[str]:
    """Messages of the CRD's CEL rules that ``obj`` (defaults applied) breaks."""
    failures = []

    def walk(node: dict, value: Any) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            if not _cel(rule["rule"])(value):
                failures.append(rule["message"])
        if isinstance(value, dict):
            for name, child in node.get("properties", {}).items():
                if name in value:
                    walk(child, value[name])
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for item in value:
                walk(node["items"], item)

    walk(SCHEMA, _with_defaults(SCHEMA, obj))
    return failures


# --- the CRD ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_is_a_valid_custom_resource_definition(version: str) -> None:
    kubernetes_validate.validate(CRD, version, strict=True)


def test_crd_names_the_tenantpolicy_kind() -> None:
    spec = CRD["spec"]
    assert CRD["metadata"]["name"] == "tenantpolicies.fairway.dev"
    assert spec["group"] == "fairway.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {"kind": "TenantPolicy", "listKind": "TenantPolicyList",
                             "plural": "tenantpolicies", "singular": "tenantpolicy",
                             "shortNames": ["tp"]}
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
    assert VERSION["served"] is True and VERSION["storage"] is True
    assert VERSION["subresources"] == {"status": {}}
    columns = {c["name"]: (c["type"], c["jsonPath"]) for c in VERSION["additionalPrinterColumns"]}
    assert columns == {
        "Tenants": ("string", ".spec.tenants"),
        "Weight": ("number", ".spec.weight"),
        "Lane": ("string", ".spec.lane"),
        "Share": ("number", ".status.share"),
        "Ready": ("string", '.status.conditions[?(@.type=="Ready")].status'),
        "Age": ("date", ".metadata.creationTimestamp"),
    }


def test_crd_spec_and_status_have_exactly_these_fields() -> None:
    assert SPEC["required"] == ["poolRef", "tenants"]
    assert list(SPEC["properties"]) == ["poolRef", "tenants", "apiKeySecretRef", "weight", "lane",
                                        "allowedLanes", "budgets", "overBudget", "limits"]
    assert list(SPEC["properties"]["poolRef"]["properties"]) == ["name"]
    assert list(SPEC["properties"]["apiKeySecretRef"]["properties"]) == ["name"]
    assert list(STATUS["properties"]) == ["observedGeneration", "conditions", "share",
                                          "queuedRequests", "runningRequests", "budgetRemaining",
                                          "lastUpdated", "capacityProfile", "whatIf"]
    assert STATUS["properties"]["capacityProfile"]["enum"] == ["throughput", "isolation"]
    assert list(STATUS["properties"]["budgetRemaining"]["properties"]) == ["burst", "sustained"]
    what_if = STATUS["properties"]["whatIf"]["properties"]
    assert list(what_if) == ["observedGeneration", "lastUpdated", "window", "pool", "tenants"]
    assert list(what_if["tenants"]["items"]["properties"]) == [
        "tenant", "share", "ttftP95", "refused429", "requests"]
    conditions = STATUS["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert list(conditions["items"]["properties"]) == ["type", "status", "reason", "message",
                                                       "lastTransitionTime", "observedGeneration"]


def test_crd_schema_is_structural() -> None:
    forbidden = {"$ref", "definitions", "patternProperties", "dependencies", "additionalItems",
                 "uniqueItems", "x-kubernetes-preserve-unknown-fields"}
    for path, node in _nodes(SCHEMA):
        assert "type" in node, f"{path or '<root>'} has no type"
        assert not forbidden & node.keys(), f"{path}: {forbidden & node.keys()}"
        assert node.get("additionalProperties") is not False, path
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), path


def test_crd_defaults_are_valid_values() -> None:
    defaults = [(path, node) for path, node in _nodes(SCHEMA) if "default" in node]
    assert {path for path, _ in defaults} == {".spec.weight", ".spec.overBudget.action"}
    for path, node in defaults:
        assert not list(OAS30Validator(node).iter_errors(node["default"])), path


def _picker_keys(cls: type) -> list[str]:
    return [f.metadata.get("key", f.name) for f in dataclasses.fields(cls)]


def test_crd_spec_fields_are_the_picker_tenant_fields() -> None:
    """A TenantPolicy's spec, less whom it is for, is the picker's tenant entry key for key."""
    props = SPEC["properties"]
    assert set(props) - IDENTITY_FIELDS == set(_picker_keys(Tenant)) - {"id"}
    assert set(props["budgets"]["properties"]) == set(_picker_keys(Budgets))
    for window in ("burst", "sustained"):
        assert set(props["budgets"]["properties"][window]["properties"]) == set(
            _picker_keys(Budget))
    assert set(props["overBudget"]["properties"]) == set(_picker_keys(OverBudget))
    assert set(props["limits"]["properties"]) == set(_picker_keys(TenantLimits))
    hints = typing.get_type_hints(OverBudget)
    assert props["overBudget"]["properties"]["action"]["enum"] == list(
        typing.get_args(hints["action"]))
    hints = typing.get_type_hints(TenantLimits)
    assert props["limits"]["properties"]["outputLimit"]["enum"] == list(
        typing.get_args(hints["output_limit"]))


DURATION = re.compile(SPEC["properties"]["budgets"]["properties"]["burst"]["properties"]["per"]
                      ["pattern"])


@pytest.mark.parametrize("text", ["250ms", "60s", "5m", "1.5h", "24h", "7d", "0.5s", "010s"])
def test_durations_the_crd_accepts_the_picker_reads_as_positive(text: str) -> None:
    assert DURATION.match(text)
    assert parse_duration(text, "per") > 0


@pytest.mark.parametrize("text", ["0s", "0.0m", "60", "1w", "-5s", "1e3s", "5 m", "s", ".5s",
                                  "inf s", "60sec"])
def test_crd_refuses_durations_outside_what_the_picker_surely_reads(text: str) -> None:
    assert not DURATION.match(text)


def test_both_budgets_take_the_same_durations() -> None:
    budgets = SPEC["properties"]["budgets"]["properties"]
    for window in ("burst", "sustained"):
        per = budgets[window]["properties"]["per"]
        assert per["pattern"] == DURATION.pattern and per["type"] == "string"
        assert budgets[window]["required"] == ["tokens", "per"]


def test_crd_has_the_cel_rules() -> None:
    over_budget = [r["rule"] for r in
                   SPEC["properties"]["overBudget"].get("x-kubernetes-validations", [])]
    assert over_budget == ["self.action != 'demote' || has(self.lane)"]
    (spec_rule,) = SPEC["x-kubernetes-validations"]
    assert "self.overBudget.lane != self.lane" in spec_rule["rule"]
    for _, node in _nodes(SCHEMA):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["message"]
            _cel(rule["rule"])  # every rule is within what this test can evaluate


POLICY = {"apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
          "metadata": {"name": "p", "namespace": "inference"},
          "spec": {"poolRef": {"name": "llm-pool"}, "tenants": ["team-a"]}}


@pytest.mark.parametrize(("spec", "message"), [
    ({"overBudget": {"action": "demote"}}, "needs the lane to demote to"),
    ({"lane": "batch", "overBudget": {"action": "demote", "lane": "batch"}},
     "must differ from lane"),
    ({"overBudget": {"lane": "batch", "action": "demote"}, "lane": "batch"},
     "must differ from lane"),
])
def test_cel_rules_refuse(spec: dict, message: str) -> None:
    policy = copy.deepcopy(POLICY)
    policy["spec"].update(spec)
    assert not _schema_errors(policy)
    failures = _cel_failures(policy)
    assert len(failures) == 1 and message in failures[0], failures


@pytest.mark.parametrize("spec", [
    {},
    {"overBudget": {}},  # defaults to reject
    {"overBudget": {"action": "reject"}, "lane": "online"},
    {"overBudget": {"action": "demote", "lane": "batch"}},  # demote from the first lane
    {"overBudget": {"action": "demote", "lane": "batch"}, "lane": "online",
     "allowedLanes": ["online"]},
    {"lane": "batch", "allowedLanes": ["online"]},  # allowedLanes need not contain lane
])
def test_cel_rules_allow(spec: dict) -> None:
    policy = copy.deepcopy(POLICY)
    policy["spec"].update(spec)
    assert not _schema_errors(policy)
    assert not _cel_failures(policy)


def test_status_of_the_operator_validates() -> None:
    policy = copy.deepcopy(POLICY)
    policy["status"] = {
        "observedGeneration": 3,
        "conditions": [{"type": "Ready", "status": "True", "reason": "Applied",
                        "message": "in the picker's config", "observedGeneration": 3,
                        "lastTransitionTime": "2025-01-01T00:00:00Z"}],
        "share": 0.25, "queuedRequests": 4, "runningRequests": 2,
        "budgetRemaining": {"burst": 1200.5, "sustained": 90000},
        "lastUpdated": "2025-01-01T00:00:05Z",
    }
    assert not _schema_errors(policy)
    policy["status"]["share"] = 1.5
    policy["status"]["conditions"][0]["status"] = "Yes"
    policy["status"]["extra"] = 1
    errors = " | ".join(_schema_errors(policy))
    assert "1.5 is greater than the maximum of 1" in errors
    assert "'Yes' is not one of" in errors
    assert "'extra' was unexpected" in errors


# --- the examples -----------------------------------------------------------------------------


def test_every_scenario_has_its_example() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(SCENARIO_FILES)
    for path in EXAMPLES.glob("*.yaml"):
        assert path.read_text(encoding="utf-8").startswith("# "), f"{path.name}: no header"
    assert len(POLICIES) >= 8


@pytest.mark.parametrize(("name", "policy"), POLICIES, ids=[n for n, _ in POLICIES])
def test_example_policy_passes_the_crd(name: str, policy: dict) -> None:
    assert policy["apiVersion"] == "fairway.dev/v1alpha1"
    assert policy["metadata"]["namespace"] == "inference"
    assert policy["spec"]["poolRef"] == {"name": "llm-pool"}
    assert _schema_errors(policy) == []
    assert _cel_failures(policy) == []


@pytest.mark.parametrize(("name", "obj"), OTHERS, ids=[n for n, _ in OTHERS])
def test_example_object_passes_kubernetes_schema(name: str, obj: dict) -> None:
    assert obj["metadata"]["namespace"] == "inference"
    kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def test_api_key_example_references_its_secret_and_the_key_is_a_placeholder() -> None:
    docs = _load_all(EXAMPLES / "api-keys.yaml")
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    (policy,) = [d for d in docs if d["kind"] == "TenantPolicy"]
    assert policy["spec"]["apiKeySecretRef"] == {"name": secret["metadata"]["name"]}
    assert "data" not in secret and secret["stringData"]
    for key in secret["stringData"].values():
        assert "EXAMPLE" in key and "NOT-A-REAL-KEY" in key


def test_base_config_loads_in_the_picker_with_online_and_batch_lanes() -> None:
    data = _base_config_data()
    assert "tenants" not in data
    config = load_config(data)
    assert isinstance(config, PickerConfig)
    lanes = {lane.name: lane for lane in config.lanes}
    assert list(lanes) == ["online", "batch"]
    assert lanes["online"].engine_priority == 0
    assert (lanes["batch"].min_share, lanes["batch"].engine_priority) == (0.2, 10)


@pytest.mark.parametrize(("name", "policy"), POLICIES, ids=[n for n, _ in POLICIES])
def test_example_lanes_exist_in_the_base_config(name: str, policy: dict) -> None:
    lanes = {lane["name"] for lane in _base_config_data()["lanes"]}
    spec = policy["spec"]
    used = {spec.get("lane"), spec.get("overBudget", {}).get("lane"), *spec.get("allowedLanes", [])}
    assert used - {None} <= lanes


def _tenant_entries(policy: dict) -> list[dict]:
    """What the operator is to write for ``policy``: the spec (defaults applied) less whom it is
    for, once per tenant."""
    spec = _with_defaults(SCHEMA, policy)["spec"]
    rules = {k: v for k, v in spec.items() if k not in IDENTITY_FIELDS}
    return [{"id": tenant, **copy.deepcopy(rules)} for tenant in spec["tenants"]]


def test_all_examples_together_make_a_picker_config() -> None:
    tenants = [entry for _, policy in POLICIES for entry in _tenant_entries(policy)]
    config = load_config({**_base_config_data(), "tenants": tenants})
    assert len(config.tenants) == len(tenants)  # tenant ids are unique across the examples
    assert config.tenant("research-lab").over_budget.lane == "batch"
    assert config.tenant("nightly-summaries").lane == "batch"
    weights = {config.tenant(t).weight for t in ("cust-0193-hobbyist", "cust-0042-studio",
                                                 "cust-0007-bigbank")}
    assert weights == {1.0, 4.0, 16.0}


def test_a_policy_lane_unknown_to_the_base_is_refused_by_the_picker() -> None:
    policy = copy.deepcopy(POLICY)
    policy["spec"]["lane"] = "gold"
    assert not _schema_errors(policy)  # the CRD cannot know the pool's lanes; the picker does
    with pytest.raises(ConfigError, match="unknown lane 'gold'"):
        load_config({**_base_config_data(), "tenants": _tenant_entries(policy)})


# --- bad fixtures -----------------------------------------------------------------------------


def test_bad_fixtures_cover_the_schema_rules() -> None:
    assert len(BAD) >= 7


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_policy_is_refused_by_the_crd(path: Path) -> None:
    (policy,) = _load_all(path)
    errors = _schema_errors(policy) + _cel_failures(policy)
    assert any(expected_message(path) in error for error in errors), errors
