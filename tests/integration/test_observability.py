"""Observability and gateway samples, checked against the real things.

* The alert rules (``manifests/alerts/fairway-rules.yaml``) pass ``promtool check rules`` and
  their unit tests (``promtool test rules``), and a real Prometheus evaluates them without error
  (the "no picker serving" one finds the live picker serving).
* The picker's ``/metrics``, after that traffic, passes ``promtool check metrics``.
* The Grafana dashboard (``dashboards/fairway.json``; Grafana itself cannot be had here): every
  panel's PromQL, with the dashboard's variables substituted, parses in a real Prometheus and
  returns series once that Prometheus has scraped a real picker (real Envoy, the picker, two
  simulated vLLM servers, which it scrapes too, as a cluster's PodMonitor would) that served
  traffic from three tenants with two lanes, a budget, a demotion, a refused request and two
  config reloads (one refused), so every metric family has samples. Every metric the dashboard
  and the rules name is one the picker (``fairway_``) or the engines (``vllm:``) export, and the
  dashboard's variables have values.
* ``manifests/gateway/envoy.yaml`` is what ``scripts/gen_gateway_envoy.py`` writes, is
  ``picker.stack.envoy.envoy_config`` but for its placeholder addresses, and Envoy accepts it;
  ``manifests/gateway/gateway-api.yaml`` wires a Gateway, an HTTPRoute and an InferencePool to
  the picker's Service.

Prometheus (Debian ``prometheus``: ``prometheus`` and ``promtool``) is installed by
``scripts/install-system-deps.sh`` (``make setup``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.metadata
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.sim.load import run_traffic
from picker.sim.traffic import load_traffic
from picker.stack.envoy import GATEWAY_CERT, envoy_binary, envoy_config
from picker.stack.launcher import Stack, hold_port
from scripts import gen_gateway_envoy
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric
from tests.tls import sample_with_client_cert

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = ROOT / "dashboards" / "fairway.json"
ALERTS = ROOT / "manifests" / "alerts"
RULES = ALERTS / "fairway-rules.yaml"
RULE_TESTS = ALERTS / "fairway-rules.test.yaml"
GATEWAY = ROOT / "manifests" / "gateway"

DASHBOARD = json.loads(DASHBOARD_PATH.read_text(encoding="utf-8"))
QUERY_VARIABLES = ("namespace", "job", "pool", "lane", "tenant")
NAMESPACE = "fairway-test"
"""The ``namespace`` target label this test's Prometheus adds, as a ServiceMonitor would."""
POOL = "llm-pool"
"""The ``pool`` target label, which the chart's ServiceMonitor adds (the picker serves one pool)."""
JOB = "fairway"
ENGINE_JOB = "vllm"
"""The job of the engines' scrape (the prefix cache panel reads their own counters)."""

LANES = [{"name": "online"}, {"name": "batch", "minShare": 0.2}]
TENANTS = [
    {"id": "alice", "weight": 2},
    {"id": "bob"},
    # 60 tokens an hour: its first request fits, the next ones are demoted into batch.
    {"id": "carol", "budgets": {"burst": {"tokens": 60, "per": "1h"},
                                "sustained": {"tokens": 100000, "per": "24h"}},
     "overBudget": {"action": "demote", "lane": "batch"}},
]
PICKER_CONFIG = {"lanes": LANES, "tenants": TENANTS, "queue": {"maxWait": "20s"},
                 "metering": {"output": "none"}}
FLOOD_S = 5
SERIES_TIMEOUT_S = 20


# -- the dashboard ------------------------------------------------------------------------------

def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel with queries, including those inside collapsed rows."""
    for panel in panels:
        if panel.get("type") == "row":
            yield from _panels(panel.get("panels", []))
        else:
            yield panel


PANELS = list(_panels(DASHBOARD["panels"]))
TARGETS = [(f"{panel['title']} [{target['refId']}]", target["expr"])
           for panel in PANELS for target in panel["targets"]]


def _substitute(expr: str) -> str:
    """The query Grafana would send with every variable at "All" (``.*``)."""
    expr = expr.replace("$__rate_interval", "1m").replace("${__rate_interval}", "1m")
    for name in QUERY_VARIABLES:
        expr = re.sub(rf"\$\{{{name}(?::\w+)?\}}|\${name}\b", ".*", expr)
    # $1 is label_replace's capture group, which Grafana leaves alone (no variable is named so).
    assert not re.search(r"\$(?!\d)", expr), f"a variable is left in {expr!r}"
    return expr


def _variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in DASHBOARD["templating"]["list"]}


SELECTOR = re.compile(r"\b((?:fairway_|scrape_duration_seconds)\w*)(\{[^}]*\})?")
ENGINE_METRIC = re.compile(r"\bvllm:\w+")


def _selectors(expr: str) -> list[tuple[str, str]]:
    """``(metric, matchers)`` of each metric named in ``expr`` (matchers ``""`` when bare)."""
    return [(m.group(1), m.group(2) or "") for m in SELECTOR.finditer(expr)]


# -- real processes ---------------------------------------------------------------------------

def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run scripts/install-system-deps.sh "
                    f"(`make setup` does)")
    return found


def _get(url: str, timeout: float = 15.0) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@dataclass
class Prometheus:
    """A real Prometheus on 127.0.0.1 scraping one picker every second, with the alert rules."""

    workdir: Path
    target: str
    engines: list[str]
    """The simulated vLLM servers' addresses, scraped as job ``ENGINE_JOB``."""
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": JOB, "static_configs": [
                {"targets": [self.target], "labels": {"namespace": NAMESPACE,
                                                      "pool": POOL}}]},
                               {"job_name": ENGINE_JOB, "static_configs": [
                                   {"targets": self.engines,
                                    "labels": {"namespace": NAMESPACE}}]}],
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        with hold_port(0) as held:  # until Prometheus listens there (Go sets SO_REUSEADDR)
            self.port = held.getsockname()[1]
            log = (self.workdir / "prometheus.log").open("w")
            self.process = subprocess.Popen(
                [_tool("prometheus"), f"--config.file={config_path}",
                 f"--web.listen-address=127.0.0.1:{self.port}",
                 f"--storage.tsdb.path={self.workdir / 'tsdb'}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"prometheus exited: see {self.workdir}/prometheus.log")
                with contextlib.suppress(OSError), \
                        urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return self
                time.sleep(0.1)
        raise RuntimeError("prometheus not ready within 20 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def api(self, path: str, **params: str) -> tuple[int, dict[str, Any]]:
        return _get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")

    def query_range(self, expr: str, start: float) -> list[dict[str, Any]]:
        status, body = self.api("query_range", query=expr, start=f"{start:.3f}",
                                end=f"{time.time():.3f}", step="1")
        assert status == 200, f"{expr}: HTTP {status}: {body.get('error')}"
        return body["data"]["result"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("observability"), policy="vtc", endpoints=2,
               server_args=["--kv-budget-tokens", "1024", "--step-ms", "5"],
               picker_config=PICKER_CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def prometheus(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    server = Prometheus(tmp_path_factory.mktemp("prometheus"),
                        target=f"127.0.0.1:{stack.metrics_port}",
                        engines=list(stack.endpoint_addresses))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _wait(predicate: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _post(stack: Stack, tenant: str, body: bytes) -> int:
    request = urllib.request.Request(
        stack.gateway_url + "/v1/chat/completions", data=body, method="POST",
        headers={TENANT_HEADER: tenant, "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture(scope="module")
def observed(stack: Stack, prometheus: Prometheus) -> float:
    """Traffic that gives every metric family samples, scraped; returns when it started."""
    started = time.time()
    _wait(lambda: prometheus.api("query", query=f'up{{job="{JOB}"}} == 1')[1]
          .get("data", {}).get("result"), "the first scrape of the picker")
    m = stack.metrics_url
    # A refused reload, then the good config again (counted when the flood is under way).
    stack.write_picker_config({**PICKER_CONFIG, "scheduling": {"policy": "no-such-policy"}})
    _wait(lambda: metric(m, "fairway_config_reloads_total", result="failure") >= 1,
          "the refused reload")
    stack.write_picker_config(PICKER_CONFIG)
    assert _post(stack, "alice", b"{not json") == 400
    for _ in range(4):  # carol's budget holds the first; the rest are demoted into batch
        assert _post(stack, "carol", chat_body(words=20, max_tokens=8)) == 200
    assert metric(m, "fairway_demotions_total", tenant="carol") >= 1
    backlog = {"backlog": 6, "prompt_tokens": [150, 300], "output_tokens": [40, 120],
               "stream_fraction": 0.5}
    traffic = load_traffic({"duration_s": FLOOD_S, "seed": 5, "timeout_s": 30, "tenants": [
        {"name": "alice", **backlog}, {"name": "bob", **backlog},
        {"name": "carol", "rate": 2, "prompt_tokens": [20, 40], "output_tokens": [5, 10]},
        {"name": "guest", "rate": 1, "prompt_tokens": [20, 40], "output_tokens": [5, 10]}]})
    result = asyncio.run(run_traffic(traffic, stack.gateway_url))
    served = {t: s["ok"] for t, s in result.summary["tenants"].items()}
    assert all(served.values()), served
    _wait(lambda: metric(m, "fairway_config_reloads_total", result="success") >= 1,
          "the good config's reload")
    return started


# -- the alert rules -----------------------------------------------------------------------------

def test_rules_pass_promtool_check() -> None:
    done = subprocess.run([_tool("promtool"), "check", "rules", str(RULES)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_unit_tests_pass() -> None:
    done = subprocess.run([_tool("promtool"), "test", "rules", RULE_TESTS.name], cwd=ALERTS,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_unit_tested_firing_and_silent() -> None:
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"]]
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name} is never shown firing"
        assert any(not case["exp_alerts"] for case in mine), f"{name} is never shown silent"


def test_rules_evaluate_in_a_real_prometheus(observed: float, prometheus: Prometheus) -> None:
    expected = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"]
                for rule in group["rules"]}

    def evaluated() -> list[dict[str, Any]]:
        status, body = prometheus.api("rules", type="alert")
        assert status == 200, body
        rules = [rule for group in body["data"]["groups"] for rule in group["rules"]]
        return rules if all(not r["lastEvaluation"].startswith("0001") for r in rules) else []

    _wait(lambda: evaluated(), "an evaluation of every rule")
    rules = evaluated()
    assert {rule["name"] for rule in rules} == expected
    assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []


def test_no_picker_serving_is_silent_while_the_picker_serves(observed: float,
                                                             prometheus: Prometheus) -> None:
    """The alert's expression finds the live picker serving (and would name its job if not)."""
    (rule,) = [rule for group in yaml.safe_load(RULES.read_text())["groups"]
               for rule in group["rules"] if rule["alert"] == "FairwayNoPickerServing"]
    _wait(lambda: prometheus.api("query", query="fairway_ready == 1")[1]["data"]["result"],
          "a scrape of fairway_ready")
    status, body = prometheus.api("query", query=rule["expr"])
    assert status == 200, body
    assert body["data"]["result"] == []
    # The same expression with readiness taken away names this picker's job.
    status, body = prometheus.api("query", query=rule["expr"].replace(
        "(fairway_ready) > 0", "(fairway_ready) > 1"))
    assert status == 200, body
    assert [r["metric"] for r in body["data"]["result"]] == [{"namespace": NAMESPACE, "job": JOB}]


# -- the picker's metrics, linted -------------------------------------------------------------

def test_live_metrics_pass_promtool(observed: float, stack: Stack) -> None:
    """``promtool check metrics`` on the page of a picker that served traffic through real
    Envoy (every family has samples: the dashboard tests need them) reports nothing."""
    with urllib.request.urlopen(stack.metrics_url, timeout=15) as response:
        page = response.read()
    families = set(re.findall(r"^# TYPE (\w+) ", page.decode(), flags=re.MULTILINE))
    assert {"fairway_virtual_service", "fairway_build_info", "fairway_leader",
            "fairway_ready", "fairway_requests_total"} <= families
    assert "fairway_virtual_counter" not in families
    assert metric(stack.metrics_url, "fairway_virtual_service", tenant="alice") > 0
    assert metric(stack.metrics_url, "fairway_leader") == 1  # no election: it leads
    assert metric(stack.metrics_url, "fairway_ready") == 1
    assert metric(stack.metrics_url, "fairway_build_info",
                  version=importlib.metadata.version("fairway")) == 1
    done = subprocess.run([_tool("promtool"), "check", "metrics"], input=page,
                          capture_output=True, timeout=30)
    assert done.returncode == 0 and done.stdout == done.stderr == b"", \
        (done.stdout + done.stderr).decode()


# -- the dashboard -------------------------------------------------------------------------------

def test_dashboard_model() -> None:
    assert 36 <= DASHBOARD["schemaVersion"] <= 41
    variables = _variables()
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in QUERY_VARIABLES:
        variable = variables[name]
        assert variable["type"] == "query" and variable["multi"] and variable["includeAll"]
        assert variable["allValue"] == ".*"
        assert variable["definition"].startswith("label_values(fairway_requests_total")
    assert len(PANELS) >= 12
    ids = [panel["id"] for panel in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    for panel in PANELS:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, \
            panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def _scraped_labels(prometheus: Prometheus, since: float) -> dict[str, set[str]]:
    """The label names of every fairway_ series Prometheus scraped since ``since``, by metric."""
    status, body = prometheus.api("series", **{"match[]": '{__name__=~"fairway_.*"}',
                                               "start": f"{since:.3f}",
                                               "end": f"{time.time():.3f}"})
    assert status == 200, body
    labels: dict[str, set[str]] = {}
    for series in body["data"]:
        labels.setdefault(series["__name__"], set()).update(series)
    return labels


def test_every_query_is_filtered_by_the_variables(observed: float,
                                                  prometheus: Prometheus) -> None:
    """namespace, job and pool on every selector; tenant and lane where the metric has them."""
    labels = _scraped_labels(prometheus, observed)
    for title, expr in TARGETS:
        for name, matchers in _selectors(expr):
            assert matchers, f"{title}: {name} without the variables' matchers"
            wanted = ["namespace", "job", "pool"]
            wanted += [label for label in ("tenant", "lane") if label in labels.get(name, ())]
            for label in wanted:
                assert f'{label}=~"${label}"' in matchers, f"{title}: {name} not by ${label}"


def test_metrics_named_are_exported(observed: float, prometheus: Prometheus) -> None:
    """Every fairway_ metric in the dashboard and the rules is one the picker exported."""
    exported = set(_scraped_labels(prometheus, observed))
    rules = [rule["expr"] for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"]]
    named = {name for expr in [e for _, e in TARGETS] + rules
             for name, _ in _selectors(expr) if name.startswith("fairway_")}
    assert named - exported == set()


def test_engine_metrics_named_are_scraped(observed: float, prometheus: Prometheus) -> None:
    """Every vllm: metric the dashboard names is one the engines exported (the simulated server
    names them as vLLM V1 does), and the picker knows those engines by the address Prometheus
    gives as their instance (the hit-rate panel joins the two on it)."""
    named = {m.group(0) for _, expr in TARGETS for m in ENGINE_METRIC.finditer(expr)}
    assert {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} <= named
    status, body = prometheus.api("series", **{"match[]": '{__name__=~"vllm:.*"}',
                                               "start": f"{observed:.3f}",
                                               "end": f"{time.time():.3f}"})
    assert status == 200, body
    assert named - {series["__name__"] for series in body["data"]} == set()
    instances = {series["instance"] for series in body["data"]}
    status, body = prometheus.api("query", query="fairway_endpoint_inflight_tokens")
    assert status == 200, body
    assert {r["metric"]["endpoint"] for r in body["data"]["result"]} == instances


@pytest.mark.parametrize(("title", "expr"), TARGETS, ids=[t for t, _ in TARGETS])
def test_panel_query_parses(prometheus: Prometheus, title: str, expr: str) -> None:
    status, body = prometheus.api("query", query=_substitute(expr))
    assert status == 200, f"{title}: HTTP {status} {body.get('errorType')}: {body.get('error')}"


@pytest.mark.parametrize(("title", "expr"), TARGETS, ids=[t for t, _ in TARGETS])
def test_panel_returns_series(observed: float, prometheus: Prometheus, title: str,
                              expr: str) -> None:
    query = _substitute(expr)
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while not prometheus.query_range(query, observed):
        if time.monotonic() > deadline:
            pytest.fail(f"{title}: no series within {SERIES_TIMEOUT_S} s for\n{query}")
        time.sleep(0.5)


def test_variables_have_values(observed: float, prometheus: Prometheus) -> None:
    variables = _variables()
    found = {}
    for name in QUERY_VARIABLES:
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variables[name]["definition"])
        assert match, variables[name]["definition"]
        selector, label = _substitute(match.group(1)), match.group(2)
        assert label == name
        status, body = prometheus.api(f"label/{label}/values", **{
            "match[]": selector, "start": f"{observed:.3f}", "end": f"{time.time():.3f}"})
        assert status == 200, body
        found[name] = set(body["data"])
    assert found["namespace"] == {NAMESPACE}
    assert found["job"] == {JOB}
    assert found["pool"] == {POOL}
    assert found["lane"] == {"online", "batch"}
    assert {"alice", "bob", "carol", "other"} <= found["tenant"]


# -- the gateway samples ---------------------------------------------------------------------

ENVOY_YAML = GATEWAY / "envoy.yaml"


def test_gateway_envoy_yaml_is_generated() -> None:
    assert ENVOY_YAML.read_text() == gen_gateway_envoy.render(), \
        "manifests/gateway/envoy.yaml is stale: run .venv/bin/python scripts/gen_gateway_envoy.py"


def test_every_generated_envoy_sample_is_current() -> None:
    """envoy-jwt.yaml and envoy-access-log.yaml too: what the script would write now."""
    assert gen_gateway_envoy.main(["--check"]) == 0


def test_the_access_log_sample_is_envoy_yaml_with_the_access_log_response_path() -> None:
    deployed = yaml.safe_load(gen_gateway_envoy.ACCESS_LOG_OUT.read_text())
    assert deployed == gen_gateway_envoy.deployment_config(response_path="access-log")
    manager = deployed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (log,) = manager["typed_config"]["access_log"]
    assert log["name"] == "envoy.access_loggers.http_grpc"
    common = log["typed_config"]["common_config"]
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == "picker"
    names = [f["name"] for f in manager["typed_config"]["http_filters"]]
    assert "fairway.meter" not in names  # no response stream to the picker


def test_gateway_envoy_yaml_is_the_tests_config_but_for_addresses() -> None:
    deployed = yaml.safe_load(ENVOY_YAML.read_text())
    undone = copy.deepcopy(deployed)
    resources = undone["static_resources"]
    resources["listeners"][0]["address"]["socket_address"]["address"] = "127.0.0.1"
    (picker,) = [c for c in resources["clusters"] if c["name"] == "picker"]
    assert picker["type"] == "STRICT_DNS"
    picker["type"] = "STATIC"
    endpoint = picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == {
        "address": gen_gateway_envoy.PICKER_HOST, "port_value": 9002}
    endpoint["address"]["socket_address"]["address"] = "127.0.0.1"
    assert undone == envoy_config(listen_port=gen_gateway_envoy.LISTEN_PORT,
                                  admin_port=gen_gateway_envoy.ADMIN_PORT, picker_port=9002,
                                  pool_pods=gen_gateway_envoy.POOL_PODS,
                                  picker_client_cert=GATEWAY_CERT)
    # fail-closed, as the InferencePool sample says
    filters = deployed["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    picker_filter = filters["typed_config"]["http_filters"][0]["typed_config"]
    assert picker_filter["failure_mode_allow"] is False


def test_gateway_envoy_yaml_passes_envoy_validate(tmp_path: Path) -> None:
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c",
                           str(sample_with_client_cert(ENVOY_YAML, tmp_path)),
                           "--log-level", "warn"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_gateway_api_wiring() -> None:
    docs = [d for d in yaml.safe_load_all((GATEWAY / "gateway-api.yaml").read_text()) if d]
    by_kind = {doc["kind"]: doc for doc in docs}
    # The picker's Service and the InferencePool are the chart's: the sample must not define
    # them again (it once re-pointed the chart's Service at nothing).
    assert set(by_kind) == {"Gateway", "HTTPRoute"}
    gateway, route = by_kind["Gateway"], by_kind["HTTPRoute"]
    assert {d["metadata"]["namespace"] for d in docs} == {"inference"}
    (parent,) = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", gateway["metadata"]["name"])
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    values = yaml.safe_load((ROOT / "charts" / "fairway" / "values.yaml").read_text())
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": values["inferencePool"]["name"]}]
    # The Envoy sample reaches the chart's picker Service.
    assert gen_gateway_envoy.PICKER_HOST.startswith("fairway-picker.inference.svc")
