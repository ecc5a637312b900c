"""The operator and two pickers against a real API server, each a local process running the
chart's own container arguments with a token of the chart's own ServiceAccount, so the chart's
Roles are what is enforced: a permission missing fails here.

The chain: ``kubectl apply`` of TenantPolicies → Ready with ``observedGeneration`` (a refused one:
``Ready=False``, a Warning Event, the others still applied) → the leader's config → the pool's pod
turned unready drains it; only the Ready pods with an IP that the pool's selector picks in its
namespace are endpoints; leader election on a real Lease (SIGTERM releases it, SIGKILL leaves it
to expire: the takeover is timed); uninstall with policies present leaves nothing stuck
terminating. Every test ends by finding no refusal (403, Forbidden) in any of its processes' logs.
"""

from __future__ import annotations

import asyncio
import datetime
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
from picker.stack.launcher import reserved_port
from tests.cluster.kube import (
    ROOT,
    Kube,
    Process,
    chart_args_with_secrets,
    in_cluster_settings,
    no_access_errors,
    replace_flags,
    start,
    until,
)

CHART = ROOT / "charts" / "fairway"
RELEASE = "fairway"
POOL = "llm-pool"
FINALIZER = f"pool.fairway.dev/{POOL}"
LEASE_DURATION = ServeSettings().lease_duration
RETRY_PERIOD = LEASE_DURATION / 3
"""The picker's elector retries (and a leader renews) every third of the lease duration
(``picker.server``); the chart sets neither, so these are the defaults."""


@dataclass
class Picker:
    process: Process
    identity: str
    admin_port: int
    token: str
    """The chart's admin token, which the admin API asks of every call."""

    def admin(self) -> admin_pb2_grpc.AdminStub:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.admin_port}")
        return admin_pb2_grpc.AdminStub(channel)

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def weights(self) -> dict[str, float]:
        reply = self.admin().ListTenants(admin_pb2.ListTenantsRequest(), timeout=5,
                                         metadata=self._metadata)
        return {t.tenant: t.weight for t in reply.tenants}

    def endpoints(self) -> list[str]:
        reply = self.admin().ListEndpoints(admin_pb2.ListEndpointsRequest(), timeout=5,
                                           metadata=self._metadata)
        return sorted(e.address for e in reply.endpoints if not e.draining)


@dataclass
class Installed:
    kube: Kube
    manifest: list[dict[str, Any]]
    model_ports: list[int]
    processes: list[Process]

    def picker(self, identity: str, kubeconfig: Path, admin: int = 0) -> Picker:
        """A picker replica; it is listening once its config exists (the operator writes it)."""
        admin = admin or reserved_port()
        args = replace_flags(chart_args_with_secrets(self.manifest, "fairway-picker",
                                                     self.kube.workdir), host="127.0.0.1",
                        grpc_port=str(reserved_port()), grpc_health_port=str(reserved_port()),
                        metrics_port=str(reserved_port()), admin_port=str(admin), grace="2")
        process = start(f"picker-{identity}", ["-m", "picker", *args], kubeconfig,
                        self.kube.workdir, POD_NAME=identity, POD_NAMESPACE=self.kube.namespace)
        self.processes.append(process)
        assert in_cluster_settings(process.popen.pid) == {}
        process.wait_for("picker listening")
        token = next(a for a in args if a.startswith("--admin-token-file="))
        return Picker(process, identity, admin,
                      Path(token.split("=", 1)[1]).read_text().strip())

    def operator(self, kubeconfig: Path, admin_port: int) -> Process:
        args = replace_flags(chart_args_with_secrets(self.manifest, "fairway-operator",
                                                     self.kube.workdir),
                        admin_address=f"127.0.0.1:{admin_port}",
                        liveness=f"http://127.0.0.1:{reserved_port()}/healthz")
        process = start("operator", ["-m", "fairway_operator", *args], kubeconfig,
                        self.kube.workdir, POD_NAMESPACE=self.kube.namespace)
        self.processes.append(process)
        assert in_cluster_settings(process.popen.pid) == {}
        return process

    def lease_holder(self) -> str | None:
        lease = self.kube.get("lease", "fairway-picker")
        return None if lease is None else lease["spec"].get("holderIdentity")


@pytest.fixture
def installed(kube: Kube, tmp_path: Path) -> Iterator[Installed]:
    """The chart installed with two picker replicas and the InferencePool; two simulated model
    servers behind one pod of the pool (127.0.0.1, one target port each), Ready."""
    ports = [reserved_port(), reserved_port()]
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


def _pod_ready(kube: Kube, ready: bool, name: str = "llm-0", ip: str | None = "127.0.0.1"
               ) -> None:
    flag = "True" if ready else "False"
    addresses = {"podIP": ip, "podIPs": [{"ip": ip}]} if ip else {}
    kube.patch_status("pod", name, {"phase": "Running", **addresses,
                                    "conditions": [{"type": "Ready", "status": flag}]})


def _pod(kube: Kube, name: str, labels: dict[str, str], ip: str | None,
         finalizers: tuple[str, ...] = ()) -> None:
    """Pod ``name`` with ``labels``, Ready (with ``ip`` as its address, or none)."""
    kube.apply(json.dumps({"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": name, "labels": labels,
                                        "finalizers": list(finalizers)},
                           "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}))
    _pod_ready(kube, True, name, ip)


def _micro_time(text: str) -> datetime.datetime:
    """A Lease's RFC 3339 MicroTime."""
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.UTC)


def _ready(kube: Kube, name: str) -> dict[str, Any] | None:
    policy = kube.get("tenantpolicy", name) or {}
    status = policy.get("status") or {}
    return next((c for c in status.get("conditions") or () if c["type"] == "Ready"), None)


def _policies() -> str:
    return (ROOT / "manifests" / "examples" / "saas-plans.yaml").read_text()


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
    no_access_errors(*installed.processes)


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
    admin_port = reserved_port()
    operator = installed.operator(kube.service_account_kubeconfig("fairway-operator"),
                                  admin_port)
    first = installed.picker("picker-a", picker_config, admin_port)
    until(lambda: installed.lease_holder() == "picker-a", what="picker-a leads")
    installed.picker("picker-b", picker_config)

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

    no_access_errors(*installed.processes)
    assert " ERROR " not in operator.text(), operator.text()[-3000:]


def test_only_the_pools_ready_pods_with_an_address_are_endpoints(installed: Installed) -> None:
    """The pool selects ``app: llm`` in its namespace. Ready pods outside the selector, in
    another namespace, without an IP or being deleted are never endpoints; a pod being deleted
    (held by a finalizer, still Ready) stops being one at once."""
    kube = installed.kube
    admin_port = reserved_port()
    installed.operator(kube.service_account_kubeconfig("fairway-operator"), admin_port)
    picker = installed.picker("picker-a", kube.service_account_kubeconfig("fairway-picker"),
                              admin_port)
    ports = installed.model_ports

    def at(ip: str) -> list[str]:
        return sorted(f"{ip}:{port}" for port in ports)

    elsewhere = Kube(kube.plane, f"{kube.namespace}-other", kube.workdir)
    kube.kubectl("create", "namespace", elsewhere.namespace, namespaced=False)
    try:
        until(lambda: elsewhere.get("serviceaccount", "default"), what="default ServiceAccount")
        _pod(elsewhere, "llm-0", {"app": "llm"}, "127.0.0.9")  # the same name, another namespace
        _pod(kube, "other-app", {"app": "other"}, "127.0.0.3")
        _pod(kube, "llm-no-ip", {"app": "llm"}, None)
        _pod(kube, "llm-1", {"app": "llm", "tier": "extra"}, "127.0.0.2")
        until(lambda: picker.endpoints() == sorted(at("127.0.0.1") + at("127.0.0.2")),
              what="the two matching Ready pods' endpoints")
        _pod(kube, "llm-leaving", {"app": "llm"}, "127.0.0.5", ("fairway.dev/test-hold",))
        until(lambda: at("127.0.0.5")[0] in picker.endpoints(), what="llm-leaving an endpoint")
        kube.kubectl("delete", "pod", "llm-leaving", "--wait=false")
        until(lambda: picker.endpoints() == sorted(at("127.0.0.1") + at("127.0.0.2")),
              what="llm-leaving drained")
        leaving = kube.get("pod", "llm-leaving")
        assert leaving["metadata"]["deletionTimestamp"], leaving["metadata"]
        assert (kube.get("pod", "llm-no-ip") or {})["status"]["conditions"][0]["status"] == "True"
        # Then a pod turned away from the selector by a label change leaves as well.
        kube.kubectl("label", "pod", "llm-1", "app=retired", "--overwrite")
        until(lambda: picker.endpoints() == at("127.0.0.1"), what="llm-1 relabelled away")
        # Never, in any endpoint list the picker published, a pod the pool does not take: every
        # address is a matching Ready pod's IP and a target port.
        published = re.findall(r"InferencePool \S+ endpoints: (.*)", picker.process.text())
        assert published, picker.process.text()[-3000:]
        allowed = set(at("127.0.0.1") + at("127.0.0.2") + at("127.0.0.5"))
        for line in published:
            assert line == "none" or set(line.split(", ")) <= allowed, line
    finally:
        kube.kubectl("patch", "pod", "llm-leaving", "--type=merge",
                     "-p", '{"metadata":{"finalizers":null}}', check=False)
        kube.kubectl("delete", "namespace", elsewhere.namespace, "--wait=false",
                     namespaced=False, check=False)
    no_access_errors(*installed.processes)


def test_leader_election_on_a_real_lease(installed: Installed) -> None:
    kube = installed.kube
    kube.apply(_policies().replace("namespace: inference", f"namespace: {kube.namespace}"))
    # Its admin address leads nowhere: it says so once, not once per policy and interval.
    operator = installed.operator(kube.service_account_kubeconfig("fairway-operator"),
                                  reserved_port())
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
    print(f"SIGTERM handover: {handover:.2f} s")
    assert handover < LEASE_DURATION / 3 + 2, handover
    transitions = kube.get("lease", "fairway-picker")["spec"]["leaseTransitions"]

    # SIGKILL: nothing is released; a new replica takes the Lease once it has expired. The
    # standby sees the killed leader's last renewal at most a retry period after it was made
    # (and that was before the kill); the record expires a lease duration after the standby saw
    # it: a takeover at most duration + retry after the kill, and between duration and
    # duration + retry after the last renewal (not before: no takeover of a live lease). Times
    # are the Lease's own (renewTime, acquireTime: written by the pickers on this host's clock).
    installed.picker("picker-c", config)
    b.process.stop(signal.SIGKILL)
    killed_at = datetime.datetime.now(datetime.UTC)
    lease = kube.get("lease", "fairway-picker")["spec"]
    assert lease["holderIdentity"] == "picker-b", lease  # still held by the dead one
    assert lease["leaseDurationSeconds"] == LEASE_DURATION, lease
    holders = []
    while len(holders) < 500:
        holders.append(installed.lease_holder())
        if holders[-1] == "picker-c":
            break
        time.sleep(0.1)
    assert holders[-1] == "picker-c", holders[-5:]
    # Never released in between: the dead leader's name stood until picker-c's replaced it.
    assert set(holders[:-1]) <= {"picker-b"}, holders
    taken = kube.get("lease", "fairway-picker")["spec"]
    acquired = _micro_time(taken["acquireTime"])
    takeover = (acquired - killed_at).total_seconds()
    since_renewal = (acquired - _micro_time(lease["renewTime"])).total_seconds()
    print(f"SIGKILL takeover: {takeover:.2f} s after the kill, {since_renewal:.2f} s after the "
          "last renewal")
    high = LEASE_DURATION + RETRY_PERIOD + 0.5  # 0.5 s: the elector's own round trips
    assert 0 < takeover <= high, (takeover, high)
    assert LEASE_DURATION <= since_renewal <= high, (since_renewal, high)
    assert kube.get("lease", "fairway-picker")["spec"]["leaseTransitions"] == transitions + 1
    no_access_errors(*installed.processes)
    log = operator.text()
    assert log.count("picker admin API unreachable") == 1, log[-3000:]
    assert " ERROR " not in log, log[-3000:]


def test_uninstall_with_policies_present_leaves_nothing_terminating(
        installed: Installed) -> None:
    kube = installed.kube
    kube.apply(_policies().replace("namespace: inference", f"namespace: {kube.namespace}"))
    admin_port = reserved_port()
    operator = installed.operator(kube.service_account_kubeconfig("fairway-operator"),
                                  admin_port)
    picker = installed.picker("picker-a", kube.service_account_kubeconfig("fairway-picker"),
                              admin_port)
    until(lambda: all((_ready(kube, p["metadata"]["name"]) or {}).get("status") == "True"
                      for p in kube.items("tenantpolicies")), timeout=30, what="policies Ready")
    # The operator's pod goes first (helm uninstall deletes its Deployment), then the policies.
    operator.stop(signal.SIGTERM)
    # The picker outlives its Role below: what it is refused from then on is no finding.
    installed_until = {process.name: process.mark() for process in installed.processes}
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
    no_access_errors(*installed.processes, upto=installed_until)



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
    no_access_errors(*installed.processes)


def test_a_process_of_the_tier_never_sees_the_in_cluster_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the tests ran in a pod: the API is found only through the kubeconfig given."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    process = start("probe", ["-c", "import time; time.sleep(60)"], tmp_path / "kubeconfig",
                    tmp_path)
    try:
        assert in_cluster_settings(process.popen.pid) == {}
    finally:
        process.stop(signal.SIGKILL)
