"""``helm install`` of ``charts/fairway`` into a real API server, the README's steps verbatim: every
object accepted under strict field validation, its pods admitted at the ``restricted`` Pod
Security level, then ``helm upgrade`` (the upgraded manifest strictly valid too) and ``helm
uninstall``. Every other variant of the chart (each value set of ``tests/fixtures/chart/``, the
PrometheusRule with the ServiceMonitor, and every pass-through pod setting at once) is rendered
by Helm against the server and accepted by a strict server-side dry run, object for object."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.cluster.kube import ROOT, Kube, KubectlFailed, until

CHART = ROOT / "charts" / "fairway"
RELEASE = "fairway"
FIXTURES = sorted((ROOT / "tests" / "fixtures" / "chart").glob("*.yaml"))
_POD = {"podAnnotations": {"example.com/owner": "ml-platform"}, "podLabels": {"team": "ml"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "inference",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
        "priorityClassName": "system-cluster-critical",
        "extraArgs": ["--log-level=DEBUG"],
        "extraEnv": [{"name": "TZ", "value": "UTC"},
                     {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "512Mi"}}}
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    (path.stem, yaml.safe_load(path.read_text())) for path in FIXTURES] + [
    ("prometheus-rule", {"prometheusRule": {"enabled": True, "labels": {"release": "kps"},
                                            "runbookBaseUrl": "https://git.example.com/runbooks.md"},
                         "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}),
    ("pod-settings", {
        "inferencePool": {"name": "llm-pool", "create": True, "matchLabels": {"app": "vllm"},
                          "targetPorts": [8000, 8001]},
        "picker": {**_POD, "replicas": 2, "updateStrategy": {"type": "Recreate"},
                   "service": {"type": "NodePort", "annotations": {"example.com/lb": "internal"}},
                   "serviceAccount": {"create": True, "name": "epp",
                                      "annotations": {"example.com/role": "epp"}}},
        "operator": {**_POD, "verbose": True, "statusInterval": "30s",
                     "serviceAccount": {"create": True, "name": "epp-operator",
                                        "annotations": {"example.com/role": "operator"}}},
        "dashboard": {"labels": {"grafana_dashboard": "1", "team": "ml"},
                      "annotations": {"grafana_folder": "LLM"}}}),
]


def readme_install_steps() -> list[str]:
    """The shell lines of the README's "Install in a cluster" block (continuations joined,
    comments dropped)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Install in a cluster\s+```sh\n(.*?)```", text, re.S)
    assert block, "README.md: no ```sh block under '## Install in a cluster'"
    joined = re.sub(r"\\\n\s*", " ", block.group(1))
    return [line.split("#", 1)[0].strip() for line in joined.splitlines()
            if line.split("#", 1)[0].strip()]


def helm_install(kube: Kube, line: str) -> dict[str, Any]:
    """``helm install NAME CHART -n NS [--create-namespace] [--set k=v]...`` through Helm's Go
    SDK (helm-python-sdk: no helm binary is packaged for this machine)."""
    parser = argparse.ArgumentParser(prog="helm")
    parser.add_argument("command", choices=["install"])
    parser.add_argument("name")
    parser.add_argument("chart")
    parser.add_argument("-n", "--namespace", required=True)
    parser.add_argument("--create-namespace", action="store_true")
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(shlex.split(line)[1:])
    values: dict[str, Any] = {}
    for expression in args.set:
        _merge(values, helm_python.parse_set_string(expression))
    with helm_python.Config(kubeconfig_path=kube.plane.kubeconfig,
                            namespace=args.namespace) as helm:
        return helm.install(str(ROOT / args.chart), args.name, values,
                            namespace=args.namespace, create_namespace=args.create_namespace)


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _objects(manifest: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def strictly_valid(kube: Kube, manifest: str, path: Path) -> list[str]:
    """``manifest`` server-side applied as a dry run with strict field validation (an unknown or
    duplicated field anywhere is refused; Helm's own install merely drops them) and no warning:
    the names of the objects the server accepted, one for each object of the manifest."""
    path.write_text(manifest)
    # --force-conflicts: over a release's live objects, Helm's manager owns the fields the server
    # defaulted (a fieldRef's apiVersion); a dry run takes nothing from it.
    done = kube.kubectl("apply", "--server-side", "--dry-run=server", "--validate=strict",
                        "--field-manager=strict-check", "--force-conflicts", "-o", "name",
                        "-f", str(path))
    accepted = done.stdout.split()
    assert len(accepted) == len(_objects(manifest)), (accepted, done.stderr)
    assert "Warning" not in done.stderr, done.stderr
    return accepted


def test_the_readme_install_steps_work_verbatim_then_upgrade_and_uninstall(
        control_plane: Any, tmp_path: Any) -> None:
    kube = Kube(control_plane, "inference", tmp_path)
    # The pods must pass the restricted Pod Security level: enforce it before anything lands.
    kube.kubectl("create", "namespace", "inference", namespaced=False)
    kube.kubectl("label", "namespace", "inference",
                 "pod-security.kubernetes.io/enforce=restricted", namespaced=False)
    steps = [s for s in readme_install_steps() if not s.startswith("make ")]
    assert [s.split()[0] for s in steps] == ["helm", "kubectl", "kubectl"], steps

    release = helm_install(kube, steps[0])
    objects = _objects(release["manifest"])
    assert len(objects) >= 10
    strictly_valid(kube, release["manifest"], tmp_path / "manifest.yaml")
    for obj in objects:
        assert kube.get(obj["kind"], obj["metadata"]["name"]) is not None, obj["kind"]

    # The ReplicaSets' pods were admitted (a pod the restricted level refuses is never created).
    deployments = [o for o in objects if o["kind"] == "Deployment"]
    wanted = sum(d["spec"].get("replicas", 1) for d in deployments)
    until(lambda: len(kube.items("pods", "-l", f"app.kubernetes.io/instance={RELEASE}"))
          == wanted, timeout=30, what=f"{wanted} pods admitted")

    for step in steps[1:]:
        done = kube.kubectl(*shlex.split(step)[1:], namespaced=False)
        assert "Error" not in done.stderr
    listed = kube.kubectl("get", "tp").stdout
    plans = _objects((ROOT / "manifests" / "examples" / "saas-plans.yaml").read_text())
    for plan in plans:
        assert plan["metadata"]["name"] in listed, listed

    with helm_python.Config(kubeconfig_path=kube.plane.kubeconfig, namespace="inference") as helm:
        upgraded = helm.upgrade(str(CHART), RELEASE, {"inferencePool": {"name": "llm-pool"},
                                                      "picker": {"replicas": 2}},
                                namespace="inference")
        accepted = strictly_valid(kube, upgraded["manifest"], tmp_path / "upgraded.yaml")
        assert "poddisruptionbudget.policy/fairway-picker" in accepted  # what 2 replicas add
        role = kube.get("role", "fairway-picker")
        assert role is not None and any("leases" in r["resources"] for r in role["rules"])
        assert kube.get("deployment", "fairway-picker")["spec"]["replicas"] == 2

        helm.uninstall(RELEASE)
    for obj in objects:
        if obj["kind"] != "Namespace":
            until(lambda obj=obj: kube.get(obj["kind"], obj["metadata"]["name"]) is None,
                  timeout=30, what=f"{obj['kind']} {obj['metadata']['name']} deleted")
    kube.kubectl("delete", "namespace", "inference", "--timeout=60s", namespaced=False)


@pytest.mark.parametrize("values", [v for _, v in VARIANTS], ids=[i for i, _ in VARIANTS])
def test_every_variant_of_the_chart_is_accepted_with_strict_field_validation(
        kube: Kube, values: dict[str, Any]) -> None:
    with helm_python.Config(kubeconfig_path=kube.plane.kubeconfig,
                            namespace=kube.namespace) as helm:
        release = helm.install(str(CHART), RELEASE, values, namespace=kube.namespace,
                               dry_run="server")
    accepted = strictly_valid(kube, release["manifest"], kube.workdir / "manifest.yaml")
    kinds = {name.split("/")[0] for name in accepted}
    # Each variant renders what it is there for.
    wanted = {"prometheusrule.monitoring.coreos.com": values.get("prometheusRule", {}).get(
                  "enabled", False),
              "servicemonitor.monitoring.coreos.com": values.get("serviceMonitor", {}).get(
                  "enabled", False),
              "inferencepool.inference.networking.k8s.io": values.get("inferencePool", {}).get(
                  "create", False),
              # On by default: only the gateway may speak ext_proc (values.yaml).
              "networkpolicy.networking.k8s.io": values.get("networkPolicy", {}).get(
                  "enabled", True),
              "poddisruptionbudget.policy": values.get("picker", {}).get("replicas", 1) > 1}
    assert {kind for kind, on in wanted.items() if on} <= kinds, kinds
    assert not {kind for kind, on in wanted.items() if not on} & kinds, kinds
    assert kube.items("deployments") == []  # a dry run: nothing was written


def test_the_strict_check_refuses_an_unknown_field(kube: Kube) -> None:
    """The check above has teeth: one misspelt field in the default manifest is refused."""
    with helm_python.Config(kubeconfig_path=kube.plane.kubeconfig,
                            namespace=kube.namespace) as helm:
        release = helm.install(str(CHART), RELEASE, {}, namespace=kube.namespace,
                               dry_run="server")
    objects = _objects(release["manifest"])
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"
                     and o["metadata"]["name"] == "fairway-picker"]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(KubectlFailed) as refused:
        strictly_valid(kube, yaml.safe_dump_all(objects), kube.workdir / "typo.yaml")
    assert ('.spec.template.spec.containers[name="picker"].imagePullPolicyy: field not declared '
            'in schema') in str(refused.value), refused.value
