"""Clients that leave. One that disconnects while its request is queued is removed without charge
and its request never reaches an engine (its slot goes to the others); one that disconnects
mid-stream is settled to what was delivered and the engine stops generating for it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, wait_until
from tests.faults.helpers import CHAT, apost, engine_requests, gauges_drain

FLOOD, FLOOD_OUTPUT = 4, 300
"""A few of the flood run at a time, the rest queue. Each runs 6 s: the quitter, queued behind
them, is seen queued and then cancelled long before a slot frees (a slot freed first would
take it, fair order, and it would be sent)."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One server with room for a few of the flood's requests at a time, each about 6 s long.
    with Stack(tmp_path_factory.mktemp("cancellation"), endpoints=1,
               server_args=["--kv-budget-tokens", "1024", "--step-ms", "20"],
               picker_config={"tenants": [{"id": t} for t in ("long", "quitter", "streamer")]}
               ) as running:
        yield running


def _engine_metric(stack: Stack, name: str, **labels: str) -> float:
    return metric(f"http://{stack.endpoint_addresses[0]}/metrics", name, **labels)


def test_a_client_leaving_while_queued_is_never_sent_nor_charged(stack: Stack) -> None:
    engine_before = engine_requests(stack)

    async def scenario() -> list[tuple[int, dict[str, str], dict]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            flood = [asyncio.create_task(apost(session, stack, "long", chat_body(
                words=300, max_tokens=FLOOD_OUTPUT))) for _ in range(FLOOD)]
            full = await asyncio.to_thread(wait_until, lambda: metric(
                stack.metrics_url, "fairway_queued_requests", tenant="long") >= 1, 10)
            assert full, "the pool never filled"
            # As large as the flood's: it cannot fit beside them, it must wait for a slot.
            quitter = asyncio.create_task(apost(session, stack, "quitter", chat_body(
                words=300, max_tokens=FLOOD_OUTPUT)))
            queued = await asyncio.to_thread(wait_until, lambda: metric(
                stack.metrics_url, "fairway_queued_requests", tenant="quitter") == 1, 10)
            assert queued, "the quitter's request never showed as queued"
            quitter.cancel()  # the client hangs up while its request waits its turn
            await asyncio.gather(quitter, return_exceptions=True)
            left = await asyncio.to_thread(wait_until, lambda: metric(
                stack.metrics_url, "fairway_requests_total", tenant="quitter",
                outcome="cancelled") == 1, 10)
            assert left, "the quitter's request was not removed as cancelled"
            return await asyncio.gather(*flood)

    answers = asyncio.run(scenario())
    # The flood was served whole, in the slots the quitter would have taken.
    assert [a[0] for a in answers] == [200] * FLOOD
    assert all(a[2]["usage"]["completion_tokens"] == FLOOD_OUTPUT for a in answers)
    assert metric(stack.metrics_url, "fairway_requests_total", tenant="quitter") == 1
    assert metric(stack.metrics_url, "fairway_service_tokens_total", tenant="quitter") == 0
    assert metric(stack.metrics_url, "fairway_weighted_service_total", tenant="quitter") == 0
    # The engine received the flood and nothing else.
    assert wait_until(lambda: engine_requests(stack) - engine_before == FLOOD)
    assert _engine_metric(stack, "vllm:request_success_total", finished_reason="abort") == 0
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained


def test_a_client_leaving_mid_stream_is_settled_to_what_was_delivered(stack: Stack) -> None:
    aborted_before = _engine_metric(stack, "vllm:request_success_total",
                                    finished_reason="abort")

    async def scenario() -> int:
        async with aiohttp.ClientSession() as session, session.post(
                stack.gateway_url + CHAT, data=chat_body(max_tokens=2000, stream=True),
                headers={TENANT_HEADER: "streamer"}) as response:
            assert response.status == 200
            seen = 0
            async for line in response.content:
                if line.startswith(b"data: {"):
                    seen += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                if seen >= 20:
                    break
            response.close()
            return seen

    seen = asyncio.run(scenario())
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_requests_total",
                                      tenant="streamer", outcome="cancelled") == 1)
    charged = metric(stack.metrics_url, "fairway_service_tokens_total", tenant="streamer",
                     kind="completion")
    assert seen <= charged < 200, charged  # what was delivered (plus chunks in flight)
    # The engine stopped generating: the request was aborted there, not run to 2000 tokens.
    assert wait_until(lambda: _engine_metric(stack, "vllm:request_success_total",
                                             finished_reason="abort") == aborted_before + 1)
    assert _engine_metric(stack, "vllm:num_requests_running") == 0
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained
