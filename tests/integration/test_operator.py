"""The operator in-process (kopf) against kmock's Kubernetes emulator over real HTTP, with a fake
picker admin API (grpc.aio) for the live figures.

The emulator is made a little more like a real API server here: it sets ``resourceVersion``
(bumped on every write), ``generation`` (bumped on spec changes), ``uid`` and
``creationTimestamp``, and answers a failed JSON-patch ``test`` with 422. Handlers may still run
more than once, so the tests poll for the end state instead of counting calls.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import jsonpatch
import kmock
import kopf
import kubernetes.client
import openapi_schema_validator
import pytest
import yaml

from fairway_operator.handlers import build_registry, kopf_settings
from fairway_operator.kube import Kube
from fairway_operator.settings import Settings
from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.config.schema import load_config
from picker.identity import hash_api_key

NS = "inference"
POOL = "llm-pool"
POLICIES = "fairway.dev/v1alpha1/tenantpolicies"
POLICY_URL = f"/apis/fairway.dev/v1alpha1/namespaces/{NS}/tenantpolicies"
CONFIGMAP_URL = f"/api/v1/namespaces/{NS}/configmaps"
SECRET_URL = f"/api/v1/namespaces/{NS}/secrets"
BASE_YAML = """\
lanes:
  - {name: online, enginePriority: 0}
  - {name: batch, minShare: 0.2, enginePriority: 10}
queue: {maxQueued: 1000, maxWait: 60s}
tenantDefaults:
  budgets: {burst: {tokens: 200000, per: 60s}}
"""
KEY_BASE_YAML = BASE_YAML + "tenancy: {mode: apiKey}\n"
"""The base config of a pool whose tenants are identified by API key (the admin's choice)."""
API_KEY = "sk-partner-acme-5d7f9a1c3e5b7d9f1a3c5e7b9d1f3a5c"
CRD = Path(__file__).resolve().parents[2] / "manifests/crd/fairway.dev_tenantpolicies.yaml"

_versions = itertools.count(1)
_seconds = itertools.count()


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator plus resourceVersion/generation/uid/creationTimestamp and 422s, and
    injected faults: ``faults[(method, path)] = n`` answers the next n such requests with 503."""

    faults: dict[tuple[str, str], int]

    async def _handle(self, request: kmock.Request) -> Any:
        fault = (str(request.method).upper().split(".")[-1], request.url.path)
        if self.faults.get(fault, 0) > 0:
            self.faults[fault] -= 1
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable",
                                        message="injected fault")
        if request.resource is not None and request.action == kmock.action.CREATE:
            meta = request.data.setdefault("metadata", {})
            meta["resourceVersion"] = str(next(_versions))
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("generation", 1)
            # One second apart, so that "older" is well defined (real ones have 1 s resolution).
            created = datetime.now(UTC) + timedelta(seconds=next(_seconds))
            meta.setdefault("creationTimestamp", created.strftime("%Y-%m-%dT%H:%M:%SZ"))
        elif request.resource is not None and request.action == kmock.action.UPDATE:
            version = str(next(_versions))
            if isinstance(request.data, dict):
                meta = request.data.setdefault("metadata", {})
                meta["resourceVersion"] = version
                if "spec" in request.data and not request.subresource:
                    try:
                        current = self.objects[request.resource, request.namespace,
                                               request.name].raw
                    except (KeyError, ValueError):
                        current = {}
                    meta["generation"] = current.get("metadata", {}).get("generation", 0) + 1
            elif isinstance(request.data, list):
                request.data.append({"op": "add", "path": "/metadata/resourceVersion",
                                     "value": version})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None


class Cluster:
    """The emulator, and the few calls a test makes to it (as kubectl would)."""

    def __init__(self, emulator: Emulator, server: kmock.Server) -> None:
        self.emulator = emulator
        self.server = server
        self.url = str(server.url).rstrip("/")

    async def _send(self, method: str, url: str, body: Any = None,
                    content_type: str = "application/merge-patch+json") -> dict:
        async with self.server.client.request(method, url, json=body,
                                              headers={"Content-Type": content_type}) as resp:
            assert resp.status < 300, f"{method} {url}: {resp.status} {await resp.text()}"
            return await resp.json()

    async def create_policy(self, name: str, tenants: list[str], **spec: Any) -> dict:
        return await self._send("POST", POLICY_URL, {
            "apiVersion": "fairway.dev/v1alpha1", "kind": "TenantPolicy",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"poolRef": {"name": POOL}, "tenants": tenants, **spec}})

    async def patch_policy_spec(self, name: str, **spec: Any) -> dict:
        return await self._send("PATCH", f"{POLICY_URL}/{name}", {"spec": spec})

    async def delete_policy(self, name: str) -> None:
        await self._send("DELETE", f"{POLICY_URL}/{name}")

    async def put_configmap(self, name: str, data: dict[str, str]) -> None:
        if self.get("v1/configmaps", name) is None:
            await self._send("POST", CONFIGMAP_URL, {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": NS}, "data": data})
        else:
            await self._send("PATCH", f"{CONFIGMAP_URL}/{name}", {"data": data})

    async def put_secret(self, name: str, keys: dict[str, str]) -> None:
        data = {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()}
        if self.get("v1/secrets", name) is None:
            await self._send("POST", SECRET_URL, {
                "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": NS}, "data": data})
        else:
            await self._send("PATCH", f"{SECRET_URL}/{name}", {"data": data})

    def get(self, resource: str, name: str) -> dict | None:
        try:
            obj = self.emulator.objects[resource, NS, name]
        except KeyError:
            return None
        return None if obj.deleted else obj.raw

    def policy(self, name: str) -> dict | None:
        return self.get(POLICIES, name)

    def ready(self, name: str) -> dict | None:
        """The policy's Ready condition, if any."""
        policy = self.policy(name) or {}
        conditions = policy.get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "Ready"), None)

    def picker_config(self) -> dict | None:
        configmap = self.get("v1/configmaps", "fairway-picker-config")
        return yaml.safe_load(configmap["data"]["picker.yaml"]) if configmap else None

    def tenant_ids(self) -> list[str] | None:
        config = self.picker_config()
        return None if config is None else [t["id"] for t in config["tenants"]]


async def eventually(check: Callable[[], Any], timeout: float = 15.0) -> Any:
    """Poll ``check`` until it returns a truthy value (not yet: falsy, or it raised
    AssertionError, KeyError, IndexError or TypeError, e.g. a status not written yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except (AssertionError, KeyError, IndexError, TypeError):
            if time.monotonic() > deadline:
                raise
        else:
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"not true within {timeout} s: {result!r}")
        await asyncio.sleep(0.05)


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    async with Emulator() as emulator, kmock.Server(emulator) as server:
        emulator.faults = {}
        verbs = {"list", "watch", "get", "create", "patch", "delete"}
        emulator.resources[POLICIES] = kmock.ResourceInfo(
            kind="TenantPolicy", singular="tenantpolicy", namespaced=True, verbs=verbs,
            subresources={"status"})
        for resource, kind in [("v1/configmaps", "ConfigMap"), ("v1/secrets", "Secret"),
                               ("v1/events", "Event")]:
            emulator.resources[resource] = kmock.ResourceInfo(kind=kind, namespaced=True,
                                                              verbs=verbs)
        emulator.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace",
                                                                 namespaced=False, verbs=verbs)
        cluster = Cluster(emulator, server)
        await cluster.put_configmap("fairway-base", {"base.yaml": BASE_YAML})
        yield cluster


class OperatorThread(threading.Thread):
    """The operator in its own thread and event loop, as in a real process: kopf cancels the
    tasks started during its run when it stops, which must not hit the test's own servers."""

    def __init__(self, cluster: Cluster, settings: Settings) -> None:
        super().__init__(name="fairway-operator", daemon=True)
        self.cluster = cluster
        self.settings = settings
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        kube = Kube(kubernetes.client.Configuration(host=self.cluster.url), timeout=5.0)
        url = self.cluster.url

        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url)

        registry = build_registry(self.settings, kube, login=login)
        try:
            # clusterwide: kmock cannot list /api/v1/namespaces, which a namespaced kopf does.
            asyncio.run(kopf.operator(
                registry=registry, settings=kopf_settings(self.settings), standalone=True,
                clusterwide=True, stop_flag=self.stop_flag))
        except BaseException as exc:
            self.error = exc


@contextlib.asynccontextmanager
async def running_operator(cluster: Cluster, **overrides: Any) -> AsyncIterator[OperatorThread]:
    operator = OperatorThread(cluster, Settings(pool=POOL, namespaces=(NS,), **overrides))
    operator.start()
    try:
        yield operator
    finally:
        operator.stop_flag.set()
        await asyncio.to_thread(operator.join, 15)
        assert not operator.is_alive(), "the operator did not stop"
        assert operator.error is None, f"the operator failed: {operator.error!r}"


class FakeAdmin(admin_pb2_grpc.AdminServicer):
    """The picker's admin API, answering with whatever the test puts in ``tenants``."""

    def __init__(self) -> None:
        self.tenants: list[admin_pb2.TenantState] = []
        self.calls = 0

    async def ListTenants(self, request: admin_pb2.ListTenantsRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.ListTenantsResponse:
        self.calls += 1
        wanted = set(request.tenants)
        return admin_pb2.ListTenantsResponse(
            tenants=[t for t in self.tenants if not wanted or t.tenant in wanted],
            window_seconds=60, taken_at_unix=time.time())


async def start_admin(admin: FakeAdmin, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def tenant(name: str, share: float, queued: int, running: int,
           burst: float | None = None) -> admin_pb2.TenantState:
    budgets = [] if burst is None else [
        admin_pb2.BudgetWindow(window="burst", remaining_tokens=burst, capacity_tokens=50000)]
    return admin_pb2.TenantState(tenant=name, configured=True, service_share=share,
                                 queued_requests=queued, running_requests=running,
                                 budgets=budgets)


def assert_valid_policy(obj: dict) -> None:
    """The object (status included) fits the CRD's schema, as a real API server would demand
    (the emulator checks nothing)."""
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    openapi_schema_validator.validate(obj, schema, cls=openapi_schema_validator.OAS30Validator)


# --- the tests ------------------------------------------------------------------------------

async def test_policies_are_rendered_and_marked_ready(cluster: Cluster) -> None:
    await cluster.create_policy("team-a", ["alice", "ann"], weight=2, lane="online",
                                budgets={"burst": {"tokens": 50000, "per": "60s"}})
    async with running_operator(cluster):
        await cluster.create_policy("nightly", ["etl"], lane="batch")  # while running

        await eventually(lambda: cluster.tenant_ids() == ["alice", "ann", "etl"])
        config = load_config(cluster.picker_config())  # what the picker will load
        assert config.tenant("alice").weight == 2 and config.tenant("etl").lane == "batch"
        assert [lane.name for lane in config.lanes] == ["online", "batch"]
        for name in ("team-a", "nightly"):
            ready = await eventually(lambda name=name: cluster.ready(name))
            assert ready["status"] == "True" and ready["reason"] == "Applied"
            assert ready["observedGeneration"] == 1
            assert cluster.policy(name)["status"]["observedGeneration"] == 1
            assert cluster.policy(name)["status"]["capacityProfile"] == "throughput"
        assert "alice, ann" in cluster.ready("team-a")["message"]
        assert_valid_policy(cluster.policy("team-a"))
        output = cluster.get("v1/configmaps", "fairway-picker-config")
        assert output["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "fairway-operator"
        # No finalizer: a policy never waits for the operator to be deleted (issue 14).
        assert not cluster.policy("team-a")["metadata"].get("finalizers")


async def test_a_bad_policy_is_refused_and_the_others_stay(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await cluster.create_policy("good", ["alice"], lane="online")
        await eventually(lambda: cluster.tenant_ids() == ["alice"])
        await cluster.create_policy("typo", ["bob"], lane="gold")
        await cluster.create_policy("copycat", ["alice", "carol"])
        await cluster.create_policy("bad-budget", ["dave"],
                                    budgets={"burst": {"tokens": 0, "per": "60s"}})
        await cluster.create_policy("other-pool", ["erin"], poolRef={"name": "elsewhere"})
        await cluster.create_policy("later", ["frank"])

        await eventually(lambda: cluster.tenant_ids() == ["alice", "frank"])
        typo = await eventually(lambda: cluster.ready("typo"))
        assert typo["status"] == "False" and typo["reason"] == "UnknownLane"
        assert "spec.lane" in typo["message"] and "'gold'" in typo["message"]
        assert typo["observedGeneration"] == 1
        copycat = await eventually(lambda: cluster.ready("copycat"))
        assert copycat["reason"] == "DuplicateTenant" and "good" in copycat["message"]
        budget = await eventually(lambda: cluster.ready("bad-budget"))
        assert budget["reason"] == "InvalidPolicy"
        assert budget["message"].startswith("spec.budgets.burst.tokens:")
        assert cluster.ready("good")["status"] == "True"
        for name in ("typo", "copycat", "good"):
            assert_valid_policy(cluster.policy(name))
        await eventually(lambda: cluster.ready("later") and cluster.ready("later")["status"]
                         == "True")
        assert cluster.ready("other-pool") is None  # another operator's business

        # Fixing the typo applies it, without touching the others.
        await cluster.patch_policy_spec("typo", lane="batch")
        await eventually(lambda: cluster.tenant_ids() == ["alice", "bob", "frank"])
        await eventually(lambda: cluster.ready("typo")["status"] == "True")
        assert cluster.ready("typo")["observedGeneration"] == 2


async def test_a_weight_change_rewrites_the_configmap(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await cluster.create_policy("team-a", ["alice"], weight=1)
        await eventually(lambda: cluster.tenant_ids() == ["alice"])
        await cluster.patch_policy_spec("team-a", weight=5)

        await eventually(lambda: cluster.picker_config()["tenants"][0]["weight"] == 5)
        await eventually(lambda: cluster.ready("team-a")["observedGeneration"] == 2)
        assert cluster.policy("team-a")["status"]["observedGeneration"] == 2


async def test_deleting_a_policy_removes_its_tenants(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await cluster.create_policy("team-a", ["alice"])
        await cluster.create_policy("team-b", ["bob"])
        await eventually(lambda: cluster.tenant_ids() == ["alice", "bob"])

        await cluster.delete_policy("team-a")
        await eventually(lambda: cluster.tenant_ids() == ["bob"])

        # And with no policy at all, the picker gets the base with no tenants.
        await cluster.delete_policy("team-b")
        await eventually(lambda: cluster.tenant_ids() == [])
        assert cluster.picker_config()["lanes"][1]["name"] == "batch"


async def test_moving_a_policy_to_another_pool_removes_its_tenants(cluster: Cluster) -> None:
    async with running_operator(cluster):
        await cluster.create_policy("team-a", ["alice"])
        await cluster.create_policy("team-b", ["bob"])
        await eventually(lambda: cluster.tenant_ids() == ["alice", "bob"])

        await cluster.patch_policy_spec("team-a", poolRef={"name": "other-pool"})
        await eventually(lambda: cluster.tenant_ids() == ["bob"])


async def test_api_server_errors_are_retried(cluster: Cluster) -> None:
    await cluster.create_policy("team-a", ["alice"])
    cluster.emulator.faults[("POST", CONFIGMAP_URL)] = 1  # creating the output ConfigMap
    cluster.emulator.faults[("PATCH", f"{POLICY_URL}/team-a/status")] = 1
    async with running_operator(cluster):
        await eventually(lambda: cluster.tenant_ids() == ["alice"], timeout=15)
        await eventually(lambda: cluster.ready("team-a")["status"] == "True")
        assert cluster.emulator.faults == {("POST", CONFIGMAP_URL): 0,
                                           ("PATCH", f"{POLICY_URL}/team-a/status"): 0}


async def test_base_config_and_secrets_are_watched(cluster: Cluster) -> None:
    await cluster.put_configmap("fairway-base", {"base.yaml": KEY_BASE_YAML})
    await cluster.put_secret("acme-keys", {"primary": API_KEY})
    async with running_operator(cluster):
        await cluster.create_policy("acme", ["partner-acme"], apiKeySecretRef={"name": "acme-keys"})
        await cluster.create_policy("no-secret", ["bob"], apiKeySecretRef={"name": "missing"})
        await eventually(lambda: cluster.tenant_ids() == ["partner-acme"])
        config = load_config(cluster.picker_config())
        assert config.tenancy.mode == "apiKey"
        assert [(k.sha256, k.tenant) for k in config.tenancy.api_keys] == [
            (hash_api_key(API_KEY), "partner-acme")]
        text = cluster.get("v1/configmaps", "fairway-picker-config")["data"]["picker.yaml"]
        assert API_KEY not in text
        missing = await eventually(lambda: cluster.ready("no-secret"))
        assert missing["reason"] == "SecretNotFound"

        # Key rotation: a new key in the Secret reaches the picker config.
        await cluster.put_secret("acme-keys", {"primary": API_KEY, "next": API_KEY + "-2"})
        await eventually(lambda: len(cluster.picker_config()["tenancy"]["apiKeys"]) == 2)
        # The missing Secret appears: that policy applies.
        await cluster.put_secret("missing", {"k": "sk-bob-0a2c4e6f8b1d3f5a7c9e"})
        await eventually(lambda: cluster.tenant_ids() == ["partner-acme", "bob"])

        # A bad base config: nothing is written, every policy says why.
        before = cluster.picker_config()
        await cluster.put_configmap("fairway-base", {"base.yaml": "lanes: []\n"})
        await eventually(lambda: all(cluster.ready(n)["reason"] == "InvalidBaseConfig"
                                     for n in ("acme", "no-secret")))
        assert "lanes" in cluster.ready("acme")["message"]
        assert cluster.picker_config() == before

        # A good base again, with a new lane: re-rendered, Ready again.
        await cluster.put_configmap("fairway-base", {
            "base.yaml": KEY_BASE_YAML + "scheduling: {policy: vtc}\n"})
        await eventually(lambda: cluster.picker_config()["scheduling"] == {"policy": "vtc"})
        await eventually(lambda: cluster.ready("acme")["status"] == "True")


async def test_the_base_config_not_a_policy_chooses_api_keys(cluster: Cluster) -> None:
    await cluster.put_secret("acme-keys", {"primary": API_KEY})
    async with running_operator(cluster):
        await cluster.create_policy("team-a", ["alice"])
        await cluster.create_policy("acme", ["partner-acme"], apiKeySecretRef={"name": "acme-keys"})
        # Header mode (the default): the key policy is refused, the others keep working.
        refused = await eventually(lambda: cluster.ready("acme"))
        assert refused["status"] == "False" and refused["reason"] == "ApiKeysNotEnabled"
        assert refused["message"].startswith("spec.apiKeySecretRef:")
        assert "tenancy.mode: apiKey" in refused["message"]
        await eventually(lambda: cluster.tenant_ids() == ["alice"])
        assert "tenancy" not in cluster.picker_config()
        assert_valid_policy(cluster.policy("acme"))

        # The admin switches the pool to API keys: the key policy applies, and the tenant that
        # no key names is refused rather than left to 401s.
        await cluster.put_configmap("fairway-base", {"base.yaml": KEY_BASE_YAML})
        await eventually(lambda: cluster.tenant_ids() == ["partner-acme"])
        config = load_config(cluster.picker_config())
        assert config.tenancy.mode == "apiKey"
        assert [k.tenant for k in config.tenancy.api_keys] == ["partner-acme"]
        await eventually(lambda: cluster.ready("acme")["status"] == "True")
        unkeyed = await eventually(lambda: cluster.ready("team-a")["status"] == "False"
                                   and cluster.ready("team-a"))
        assert unkeyed["reason"] == "TenantsUnidentifiable"
        assert "alice" in unkeyed["message"] and "401" in unkeyed["message"]


async def test_live_figures_reach_the_status(cluster: Cluster) -> None:
    admin = FakeAdmin()
    admin.tenants = [tenant("alice", 0.25, 3, 1, burst=1200.0), tenant("ann", 0.125, 1, 2),
                     tenant("noisy", 0.625, 40, 8, burst=-50.0)]
    server, port = await start_admin(admin)
    try:
        await cluster.create_policy("team-a", ["alice", "ann"])
        await cluster.create_policy("typo", ["zed"], lane="gold")
        async with running_operator(cluster, admin_address=f"127.0.0.1:{port}",
                                    status_interval=0.2):
            status = await eventually(
                lambda: cluster.policy("team-a")["status"].get("lastUpdated")
                and cluster.policy("team-a")["status"])
            assert status["share"] == pytest.approx(0.375)
            assert status["queuedRequests"] == 4 and status["runningRequests"] == 3
            assert status["budgetRemaining"] == {"burst": 1200}
            assert status["lastUpdated"].endswith("Z")
            assert status["conditions"][0]["status"] == "True"  # figures do not disturb it
            assert_valid_policy(cluster.policy("team-a"))

            # Figures follow the picker.
            admin.tenants = [tenant("alice", 0.5, 0, 0, burst=900.0), tenant("ann", 0.25, 0, 1)]
            await eventually(lambda: cluster.policy("team-a")["status"]["share"] == 0.75)
            assert cluster.policy("team-a")["status"]["budgetRemaining"] == {"burst": 900}
            # A refused policy gets no figures.
            assert "share" not in cluster.policy("typo")["status"]
    finally:
        await server.stop(None)


async def test_an_unreachable_picker_keeps_the_figures(cluster: Cluster) -> None:
    admin = FakeAdmin()
    admin.tenants = [tenant("alice", 0.5, 2, 1, burst=100.0)]
    server, port = await start_admin(admin)
    await cluster.create_policy("team-a", ["alice"])
    async with running_operator(cluster, admin_address=f"127.0.0.1:{port}",
                                status_interval=0.2, admin_timeout=0.5) as operator:
        figures = await eventually(lambda: cluster.policy("team-a")["status"].get("lastUpdated")
                                   and dict(cluster.policy("team-a")["status"]))
        await server.stop(None)  # the picker goes away
        calls = admin.calls
        await asyncio.sleep(1.5)  # several refresh intervals

        status = cluster.policy("team-a")["status"]
        for key in ("share", "queuedRequests", "runningRequests", "budgetRemaining"):
            assert status[key] == figures[key]
        assert admin.calls == calls
        assert operator.is_alive() and operator.error is None  # no crash

        # The operator still reconciles while the picker is away.
        await cluster.patch_policy_spec("team-a", weight=3)
        await eventually(lambda: cluster.picker_config()["tenants"][0]["weight"] == 3)
        assert cluster.policy("team-a")["status"]["share"] == figures["share"]

        # The picker is back (same port): figures flow again.
        admin.tenants = [tenant("alice", 0.2, 0, 0, burst=100.0)]
        server, _ = await start_admin(admin, port)
        try:
            await eventually(lambda: cluster.policy("team-a")["status"]["share"] == 0.2,
                             timeout=15)
        finally:
            await server.stop(None)
