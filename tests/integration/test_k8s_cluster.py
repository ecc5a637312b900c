"""The picker's Kubernetes parts against kmock's API emulator over real HTTP on 127.0.0.1: config
from a ConfigMap, endpoints from an InferencePool and its Pods (down to a real Dispatcher draining a
removed endpoint), and leader election on a Lease.

kmock's emulator sets no ``resourceVersion`` and starts each watch by replaying the objects, then
streams changes made after the watch subscribed; ``_watching`` waits for the watches to be open
before a test changes anything, so no change falls in the gap between list and watch (a real API
server has no such gap: the watch starts from the list's ``resourceVersion``).
"""

from __future__ import annotations

import asyncio
import datetime
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import kmock
import pytest
from prometheus_client import CollectorRegistry

from picker.config.schema import PickerConfig, load_config
from picker.dispatch import Dispatcher
from picker.errors import ConfigError
from picker.k8s import (
    ApiError,
    ConfigMapWatcher,
    KubeClient,
    LeaderElector,
    LiveConfig,
    PoolDiscovery,
    fetch_config,
)
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest

pytestmark = pytest.mark.integration

NS = "fairway"
RESOURCES = ("v1/namespaces", "v1/configmaps", "v1/pods",
             "inference.networking.k8s.io/v1/inferencepools", "coordination.k8s.io/v1/leases")
CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"
PODS = f"/api/v1/namespaces/{NS}/pods"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
QUICK = {"retry_min": 0.1, "retry_max": 0.5}


@dataclass
class Api:
    emulator: kmock.KubernetesEmulator
    url: str
    admin: KubeClient
    """The test's own client, for setting the scene."""
    clients: list[KubeClient]

    def client(self) -> KubeClient:
        """A client for the code under test, found the way serve() will find it (closed at the
        end of the test)."""
        client = KubeClient.from_environment(self.url)
        self.clients.append(client)
        return client

    def watches(self) -> int:
        return sum(1 for request in self.emulator if request.action == kmock.action.WATCH)

    def subscribed(self) -> int:
        """Watch streams kmock has subscribed to changes: its event buses' consumers (kmock 0.8
        has no public view of them). A stream subscribes after replaying the objects."""
        return sum(bus.consumer_count for bus in self.emulator._buses.values())


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    emulator = kmock.KubernetesEmulator()
    for resource in RESOURCES:
        emulator.resources[resource] = {"namespaced": resource != "v1/namespaces"}
    async with emulator, kmock.Server(emulator) as server:
        api = Api(emulator, str(server.url), KubeClient(str(server.url)), [])
        yield api
        for client in [api.admin, *api.clients]:
            await client.close()


async def _until(predicate: Callable[[], bool], timeout: float = 15.0) -> float:
    """Seconds until ``predicate()`` held (fails after ``timeout``)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _watching(api: Api, count: int) -> None:
    """Until ``count`` watches are subscribed to changes (a change made before would be lost)."""
    await _until(lambda: api.watches() >= count and api.subscribed() >= count)


class Running:
    """Components' ``run(stop)`` as tasks; ``stop()`` checks they return (one that did not heed
    ``stop`` would go on until its watch times out: minutes)."""

    def __init__(self) -> None:
        self.stop_event = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, component: Any) -> None:
        self.tasks.append(asyncio.create_task(component.run(self.stop_event)))

    async def stop(self) -> None:
        self.stop_event.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 15.0)


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    components = Running()
    yield components
    if not components.stop_event.is_set():
        await components.stop()


# -- config from a ConfigMap --

def _configmap(text: str) -> dict[str, Any]:
    return {"metadata": {"name": "picker", "namespace": NS}, "data": {"picker.yaml": text}}


def _yaml(budget: int, weight: float = 1.0) -> str:
    return f"capacity:\n  kvBudgetTokens: {budget}\ntenants:\n  - id: a\n    weight: {weight}\n"


async def _set_configmap(api: Api, text: str) -> None:
    await api.admin.merge_patch(f"{CONFIGMAPS}/picker", {"data": {"picker.yaml": text}})


async def test_configmap_config_applies_changes_in_seconds_and_refuses_bad_ones(
        api: Api, running: Running) -> None:
    applied: list[PickerConfig] = []
    results: list[str] = []
    client = api.client()
    watcher = ConfigMapWatcher(client, NS, "picker", applied.append, results.append,
                               retry_interval=0.1, **QUICK)
    running.start(watcher)
    await _watching(api, 1)
    assert applied == [] and results == []  # no ConfigMap yet: nothing to apply

    await api.admin.create(CONFIGMAPS, _configmap(_yaml(1000)))
    await _until(lambda: len(applied) == 1)
    assert applied[0].capacity.kv_budget_tokens == 1000 and results == ["success"]

    # Through the watch: a watcher missing the event would see it at its next list, after the
    # watch's timeout (300 s), far beyond _until's.
    await _set_configmap(api, _yaml(2000, weight=3))
    await _until(lambda: len(applied) == 2)
    assert applied[1].capacity.kv_budget_tokens == 2000
    assert applied[1].tenant("a").weight == 3

    await _set_configmap(api, _yaml(2000, weight=-1))  # refused: weight must be > 0
    await _until(lambda: results[-1:] == ["failure"])
    assert "tenants[0].weight" in watcher.last_error
    await _set_configmap(api, "capacity: {kvBudgetTokens: [")  # refused: not YAML
    await _until(lambda: results.count("failure") == 2)
    assert len(applied) == 2 and watcher.config is applied[1]  # the last good one serves

    await _set_configmap(api, _yaml(4000))
    await _until(lambda: len(applied) == 3)
    assert applied[2].capacity.kv_budget_tokens == 4000
    assert results == ["success", "success", "failure", "failure", "success"]

    await api.admin.delete(f"{CONFIGMAPS}/picker")
    await asyncio.sleep(0.3)
    assert len(applied) == 3 and watcher.config is applied[2]  # deleted: nothing changes
    await running.stop()


async def test_configmap_watcher_recovers_when_the_api_comes_back(api: Api) -> None:
    """The API is down at start (connection refused), then up: the config arrives."""
    applied: list[PickerConfig] = []
    await api.admin.create(CONFIGMAPS, _configmap(_yaml(1000)))
    client = KubeClient("http://127.0.0.1:9")  # nothing listens on the discard port
    api.clients.append(client)
    watcher = ConfigMapWatcher(client, NS, "picker", applied.append, **QUICK)
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    await _until(lambda: watcher.reflector.errors >= 2)
    assert applied == []
    client.server = api.url.rstrip("/")  # the API server is reachable again
    await _until(lambda: len(applied) == 1)
    stop.set()
    await asyncio.wait_for(task, 15.0)


async def test_fetch_config_reads_the_configmap_once(api: Api) -> None:
    with pytest.raises(ApiError) as missing:
        await fetch_config(api.admin, NS, "picker")
    assert missing.value.code == 404
    await api.admin.create(CONFIGMAPS, _configmap(_yaml(1234)))
    assert (await fetch_config(api.admin, NS, "picker")).capacity.kv_budget_tokens == 1234
    with pytest.raises(ConfigError, match=r"no key 'other\.yaml'"):
        await fetch_config(api.admin, NS, "picker", key="other.yaml")
    await _set_configmap(api, "queue: {maxQueued: 0}")
    with pytest.raises(ConfigError) as bad:
        await fetch_config(api.admin, NS, "picker")
    assert bad.value.path == "queue.maxQueued"


# -- endpoints from an InferencePool --

LABELS = {"app": "vllm", "pool": "main"}


def _pool(ports: tuple[int, ...] = (8000,)) -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "main", "namespace": NS},
            "spec": {"selector": {"matchLabels": LABELS},
                     "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "fairway", "port": {"number": 9002}}}}


def _ready(status: str) -> dict[str, Any]:
    return {"conditions": [{"type": "Initialized", "status": "True"},
                           {"type": "Ready", "status": status}]}


def _pod(name: str, ip: str, ready: bool = True, labels: dict[str, str] | None = None
         ) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS, "labels": labels or LABELS},
            "status": {"phase": "Running", "podIP": ip, **_ready("True" if ready else "False")}}


async def _scene(api: Api, pods: list[dict[str, Any]], ports: tuple[int, ...] = (8000,)) -> None:
    await api.admin.create(POOLS, _pool(ports))
    for pod in pods:
        await api.admin.create(PODS, pod)


async def test_pool_discovery_follows_pods_becoming_unready_deleted_and_added(
        api: Api, running: Running) -> None:
    await _scene(api, [_pod("vllm-0", "10.1.0.1"), _pod("vllm-1", "10.1.0.2"),
                       _pod("vllm-2", "10.1.0.3", ready=False),
                       _pod("other-0", "10.1.0.9", labels={"app": "vllm", "pool": "other"})])
    published: list[list[str]] = []
    client = api.client()
    discovery = PoolDiscovery(client, NS, "main", published.append, **QUICK)
    running.start(discovery)
    await asyncio.wait_for(discovery.ready.wait(), 15.0)
    assert published == [["10.1.0.1:8000", "10.1.0.2:8000"]]
    await _watching(api, 2)

    await api.admin.merge_patch(f"{PODS}/vllm-0", {"status": _ready("False")})
    await _until(lambda: published[-1] == ["10.1.0.2:8000"])

    await api.admin.merge_patch(f"{PODS}/vllm-2", {"status": _ready("True")})
    await _until(lambda: published[-1] == ["10.1.0.2:8000", "10.1.0.3:8000"])

    await api.admin.delete(f"{PODS}/vllm-1")
    await _until(lambda: published[-1] == ["10.1.0.3:8000"])

    await api.admin.create(PODS, _pod("vllm-3", "10.1.0.4"))
    await _until(lambda: published[-1] == ["10.1.0.3:8000", "10.1.0.4:8000"])

    # terminating: kubelet is stopping it, the object is still there with a deletionTimestamp
    await api.admin.merge_patch(f"{PODS}/vllm-3",
                                {"metadata": {"deletionTimestamp": "2025-01-01T00:00:00Z"}})
    await _until(lambda: published[-1] == ["10.1.0.3:8000"])

    await api.admin.merge_patch(f"{POOLS}/main", {"spec": {"targetPorts": [{"number": 8000},
                                                                          {"number": 8001}]}})
    await _until(lambda: published[-1] == ["10.1.0.3:8000", "10.1.0.3:8001"])

    await api.admin.delete(f"{POOLS}/main")
    await _until(lambda: published[-1] == [])
    # each change was published once, nothing in between
    assert len(published) == 8
    await running.stop()


async def test_discovered_endpoint_removed_mid_request_drains_in_a_real_dispatcher(
        api: Api, running: Running) -> None:
    await _scene(api, [_pod("vllm-0", "10.2.0.1"), _pod("vllm-1", "10.2.0.2")])
    static = load_config({"endpoints": [{"address": "127.0.0.1:9"}],
                          "capacity": {"kvBudgetTokens": 1000}})
    dispatcher = Dispatcher(static, metrics=PickerMetrics(CollectorRegistry()))
    live = LiveConfig(dispatcher.apply_config, static)
    client = api.client()
    discovery = PoolDiscovery(client, NS, "main", live.set_endpoints, **QUICK)
    running.start(discovery)
    a, b = "10.2.0.1:8000", "10.2.0.2:8000"
    await _until(lambda: set(dispatcher.endpoints) == {a, b})
    await _watching(api, 2)

    def request(prompt: int) -> InferenceRequest:
        return InferenceRequest(model="m", prompt_tokens=prompt, max_tokens=None, stream=True,
                                include_usage=True, body={})

    dispatcher.endpoints[b].inflight_tokens = 500  # steer the first request to a
    in_flight = await asyncio.wait_for(dispatcher.admit("t", request(100)), 15.0)
    dispatcher.endpoints[b].inflight_tokens = 0
    assert in_flight.destinations[0] == a

    await api.admin.delete(f"{PODS}/vllm-0")
    await _until(lambda: dispatcher.endpoints[a].draining)
    assert [e.address for e in dispatcher.config.endpoints] == [b]
    assert dispatcher.endpoints[a].inflight_requests == 1
    for _ in range(3):  # a has more room, but is draining
        ticket = await asyncio.wait_for(dispatcher.admit("t", request(10)), 15.0)
        assert ticket.destinations == [b]
        dispatcher.complete(ticket, None, "ok")

    dispatcher.complete(in_flight, None, "ok")
    assert a not in dispatcher.endpoints and set(dispatcher.endpoints) == {b}

    await api.admin.create(PODS, _pod("vllm-2", "10.2.0.3"))
    await _until(lambda: "10.2.0.3:8000" in dispatcher.endpoints)
    assert not dispatcher.endpoints["10.2.0.3:8000"].draining
    await running.stop()
    dispatcher.close()


# -- leader election --

#: Long enough that an event-loop stall (the electors, kmock and the test share one loop) does not
#: outlast the renew deadline and make the leader step down; renewals every RETRY.
LEASE, RENEW_DEADLINE, RETRY = 6.0, 4.0, 0.2


def _elector(api: Api, client: KubeClient, identity: str, states: list[tuple[str, bool]],
             **options: Any) -> LeaderElector:
    return LeaderElector(client, NS, "fairway-picker",
                         lambda leading: states.append((identity, leading)), identity=identity,
                         lease_duration=LEASE, renew_deadline=RENEW_DEADLINE, retry_period=RETRY,
                         **options)


async def _lease(api: Api) -> dict[str, Any]:
    return (await api.admin.get(f"{LEASES}/fairway-picker"))["spec"]


def _when(micro_time: str) -> datetime.datetime:
    return datetime.datetime.strptime(micro_time, "%Y-%m-%dT%H:%M:%S.%fZ")


async def _renewals(api: Api, count: int, leader: LeaderElector,
                    follower: LeaderElector) -> None:
    """Until ``leader`` has renewed the Lease ``count`` times, ``follower`` having read it held
    before; all along, one leads and the other follows (a follower taking a held Lease would
    hold it after its first read, and the leader would find itself not the holder)."""
    await _until(lambda: follower.holder is not None)
    seen = [(await _lease(api))["renewTime"]]
    while len(seen) <= count:
        assert leader.leading and not follower.leading
        lease = await _lease(api)
        assert lease["holderIdentity"] == leader.identity
        if lease["renewTime"] != seen[-1]:
            seen.append(lease["renewTime"])
        await asyncio.sleep(RETRY / 4)
    assert leader.leading and not follower.leading


async def test_leader_election_one_leads_a_crashed_leader_is_replaced_a_stopped_one_hands_over(
        api: Api) -> None:
    states: list[tuple[str, bool]] = []
    client = api.client()
    a = _elector(api, client, "picker-a", states, release_on_stop=False)  # it will crash
    b = _elector(api, client, "picker-b", states)
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    task_a = asyncio.create_task(a.run(stop_a))
    await _until(lambda: a.leading)
    task_b = asyncio.create_task(b.run(stop_b))
    await _renewals(api, 3, a, b)  # a renews, b stays a follower
    lease = await _lease(api)
    assert lease["holderIdentity"] == "picker-a" and lease["leaseTransitions"] == 0
    assert lease["leaseDurationSeconds"] == LEASE
    assert MICRO_TIME.match(lease["acquireTime"]) and MICRO_TIME.match(lease["renewTime"])
    assert lease["renewTime"] > lease["acquireTime"]

    task_a.cancel()  # a crashes: no release, the lease has to expire
    await asyncio.gather(task_a, return_exceptions=True)
    last_renewal = _when((await _lease(api))["renewTime"])
    await _until(lambda: b.leading, timeout=3 * LEASE)
    lease = await _lease(api)
    assert lease["holderIdentity"] == "picker-b" and lease["leaseTransitions"] == 1
    # Not before the lease ran out: b counts it from when it saw a's last renewal (a renewal
    # still in flight at the crash would only make this later).
    expired_for = _when(lease["acquireTime"]) - last_renewal
    assert expired_for.total_seconds() >= LEASE - 0.01

    c = _elector(api, client, "picker-c", states)
    stop_c = asyncio.Event()
    task_c = asyncio.create_task(c.run(stop_c))
    await _renewals(api, 2, b, c)
    stop_b.set()  # a clean stop releases the lease: c takes over at its next retry
    await asyncio.wait_for(task_b, 15.0)
    assert (await _lease(api))["holderIdentity"] in ("", "picker-c")  # released, not expiring
    await _until(lambda: c.leading)
    lease = await _lease(api)
    assert lease["holderIdentity"] == "picker-c" and lease["leaseTransitions"] == 2
    stop_c.set()
    await asyncio.wait_for(task_c, 15.0)
    assert states == [("picker-a", True), ("picker-a", False),  # cancelled: reported, no release
                      ("picker-b", True), ("picker-b", False), ("picker-c", True),
                      ("picker-c", False)]
