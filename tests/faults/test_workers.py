"""One pod's picker over worker processes (``--workers 2``) behind real Envoy, on a real
``redis-server``: both workers take the gateway's requests on the one ext_proc port, the pod's
health and metrics answer for all of them, a worker killed under load is started again while the
other serves on, and SIGTERM drains every worker before the pod's process exits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import aiohttp
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.stack.launcher import Stack
from picker.stack.redis import RedisServer
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, wait_until

pytestmark = pytest.mark.faults

WORKERS = 2
CUT = 0
"""The status recorded for a response cut mid-body: on the inline path the response passes
through the worker, so one the killed worker was relaying ends there."""
CLIENTS = 12
CONNECTION_AGE = 2.0
"""Seconds a worker keeps a gateway connection (30 by default): a restarted worker is dialled
within about this long, however Envoy's connections stood."""


def _children(pid: int) -> list[int]:
    """The worker processes of the supervisor ``pid`` (not multiprocessing's resource
    tracker), oldest first: as started, worker 0 first."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
    return sorted(found)


def _health(stack: Stack, service: str) -> int | None:
    """The pod's answer, or None when it gives none (within 10 s: a loaded machine's slow
    answer is still an answer)."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.health_port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10).status
        except grpc.RpcError:
            return None


SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Stack]:
    with RedisServer(tmp_path / "redis") as store, Stack(
            tmp_path / "stack", endpoints=2, response_path="inline",
            picker_config={"state": {"backend": "redis", "redis": {"url": store.url},
                                     "syncInterval": "100ms"}},
            picker_args=["--workers", str(WORKERS), "--connection-age", str(CONNECTION_AGE)],
            picker_streams_per_connection=4) as stack:
        yield stack


class Answer(NamedTuple):
    client: int
    status: int
    sent: float
    ended: float
    """``time.monotonic`` when the request was sent and when its answer was read."""


async def _load(stack: Stack, seconds: float, clients: int,
                until: Callable[[], bool] | None = None) -> tuple[dict[int, int], list[Answer]]:
    """``clients`` closed-loop clients for ``seconds``, or until ``until()`` (polled) holds;
    status counts, and every answer. A response cut mid-body counts as status ``CUT``."""
    statuses: dict[int, int] = {}
    answers: list[Answer] = []
    deadline = time.monotonic() + seconds
    done = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        async def client(i: int) -> None:
            while time.monotonic() < deadline and not done.is_set():
                sent = time.monotonic()
                async with session.post(f"{stack.gateway_url}/v1/chat/completions",
                                        data=chat_body(max_tokens=20),
                                        headers={TENANT_HEADER: f"t{i % 3}",
                                                 "content-type": "application/json"}) as reply:
                    try:
                        await reply.read()
                        status = reply.status
                    except aiohttp.ClientPayloadError:
                        status = CUT
                statuses[status] = statuses.get(status, 0) + 1
                answers.append(Answer(i, status, sent, time.monotonic()))

        async def watch() -> None:
            if until is not None and await asyncio.to_thread(wait_until, until, seconds):
                done.set()
        await asyncio.gather(watch(), *(client(i) for i in range(clients)))
    return statuses, answers


def test_both_workers_take_requests_on_one_port_and_the_pod_answers_for_them(
        pod: Stack) -> None:
    statuses, _ = asyncio.run(_load(pod, 4.0, 24))
    assert set(statuses) == {200}, statuses
    served = [metric(pod.metrics_url, "fairway_requests_total", worker=str(i))
              for i in range(WORKERS)]
    # Every request is counted once, by the worker that held it; both held some.
    assert sum(served) == statuses[200], (served, statuses)
    # A worker no connection reached would have none; how evenly they share is the kernel's
    # hash of a few connections, not asserted.
    assert min(served) > 0, served
    assert metric(pod.metrics_url, "fairway_workers_ready") == WORKERS
    assert metric(pod.metrics_url, "fairway_ready") == WORKERS  # one sample per worker
    for service in ("", "readiness", "liveness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert _health(pod, service) == SERVING, service
    assert len(_children(pod.picker_process.pid)) == WORKERS


def test_a_killed_worker_is_started_again_and_sigterm_drains_every_worker(pod: Stack) -> None:
    """A worker SIGKILLed under load is started again while the other serves; then SIGTERM to
    the pod (its main process, as the kubelet sends it) drains both before the pod exits."""
    supervisor = pod.picker_process.pid
    victim = _children(supervisor)[0]

    async def scenario() -> tuple[dict[int, int], list[Answer], float, list[int | None]]:
        load = asyncio.create_task(_load(pod, 8.0, CLIENTS))
        await asyncio.sleep(2.0)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        readiness = []
        for _ in range(10):  # the pod stays Ready: the other worker serves
            readiness.append(await asyncio.to_thread(_health, pod, "readiness"))
            await asyncio.sleep(0.3)
        statuses, answers = await load
        return statuses, answers, killed_at, readiness

    statuses, answers, killed_at, readiness = asyncio.run(scenario())
    assert readiness == [SERVING] * len(readiness), readiness
    # The pod served on: requests sent after the kill were answered.
    assert any(a.status == 200 and a.sent > killed_at for a in answers), statuses
    # Only what the dead worker held fails (a retryable 503, or a response it was relaying
    # cut mid-body), and nothing fails before the kill. A client has one request at a time, so
    # each fails at most once with a request sent before the kill (the one it had there) and at
    # most once with one sent after it (routed over the dead worker's connection before Envoy
    # saw it close: a client whose request failed at the kill sends its next at once, CI saw it
    # 10 ms later, and that one can fail too). A client failing more often was failed by
    # something other than the dead worker.
    failures = [a for a in answers if a.status != 200]
    shown = [(a.client, round(a.sent - killed_at, 2), round(a.ended - killed_at, 2))
             for a in failures]
    assert set(statuses) <= {200, 503, CUT}, statuses
    assert all(a.ended > killed_at for a in failures), shown
    for sent_after in (False, True):
        per_client = Counter(a.client for a in failures if (a.sent > killed_at) == sent_after)
        assert max(per_client.values(), default=0) <= 1, shown
    assert wait_until(lambda: metric(pod.metrics_url, "fairway_workers_ready") == WORKERS, 20)
    assert metric(pod.metrics_url, "fairway_worker_restarts_total") == 1
    assert victim not in _children(supervisor) and len(_children(supervisor)) == WORKERS
    # The restarted worker (0: the oldest was killed) takes requests again, once Envoy's
    # connections have been dialled anew (each ends after CONNECTION_AGE): the load goes on
    # until it does (or 30 s).
    before = metric(pod.metrics_url, "fairway_requests_total", worker="0")

    def worker_0_serves() -> bool:
        return metric(pod.metrics_url, "fairway_requests_total", worker="0") > before
    statuses, _ = asyncio.run(_load(pod, 30.0, 24, until=worker_0_serves))
    assert set(statuses) == {200}, statuses
    assert worker_0_serves()

    workers = _children(supervisor)

    async def terminate() -> dict[int, int]:
        load = asyncio.create_task(_load(pod, 1.5, 12))
        await asyncio.sleep(1.0)
        pod.picker_process.send_signal(signal.SIGTERM)
        return (await load)[0]

    statuses = asyncio.run(terminate())
    assert pod.picker_process.wait(30) == 0
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    # What was running when SIGTERM came finished; what came after was refused retryably.
    assert statuses.get(200, 0) > 0 and set(statuses) <= {200, 503}, statuses


def _serve(tmp_path: Path, config: dict[str, object], *flags: str) -> subprocess.CompletedProcess:
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "picker", "serve", "--config", str(path),
                           "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
                           "--admin-port", "0", *flags],
                          capture_output=True, text=True, timeout=30)


def test_workers_refuse_the_memory_backend_a_lease_and_a_zero_connection_age(
        tmp_path: Path) -> None:
    config = {"endpoints": [{"address": "127.0.0.1:1"}]}
    memory = _serve(tmp_path, config, "--workers", "2")
    assert memory.returncode == 1
    assert "state.backend: worker processes (--workers) need the redis backend" in memory.stderr
    leased = _serve(tmp_path, config, "--workers", "2", "--lease", "ns/name")
    assert leased.returncode == 2 and "without --lease" in leased.stderr
    ageless = _serve(tmp_path, config, "--workers", "2", "--connection-age", "0")
    assert ageless.returncode == 2 and "--connection-age must be positive" in ageless.stderr
