"""The whole chain on a real API server: ``kubectl apply`` of TenantPolicies → the operator (the
chart's arguments and ServiceAccount) renders them → the picker (its ServiceAccount) reads the
ConfigMap and the InferencePool → real Envoy in front of simulated model servers: the traffic
split follows a weight changed with ``kubectl patch``, the policy's status records the new
generation, and neither process was refused anything by the chart's Roles."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import helm_python
import pytest
import yaml

from picker.stack.launcher import Stack, reserved_port
from tests.cluster.kube import (
    ROOT,
    Kube,
    Process,
    chart_args,
    chart_args_with_secrets,
    in_cluster_settings,
    no_access_errors,
    replace_flags,
    start,
    until,
)
from tests.e2e.test_cluster_chain import _polled, _pool_discovered, _shares, _weight

POOL = "llm-pool"


def _ready_at(kube: Kube, name: str, generation: int) -> bool:
    """Policy ``name`` is Ready and its status (and Ready condition) observed ``generation``."""
    status = (kube.get("tenantpolicy", name) or {}).get("status") or {}
    ready = next((c for c in status.get("conditions") or () if c["type"] == "Ready"), {})
    return (status.get("observedGeneration") == generation and ready.get("status") == "True"
            and ready.get("observedGeneration") == generation)


def _policy(name: str, weight: int) -> str:
    return json.dumps({"apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
                       "metadata": {"name": name},
                       "spec": {"poolRef": {"name": POOL}, "tenants": [name], "weight": weight,
                                "lane": "online"}})


async def test_a_weight_patched_with_kubectl_moves_the_split_through_envoy(
        kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with helm_python.Config(kubeconfig_path=kube.plane.kubeconfig,
                            namespace=kube.namespace) as helm:
        release = helm.install(str(ROOT / "charts" / "fairway"), "fairway",
                               {"inferencePool": {"name": POOL}}, namespace=kube.namespace)
    manifest = [d for d in yaml.safe_load_all(release["manifest"]) if d]
    kube.apply(_policy("alpha", 1))
    kube.apply(_policy("beta", 1))
    admin_port = reserved_port()
    operator = start("operator", ["-m", "fairway_operator", *replace_flags(
        chart_args_with_secrets(manifest, "fairway-operator", tmp_path),
        admin_address=f"127.0.0.1:{admin_port}",
        liveness=f"http://127.0.0.1:{reserved_port()}/healthz")],
        kube.service_account_kubeconfig("fairway-operator"), tmp_path,
        POD_NAMESPACE=kube.namespace)
    # The stack's picker: the chart's source flags, the chart's ServiceAccount.
    source = [a for a in chart_args(manifest, "fairway-picker")
              if a.startswith(("--config-map=", "--pool="))]
    monkeypatch.setenv("KUBECONFIG", str(kube.service_account_kubeconfig("fairway-picker")))
    stack = Stack(tmp_path / "stack", policy="vtc", endpoints=2, picker_source=source,
                  server_args=["--kv-budget-tokens", "1024", "--step-ms", "5"],
                  picker_args=["--admin-port", str(admin_port)])
    try:
        await asyncio.to_thread(stack.start)
        picker = Process("stack-picker", stack.picker_process, stack.workdir / "picker.log")
        for process in (operator, picker):
            assert in_cluster_settings(process.popen.pid) == {}, process.name
        ports = [int(a.rsplit(":", 1)[1]) for a in stack.endpoint_addresses]
        kube.apply(json.dumps({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL},
            "spec": {"selector": {"matchLabels": {"app": "llm"}},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "fairway-picker", "port": {"number": 9002}}}}))
        kube.apply(json.dumps({"apiVersion": "v1", "kind": "Pod",
                               "metadata": {"name": "llm-0", "labels": {"app": "llm"}},
                               "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}))
        kube.patch_status("pod", "llm-0", {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                                           "conditions": [{"type": "Ready", "status": "True"}]})

        await _polled(lambda: _pool_discovered(stack), "the picker found the pool")
        # Weights 1:1, then 1:3: each split is measured against the other, a quarter of the way
        # from one (0.5) to the other (0.75).
        even = await _shares(stack, 6)
        assert even["beta"] == pytest.approx(0.5, abs=1 / 16), even

        kube.kubectl("patch", "tenantpolicy", "beta", "--type=merge",
                     "-p", json.dumps({"spec": {"weight": 3}}))
        await _polled(lambda: _weight(stack, "beta") == 3, "the picker took the new weight")
        # The operator writes the ConfigMap before the status: the picker may be first.
        await asyncio.to_thread(until, lambda: _ready_at(kube, "beta", 2),
                                what="beta Ready at generation 2")
        skewed = await _shares(stack, 6)
        assert skewed["beta"] == pytest.approx(0.75, abs=1 / 16), skewed
        no_access_errors(operator, picker)
    finally:
        await asyncio.to_thread(stack.stop)
        operator.stop(signal.SIGTERM)
