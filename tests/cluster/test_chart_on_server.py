"""``helm install`` of ``charts/fairway`` into a real API server, the README's steps verbatim: every
object accepted under strict field validation, its pods admitted at the ``restricted`` Pod
Security level, then ``helm upgrade`` and ``helm uninstall``; and what the chart's
ServiceAccounts may and may not do (``kubectl auth can-i`` with their own tokens)."""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any

import helm_python
import yaml

from tests.cluster.kube import ROOT, Kube, until

CHART = ROOT / "charts" / "fairway"
RELEASE = "fairway"


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
    # Every object again, as a server-side dry run with strict field validation: an unknown or
    # duplicated field anywhere would be refused here (Helm's own install merely drops them).
    (tmp_path / "manifest.yaml").write_text(release["manifest"])
    kube.kubectl("apply", "--dry-run=server", "--validate=strict", "-f",
                 str(tmp_path / "manifest.yaml"))
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
        helm.upgrade(str(CHART), RELEASE, {"inferencePool": {"name": "llm-pool"},
                                           "picker": {"replicas": 2}}, namespace="inference")
        role = kube.get("role", "fairway-picker")
        assert role is not None and any("leases" in r["resources"] for r in role["rules"])
        assert kube.get("deployment", "fairway-picker")["spec"]["replicas"] == 2

        helm.uninstall(RELEASE)
    for obj in objects:
        if obj["kind"] != "Namespace":
            until(lambda obj=obj: kube.get(obj["kind"], obj["metadata"]["name"]) is None,
                  timeout=30, what=f"{obj['kind']} {obj['metadata']['name']} deleted")
    kube.kubectl("delete", "namespace", "inference", "--timeout=60s", namespaced=False)
