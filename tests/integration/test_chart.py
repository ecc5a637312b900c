"""The Helm chart (``charts/fairway``), rendered by real Helm: helm-python-sdk is Helm v4's Go SDK
behind ctypes, so loading, values coalescing, ``values.schema.json``, templates and lint are
Helm's own code.

Rendered for the default values and each value set in ``tests/fixtures/chart/`` (plus the
defaults under another release name), and checked:

- ``helm lint --strict`` has nothing above INFO to say;
- every rendered object of a built-in kind passes Kubernetes' own schema
  (``kubernetes-validate --strict``) for 1.28, the chart's minimum, and the newest it knows;
  the CRD in ``crds/`` too;
- the two custom-resource kinds it cannot know are checked against small schemas written here
  from the documented APIs, for the fields the chart sets: the InferencePool
  (``inference.networking.k8s.io/v1``) and the ServiceMonitor (``monitoring.coreos.com/v1``).
  Nothing else is skipped, and the chart renders no TenantPolicy;
- every container runs as non-root with a read-only root filesystem (and ``/tmp`` an emptyDir);
- RBAC is Roles and RoleBindings only, with exactly the verbs the picker and the operator need;
- the flags the chart passes are parsed by the picker's and the operator's own argument parsers,
  and the names agree (the picker reads the ConfigMap the operator writes from the base the
  chart renders; the operator's admin address is the picker's Service);
- the rendered base config loads with the picker's ``load_config`` (and the operator's renderer
  accepts it with a policy), the CRD in ``crds/`` is byte-identical to ``manifests/crd/``, the
  dashboard in the chart is the repository's dashboard;
- with ``state.backend: redis`` every replica serves: no ``--lease``, a readiness-gated rollout,
  a PodDisruptionBudget of one eviction at a time, and the Secrets mounted where the rendered
  ``state`` section (as the picker loads it) looks for them; with ``memory`` the chart renders as
  before;
- every file in ``tests/fixtures/chart/bad/`` is refused at install by ``values.schema.json``
  with the message on its ``# expect:`` line; the state backend's are refused by the templates
  too when the schema is skipped.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helm_python import Chart, HelmRenderError, HelmValuesError, lint, package
from kubernetes_validate.utils import SchemaNotFoundError, latest_version

import picker.__main__ as picker_main
from fairway_operator import render as operator_render
from fairway_operator.__main__ import parse_args as operator_parse_args
from picker.config.schema import PickerConfig, load_config
from picker.server import ServeSettings, serve
from picker.tls import KeyPair, certificate_authority, issue, unverified_channel_credentials
from tests.expect import expected_message

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "fairway"
FIXTURES = ROOT / "tests" / "fixtures" / "chart"
BAD = sorted((FIXTURES / "bad").glob("*.yaml"))
NS = "inference"
K8S_VERSIONS = ["1.28", latest_version()]
# Kinds kubernetes-validate has no schema for; checked against the schemas below instead.
CUSTOM_KINDS = {"InferencePool", "ServiceMonitor"}

# (id, release name, values)
CASES: list[tuple[str, str, dict]] = [("default", "fairway", {}),
                                      ("default-release-llm", "llm", {})]
CASES += [(p.stem, "fairway", yaml.safe_load(p.read_text(encoding="utf-8")))
          for p in sorted(FIXTURES.glob("*.yaml"))]
IDS = [c[0] for c in CASES]
OPERATOR_IDS = [c[0] for c in CASES if c[2].get("operator", {}).get("enabled", True)]
REDIS_IDS = [c[0] for c in CASES if c[2].get("state", {}).get("backend") == "redis"]


@functools.cache
def _chart() -> Chart:
    return Chart.load(CHART)


@functools.cache
def _rendered(case_id: str) -> tuple[dict[str, str], dict]:
    """(template path → manifest, the coalesced values) of one case."""
    _, release, values = next(c for c in CASES if c[0] == case_id)
    chart = _chart()
    manifests = chart.render(copy.deepcopy(values), name=release, namespace=NS, is_install=True)
    return manifests, chart.merge_values(copy.deepcopy(values))


@functools.cache
def _objects(case_id: str) -> list[dict]:
    """The rendered objects (shared between tests: copy before changing one)."""
    manifests, _ = _rendered(case_id)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.load_all(text, Loader=loader) if doc]


def _values(case_id: str) -> dict:
    return _rendered(case_id)[1]


def _kind(case_id: str, kind: str) -> list[dict]:
    return [o for o in _objects(case_id) if o["kind"] == kind]


def _one(case_id: str, kind: str, component: str | None = None) -> dict:
    found = [o for o in _kind(case_id, kind) if component is None
             or o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"{case_id}: {len(found)} {kind} {component or ''}"
    return found[0]


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _flags(args: list[str]) -> dict[str, str | bool]:
    """``--name=value`` (or a bare ``--flag``) → {name: value}; a flag may appear once."""
    flags: dict[str, str | bool] = {}
    for arg in args:
        if not arg.startswith("--"):
            continue
        name, sep, value = arg[2:].partition("=")
        assert name not in flags, f"--{name} twice"
        flags[name] = value if sep else True
    return flags


def _selected(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _shared(case_id: str) -> bool:
    """Whether the case's pickers share their state through Redis (all serve, none leads)."""
    return bool(_values(case_id)["state"]["backend"] == "redis")


# --- Helm: lint, schema, rendering ---------------------------------------------------------


@pytest.mark.parametrize("case_id", IDS)
def test_chart_lints_strictly(case_id: str) -> None:
    _, _, values = next(c for c in CASES if c[0] == case_id)
    report = lint(CHART, copy.deepcopy(values), strict=True, namespace=NS)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # warnings fail --strict


@pytest.mark.parametrize("case_id", IDS)
def test_values_pass_the_schema_and_render(case_id: str) -> None:
    _chart().validate_schema(_values(case_id))
    kinds = sorted(o["kind"] for o in _objects(case_id))
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
            "ConfigMap"} <= set(kinds)
    for obj in _objects(case_id):
        assert obj["metadata"]["namespace"] == NS, obj["metadata"]["name"]
        assert len(obj["metadata"]["name"]) <= 63


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_values_are_refused_by_the_schema(path: Path) -> None:
    values = yaml.safe_load(path.read_text(encoding="utf-8"))
    expected = expected_message(path)
    with pytest.raises(HelmValuesError) as refused:  # what `helm install` does
        _chart().render(values, name="fairway", namespace=NS, is_install=True)
    assert expected in str(refused.value)
    with pytest.raises(HelmValuesError, match=re.escape(expected)):
        _chart().validate_schema(_chart().merge_values(values))


def test_bad_fixtures_are_one_failure_each() -> None:
    """Each bad file breaks one thing: every error is about one value (or what lies under it)."""
    assert len(BAD) >= 15
    for path in BAD:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
        with pytest.raises(HelmValuesError) as refused:
            _chart().validate_schema(_chart().merge_values(values))
        paths = sorted({line.split("'")[1] for line in str(refused.value).splitlines()
                        if line.strip().startswith("- at '")})
        paths = [p for p in paths if p] or paths  # '' (the root) summarises allOf's failures
        assert paths and all(p.startswith(paths[0]) for p in paths), (path.name, paths)


def test_grace_must_be_shorter_than_the_termination_grace_period() -> None:
    with pytest.raises(HelmRenderError, match="terminationGracePeriodSeconds must exceed"):
        _chart().render({"picker": {"grace": 30, "terminationGracePeriodSeconds": 30}},
                        name="fairway", namespace=NS, is_install=True)


# The template's message for each state fixture in bad/: what `helm install
# --skip-schema-validation` says.
TEMPLATE_REFUSALS = {
    "redis_without_url": "state.redis.url is required with state.backend redis",
    "redis_url_not_redis": "state.redis.url must start with redis:// or rediss://",
    "redis_url_with_credentials": "state.redis.url must not carry credentials",
    "state_in_config": "config.state is not read: set the top-level `state` values",
    "redis_ca_without_tls": "state.redis.caSecret is used only with TLS",
    "workers_without_redis": "picker.workers > 1 needs state.backend redis",
}


@pytest.mark.parametrize("name", sorted(TEMPLATE_REFUSALS))
def test_state_mistakes_are_refused_without_the_schema_too(name: str, tmp_path: Path) -> None:
    chart_dir = tmp_path / "fairway"
    shutil.copytree(CHART, chart_dir)
    (chart_dir / "values.schema.json").unlink()
    values = yaml.safe_load((FIXTURES / "bad" / f"{name}.yaml").read_text(encoding="utf-8"))
    with Chart.load(chart_dir) as unchecked, pytest.raises(HelmRenderError) as refused:
        unchecked.render(values, name="fairway", namespace=NS, is_install=True)
    assert TEMPLATE_REFUSALS[name] in str(refused.value)


# --- Kubernetes' schemas and the custom kinds --------------------------------------------------

# Written from the InferencePool v1 API reference (Gateway API Inference Extension): the fields
# this chart sets, with their documented constraints.
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False, "required": ["matchLabels"],
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1,
                        "additionalProperties": {
                            "type": "string", "maxLength": 63,
                            "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}}},
                "targetPorts": {
                    "type": "array", "minItems": 1, "maxItems": 8,
                    "items": {"type": "object", "additionalProperties": False,
                              "required": ["number"],
                              "properties": {"number": {"type": "integer", "minimum": 1,
                                                        "maximum": 65535}}}},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": {"type": "object", "additionalProperties": False,
                                 "required": ["number"],
                                 "properties": {"number": {"type": "integer", "minimum": 1,
                                                           "maximum": 65535}}},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}},
}

# Written from prometheus-operator's ServiceMonitor v1 API: the fields this chart sets.
SERVICE_MONITOR_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "properties": {
                    "matchLabels": {"type": "object",
                                    "additionalProperties": {"type": "string"}}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False,
                                      "properties": {"any": {"type": "boolean"},
                                                     "matchNames": {"type": "array", "items": {
                                                         "type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string", "minLength": 1},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string",
                                     "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                                                "(([0-9]+)ms)?)$"},
                        "scrapeTimeout": {"type": "string",
                                          "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
                                                     "(([0-9]+)ms)?)$"},
                        "authorization": {
                            "type": "object", "additionalProperties": False,
                            "required": ["credentials"],
                            "properties": {"type": {"type": "string"},
                                           "credentials": {
                                               "type": "object", "additionalProperties": False,
                                               "required": ["name", "key"],
                                               "properties": {"name": {"type": "string"},
                                                              "key": {"type": "string"}}}}},
                        "relabelings": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False,
                            "required": ["targetLabel"],
                            "properties": {
                                "action": {"enum": ["replace", "keep", "drop", "labelmap"]},
                                "targetLabel": {"type": "string", "minLength": 1},
                                "replacement": {"type": "string"}}}}}}}}}},
}


@pytest.mark.parametrize("case_id", IDS)
def test_every_object_passes_its_schema(case_id: str) -> None:
    skipped = set()
    for obj in _objects(case_id):
        if obj["kind"] in CUSTOM_KINDS:
            schema = {"InferencePool": INFERENCE_POOL_V1,
                      "ServiceMonitor": SERVICE_MONITOR_V1}[obj["kind"]]
            jsonschema.Draft7Validator(schema).validate(obj)
            for version in K8S_VERSIONS:  # really unknown to kubernetes-validate
                with pytest.raises(SchemaNotFoundError):
                    kubernetes_validate.validate(obj, version, strict=True)
            skipped.add(obj["kind"])
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    assert skipped <= CUSTOM_KINDS


def test_the_custom_schemas_refuse_what_the_apis_refuse() -> None:
    pool = _one("inferencepool-failopen", "InferencePool")
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSafe"
    bad["spec"]["targetPorts"] = []
    errors = list(jsonschema.Draft7Validator(INFERENCE_POOL_V1).iter_errors(bad))
    assert len(errors) == 2
    monitor = _one("monitoring-netpol", "ServiceMonitor")
    bad = copy.deepcopy(monitor)
    bad["spec"]["endpoints"][0]["interval"] = "30 seconds"
    assert not jsonschema.Draft7Validator(SERVICE_MONITOR_V1).is_valid(bad)


# --- security --------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", IDS)
def test_every_container_is_non_root_with_a_read_only_root_filesystem(case_id: str) -> None:
    deployments = _kind(case_id, "Deployment")
    assert len(deployments) == (2 if _values(case_id)["operator"]["enabled"] else 1)
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 1) != 0
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            where = f"{deployment['metadata']['name']}/{container['name']}"
            assert context["runAsNonRoot"] is True, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context.get("privileged", False) is False, where
            assert "ALL" in context["capabilities"]["drop"], where
            assert not context["capabilities"].get("add"), where
            (tmp,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert "emptyDir" in volumes[tmp["name"]], where
            assert container["resources"]["requests"] and container["resources"]["limits"]


def _elects(case_id: str) -> bool:
    """Whether the case's pickers elect a leader: they are started with --lease."""
    (deployment,) = [d for d in _kind(case_id, "Deployment")
                     if d["metadata"]["labels"]["app.kubernetes.io/component"] == "picker"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return any(arg.startswith("--lease=") for arg in args)


@pytest.mark.parametrize("case_id", IDS)
def test_rbac_is_namespaced_and_least_privilege(case_id: str) -> None:
    kinds = {o["kind"] for o in _objects(case_id)}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding"}
    operator = _values(case_id)["operator"]["enabled"]

    def grants(role: dict) -> set[tuple[str, str, str]]:
        return {(group, resource, verb) for rule in role["rules"]
                for group in rule["apiGroups"] for resource in rule["resources"]
                for verb in rule["verbs"]}

    picker = grants(_one(case_id, "Role", "picker"))
    assert picker == {
        ("", "configmaps", "get"), ("", "configmaps", "list"), ("", "configmaps", "watch"),
        ("", "pods", "list"), ("", "pods", "watch"),
        ("inference.networking.k8s.io", "inferencepools", "get"),
        ("inference.networking.k8s.io", "inferencepools", "list"),
        ("inference.networking.k8s.io", "inferencepools", "watch")} | ({
            ("coordination.k8s.io", "leases", "get"), ("coordination.k8s.io", "leases", "create"),
            ("coordination.k8s.io", "leases", "patch")} if _elects(case_id) else set())
    roles = {role["metadata"]["name"] for role in _kind(case_id, "Role")}
    assert len(roles) == (2 if operator else 1)
    if operator:
        assert grants(_one(case_id, "Role", "operator")) == {
            ("fairway.dev", "tenantpolicies", v) for v in ("get", "list", "watch", "patch")} | {
            ("fairway.dev", "tenantpolicies/status", "patch"),
            *{("", "configmaps", v) for v in ("get", "list", "watch", "create", "patch")},
            *{("", "secrets", v) for v in ("get", "list", "watch")},
            ("", "events", "create")}
    # Each Deployment's service account is bound to its component's Role, in the namespace.
    accounts = {a["metadata"]["name"] for a in _kind(case_id, "ServiceAccount")}
    for deployment in _kind(case_id, "Deployment"):
        component = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        assert account in accounts
        binding = _one(case_id, "RoleBinding", component)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": _one(case_id, "Role", component)["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                        "namespace": NS}]


# --- the picker ------------------------------------------------------------------------------


def _picker_run(args: list[str]) -> tuple[Any, int]:
    """The picker's own argument parser applied to ``args``: the settings it would serve with,
    and over how many worker processes."""
    seen: list[tuple[Any, int]] = []

    async def fake_serve(settings: Any) -> None:
        seen.append((settings, 1))

    async def fake_workers(settings: Any, workers: int, log_level: str = "INFO",
                           **options: Any) -> None:
        seen.append((settings, workers))

    originals = picker_main.serve, picker_main.run_workers
    picker_main.serve, picker_main.run_workers = fake_serve, fake_workers
    try:
        assert picker_main.main(args) == 0
    finally:
        picker_main.serve, picker_main.run_workers = originals
    return seen[0]


def _picker_settings(args: list[str]) -> Any:
    return _picker_run(args)[0]


@pytest.mark.parametrize("case_id", IDS)
def test_picker_workers_per_pod(case_id: str) -> None:
    """``picker.workers`` reaches the picker's own parser as ``--workers`` (left out at 1)."""
    values = _values(case_id)
    container = _container(_one(case_id, "Deployment", "picker"))
    _, workers = _picker_run(container["args"])
    assert workers == values["picker"]["workers"]
    assert (workers > 1) == any(arg.startswith("--workers") for arg in container["args"])


@pytest.mark.parametrize("case_id", IDS)
def test_picker_deployment(case_id: str) -> None:
    values = _values(case_id)
    deployment = _one(case_id, "Deployment", "picker")
    container = _container(deployment)
    replicas = values["picker"]["replicas"]
    pool = values["inferencePool"]["name"]
    assert deployment["spec"]["replicas"] == replicas
    flags = _flags(container["args"])
    config_map = flags["config-map"]
    assert isinstance(config_map, str) and config_map.startswith(f"{NS}/")
    assert config_map.endswith("-picker-config")
    assert flags.get("pool") == (f"{NS}/{pool}" if pool else None)
    lease = flags.get("lease")
    if replicas > 1 and not _shared(case_id):
        assert lease == f"{NS}/{deployment['metadata']['name']}"
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "100%",
                                                                   "maxUnavailable": "100%"}
    else:
        assert lease is None
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    settings = _picker_settings(container["args"])
    assert settings.host == "0.0.0.0"
    assert (settings.grpc_port, settings.grpc_health_port, settings.metrics_port,
            settings.admin_port) == (9002, 9003, 9090, 9004)
    tls = _values(case_id)["picker"]["tls"]
    assert settings.secure_serving == tls["enabled"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    if tls["enabled"] and tls["secretName"]:
        # The Secret is mounted where --cert-path points, read-only, its two keys by name.
        assert settings.cert_path is not None
        assert mounts["tls"]["mountPath"] == str(settings.cert_path)
        assert mounts["tls"]["readOnly"] is True
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"] == {
            "secretName": tls["secretName"],
            "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}
    else:
        assert settings.cert_path is None and "tls" not in mounts  # self-signed at start
    assert settings.config_map == config_map and settings.config_path is None
    assert settings.grace < deployment["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]

    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"ext-proc": 9002, "health": 9003, "metrics": 9090, "admin": 9004}
    # Upstream's probes: gRPC health on 9003 (plaintext), readiness (the synced leader) and
    # liveness (every running replica) by service name.
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert _selected(selector, deployment["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("case_id", IDS)
def test_picker_service(case_id: str) -> None:
    service = _one(case_id, "Service", "picker")
    deployment = _one(case_id, "Deployment", "picker")
    assert _selected(service["spec"]["selector"],
                     deployment["spec"]["template"]["metadata"]["labels"])
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert {name: p["port"] for name, p in ports.items()} == {
        "ext-proc": 9002, "health": 9003, "metrics": 9090, "admin": 9004}
    # TLS by default (upstream's Service says http2); h2c only when TLS is off.
    tls = _values(case_id)["picker"]["tls"]["enabled"]
    assert ports["ext-proc"]["appProtocol"] == ("http2" if tls else "kubernetes.io/h2c")
    assert ports["health"]["appProtocol"] == "kubernetes.io/h2c"
    container_ports = {p["name"] for p in _container(deployment)["ports"]}
    assert {p["targetPort"] for p in ports.values()} <= container_ports


@pytest.mark.parametrize("case_id", IDS)
def test_pdb_only_with_several_replicas(case_id: str) -> None:
    replicas = _values(case_id)["picker"]["replicas"]
    budgets = _kind(case_id, "PodDisruptionBudget")
    if replicas == 1:
        assert budgets == []
        return
    (pdb,) = budgets
    deployment = _one(case_id, "Deployment", "picker")
    if _shared(case_id):  # every replica serves: any one may go, the others keep serving
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    else:  # only the leader is Ready: it stays
        assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # standbys are unready
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]


def test_ha_spreads_replicas_and_elects_a_leader() -> None:
    deployment = _one("ha", "Deployment", "picker")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 3
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == \
        deployment["spec"]["selector"]["matchLabels"]
    container = _container(deployment)
    assert container["image"] == "registry.example.com/fairway:0.1.0"
    assert _picker_settings(container["args"]).lease == f"{NS}/fairway-picker"


@pytest.mark.parametrize("case_id", REDIS_IDS)
def test_with_redis_every_replica_serves(case_id: str) -> None:
    """No leader election, whatever the replica count; a readiness-gated rollout and one
    eviction at a time, since every replica is Ready; still spread over nodes."""
    deployment = _one(case_id, "Deployment", "picker")
    assert deployment["spec"]["replicas"] == _values(case_id)["picker"]["replicas"] > 1
    args = _container(deployment)["args"]
    assert not any(arg.startswith("--lease") for arg in args)
    assert _picker_settings(args).lease is None
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (pdb,) = _kind(case_id, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    term = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


def test_with_redis_an_update_strategy_value_wins() -> None:
    _, _, values = next(c for c in CASES if c[0] == "redis")
    values = copy.deepcopy(values)
    values["picker"]["updateStrategy"] = {"type": "Recreate"}
    manifests = _chart().render(values, name="fairway", namespace=NS, is_install=True)
    deployment = yaml.safe_load(manifests["fairway/templates/picker-deployment.yaml"])
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_with_redis_the_secrets_are_mounted_where_the_config_names_them() -> None:
    values = _values("redis")["state"]["redis"]
    deployment = _one("redis", "Deployment", "picker")
    pod = deployment["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in _container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["redis"] == {"name": "redis", "mountPath": "/etc/fairway/redis",
                               "readOnly": True}
    # Only the named key of each Secret, under the file name the config gives.
    assert volumes["redis"]["projected"]["sources"] == [
        {"secret": {"name": "fairway-redis",
                    "items": [{"key": "redis-password", "path": "password"}]}},
        {"secret": {"name": "redis-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]
    assert values["passwordSecret"]["key"] == "redis-password"  # the fixture's
    assert values["caSecret"]["key"] == "ca.crt"  # the default
    config = load_config(yaml.safe_load(
        _one("redis", "ConfigMap", "picker-config")["data"]["base.yaml"]))
    files = {item["path"] for source in volumes["redis"]["projected"]["sources"]
             for item in source["secret"]["items"]}
    assert config.state.redis.password_file == "/etc/fairway/redis/password"
    assert config.state.redis.ca_file == "/etc/fairway/redis/ca.crt"
    for path in (config.state.redis.password_file, config.state.redis.ca_file):
        directory, _, name = path.rpartition("/")
        assert directory == mounts["redis"]["mountPath"] and name in files
    # Without Secrets: nothing mounted, no file named.
    config = load_config(yaml.safe_load(
        _one("redis-no-operator", "ConfigMap", "picker-config")["data"]["picker.yaml"]))
    assert config.state.redis.password_file is None and config.state.redis.ca_file is None
    deployment = _one("redis-no-operator", "Deployment", "picker")
    # (the gateway CA and the tokens are mounted whatever the state backend)
    assert [v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]] == [
        "tmp", "client-ca", "admin-token", "metrics-token"]
    assert [m["name"] for m in _container(deployment)["volumeMounts"]] == [
        "tmp", "client-ca", "admin-token", "metrics-token"]


# --- the operator and the names the components share -------------------------------------------


@pytest.mark.parametrize("case_id", OPERATOR_IDS)
def test_operator_flags_match_the_picker_and_the_base_config(
        case_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("POOL", "NAMESPACES", "ALL_NAMESPACES", "BASE_CONFIGMAP", "BASE_KEY",
                 "OUTPUT_CONFIGMAP", "OUTPUT_KEY", "ADMIN_ADDRESS", "STATUS_INTERVAL",
                 "LIVENESS", "VERBOSE"):
        monkeypatch.delenv(f"FAIRWAY_{name}", raising=False)
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    values = _values(case_id)
    operator = _one(case_id, "Deployment", "operator")
    container = _container(operator)
    assert container["command"] == ["python", "-m", "fairway_operator"]
    assert operator["spec"]["replicas"] == 1  # one writer of the picker's ConfigMap
    settings, args = operator_parse_args(container["args"])
    picker_flags = _flags(_container(_one(case_id, "Deployment", "picker"))["args"])

    assert settings.pool == values["inferencePool"]["name"]
    assert settings.namespaces == (NS,)
    assert picker_flags["config-map"] == f"{NS}/{settings.output_configmap}"
    assert settings.output_key == "picker.yaml"
    base = _one(case_id, "ConfigMap", "picker-config")
    assert base["metadata"]["name"] == settings.base_configmap
    assert list(base["data"]) == [settings.base_key] == ["base.yaml"]
    service = _one(case_id, "Service", "picker")
    assert settings.admin_address == f"{service['metadata']['name']}:9004"
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    names = {o["metadata"]["name"] for o in _objects(case_id)}
    assert settings.output_configmap not in names  # the operator's, never Helm's


def test_names_follow_the_release() -> None:
    names = {(o["kind"], o["metadata"]["name"]) for o in _objects("default-release-llm")}
    assert {("Deployment", "llm-fairway-picker"), ("Deployment", "llm-fairway-operator"),
            ("ConfigMap", "llm-fairway-base"), ("Service", "llm-fairway-picker")} <= names
    names = {(o["kind"], o["metadata"]["name"]) for o in _objects("default")}
    assert {("Deployment", "fairway-picker"), ("ConfigMap", "fairway-base")} <= names


# --- the config --------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", IDS)
def test_rendered_config_loads_in_the_picker(case_id: str) -> None:
    values = _values(case_id)
    configmap = _one(case_id, "ConfigMap", "picker-config")
    (key,) = configmap["data"]
    data = yaml.safe_load(configmap["data"][key])
    # toYaml kept every value and its type; `state` is the chart's, from the `state` values.
    assert {k: v for k, v in data.items() if k != "state"} == values["config"]
    assert ("state" in data) == _shared(case_id)
    config = load_config(data)
    assert isinstance(config, PickerConfig)
    assert config.state.backend == values["state"]["backend"]
    if values["operator"]["enabled"]:
        assert key == "base.yaml" and configmap["metadata"]["name"].endswith("-base")
        # The operator accepts the base and adds a policy's tenant to it.
        base = operator_render.parse_base(configmap["data"], key, configmap["metadata"]["name"])
        lane = config.lanes[-1].name
        policy = {"apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
                  "metadata": {"name": "team-a", "namespace": NS, "generation": 1,
                               "creationTimestamp": "2026-01-01T00:00:00Z"},
                  "spec": {"poolRef": {"name": values["inferencePool"]["name"]},
                           "tenants": ["team-a"], "weight": 2, "lane": lane}}
        rendered, verdicts = operator_render.render(base, [policy], {})
        assert rendered is not None and verdicts["team-a"].ready, verdicts
        assert load_config(rendered).tenant("team-a").weight == 2
        assert load_config(rendered).state == config.state  # the operator keeps it
    else:
        assert key == "picker.yaml" and configmap["metadata"]["name"].endswith("-picker-config")


def test_config_values_keep_their_types() -> None:
    config = load_config(yaml.safe_load(
        _one("single-replica", "ConfigMap", "picker-config")["data"]["base.yaml"]))
    sustained = config.tenant_defaults.budgets.sustained
    assert sustained is not None and sustained.tokens == 20_000_000
    assert isinstance(sustained.tokens, int) and sustained.per == 86400
    assert config.capacity.kv_budget_tokens == 16384
    assert [lane.engine_priority for lane in config.lanes] == [0, 10]


def _state(case_id: str) -> Any:
    """The picker's ``state`` settings, as it loads them from the config the chart renders."""
    configmap = _one(case_id, "ConfigMap", "picker-config")
    (text,) = configmap["data"].values()
    return load_config(yaml.safe_load(text)).state


def test_redis_state_section_loads_in_the_picker() -> None:
    state = _state("redis")
    assert (state.backend, state.redis.url) == ("redis", "rediss://redis-master.redis.svc:6379/0")
    assert (state.sync_interval, state.max_staleness, state.on_unavailable) == (
        0.05, 1.0, "failSoft")
    state = _state("redis-no-operator")
    assert (state.backend, state.redis.url) == ("redis", "redis://redis.shared.svc:6379/2")
    assert (state.sync_interval, state.max_staleness, state.on_unavailable) == (
        0.1, 2.0, "failClosed")  # the chart's defaults are the picker's
    for case_id in IDS:
        if case_id not in REDIS_IDS:
            assert _state(case_id).backend == "memory"


def test_redis_key_prefix_defaults_to_the_namespace_and_the_picker() -> None:
    """Two pools (releases) sharing a Redis stay apart; an explicit prefix is kept."""
    deployment = _one("redis", "Deployment", "picker")
    assert _state("redis").redis.key_prefix == f"{NS}/{deployment['metadata']['name']}" == \
        f"{NS}/fairway-picker"
    assert _state("redis-no-operator").redis.key_prefix == "team-pools/llm"
    _, _, values = next(c for c in CASES if c[0] == "redis")
    manifests = _chart().render(copy.deepcopy(values), name="chat", namespace="other",
                                is_install=True)
    base = yaml.safe_load(yaml.safe_load(manifests["fairway/templates/config.yaml"])["data"][
        "base.yaml"])
    assert load_config(base).state.redis.key_prefix == "other/chat-fairway-picker"


def test_memory_backend_renders_no_state_section() -> None:
    """The picker's default: the chart adds nothing to the config it renders."""
    assert _values("default")["state"]["backend"] == "memory"
    for case_id in IDS:
        if case_id not in REDIS_IDS:
            (text,) = _one(case_id, "ConfigMap", "picker-config")["data"].values()
            assert "state" not in yaml.safe_load(text)


def test_without_operator_the_chart_writes_the_whole_picker_config() -> None:
    configmap = _one("no-operator", "ConfigMap", "picker-config")
    config = load_config(yaml.safe_load(configmap["data"]["picker.yaml"]))
    assert [t.id for t in config.tenants] == ["team-a", "nightly"]
    assert len(config.endpoints) == 2 and config.tenancy.mode == "apiKey"
    picker = _container(_one("no-operator", "Deployment", "picker"))
    assert _flags(picker["args"])["config-map"] == f"{NS}/{configmap['metadata']['name']}"
    assert "pool" not in _flags(picker["args"])
    assert _kind("no-operator", "Role") == [_one("no-operator", "Role", "picker")]


# --- optional objects --------------------------------------------------------------------------


def test_inference_pool_points_at_the_picker() -> None:
    pool = _one("inferencepool-failopen", "InferencePool")
    service = _one("inferencepool-failopen", "Service", "picker")
    assert pool["metadata"]["name"] == "qwen-pool"
    assert pool["spec"]["selector"] == {"matchLabels": {"app": "vllm-qwen"}}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": service["metadata"]["name"],
        "port": {"number": 9002}, "failureMode": "FailOpen"}
    picker = _container(_one("inferencepool-failopen", "Deployment", "picker"))
    assert _flags(picker["args"])["pool"] == f"{NS}/qwen-pool"
    for case_id in IDS:
        if case_id != "inferencepool-failopen":
            assert _kind(case_id, "InferencePool") == []


def test_service_monitor_scrapes_the_metrics_port() -> None:
    monitor = _one("monitoring-netpol", "ServiceMonitor")
    service = _one("monitoring-netpol", "Service", "picker")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert _selected(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        "metrics", "/metrics", "30s")
    # The page names every tenant: the scrape sends the token the picker mounts.
    picker = _one("monitoring-netpol", "Deployment", "picker")
    settings = _picker_settings(_container(picker)["args"])
    assert settings.metrics_token_file is not None
    volume = _mounted(picker, str(settings.metrics_token_file))
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {
        "name": volume["secret"]["secretName"], "key": "token"}}
    assert len(_secret("monitoring-netpol", volume["secret"]["secretName"])["token"]) >= 32
    # The dashboard's pool variable reads this label.
    assert endpoint["relabelings"] == [
        {"action": "replace", "targetLabel": "pool", "replacement": "llm-pool"}]
    assert _kind("default", "ServiceMonitor") == []


def test_network_policies() -> None:
    values = _values("monitoring-netpol")["networkPolicy"]
    picker = _one("monitoring-netpol", "NetworkPolicy", "picker")
    operator = _one("monitoring-netpol", "NetworkPolicy", "operator")
    picker_pods = _one("monitoring-netpol", "Deployment", "picker")["spec"]["template"]
    operator_pods = _one("monitoring-netpol", "Deployment", "operator")["spec"]["template"]
    assert _selected(picker["spec"]["podSelector"]["matchLabels"],
                     picker_pods["metadata"]["labels"])
    assert picker["spec"]["policyTypes"] == ["Ingress"]  # egress: the API and the engines
    by_port = {}
    for rule in picker["spec"]["ingress"]:
        for port in rule["ports"]:
            by_port[port["port"]] = rule["from"]
    gateway = [{"namespaceSelector": values["gateway"]["namespaceSelector"],
                "podSelector": values["gateway"]["podSelector"]}]
    assert by_port == {
        "ext-proc": gateway,
        "health": gateway,  # gateways may health-check the picker; the kubelet is not a pod
        "metrics": [{"namespaceSelector": values["metrics"]["namespaceSelector"]}],
        "admin": [{"podSelector": operator["spec"]["podSelector"]}],
    }
    assert _selected(by_port["admin"][0]["podSelector"]["matchLabels"],
                     operator_pods["metadata"]["labels"])
    assert not _selected(by_port["admin"][0]["podSelector"]["matchLabels"],
                         picker_pods["metadata"]["labels"])
    assert operator["spec"]["ingress"] == [] and operator["spec"]["policyTypes"] == ["Ingress"]


def test_network_policies_are_on_by_default() -> None:
    """Without any value the picker takes ext_proc only from the samples' Gateway's pods,
    metrics only from the monitoring namespace and the admin API only from the operator."""
    policy = _one("default", "NetworkPolicy", "picker")
    by_port = {port["port"]: rule["from"] for rule in policy["spec"]["ingress"]
               for port in rule["ports"]}
    gateway = [{"podSelector": {"matchLabels": {
        "gateway.networking.k8s.io/gateway-name": "inference-gateway"}}}]
    assert by_port["ext-proc"] == by_port["health"] == gateway
    assert by_port["metrics"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    operator = _one("default", "Deployment", "operator")["spec"]["template"]["metadata"]
    (admin,) = by_port["admin"]
    assert _selected(admin["podSelector"]["matchLabels"], operator["labels"])
    # A picker.ctl pod may be let in beside the operator (it still needs the token).
    manifests = _chart().render({"networkPolicy": {"admin": [{"podSelector": {
        "matchLabels": {"app": "ops"}}}]}}, name="fairway", namespace=NS, is_install=True)
    (policy, _) = yaml.safe_load_all(manifests["fairway/templates/networkpolicy.yaml"])
    admin_from = [rule["from"] for rule in policy["spec"]["ingress"]
                  if rule["ports"] == [{"port": "admin", "protocol": "TCP"}]]
    assert admin_from[0][1:] == [{"podSelector": {"matchLabels": {"app": "ops"}}}]


def test_network_policy_with_only_a_gateway_pod_selector() -> None:
    manifests = _chart().render({"networkPolicy": {"enabled": True, "gateway": {
        "podSelector": {"matchLabels": {"app": "envoy"}}}}}, name="fairway", namespace=NS,
        is_install=True)
    (policy, _) = yaml.safe_load_all(manifests["fairway/templates/networkpolicy.yaml"])
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": {
        "matchLabels": {"app": "envoy"}}}]  # pods of the release namespace only


def test_network_policy_leaves_the_pickers_way_to_redis_open() -> None:
    _, _, values = next(c for c in CASES if c[0] == "redis")
    values = copy.deepcopy(values)
    values["networkPolicy"] = {"enabled": True, "gateway": {
        "podSelector": {"matchLabels": {"app": "envoy"}}}}
    manifests = _chart().render(values, name="fairway", namespace=NS, is_install=True)
    for policy in yaml.safe_load_all(manifests["fairway/templates/networkpolicy.yaml"]):
        assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]


# --- who may speak to the picker: mTLS on ext_proc, the admin token ---------------------------


def _secret(case_id: str, name: str) -> dict[str, bytes]:
    (secret,) = [o for o in _kind(case_id, "Secret") if o["metadata"]["name"] == name]
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


def _mounted(deployment: dict, path: str) -> dict:
    """The volume mounted at the directory of ``path`` in the first container."""
    directory = str(Path(path).parent)
    (mount,) = [m for m in _container(deployment)["volumeMounts"] if m["mountPath"] == directory]
    assert mount["readOnly"] is True
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    return volume


@pytest.mark.parametrize("case_id", IDS)
def test_the_picker_requires_the_gateways_client_certificate(case_id: str) -> None:
    """By default (TLS on) the picker verifies a client certificate against a CA Secret it
    mounts where ``--client-ca`` points, and pins the names; plaintext says its mode."""
    values = _values(case_id)["picker"]["tls"]
    deployment = _one(case_id, "Deployment", "picker")
    settings = _picker_settings(_container(deployment)["args"])
    auth = settings.client_authentication()
    if not values["enabled"]:
        assert auth.mode == values["clientAuth"]["mode"] != "mtls"
        assert settings.client_ca is None
        return
    assert auth.mode == "mtls" and auth.names == {"fairway-gateway"}
    volume = _mounted(deployment, str(settings.client_ca))
    fullname = deployment["metadata"]["name"]
    assert volume["secret"] == {"secretName": f"{fullname}-client-ca",
                                "items": [{"key": "ca.crt", "path": settings.client_ca.name}]}
    # The gateway's Secret is a TLS Secret signed by that CA, for the pinned name.
    ca = x509.load_pem_x509_certificate(_secret(case_id, f"{fullname}-client-ca")["ca.crt"])
    gateway = _secret(case_id, f"{fullname}-gateway-tls")
    cert = x509.load_pem_x509_certificate(gateway["tls.crt"])
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["fairway-gateway"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.ExtendedKeyUsageOID.CLIENT_AUTH in usage
    assert set(gateway) == {"tls.crt", "tls.key"}  # no ca.crt: Istio would verify with it


def test_a_picker_with_the_rendered_ca_serves_only_the_rendered_gateway(tmp_path: Path) -> None:
    """The chart's generated CA and gateway certificate, handed to a real picker: the gateway's
    certificate is served, a client without one (or with another CA's) is refused at the
    handshake."""
    (tmp_path / "ca.crt").write_bytes(_secret("default", "fairway-picker-client-ca")["ca.crt"])
    gateway = _secret("default", "fairway-picker-gateway-tls")
    pair = KeyPair(gateway["tls.crt"], gateway["tls.key"], None)  # type: ignore[arg-type]
    stranger = issue(certificate_authority("another-ca"), ["fairway-gateway"])
    config = tmp_path / "picker.yaml"
    config.write_text(json.dumps({"endpoints": [{"address": "127.0.0.1:9"}]}))

    async def check(port: int, client: KeyPair | None) -> bool:
        credentials = await asyncio.to_thread(unverified_channel_credentials, "127.0.0.1",
                                              port, 5.0, client)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE
                return False
        return True

    async def scenario() -> list[bool]:
        stop = asyncio.Event()
        ready: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        settings = ServeSettings(config, grpc_port=0, grpc_health_port=0, metrics_port=0,
                                 admin_port=0, grace=0.2, client_ca=tmp_path / "ca.crt",
                                 client_names=("fairway-gateway",))
        task = asyncio.create_task(serve(settings, stop, ready))
        try:
            port, _ = await asyncio.wait_for(asyncio.shield(ready), 15)
            return [await check(port, pair), await check(port, None),
                    await check(port, stranger)]
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)

    assert asyncio.run(scenario()) == [True, False, False]


def test_a_ca_secret_of_ones_own_replaces_the_generated_ones() -> None:
    """cert-manager (or any CA): the picker mounts the named Secret's key; nothing generated."""
    manifests = _chart().render({"picker": {"tls": {"clientAuth": {
        "caSecretName": "gateway-ca", "caKey": "tls-ca.pem"}}}}, name="fairway", namespace=NS,
        is_install=True)
    objects = [o for path, text in manifests.items() if path.endswith(".yaml")
               for o in yaml.safe_load_all(text) if o]
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    assert names == {"fairway-picker-admin-token", "fairway-picker-metrics-token"}
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"
                     and o["metadata"]["name"] == "fairway-picker"]
    settings = _picker_settings(_container(deployment)["args"])
    assert _mounted(deployment, str(settings.client_ca))["secret"] == {
        "secretName": "gateway-ca", "items": [{"key": "tls-ca.pem", "path": "ca.crt"}]}


def test_the_gateway_secret_goes_to_the_gateways_namespace() -> None:
    manifests = _chart().render({"picker": {"tls": {"clientAuth": {
        "gatewayNamespace": "envoy-gateway-system"}}}}, name="fairway", namespace=NS,
        is_install=True)
    secrets = {o["metadata"]["name"]: o["metadata"]["namespace"]
               for path, text in manifests.items() if path.endswith(".yaml")
               for o in yaml.safe_load_all(text) if o and o["kind"] == "Secret"}
    assert secrets == {"fairway-picker-client-ca": NS,
                       "fairway-picker-gateway-tls": "envoy-gateway-system",
                       "fairway-picker-admin-token": NS, "fairway-picker-metrics-token": NS}


@pytest.mark.parametrize("case_id", IDS)
def test_the_admin_api_needs_the_token_the_operator_sends(
        case_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The picker's ``--admin-token-file`` and the operator's are one Secret's ``token``."""
    monkeypatch.delenv("FAIRWAY_ADMIN_TOKEN_FILE", raising=False)
    picker = _one(case_id, "Deployment", "picker")
    settings = _picker_settings(_container(picker)["args"])
    assert settings.admin_token_file is not None and settings.exposure_problem() is None
    volume = _mounted(picker, str(settings.admin_token_file))
    secret = volume["secret"]["secretName"]
    assert volume["secret"]["items"] == [{"key": "token",
                                          "path": settings.admin_token_file.name}]
    assert len(_secret(case_id, secret)["token"]) >= 32
    if _values(case_id)["operator"]["enabled"]:
        operator = _one(case_id, "Deployment", "operator")
        operator_settings, _ = operator_parse_args(_container(operator)["args"])
        assert operator_settings.admin_token_file == settings.admin_token_file
        assert _mounted(operator, str(operator_settings.admin_token_file)) == volume
    # Without the token flag, the chart's 0.0.0.0 would be refused at start.
    args = [a for a in _container(picker)["args"] if not a.startswith("--admin-token-file")]
    with pytest.raises(SystemExit):
        picker_main.main(args)


# --- files shared with the repository ----------------------------------------------------------


def test_crd_in_the_chart_is_the_manifests_crd() -> None:
    source = ROOT / "manifests" / "crd" / "fairway.dev_tenantpolicies.yaml"
    copied = CHART / "crds" / "fairway.dev_tenantpolicies.yaml"
    assert copied.read_bytes() == source.read_bytes(), \
        "charts/fairway/crds/ drifted: cp manifests/crd/fairway.dev_tenantpolicies.yaml " \
        "charts/fairway/crds/"
    (crd,) = _chart().crds  # Helm's loader sees it, and only it
    assert crd["name"] == "crds/fairway.dev_tenantpolicies.yaml"
    assert crd["data"].encode() == source.read_bytes()
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(yaml.safe_load(source.read_text(encoding="utf-8")),
                                     version, strict=True)
    for case_id in IDS:  # Helm installs it from crds/, never as a template
        assert _kind(case_id, "CustomResourceDefinition") == []


def test_dashboard_configmap_carries_the_repositorys_dashboard() -> None:
    chart_copy = CHART / "dashboards" / "fairway.json"
    source = ROOT / "dashboards" / "fairway.json"
    if source.exists():
        assert chart_copy.read_bytes() == source.read_bytes(), \
            "charts/fairway/dashboards/fairway.json drifted: cp dashboards/fairway.json " \
            "charts/fairway/dashboards/"
    dashboard = json.loads(chart_copy.read_text(encoding="utf-8"))
    assert dashboard["title"]
    configmap = _one("monitoring-netpol", "ConfigMap", "dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(configmap["data"]["fairway.json"]) == dashboard
    assert chart_copy.read_text(encoding="utf-8").strip() == configmap["data"]["fairway.json"]
    assert _kind("no-operator", "ConfigMap") == [_one("no-operator", "ConfigMap",
                                                      "picker-config")]


def test_packaged_chart_renders_the_same(tmp_path: Path) -> None:
    """`helm package` keeps everything the chart needs (CRD, dashboard, schema)."""
    archive = package(CHART, destination=tmp_path)
    assert Path(archive).name == "fairway-0.1.0.tgz"
    with Chart.load(archive) as packaged:
        assert [c["data"] for c in packaged.crds] == [c["data"] for c in _chart().crds]
        assert packaged.schema == _chart().schema
        assert _unkeyed(packaged.render({}, name="fairway", namespace=NS, is_install=True)) \
            == _unkeyed(_rendered("default")[0])


def _unkeyed(manifests: dict[str, str]) -> dict[str, str]:
    """The manifests with the generated keys, certificates and token blanked (new each render
    without a cluster to look the old ones up in)."""
    return {path: re.sub(r"^(  (?:ca\.crt|tls\.crt|tls\.key|token)): \S+$", r"\1: ...", text,
                         flags=re.M) for path, text in manifests.items()}


@pytest.mark.parametrize("case_id", ["default", "ha", "inferencepool-failopen", "no-operator",
                                     "redis"])
def test_notes_say_what_to_do_next(case_id: str) -> None:
    notes = next(text for path, text in _rendered(case_id)[0].items()
                 if path.endswith("NOTES.txt"))
    assert "port-forward service/" in notes and "9004:9004" in notes
    assert "python -m picker.ctl top --admin 127.0.0.1:9004 --token-file admin-token" in notes
    assert "-admin-token -o jsonpath='{.data.token}'" in notes
    assert ("mount Secret" in notes) == (_values(case_id)["picker"]["tls"]["clientAuth"]["mode"]
                                         == "mtls" and _values(case_id)["picker"]["tls"]["enabled"])
    assert ("kind: TenantPolicy" in notes) == _values(case_id)["operator"]["enabled"]
    assert ("Grafana" in notes) == _values(case_id)["dashboard"]["enabled"]
    assert "9002" in notes
    assert ("delete the leader pod" in notes) == (_values(case_id)["picker"]["replicas"] > 1
                                                  and not _shared(case_id))



@pytest.mark.parametrize("case_id", ["default", "ha", "redis-no-operator"])
def test_notes_say_the_tenancy_mode_and_what_the_gateway_must_do(case_id: str) -> None:
    notes = next(text for path, text in _rendered(case_id)[0].items()
                 if path.endswith("NOTES.txt"))
    tenancy = _values(case_id)["config"]["tenancy"]
    assert tenancy.get("mode", "header") == "header"
    header = tenancy["header"]
    assert "Tenancy mode: header" in notes and "Tenancy mode: apiKey." not in notes
    assert f"set {header} from authentication" in notes
    for name in ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id",
                 "x-fairway-lane", "x-gateway-inference-objective"):
        assert name in notes
    # The base config chooses API-key mode, never a TenantPolicy (a header-mode base refuses a
    # policy that brings keys): the NOTES must not promise that a policy switches the mode.
    assert "once a TenantPolicy" not in notes
    operator = _values(case_id)["operator"]["enabled"]
    assert ("apiKeySecretRef is refused (Ready=False, ApiKeysNotEnabled)" in notes) == operator
    assert ("for API keys set\n   config.tenancy.mode: apiKey." in notes) == operator


def test_notes_name_the_headers_the_config_trusts_not_a_fixed_four() -> None:
    """Issue 26: a picker told to read other headers needs those removed; the NOTES list the
    configured ones (tenancy.header, alsoAccept, laneHeader) and the objective header."""
    tenancy = {"header": "x-tenant-id", "alsoAccept": ["x-org"], "laneHeader": "x-my-lane"}
    notes = _chart().render({"config": {"tenancy": tenancy}}, name="fairway", namespace=NS,
                            is_install=True)
    text = next(t for path, t in notes.items() if path.endswith("NOTES.txt"))
    assert "client-sent x-tenant-id, x-org, x-my-lane and\n   x-gateway-inference-objective" \
        in text
    assert "x-gateway-inference-fairness-id" not in text
    assert "--gateway FILE" in text


def test_notes_in_api_key_mode_say_authorization_reaches_the_picker() -> None:
    assert _values("no-operator")["config"]["tenancy"]["mode"] == "apiKey"
    notes = next(text for path, text in _rendered("no-operator")[0].items()
                 if path.endswith("NOTES.txt"))
    assert "Tenancy mode: apiKey." in notes and "Authorization" in notes
    assert "Tenancy mode: header" not in notes
    assert "TenantPolicies" not in notes and "ApiKeysNotEnabled" not in notes


def test_notes_in_api_key_mode_with_the_operator_say_policies_add_keys() -> None:
    # No fixture runs the operator on an apiKey base: render one here.
    values = {"config": {"tenancy": {"mode": "apiKey", "apiKeys": [
        {"sha256": "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8",
         "tenant": "team-a"}]}}}
    manifests = _chart().render(values, name="fairway", namespace=NS, is_install=True)
    notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    assert "Tenancy mode: apiKey." in notes and "Tenancy mode: header" not in notes
    assert "The base config's config.tenancy.mode chose it" in notes
    assert "TenantPolicies (apiKeySecretRef)\n   are added to config.tenancy.apiKeys" in notes
    assert "ApiKeysNotEnabled" not in notes


def test_notes_with_redis_say_how_to_bring_it_and_that_all_replicas_serve() -> None:
    notes = next(text for path, text in _rendered("redis")[0].items()
                 if path.endswith("NOTES.txt"))
    assert "3 replicas, all serving" in notes and "leader election" not in notes
    assert "rediss://redis-master.redis.svc:6379/0" in notes and f"{NS}/fairway-picker" in notes
    assert "Redis 6+" in notes and "AOF" in notes and "Bitnami" in notes
    assert "create secret generic fairway-redis --from-literal=redis-password=" in notes
    assert "Secret redis-ca" in notes
    assert "inline response path" in notes
    assert "one picker at a time" in notes and "delete the leader pod" not in notes
    notes = next(text for path, text in _rendered("redis-no-operator")[0].items()
                 if path.endswith("NOTES.txt"))
    assert "No password is set" in notes and "503 state_unavailable" in notes
    for case_id in ("default", "ha"):
        notes = next(text for path, text in _rendered(case_id)[0].items()
                     if path.endswith("NOTES.txt"))
        assert "Redis" not in notes
