"""The chart's PrometheusRule (``prometheusRule``), rendered by real Helm (helm-python-sdk).

Off by default. Enabled, it carries ``manifests/alerts/fairway-rules.yaml`` unchanged (its copy
in ``charts/fairway/rules/`` is byte-identical), with the release's labels plus
``prometheusRule.labels``; ``runbookBaseUrl`` replaces only the runbook links' base. The rendered
object passes a schema written here from the prometheus-operator's documented
``monitoring.coreos.com/v1`` PrometheusRule (kubernetes-validate does not know the kind), and its
rules pass ``promtool check rules``. ``helm lint --strict`` is clean with it enabled, and a
packaged chart renders it the same.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from helm_python import Chart, HelmValuesError, lint, package

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "fairway"
RULES = ROOT / "manifests" / "alerts" / "fairway-rules.yaml"
CHART_RULES = CHART / "rules" / "fairway-rules.yaml"
TEMPLATE = "fairway/templates/prometheusrule.yaml"
NS = "inference"
BASE = "https://git.example.com/fairway/blob/v0.1.0/docs/runbooks.md"
ENABLED = {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}

# monitoring.coreos.com/v1 PrometheusRule, the fields the chart sets (prometheus-operator's API
# reference: spec.groups[] {name, interval?, rules[] {alert | record, expr, for?, labels?,
# annotations?}}; expr is a string or an integer).
PROMETHEUS_RULE_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name", "namespace"], "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                     "maxLength": 253},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string"},
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                        "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]},
                            "for": {"type": "string",
                                    "pattern": r"^(0|(([0-9]+)(ms|s|m|h|d|w|y))+)$"},
                            "labels": {"type": "object",
                                       "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object",
                                            "additionalProperties": {"type": "string"}}}}}}}}}},
    },
}


@functools.cache
def _chart() -> Chart:
    return Chart.load(CHART)


def _render(values: dict, name: str = "fairway") -> dict[str, str]:
    return _chart().render(copy.deepcopy(values), name=name, namespace=NS, is_install=True)


def _rule_object(values: dict, name: str = "fairway") -> dict:
    (rule,) = [d for d in yaml.safe_load_all(_render(values, name)[TEMPLATE]) if d]
    return rule


def _alerts(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"]]


def test_the_charts_rules_are_the_manifests_rules() -> None:
    assert CHART_RULES.read_bytes() == RULES.read_bytes(), \
        "charts/fairway/rules/ drifted: cp manifests/alerts/fairway-rules.yaml " \
        "charts/fairway/rules/"


def test_off_by_default() -> None:
    assert not _render({}).get(TEMPLATE, "").strip()
    assert _chart().merge_values({})["prometheusRule"] == {
        "enabled": False, "labels": {}, "runbookBaseUrl": ""}


@pytest.mark.parametrize("release", ["fairway", "llm"])
def test_enabled_it_carries_the_rules_unchanged(release: str) -> None:
    rule = _rule_object(ENABLED, release)
    jsonschema.Draft7Validator(PROMETHEUS_RULE_V1).validate(rule)
    assert rule["metadata"]["namespace"] == NS
    assert rule["metadata"]["name"].startswith(release)
    labels = rule["metadata"]["labels"]
    assert labels["release"] == "kube-prometheus-stack"
    assert labels["app.kubernetes.io/instance"] == release
    assert labels["app.kubernetes.io/part-of"] == "fairway"
    assert rule["spec"] == yaml.safe_load(RULES.read_text(encoding="utf-8"))
    names = {alert["alert"] for alert in _alerts(rule["spec"]["groups"])}
    assert "FairwayNoPickerServing" in names and len(names) >= 8


def test_runbook_base_url_replaces_only_the_links_base() -> None:
    values = {"prometheusRule": {"enabled": True, "runbookBaseUrl": BASE}}
    rule = _rule_object(values)
    source = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    rendered = _alerts(rule["spec"]["groups"])
    for alert in rendered:
        assert alert["annotations"]["runbook_url"] == f"{BASE}#{alert['alert'].lower()}"
    for alert in _alerts(source["groups"]):  # put the repository's links back: the rest is equal
        alert["annotations"]["runbook_url"] = f"{BASE}#{alert['alert'].lower()}"
    assert rule["spec"] == source


def test_the_rendered_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: run scripts/install-system-deps.sh")
    rule = _rule_object({"prometheusRule": {"enabled": True, "runbookBaseUrl": BASE}})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alerts(rule['spec']['groups']))} rules found" in done.stdout


def test_lint_is_clean_with_it_enabled() -> None:
    values = {"prometheusRule": {"enabled": True, "runbookBaseUrl": BASE,
                                 "labels": {"release": "x"}}}
    report = lint(CHART, values, strict=True, namespace=NS)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(("values", "field"), [
    ({"prometheusRule": {"enabled": "yes"}}, "enabled"),
    ({"prometheusRule": {"enabled": True, "runbookBaseUrl": "docs#x"}}, "runbookBaseUrl"),
    ({"prometheusRule": {"enabled": True, "labels": {"release": 1}}}, "release"),
    ({"prometheusRule": {"enabled": True, "interval": "1m"}}, "interval"),
])
def test_the_schema_refuses_bad_values(values: dict, field: str) -> None:
    with pytest.raises(HelmValuesError) as refused:
        _render(values)
    assert field in str(refused.value)


def test_a_packaged_chart_renders_it_the_same(tmp_path: Path) -> None:
    archive = package(CHART, destination=tmp_path)
    with Chart.load(archive) as packaged:
        rendered = packaged.render(copy.deepcopy(ENABLED), name="fairway", namespace=NS,
                                   is_install=True)
        assert rendered[TEMPLATE] == _render(ENABLED)[TEMPLATE]
