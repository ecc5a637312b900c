"""Envoy is SIGKILLed mid-stream and restarted on the same ports: the streams it cut are settled to
what was delivered (not their reservation, not nothing), the picker's gauges drain, and the
restarted Envoy serves new requests through the same picker."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, wait_until
from tests.faults.helpers import CHAT, gauges_drain, post

MAX_TOKENS = 600


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("envoy-restart"), endpoints=1,
               server_args=["--step-ms", "10"],
               picker_config={"tenants": [{"id": "cut"}, {"id": "after"}]}) as running:
        yield running


async def _stream_until_cut(session: aiohttp.ClientSession, stack: Stack,
                            started: asyncio.Event, seen: list[int], index: int) -> None:
    """Read a long stream, counting content chunks, until the connection breaks."""
    try:
        async with session.post(stack.gateway_url + CHAT,
                                data=chat_body(max_tokens=MAX_TOKENS, stream=True),
                                headers={TENANT_HEADER: "cut"}) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    seen[index] += bool(delta.get("content"))
                if min(seen) >= 10:
                    started.set()
    except (TimeoutError, aiohttp.ClientError):
        pass


def test_streams_cut_by_an_envoy_crash_are_settled_and_the_restart_serves(stack: Stack) -> None:
    seen = [0, 0, 0]

    async def scenario() -> None:
        started = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            streams = [asyncio.create_task(_stream_until_cut(session, stack, started, seen, i))
                       for i in range(len(seen))]
            await asyncio.wait_for(started.wait(), 20)
            await asyncio.to_thread(stack.restart_envoy)
            await asyncio.gather(*streams)

    asyncio.run(scenario())
    assert all(0 < n < MAX_TOKENS for n in seen), seen  # cut mid-stream, not finished
    # Each cut stream ends (cancelled or error, not ok) and is charged what was generated for
    # it: at least what the client saw, far less than what it asked for.
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_requests_total",
                                      tenant="cut") == len(seen), 15)
    assert metric(stack.metrics_url, "fairway_requests_total", tenant="cut", outcome="ok") == 0
    charged = metric(stack.metrics_url, "fairway_service_tokens_total", tenant="cut",
                     kind="completion")
    assert sum(seen) <= charged < len(seen) * MAX_TOKENS / 2, (seen, charged)
    assert metric(stack.metrics_url, "fairway_service_tokens_total", tenant="cut",
                  kind="prompt") > 0
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained

    # The restarted Envoy (same ports, same config) reaches the same picker.
    status, _, answer = post(stack, "after", chat_body(max_tokens=5))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 5
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_service_tokens_total",
                                      tenant="after", kind="completion") == 5)
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained
