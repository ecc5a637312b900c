"""``python -m picker serve`` as a process: startup, metrics, hot reload, SIGTERM drain, bad config.

The picker runs as a subprocess on free 127.0.0.1 ports in front of an in-process simulated vLLM
server; the test talks to it over gRPC as Envoy would (the helpers of ``test_extproc_contract``) and
reads its ``/metrics`` page, stdout and stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from picker.server import EXT_PROC_SERVICE
from picker.sim.server import SimServer, SimServerConfig
from picker.stack.launcher import reserved_port
from tests.integration.test_extproc_contract import (
    CHAT,
    TENANT_HEADER,
    Picker,
    Stream,
    chat_body,
    fetch,
    refusal,
    relay_response,
    route,
    send_request,
)
from tests.tls import tls_channel

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 20.0


def write_config(path: Path, document: dict[str, Any]) -> None:
    """Replace the file atomically, so the watcher never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document))  # JSON is YAML
    tmp.replace(path)


@dataclass
class Process:
    """A running ``python -m picker serve``; its output is collected as it comes."""

    process: asyncio.subprocess.Process
    grpc_port: int
    metrics_port: int
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    readers: list[asyncio.Task[None]] = field(default_factory=list)

    def collect(self) -> None:
        for stream, sink in ((self.process.stdout, self.stdout),
                             (self.process.stderr, self.stderr)):
            assert stream is not None
            self.readers.append(asyncio.create_task(_read_lines(stream, sink)))

    async def wait_for_output(self, fragment: str, sink: list[str],
                              timeout: float = STARTUP_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            for line in sink:
                if fragment in line:
                    return line
            if self.process.returncode is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {fragment!r} (exit {self.process.returncode}); "
                                     f"stderr:\n{''.join(self.stderr)}")
            await asyncio.sleep(0.02)

    async def exit_code(self, timeout: float) -> int:
        code = await asyncio.wait_for(self.process.wait(), timeout)
        await asyncio.gather(*self.readers)
        return code


async def _read_lines(stream: asyncio.StreamReader, sink: list[str]) -> None:
    async for line in stream:
        sink.append(line.decode(errors="replace"))


async def spawn(config_path: Path, *extra: str) -> Process:
    """``python -m picker serve``; the tests' own gRPC clients stand in for the gateway, so
    unless ``extra`` says who may speak ext_proc, tenant headers are believed from them
    (``--client-auth=trust-network``, the explicit development mode)."""
    if not any(arg.startswith(("--client-auth", "--client-ca")) for arg in extra):
        extra = ("--client-auth=trust-network", *extra)
    grpc_port, metrics_port = reserved_port(), reserved_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "picker", "serve", "--config", str(config_path),
        "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--admin-port", "0",
        "--grpc-health-port", "0", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    running = Process(process, grpc_port, metrics_port)
    running.collect()
    return running


@contextlib.asynccontextmanager
async def picker_process(tmp_path: Path, *extra: str,
                         **config: Any) -> AsyncIterator[tuple[Picker, Process, Path]]:
    """A simulated server, a config naming it (``config`` keys merged in), the picker serving it.

    Yields the gRPC/metrics client (``Picker``), the process, and the config path.
    """
    async with SimServer(SimServerConfig(step_ms=2.0)) as sim:
        address = f"127.0.0.1:{sim.port}"
        document: dict[str, Any] = {"endpoints": [{"address": address}],
                                    "capacity": {"scrapeInterval": "50ms"}}
        for key, value in config.items():
            document[key] = {**document.get(key, {}), **value} if isinstance(value, dict) \
                else value
        path = tmp_path / "picker.yaml"
        write_config(path, document)
        running = await spawn(path, *extra)
        try:
            await running.wait_for_output("picker listening", running.stdout)
            # TLS, unverified: as the gateways dial it (the picker's default).
            async with await tls_channel(running.grpc_port) as channel:
                picker = Picker(running.grpc_port, running.metrics_port, [address], channel)
                try:
                    yield picker, running, path
                finally:
                    for stream in picker.streams:
                        await stream.close()
        finally:
            if running.process.returncode is None:
                running.process.kill()
            await running.exit_code(10)


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=15)
    return answer.status


async def complete(picker: Picker, stream: Stream, tenant: str, max_tokens: int = 3) -> None:
    """One whole non-streaming request through the stream, forwarded to where the picker said."""
    body = chat_body(max_tokens=max_tokens)
    routed = await route(stream, body, headers={TENANT_HEADER: tenant})
    upstream = await fetch(routed.header, CHAT, body)
    assert upstream.status == 200
    await relay_response(stream, 200, upstream.content_type, [upstream.data])


async def test_prints_its_listening_line_and_serves_metrics(tmp_path: Path) -> None:
    async with picker_process(tmp_path, tenants=[{"id": "a"}]) as (picker, running, _):
        line = await running.wait_for_output("picker listening", running.stdout)
        assert line.strip() == (f"picker listening grpc=127.0.0.1:{running.grpc_port} "
                                f"metrics=127.0.0.1:{running.metrics_port}")
        for service in ("", EXT_PROC_SERVICE):
            assert await health_status(picker.channel, service) == \
                health_pb2.HealthCheckResponse.SERVING
        await complete(picker, picker.open(), "a")
        await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")

        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{running.metrics_port}/metrics") as response:
            assert response.status == 200
            families = {f.name for f in text_string_to_metric_families(await response.text())}
        assert {"fairway_requests", "fairway_rejections", "fairway_service_tokens",
                "fairway_weighted_service", "fairway_queue_wait_seconds", "fairway_ttft_seconds",
                "fairway_config_reloads", "fairway_queued_requests", "fairway_running_requests",
                "fairway_virtual_service", "fairway_endpoint_inflight_tokens"} <= families
        assert await picker.metric("fairway_endpoint_inflight_tokens",
                                   endpoint=picker.endpoints[0]) == 0


async def test_hot_reload_applies_a_good_config_and_keeps_the_last_good_one(
        tmp_path: Path) -> None:
    async with picker_process(tmp_path, tenants=[{"id": "a"}]) as (picker, running, path):
        config = json.loads(path.read_text())
        write_config(path, {**config, "tenants": [{"id": "a", "weight": 4}, {"id": "b"}]})
        await picker.eventually("fairway_config_reloads_total", 1, result="success")

        # The new weight is in force: a's virtual counter is its weighted service ÷ 4.
        await complete(picker, picker.open(), "a")
        await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
        weighted = await picker.metric("fairway_weighted_service_total", tenant="a")
        assert weighted > 0
        assert await picker.metric("fairway_virtual_service", tenant="a") == \
            pytest.approx(weighted / 4)

        write_config(path, {**config, "tenants": [{"id": "a"}, {"id": "b", "weight": 0}]})
        await picker.eventually("fairway_config_reloads_total", 1, result="failure")
        line = await running.wait_for_output("config reload failed", running.stderr, 15)
        assert "keeping the last good config" in line
        assert "tenants[1].weight: must be >= 0.001" in line

        # Still serving, still with the last good config (b is a configured tenant there).
        await complete(picker, picker.open(), "b")
        await picker.eventually("fairway_requests_total", 1, tenant="b", outcome="ok")
        assert await picker.metric("fairway_config_reloads_total", result="success") == 1
        assert await health_status(picker.channel, "") == health_pb2.HealthCheckResponse.SERVING
        assert running.process.returncode is None


async def test_sigterm_drains_refuses_the_queue_and_exits_0(tmp_path: Path) -> None:
    # Long: waiting it out (the wrong behaviour) must take longer than the test's own RPCs
    # after the signal on a loaded machine; exiting when the request ends takes no time.
    grace = 20.0
    async with picker_process(tmp_path, "--grace", str(grace),
                              capacity={"kvBudgetTokens": 64}, queue={"maxWait": "30s"},
                              tenants=[{"id": "holder"}, {"id": "a"}]) as (picker, running, _):
        # The pool (one endpoint, 64 tokens) is filled by a streaming request left running.
        holder = picker.open()
        await route(holder, chat_body("word " * 60, max_tokens=500, stream=True),
                    headers={TENANT_HEADER: "holder"})
        queued = picker.open()
        await send_request(queued, chat_body(), headers={TENANT_HEADER: "a"})
        await picker.eventually("fairway_queued_requests", 1, tenant="a")

        running.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        refused = refusal(await queued.reply())
        assert refused.status == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.error["type"] == "server_error"
        assert "shutting down" in refused.error["message"]
        for service in ("", EXT_PROC_SERVICE):
            assert await health_status(picker.channel, service) == \
                health_pb2.HealthCheckResponse.NOT_SERVING
        assert await picker.metric("fairway_requests_total", tenant="a",
                                   outcome="shutdown") == 1

        # A newcomer during the drain is refused the same way.
        late = picker.open()
        await send_request(late, chat_body(), headers={TENANT_HEADER: "a"})
        assert refusal(await late.reply()).status == 503

        # The running request may finish; then the picker exits at once, well within the grace.
        await relay_response(holder, 200, "text/event-stream", [b"data: [DONE]\n\n"])
        assert await running.exit_code(grace + 5) == 0
        assert time.monotonic() - signalled < grace  # a picker waiting out the grace exits later
        assert any("picker stopped" in line for line in running.stderr)


async def test_sigterm_with_a_request_that_never_finishes_exits_after_the_grace(
        tmp_path: Path) -> None:
    grace = 1.0
    async with picker_process(tmp_path, "--grace", str(grace)) as (picker, running, _):
        holder = picker.open()
        await route(holder, chat_body(max_tokens=500, stream=True))
        running.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # It exits (a picker waiting for the request would not: it never ends) ...
        assert await running.exit_code(grace + 15) == 0
        # ... once the grace is out.
        assert time.monotonic() - signalled >= grace
        assert await holder.ended()


@pytest.mark.parametrize(
    ("config", "message"),
    [({"tenants": [{"id": "a"}, {"id": "b", "weight": -1}]}, "tenants[1].weight: must be >= 0.001"),
     ({"queue": {"maxWait": "soon"}}, "queue.maxWait: must be a duration"),
     ({"tenancy": {"headr": "x-team"}}, "tenancy.headr: unknown key"),
     ({"endpoints": [{"address": "not an address"}]}, "endpoints[0].address: must be host:port")],
    ids=["range", "duration", "unknown-key", "address"])
async def test_bad_config_at_startup_exits_1_naming_the_field(
        tmp_path: Path, config: dict[str, Any], message: str) -> None:
    path = tmp_path / "picker.yaml"
    write_config(path, config)
    running = await spawn(path)
    assert await running.exit_code(STARTUP_TIMEOUT) == 1
    stderr = "".join(running.stderr)
    assert f"{path}: {message}" in stderr
    assert "Traceback" not in stderr
    assert not any("picker listening" in line for line in running.stdout)

