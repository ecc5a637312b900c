"""The operator and two pickers against a real API server, each a local process running the
chart's own container arguments with a token of the chart's own ServiceAccount, so the chart's
Roles are what is enforced: a permission missing fails here.

The chain: ``kubectl apply`` of TenantPolicies → Ready with ``observedGeneration`` (a refused one:
``Ready=False``, a Warning Event, the others still applied) → the leader's config → the pool's pod
turned unready drains it; leader election on a real Lease (SIGTERM releases it, SIGKILL leaves it
to expire); uninstall with policies present leaves nothing stuck terminating.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import helm_python
import pytest
import yaml

from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.k8s import KubeClient, LeaderElector
from picker.k8s.leader import LEADING
from picker.server import ServeSettings
from scripts.cluster import free_port
from tests.cluster.kube import ROOT, Kube, Process, chart_args, replace_flags, start, until

CHART = ROOT / "charts" / "fairway"
RELEASE = "fairway"
POOL = "llm-pool"
FINALIZER = f"pool.fairway.dev/{POOL}"
LEASE_DURATION = ServeSettings().lease_duration


@dataclass
class Picker:
    process: Process
    identity: str
    admin_port: int

    def admin(self) -> admin_pb2_grpc.AdminStub:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.admin_port}")
        return admin_pb2_grpc.AdminStub(channel)

    def weights(self) -> dict[str, float]:
        reply = self.admin().ListTenants(admin_pb2.ListTenantsRequest(), timeout=5)
        return {t.tenant: t.weight for t in reply.tenants}

    def endpoints(self) -> list[str]:
        reply = self.admin().ListEndpoints(admin_pb2.ListEndpointsRequest(), timeout=5)
        return sorted(e.address for e in reply.endpoints if not e.draining)


@dataclass
class Installed:
    kube: Kube
    manifest: list[dict[str, Any]]
    model_ports: list[int]
    processes: list[Process]

    def picker(self, identity: str, kubeconfig: Path, admin: int = 0) -> Picker:
        """A picker replica; it is listening once its config exists (the operator writes it)."""
        admin = admin or free_port()
        args = replace_flags(chart_args(self.manifest, "fairway-picker"), host="127.0.0.1",
                        grpc_port=str(free_port()), grpc_health_port=str(free_port()),
                        metrics_port=str(free_port()), admin_port=str(admin), grace="2")
        process = start(f"picker-{identity}", ["-m", "picker", *args], kubeconfig,
                        self.kube.workdir, POD_NAME=identity, POD_NAMESPACE=self.kube.namespace)
        self.processes.append(process)
        process.wait_for("picker listening")
        return Picker(process, identity, admin)

    def operator(self, kubeconfig: Path, admin_port: int) -> Process:
        args = replace_flags(chart_args(self.manifest, "fairway-operator"),
                        admin_address=f"127.0.0.1:{admin_port}",
                        liveness=f"http://127.0.0.1:{free_port()}/healthz")
        process = start("operator", ["-m", "fairway_operator", *args], kubeconfig,
                        self.kube.workdir, POD_NAMESPACE=self.kube.namespace)
        self.processes.append(process)
        return process

    def lease_holder(self) -> str | None:
        lease = self.kube.get("lease", "fairway-picker")
        return None if lease is None else lease["spec"].get("holderIdentity")


@pytest.fixture
def installed(kube: Kube, tmp_path: Path) -> Iterator[Installed]:
    """The chart installed with two picker replicas and the InferencePool; two simulated model
    servers behind one pod of the pool (127.0.0.1, one target port each), Ready."""
    ports = [free_port(), free_port()]
    servers = [start(f"model-{port}", ["-m", "picker.sim.server", "--port", str(port),
                                       "--step-ms", "2"], kube.plane.kubeconfig, tmp_path)
               for port in ports]
    values = {"inferencePool": {"name": POOL, "create": True, "matchLabels": {"app": "llm"},
                                "targetPorts": ports},
              "picker": {"replicas": 2}, "operator": {"statusInterval": "1s"}}
    with helm_python.Config(kubeconfig_path=kube.plane.kubeconfig,
                            namespace=kube.namespace) as helm:
        release = helm.install(str(CHART), RELEASE, values, namespace=kube.namespace)
    kube.apply(json.dumps({"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": "llm-0", "labels": {"app": "llm"}},
                           "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}))
    _pod_ready(kube, True)
    box = Installed(kube, [d for d in yaml.safe_load_all(release["manifest"]) if d], ports,
                    servers)
    try:
        yield box
    finally:
        for process in box.processes:
            process.stop(signal.SIGKILL)


def _pod_ready(kube: Kube, ready: bool) -> None:
    flag = "True" if ready else "False"
    kube.patch_status("pod", "llm-0", {
        "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
        "conditions": [{"type": "Ready", "status": flag}]})


def _ready(kube: Kube, name: str) -> dict[str, Any] | None:
    policy = kube.get("tenantpolicy", name) or {}
    status = policy.get("status") or {}
    return next((c for c in status.get("conditions") or () if c["type"] == "Ready"), None)


def _policies() -> str:
    return (ROOT / "manifests" / "examples" / "saas-plans.yaml").read_text()


# A refusal as the API server words it ("Forbidden", "... is forbidden: User ...") or as a
# client reports its status; not the digits 403 inside a timestamp, a port or a random name.
ACCESS_ERROR = re.compile(r"forbidden|(?<![\w,.:])403(?!\w)", re.IGNORECASE)


def _no_access_errors(process: Process) -> None:
    text = process.text()
    found = ACCESS_ERROR.search(text)
    assert found is None, f"{process.name}: {found.group()!r} in its log:\n{text[-3000:]}"


def test_the_charts_roles_allow_what_each_needs_and_no_more(installed: Installed) -> None:
    kube = installed.kube
    picker = kube.service_account_kubeconfig("fairway-picker")
    operator = kube.service_account_kubeconfig("fairway-operator")
    for verb, resource in [("get", "configmaps"), ("watch", "configmaps"), ("list", "pods"),
                           ("watch", "pods"), ("get", "inferencepools"),
                           ("watch", "inferencepools"), ("create", "leases"),
                           ("patch", "leases")]:
        assert kube.can_i(picker, verb, resource), f"picker cannot {verb} {resource}"
    for verb, resource in [("create", "configmaps"), ("get", "secrets"), ("delete", "leases"),
                           ("patch", "pods"), ("list", "tenantpolicies")]:
        assert not kube.can_i(picker, verb, resource), f"picker may {verb} {resource}"
    assert not kube.can_i(picker, "list", "pods", all_namespaces=True)
    for verb, resource in [("watch", "tenantpolicies"), ("patch", "tenantpolicies"),
                           ("patch", "tenantpolicies/status"), ("create", "configmaps"),
                           ("patch", "configmaps"), ("get", "secrets"), ("create", "events")]:
        assert kube.can_i(operator, verb, resource), f"operator cannot {verb} {resource}"
    for verb, resource in [("delete", "configmaps"), ("create", "secrets"),
                           ("delete", "tenantpolicies"), ("create", "leases")]:
        assert not kube.can_i(operator, verb, resource), f"operator may {verb} {resource}"
    for resource in ("namespaces", "customresourcedefinitions", "tenantpolicies"):
        assert not kube.can_i(operator, "list", resource, all_namespaces=True), resource


def test_policies_reach_the_leader_through_the_operator_with_the_charts_rbac(
        installed: Installed) -> None:
    kube = installed.kube
    picker_config = kube.service_account_kubeconfig("fairway-picker")
    # A policy marked by an operator of before this fix: the new one takes the mark away.
    kube.apply(json.dumps({
        "apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
        "metadata": {"name": "legacy", "finalizers": [FINALIZER]},
        "spec": {"poolRef": {"name": POOL}, "tenants": ["legacy-team"], "weight": 2}}))
    kube.apply(_policies().replace("namespace: inference", f"namespace: {kube.namespace}"))
    admin_port = free_port()
    operator = installed.operator(kube.service_account_kubeconfig("fairway-operator"),
                                  admin_port)
    first = installed.picker("picker-a", picker_config, admin_port)
    until(lambda: installed.lease_holder() == "picker-a", what="picker-a leads")
    second = installed.picker("picker-b", picker_config)

    names = [d["metadata"]["name"] for d in yaml.safe_load_all(_policies())] + ["legacy"]
    for name in names:
        ready = until(lambda name=name: _ready(kube, name), timeout=30, what=f"{name} status")
        until(lambda name=name: (_ready(kube, name) or {}).get("status") == "True",
              timeout=30, what=f"{name} Ready")
        policy = kube.get("tenantpolicy", name)
        assert ready["observedGeneration"] == policy["metadata"]["generation"]
        assert not policy["metadata"].get("finalizers"), policy["metadata"]
    weights = until(lambda: first.weights().get("cust-0007-bigbank") == 16 and first.weights(),
                    what="the leader has the enterprise weight")
    assert weights["legacy-team"] == 2
    until(lambda: first.endpoints() == sorted(f"127.0.0.1:{p}" for p in installed.model_ports),
          what="the pool's endpoints")

    # A policy that cannot apply: Ready=False with the reason, a Warning Event, others stay.
    kube.apply(json.dumps({
        "apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
        "metadata": {"name": "nowhere"},
        "spec": {"poolRef": {"name": POOL}, "tenants": ["lost"], "lane": "express"}}))
    refused = until(lambda: (_ready(kube, "nowhere") or {}).get("status") == "False"
                    and _ready(kube, "nowhere"), what="nowhere refused")
    assert refused["reason"] == "UnknownLane" and "express" in refused["message"]
    events = until(lambda: [e for e in kube.items("events", "--field-selector",
                                                  "involvedObject.name=nowhere")
                            if e["type"] == "Warning"], what="a Warning Event")
    assert events[0]["reason"] == "UnknownLane" and "express" in events[0]["message"]
    assert all((_ready(kube, n) or {}).get("status") == "True" for n in names)
    # The status figures flow from the leader's admin API.
    until(lambda: "lastUpdated" in (kube.get("tenantpolicy", "plan-pro") or {}).get("status", {}),
          timeout=30, what="live figures in the status")

    # The pool's pod turns unready: its endpoints drain from the leader's view.
    _pod_ready(kube, False)
    until(lambda: first.endpoints() == [], what="endpoints drained")
    _pod_ready(kube, True)
    until(lambda: len(first.endpoints()) == 2, what="endpoints back")

    for process in (first.process, second.process, operator):
        _no_access_errors(process)
    assert " ERROR " not in operator.text(), operator.text()[-3000:]


def test_leader_election_on_a_real_lease(installed: Installed) -> None:
    kube = installed.kube
    kube.apply(_policies().replace("namespace: inference", f"namespace: {kube.namespace}"))
    # Its admin address leads nowhere: it says so once, not once per policy and interval.
    operator = installed.operator(kube.service_account_kubeconfig("fairway-operator"),
                                  free_port())
    config = kube.service_account_kubeconfig("fairway-picker")
    a = installed.picker("picker-a", config)
    until(lambda: installed.lease_holder() == "picker-a", what="picker-a leads")
    b = installed.picker("picker-b", config)
    time.sleep(1)
    assert installed.lease_holder() == "picker-a"

    # SIGTERM: the leader releases the Lease on its way out; the standby takes it at its next
    # retry (a third of the lease duration), long before the lease would have expired.
    stopped_at = time.monotonic()
    assert a.process.stop(signal.SIGTERM) == 0
    lease = kube.get("lease", "fairway-picker")
    assert lease["spec"].get("holderIdentity") in ("", "picker-b"), lease["spec"]
    until(lambda: installed.lease_holder() == "picker-b", timeout=LEASE_DURATION,
          what="picker-b takes the released Lease")
    handover = time.monotonic() - stopped_at
    assert handover < LEASE_DURATION / 3 + 2, handover
    transitions = kube.get("lease", "fairway-picker")["spec"]["leaseTransitions"]

    # SIGKILL: nothing is released; a new replica takes the Lease once it has expired.
    c = installed.picker("picker-c", config)
    b.process.stop(signal.SIGKILL)
    until(lambda: installed.lease_holder() == "picker-c", timeout=LEASE_DURATION * 2,
          what="picker-c takes the expired Lease")
    assert kube.get("lease", "fairway-picker")["spec"]["leaseTransitions"] == transitions + 1
    _no_access_errors(c.process)
    log = operator.text()
    assert log.count("picker admin API unreachable") == 1, log[-3000:]
    assert " ERROR " not in log, log[-3000:]


def test_uninstall_with_policies_present_leaves_nothing_terminating(
        installed: Installed) -> None:
    kube = installed.kube
    kube.apply(_policies().replace("namespace: inference", f"namespace: {kube.namespace}"))
    admin_port = free_port()
    operator = installed.operator(kube.service_account_kubeconfig("fairway-operator"),
                                  admin_port)
    picker = installed.picker("picker-a", kube.service_account_kubeconfig("fairway-picker"),
                              admin_port)
    until(lambda: all((_ready(kube, p["metadata"]["name"]) or {}).get("status") == "True"
                      for p in kube.items("tenantpolicies")), timeout=30, what="policies Ready")
    # The operator's pod goes first (helm uninstall deletes its Deployment), then the policies.
    operator.stop(signal.SIGTERM)
    with helm_python.Config(kubeconfig_path=kube.plane.kubeconfig,
                            namespace=kube.namespace) as helm:
        helm.uninstall(RELEASE)
    kube.kubectl("delete", "tenantpolicies", "--all", "--timeout=20s")
    assert kube.items("tenantpolicies") == []
    # The picker's Lease and the operator's ConfigMap go with the release's objects they hang on.
    picker.process.stop(signal.SIGTERM)
    until(lambda: kube.get("configmap", "fairway-picker-config") is None, timeout=30,
          what="the operator's ConfigMap collected")
    until(lambda: kube.get("lease", "fairway-picker") is None, timeout=30,
          what="the picker's Lease collected")
    kube.kubectl("delete", "namespace", kube.namespace, "--timeout=60s", namespaced=False)



async def test_candidates_racing_for_a_free_lease_are_told_apart_by_resource_version(
        installed: Installed) -> None:
    """Five candidates at once, twenty rounds, each on a Lease just released: the API server's
    409 on a stale ``resourceVersion`` leaves exactly one leader every time."""
    kube = installed.kube
    config = str(kube.service_account_kubeconfig("fairway-picker"))
    clients = [KubeClient.from_environment(kubeconfig=config) for _ in range(5)]
    try:
        electors = [LeaderElector(client, kube.namespace, "race", identity=f"candidate-{i}")
                    for i, client in enumerate(clients)]
        leaders = []
        for _ in range(20):
            results = await asyncio.gather(*(e.try_acquire_or_renew() for e in electors))
            assert results.count(LEADING) == 1, results
            (leader,) = [e for e, r in zip(electors, results, strict=True) if r == LEADING]
            lease = await asyncio.to_thread(kube.get, "lease", "race")
            assert lease["spec"]["holderIdentity"] == leader.identity
            leaders.append(leader.identity)
            await leader.release()
        assert len(set(leaders)) > 1, leaders  # the races were real: not always the same winner
    finally:
        for client in clients:
            await client.close()
