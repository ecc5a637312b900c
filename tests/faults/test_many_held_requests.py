"""More requests held in the fair queue than Envoy's default circuit breaker lets through to a
cluster (1,024): each is an open ext_proc stream to the picker, so a picker cluster at Envoy's
default refuses every new request with 503 ``overflow`` once about a thousand wait. The stack
raises the limit (``picker.stack.envoy.MAX_CLUSTER_REQUESTS``); a light tenant arriving behind
1,100 held requests still gets its place in the fair queue and its answer.

A burst of 1,100 new streams can hold up the picker's reading of the running request's meter
stream past ``METER_BACKLOG_SHED``; the flood's requests refused for it meanwhile (503
``picker_overloaded``) are retried as a client honouring ``Retry-After`` would, so that all are
held in the end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import chat_body, metric, wait_until
from tests.faults.helpers import apost, gauges_drain

HELD = 1100


async def held_request(session: aiohttp.ClientSession, stack: Stack, body: bytes
               ) -> tuple[int, dict[str, str], dict]:
    """A flood request, sent again while the picker refuses it for its meter backlog."""
    while True:
        answer = await apost(session, stack, "flood", body)
        status, _, error = answer
        if status != 503 or error.get("error", {}).get("code") != "picker_overloaded":
            return answer
        await asyncio.sleep(0.2)


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One slow request at a time fits the server: everything else waits in the picker.
    with Stack(tmp_path_factory.mktemp("held"), endpoints=1,
               server_args=["--kv-budget-tokens", "512", "--step-ms", "40"],
               picker_config={"tenants": [{"id": "flood"}, {"id": "light"}],
                              "queue": {"maxWait": "60s"}}) as running:
        yield running


def test_a_light_request_behind_more_held_streams_than_envoys_default_is_served(
        stack: Stack) -> None:
    async def scenario() -> tuple[int, dict]:
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=90),
                connector=aiohttp.TCPConnector(limit=HELD + 10)) as session:
            flood = [asyncio.create_task(held_request(session, stack, chat_body(
                words=20, max_tokens=200))) for _ in range(HELD)]
            # Each flood request runs 8 s alone, so a few finish while a busy machine is still
            # sending the rest: they count as having been held.
            held = await asyncio.to_thread(wait_until, lambda: metric(
                stack.metrics_url, "fairway_queued_requests")
                + sum(task.done() for task in flood) >= HELD - 5, 60.0)
            queued = metric(stack.metrics_url, "fairway_queued_requests")
            assert held and queued > 1024, (queued, sum(task.done() for task in flood))
            status, _, body = await apost(session, stack, "light", chat_body(max_tokens=5))
            for task in flood:
                task.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            return status, body

    status, body = asyncio.run(scenario())
    assert status == 200, body
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained
