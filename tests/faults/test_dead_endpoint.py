"""A model server dies or hangs: the picker ejects it (outlier ejection), nobody is charged for a
request that never reached an engine, traffic returns once it is back, and no slot leaks.

Real Envoy, the picker and simulated servers on 127.0.0.1 (``picker.stack.launcher.Stack``).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from picker.stack.envoy import envoy_config
from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, settled_metric, wait_until

HEALTH = {"consecutiveFailures": 3, "baseEjectionTime": "500ms", "maxEjectionTime": "2s"}
"""Short ejections, so a restarted server is probed back within the test's bounds."""
LONG_EJECTION = {**HEALTH, "baseEjectionTime": "5s", "maxEjectionTime": "5s"}
"""Ejections that outlast the requests sent to a dead server: each expiry is a probe window in
which one request may be sent there and fail, so with short ones how many fail would depend on
how fast the machine sends them. Still short enough to be probed back within the test's
bounds."""


def _post(stack: Stack, body: bytes, timeout: float = 20) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(stack.gateway_url + "/v1/chat/completions", data=body,
                                     headers={TENANT_HEADER: "a",
                                              "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def _served_by(stack: Stack) -> list[str]:
    return [line.split("upstream=", 1)[1].split(" ", 1)[0]
            for line in stack.access_log.read_text().splitlines() if "upstream=" in line]



def _assert_traffic_returns(stack: Stack, requests: int) -> None:
    """The restarted first endpoint, probed back, serves some of ``requests`` new ones."""
    before = len(_served_by(stack))
    for _ in range(requests):
        status, _, _ = _post(stack, chat_body(max_tokens=2))
        assert status == 200
    wait_until(lambda: len(_served_by(stack)) >= before + requests, timeout=15)
    assert stack.endpoint_addresses[0] in _served_by(stack)[before:], "traffic did not return"

def _assert_gauges_return_to_zero(stack: Stack) -> None:
    for name in ("fairway_queued_requests", "fairway_running_requests",
                 "fairway_endpoint_inflight_tokens"):
        assert settled_metric(stack.metrics_url, name, 0.0, timeout=10) == 0.0, name


def _ejected(stack: Stack, index: int) -> float:
    return metric(stack.metrics_url, "fairway_endpoint_ejected",
                  endpoint=stack.endpoint_addresses[index])


@pytest.fixture
def plain_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Envoy routes on the header (``ORIGINAL_DST``, the form kept for endpoints discovered
    later): it cannot retry elsewhere, so the picker's ejection is what protects clients."""
    with Stack(tmp_path_factory.mktemp("dead"), endpoints=2, gateway_retries=False,
               picker_config={"tenants": [{"id": "a"}], "health": LONG_EJECTION}) as running:
        yield running


def test_a_killed_server_is_ejected_uncharged_and_probed_back(plain_stack: Stack) -> None:
    stack = plain_stack
    status, _, _ = _post(stack, chat_body(max_tokens=2))
    assert status == 200
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_requests_total", tenant="a",
                                     outcome="ok") == 1)  # settled a moment after the answer
    prompt = metric(stack.metrics_url, "fairway_service_tokens_total", tenant="a", kind="prompt")
    assert prompt > 0
    stack.kill_server(0)
    statuses = []
    for _ in range(12):
        status, headers, body = _post(stack, chat_body(max_tokens=2))
        statuses.append(status)
        if status != 200:
            # Never reached an engine: a retryable 503 with an OpenAI body, not a bare error.
            assert status == 503, body
            assert headers["retry-after"] == "1"
            assert json.loads(body)["error"]["code"] == "model_server_unavailable"
    failures = len([s for s in statuses if s != 200])
    # Ejected after at most consecutiveFailures (failed scrapes count too): then the healthy
    # server takes everything.
    assert failures <= HEALTH["consecutiveFailures"], statuses
    assert statuses[-8:] == [200] * 8, statuses
    assert _ejected(stack, 0) == 1.0
    assert metric(stack.metrics_url, "fairway_requests_total", tenant="a",
                  outcome="upstream_failed") == failures
    # Charged for the requests that were served, and for nothing else.
    ok = 1 + statuses.count(200)
    assert settled_metric(stack.metrics_url, "fairway_service_tokens_total", prompt * ok,
                          tenant="a", kind="prompt") == prompt * ok
    assert settled_metric(stack.metrics_url, "fairway_service_tokens_total", 2.0 * ok,
                          tenant="a", kind="completion") == 2.0 * ok

    stack.restart_server(0, [])
    assert wait_until(lambda: _ejected(stack, 0) == 0.0, timeout=15), "not probed back"
    _assert_traffic_returns(stack, 6)
    _assert_gauges_return_to_zero(stack)


@pytest.fixture
def retrying_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Envoy routes with ``override_host`` and retries on the picker's fallback; the servers are
    slow (20 ms a token) and small, so requests queue in the picker."""
    with Stack(tmp_path_factory.mktemp("retry"), endpoints=2, gateway_retries=True,
               server_args=["--step-ms", "20"],
               picker_config={"tenants": [{"id": "a"}], "health": HEALTH,
                              "capacity": {"kvBudgetTokens": 80}}) as running:
        yield running


def _stream(stack: Stack) -> tuple[int, bool]:
    """One streaming request: its status, and whether the stream ended with ``[DONE]``."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.gateway_port, timeout=30)
    try:
        connection.request("POST", "/v1/chat/completions",
                           body=chat_body(max_tokens=30, stream=True),
                           headers={TENANT_HEADER: "a", "content-type": "application/json"})
        response = connection.getresponse()
        try:
            text = response.read().decode(errors="replace")
        except (http.client.IncompleteRead, ConnectionError) as error:
            text = getattr(error, "partial", b"").decode(errors="replace")
        return response.status, "[DONE]" in text
    finally:
        connection.close()


def test_with_gateway_retries_queued_requests_go_to_the_live_server(retrying_stack: Stack
                                                                     ) -> None:
    stack = retrying_stack
    status, _, _ = _post(stack, chat_body(max_tokens=2))
    assert status == 200
    # The meter stream settles a moment after the client has its answer: wait for it, then read
    # what one request's prompt costs.
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_requests_total", tenant="a",
                                     outcome="ok") == 1)
    prompt = metric(stack.metrics_url, "fairway_service_tokens_total", tenant="a", kind="prompt")
    assert prompt > 0
    with ThreadPoolExecutor(12) as pool:
        results = [pool.submit(_stream, stack) for _ in range(12)]
        # Some are streaming on each server, the rest queue in the picker; then server 0 dies.
        assert wait_until(lambda: metric(stack.metrics_url, "fairway_queued_requests") > 0
                          and metric(stack.metrics_url, "fairway_running_requests") >= 2,
                          timeout=10)
        stack.kill_server(0)
        outcomes = [future.result(timeout=60) for future in results]
    # Mid-stream on the dead server: cut off (200, no [DONE]). Everything else, queued ones
    # included, was served whole by the live server: none saw the dead one.
    assert all(status == 200 for status, _ in outcomes), outcomes
    whole = sum(done for _, done in outcomes)
    assert whole >= 12 - 4, outcomes  # at most the few running on server 0 were cut off
    assert metric(stack.metrics_url, "fairway_requests_total", outcome="upstream_failed") == 0
    # Each request reached exactly one engine: its prompt is charged once, never twice.
    assert settled_metric(stack.metrics_url, "fairway_service_tokens_total", prompt * 13,
                          tenant="a", kind="prompt") == prompt * 13
    assert _ejected(stack, 0) == 1.0

    stack.restart_server(0, ["--step-ms", "20"])
    assert wait_until(lambda: _ejected(stack, 0) == 0.0, timeout=10), "not probed back"
    _assert_traffic_returns(stack, 4)
    _assert_gauges_return_to_zero(stack)


class _SilentServer:
    """Accepts connections and reads, but never answers."""

    def __init__(self) -> None:
        self.port = 0
        """Bound on ``__enter__`` (port 0, read back)."""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await reader.read(65536):
                pass
            writer.close()

        async def main() -> None:
            self._server = await asyncio.start_server(swallow, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()
            await self._server.serve_forever()

        asyncio.set_event_loop(self._loop)
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(main())

    def __enter__(self) -> _SilentServer:
        self._thread.start()
        assert self._ready.wait(15)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        for task in asyncio.all_tasks(self._loop):
            self._loop.call_soon_threadsafe(task.cancel)
        self._thread.join(5)


def test_a_server_that_never_answers_times_out_uncharged(tmp_path: Path) -> None:
    """The only endpoint accepts and never answers: each request times out at the gateway with
    a retryable 504 and an OpenAI body, costs nothing, and leaves no slot behind. It is not
    ejected: it is the last endpoint in service (see picker.core.health)."""
    def bootstrap(stack: Stack) -> dict:
        return envoy_config(listen_port=stack.gateway_port, admin_port=stack.admin_port,
                            picker_port=stack.grpc_port, request_timeout_s=2,
                            access_log=stack.access_log, identity="trusted-client")

    with _SilentServer() as silent, Stack(
            tmp_path, endpoints=0, external_endpoints=[f"127.0.0.1:{silent.port}"],
            envoy_bootstrap=bootstrap,
            picker_config={"tenants": [{"id": "a"}], "health": HEALTH}) as stack:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: _post(stack, chat_body(max_tokens=2)), range(3)))
        for status, headers, body in answers:
            assert status == 504, body
            assert headers.get("retry-after") == "1", (headers, body)
            error = json.loads(body)["error"]
            assert error["code"] == "model_server_unavailable"
            assert "response_timeout" in error["message"]
        assert settled_metric(stack.metrics_url, "fairway_requests_total", 3.0, tenant="a",
                              outcome="upstream_failed") == 3.0
        assert metric(stack.metrics_url, "fairway_service_tokens_total", tenant="a") == 0.0
        assert _ejected(stack, 0) == 0.0
        _assert_gauges_return_to_zero(stack)
