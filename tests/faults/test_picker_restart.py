"""The picker dies under load, or is told to stop: no client is left hanging or given a bare
failure. SIGKILL: Envoy answers the dead picker's clients 503 ``picker_unavailable`` with
Retry-After, and a restarted picker serves again. SIGTERM: the queued requests are refused with a
retryable 503 ``shutting_down`` while the running ones finish within ``--grace``."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import chat_body, metric, wait_until
from tests.faults.helpers import apost, assert_openai_error, engine_requests, gauges_drain, post

OUTPUT = 60
LOAD = 10


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One small server (room for about two of these requests): most of the load queues.
    with Stack(tmp_path_factory.mktemp("picker-restart"), endpoints=1,
               server_args=["--kv-budget-tokens", "1024", "--step-ms", "15"],
               picker_config={"tenants": [{"id": "load"}, {"id": "after"}]}) as running:
        yield running


async def _load_then(stack: Stack, act: Any) -> list[tuple[int, dict[str, str], dict]]:
    """Send ``LOAD`` requests at once; once some run and some queue, call ``act()``; return what
    every client saw."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        tasks = [asyncio.create_task(apost(session, stack, "load",
                                           chat_body(words=300, max_tokens=OUTPUT)))
                 for _ in range(LOAD)]

        def busy() -> bool:
            return (metric(stack.metrics_url, "fairway_queued_requests") >= 3
                    and metric(stack.metrics_url, "fairway_running_requests") >= 1)
        assert await asyncio.to_thread(wait_until, busy, 15), "the load never queued"
        act()
        return await asyncio.gather(*tasks)


def _served_after_restart(stack: Stack) -> None:
    status, _, answer = post(stack, "after", chat_body(max_tokens=5))
    assert status == 200, answer
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_service_tokens_total",
                                      tenant="after", kind="completion") == 5)
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained


def test_sigkill_under_load_is_a_retryable_503_and_a_restart_serves(stack: Stack) -> None:
    picker = stack.picker_process

    def kill() -> None:
        os.killpg(picker.pid, signal.SIGKILL)
        picker.wait(10)

    seen = asyncio.run(_load_then(stack, kill))
    refused = [s for s in seen if s[0] != 200]
    # The queued ones (at least) lost their picker: Envoy's own refusal, OpenAI-shaped and
    # retryable. Anything already answered by the engine may finish; nothing else is allowed.
    assert len(refused) >= 3, [s[0] for s in seen]
    for status, headers, body in refused:
        assert_openai_error(status, headers, body, 503, "picker_unavailable", retryable=True)
    for status, _, body in seen:
        if status == 200:
            assert body["usage"]["completion_tokens"] == OUTPUT
    # Nothing wedged at the engine either: what it had, it finished or aborted.
    assert wait_until(lambda: metric(f"http://{stack.endpoint_addresses[0]}/metrics",
                                     "vllm:num_requests_running") == 0, 15)

    stack.restart_picker()
    _served_after_restart(stack)


def test_sigterm_refuses_the_queued_and_lets_the_running_finish(stack: Stack) -> None:
    picker = stack.picker_process
    engine_before = engine_requests(stack)

    def term() -> None:
        os.killpg(picker.pid, signal.SIGTERM)

    seen = asyncio.run(_load_then(stack, term))
    ok = [s for s in seen if s[0] == 200]
    refused = [s for s in seen if s[0] != 200]
    assert ok and refused, [s[0] for s in seen]
    for status, headers, body in refused:
        assert_openai_error(status, headers, body, 503, "shutting_down", retryable=True)
    # The running ones were not cut: each got its whole answer within the 2 s grace.
    for _, _, body in ok:
        assert body["usage"]["completion_tokens"] == OUTPUT
    assert picker.wait(15) == 0
    # Only the requests that were answered reached the engine; the refused never did.
    assert engine_requests(stack) - engine_before == len(ok)

    stack.restart_picker()
    _served_after_restart(stack)
