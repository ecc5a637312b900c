"""The whole picker process (``serve()``) in an emulated cluster: config from a ConfigMap,
endpoints from an InferencePool's ready pods, and leader election between two replicas.

kmock's emulator serves the Kubernetes API over real HTTP on 127.0.0.1; the model servers are
simulated vLLM servers; requests are played as Envoy plays them on the ext_proc stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import kmock
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.admin.v1 import admin_pb2, admin_pb2_grpc
from picker.k8s import ApiError, KubeClient
from picker.server import EXT_PROC_SERVICE, ServeSettings, serve
from picker.sim.server import SimServer, SimServerConfig
from tests.integration.test_extproc_contract import (
    TENANT_HEADER,
    Picker,
    chat_body,
    expect_route,
    refusal,
    send_request,
)
from tests.integration.test_k8s_cluster import CONFIGMAPS, LEASES, NS, PODS, POOLS, RESOURCES
from tests.tls import tls_channel

pytestmark = pytest.mark.integration

#: The pickers' lease: long, since both replicas, kmock and the test share one event loop, and a
#: loop stall longer than the renew deadline (two thirds of it) would make the leader step down.
#: It renews every third of it.
LEASE = 10.0

def _configmap(weight: float) -> dict[str, Any]:
    config = {"tenants": [{"id": "a", "weight": weight}], "capacity": {"scrapeInterval": "50ms"}}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "fairway-picker-config", "namespace": NS},
            "data": {"picker.yaml": json.dumps(config)}}


def _pod(name: str, ready: bool = True) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": "llm"}},
            "status": {"podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def _until(predicate: Callable[[], Any], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _lease(api: KubeClient) -> dict[str, Any]:
    return (await api.get(f"{LEASES}/fairway-picker"))["spec"]


async def _next_renewal(api: KubeClient, timeout: float = 3 * LEASE) -> dict[str, Any]:
    """The Lease once it has been written again (renewed, or taken over)."""
    before = (await _lease(api))["renewTime"]
    deadline = time.monotonic() + timeout
    while (spec := await _lease(api))["renewTime"] == before:
        assert time.monotonic() < deadline, "the Lease was not renewed"
        await asyncio.sleep(0.05)
    return spec


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[tuple[str, KubeClient]]:
    emulator = kmock.KubernetesEmulator()
    for resource in RESOURCES:
        emulator.resources[resource] = {"namespaced": resource != "v1/namespaces"}
    async with emulator, kmock.Server(emulator) as server:
        client = KubeClient(str(server.url))
        try:
            yield str(server.url), client
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def picker(url: str, **settings: Any) -> AsyncIterator[tuple[int, int]]:
    """serve() in-process; yields (ext_proc port, admin port)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[tuple[int, int]] = loop.create_future()
    admin_ready: asyncio.Future[int] = loop.create_future()
    task = asyncio.create_task(serve(ServeSettings(
        grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, grace=0.5, kube_server=url,
        config_map=f"{NS}/fairway-picker-config", client_auth="trust-network", **settings),
        stop, ready, admin_ready))
    try:
        (grpc_port, _), admin_port = await asyncio.wait_for(
            asyncio.gather(asyncio.shield(ready), asyncio.shield(admin_ready)), 20)
        yield grpc_port, admin_port
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def _endpoints(admin_port: int) -> list[str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
        reply = await admin_pb2_grpc.AdminStub(channel).ListEndpoints(
            admin_pb2.ListEndpointsRequest())
    return sorted(e.address for e in reply.endpoints if not e.draining)


async def _weight(admin_port: int, tenant: str) -> float:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
        reply = await admin_pb2_grpc.AdminStub(channel).ListTenants(
            admin_pb2.ListTenantsRequest(tenants=[tenant]))
    return reply.tenants[0].weight if reply.tenants else -1.0


async def _serving(grpc_port: int) -> bool:
    async with await tls_channel(grpc_port) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE))
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_config_map_and_pool_drive_the_picker() -> None:
    async with cluster() as (url, api), \
            SimServer(SimServerConfig(step_ms=2.0)) as one, \
            SimServer(SimServerConfig(step_ms=2.0)) as two:
        await api.create(CONFIGMAPS, _configmap(1))
        await api.create(POOLS, {
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "llm-pool", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "llm"}},
                     "targetPorts": [{"number": one.port}, {"number": two.port}]}})
        await api.create(PODS, _pod("llm-0"))
        async with picker(url, pool=f"{NS}/llm-pool") as (grpc_port, admin_port):
            expected = sorted(f"127.0.0.1:{s.port}" for s in (one, two))
            await _until(lambda: _endpoints_are(admin_port, expected))
            async with await tls_channel(grpc_port) as channel:
                box = Picker(grpc_port, 0, expected, channel)
                stream = box.open()
                body = chat_body(max_tokens=2)
                await send_request(stream, body, headers={TENANT_HEADER: "a"})
                routed = await expect_route(stream, body)
                assert routed.header in expected
                await stream.close()

                # A new weight in the ConfigMap reaches the picker through the watch.
                await api.merge_patch(f"{CONFIGMAPS}/fairway-picker-config",
                                      {"data": _configmap(3)["data"]})
                await _until(lambda: _weight_is(admin_port, "a", 3.0))

                # The pod turns unready: no endpoint is left for new requests.
                await api.merge_patch(f"{PODS}/llm-0", {"status": _pod("x", False)["status"]})
                await _until(lambda: _endpoints_are(admin_port, []))
                stream = box.open()
                await send_request(stream, body, headers={TENANT_HEADER: "a"})
                assert refusal(await stream.reply()).status == 503
                await stream.close()


async def _endpoints_are(admin_port: int, expected: list[str]) -> bool:
    return await _endpoints(admin_port) == expected


async def _weight_is(admin_port: int, tenant: str, weight: float) -> bool:
    return await _weight(admin_port, tenant) == weight


async def test_only_the_leader_serves_and_a_standby_takes_over() -> None:
    async with cluster() as (url, api), contextlib.AsyncExitStack() as replicas:
        await api.create(CONFIGMAPS, _configmap(1))
        lease = {"lease": f"{NS}/fairway-picker", "lease_duration": LEASE}
        leader_exit = contextlib.AsyncExitStack()
        first = await leader_exit.enter_async_context(picker(url, identity="one", **lease))
        replicas.push_async_callback(leader_exit.aclose)
        await _until(lambda: _serving(first[0]))
        second = await replicas.enter_async_context(picker(url, identity="two", **lease))
        # The standby read the held Lease as it started; one that took it would hold it by the
        # leader's next renewal.
        assert (await _next_renewal(api))["holderIdentity"] == "one"
        assert await _serving(first[0]) and not await _serving(second[0])
        async with await tls_channel(second[0]) as channel:
            stream = Picker(second[0], 0, [], channel).open()
            await send_request(stream, chat_body(), headers={TENANT_HEADER: "a"})
            refused = refusal(await stream.reply())
            assert refused.status == 503 and "standby" in refused.error["message"]
            await stream.close()
        await leader_exit.aclose()  # the leader goes away, releasing the Lease ...
        assert (await _lease(api))["holderIdentity"] in ("", "two")
        # ... so the standby takes over at its next retry (a third of the lease).
        await _until(lambda: _serving(second[0]), timeout=20)


async def test_the_picker_waits_for_its_config_map_instead_of_exiting() -> None:
    async with cluster() as (url, api):
        stop = asyncio.Event()
        ready: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(ServeSettings(
            grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, grace=0.5,
            kube_server=url, config_map=f"{NS}/fairway-picker-config"), stop, ready))
        await asyncio.sleep(1.0)
        assert not task.done() and not ready.done()  # waiting, neither serving nor exited
        await api.create(CONFIGMAPS, _configmap(1))  # the operator writes it
        grpc_port, _ = await asyncio.wait_for(asyncio.shield(ready), 15)
        await _until(lambda: _serving(grpc_port))
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_picker_stopped_while_waiting_for_its_config_map_ends() -> None:
    async with cluster() as (url, _):
        stop = asyncio.Event()
        task = asyncio.create_task(serve(ServeSettings(
            grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, kube_server=url,
            config_map=f"{NS}/fairway-picker-config"), stop))
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def _scripted_api(statuses: list[int]) -> AsyncIterator[tuple[str, list[int]]]:
    """An API server that answers reads of the ConfigMap with ``statuses`` in turn, then with the
    ConfigMap; yields its URL and the statuses it has answered so far."""
    from aiohttp import web

    answered: list[int] = []

    async def configmap(request: web.Request) -> web.Response:
        status = statuses[len(answered)] if len(answered) < len(statuses) else 200
        answered.append(status)
        if status != 200:
            return web.json_response({"kind": "Status", "code": status, "message": "scripted"},
                                     status=status)
        return web.json_response(_configmap(1))

    app = web.Application()
    app.router.add_get(f"/api/v1/namespaces/{NS}/configmaps/fairway-picker-config", configmap)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", answered
    finally:
        await runner.cleanup()


async def test_a_picker_starting_while_the_api_server_is_overloaded_waits_for_it() -> None:
    # An API server under a rollout answers 503 and 429 for a while; the picker must not exit
    # into a restart backoff (seen once as a picker that died at start in a busy test run).
    async with _scripted_api([503, 429, 500]) as (url, answered):
        stop = asyncio.Event()
        ready: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(ServeSettings(
            grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, grace=0.5,
            kube_server=url, config_map=f"{NS}/fairway-picker-config"), stop, ready))
        grpc_port, _ = await asyncio.wait_for(asyncio.shield(ready), 20)
        assert answered == [503, 429, 500, 200]
        await _until(lambda: _serving(grpc_port))
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_picker_refused_its_config_map_exits_with_the_refusal() -> None:
    # 403 is a missing RBAC rule, not a passing state: waiting would hide it behind a pod that
    # never becomes Ready.
    async with _scripted_api([403]) as (url, answered):
        with pytest.raises(ApiError) as refused:
            await asyncio.wait_for(serve(ServeSettings(
                grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, grace=0.5,
                kube_server=url, config_map=f"{NS}/fairway-picker-config")), 10)
        assert refused.value.code == 403 and answered == [403]


async def test_a_picker_starting_before_the_api_server_listens_waits_for_it() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stop = asyncio.Event()
    task = asyncio.create_task(serve(ServeSettings(
        grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, grace=0.5,
        kube_server=f"http://127.0.0.1:{port}", config_map=f"{NS}/fairway-picker-config"), stop))
    await asyncio.sleep(1.0)
    assert not task.done()  # connection refused is waited through, not an exit
    stop.set()
    await asyncio.wait_for(task, 10)
