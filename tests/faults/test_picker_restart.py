"""The picker dies under load, or is told to stop: no client is left hanging or given a bare
failure. SIGKILL: Envoy answers the dead picker's clients 503 ``picker_unavailable`` with
Retry-After, and a restarted picker serves again. SIGTERM: the queued requests are refused with a
retryable 503 ``shutting_down`` while the running ones finish within ``--grace``.

What a tenant is charged is read from the picker's metering records (one per finished request,
appended to one file across restarts) and from its metrics. With the memory backend a restarted
picker starts from nothing: whatever the SIGKILLed one had charged is gone with it. So the checks
are that the restarted picker charges exactly what it serves and nothing of the requests cut
before it started."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import chat_body, metric, settled_metric, wait_until
from tests.faults.helpers import (
    ScrapesUntilExit,
    apost,
    assert_openai_error,
    engine_requests,
    gauges_drain,
    post,
    usage_records,
)

OUTPUT = 60
LOAD = 10
AFTER_OUTPUT = 5
USAGE = "usage.jsonl"
DECODE_WEIGHT = 2
"""The default cost (``scheduling.cost``): a prompt token costs 1, an output token 2."""
GRACE = 15
"""``--grace`` (seconds): far more than a running request takes (about 1 s, near 2 on a slow
machine), so that one cut on SIGTERM is the picker's fault, not the machine's pace."""


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("picker-restart")
    # One small server (room for about two of these requests): most of the load queues.
    with Stack(workdir, endpoints=1,
               server_args=["--kv-budget-tokens", "1024", "--step-ms", "15"],
               picker_args=["--grace", str(GRACE)],
               picker_config={"tenants": [{"id": "load"}, {"id": "after"}],
                              "metering": {"output": str(workdir / USAGE)}}) as running:
        yield running


def _records(stack: Stack, tenant: str) -> list[dict[str, Any]]:
    return usage_records(stack.workdir / USAGE, tenant)


def _cost(prompt: int, completion: int) -> int:
    return prompt + DECODE_WEIGHT * completion


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
    """The restarted picker serves tenant ``after`` and charges it exactly what it used, once."""
    status, _, answer = post(stack, "after", chat_body(max_tokens=AFTER_OUTPUT))
    assert status == 200, answer
    prompt, completion = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
    assert completion == AFTER_OUTPUT
    url = stack.metrics_url
    assert settled_metric(url, "fairway_service_tokens_total", AFTER_OUTPUT, tenant="after",
                          kind="completion") == AFTER_OUTPUT
    assert metric(url, "fairway_service_tokens_total", tenant="after", kind="prompt") == prompt
    assert metric(url, "fairway_weighted_service_total", tenant="after") == _cost(prompt,
                                                                                  completion)
    assert wait_until(lambda: len(_records(stack, "after")) == 1)
    (record,) = _records(stack, "after")
    assert (record["outcome"], record["prompt_tokens"], record["completion_tokens"],
            record["cost"]) == ("ok", prompt, completion, _cost(prompt, completion)), record
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
    # What the dead picker had settled before the kill (usually nothing: the kill comes before
    # the first request can finish) is all it ever wrote, each one a whole answer.
    cut = _records(stack, "load")
    assert len(cut) <= LOAD - len(refused), cut
    assert all(r["outcome"] == "ok" and r["completion_tokens"] == OUTPUT for r in cut), cut

    stack.restart_picker()
    # ``_served_after_restart`` also waits for the restarted picker's queued, running and
    # in-flight gauges to be 0 (the dead one's cannot be read).
    _served_after_restart(stack)
    # The restarted picker charges ``load`` nothing: it never saw the cut requests (no late
    # meter stream or retry reached it) and, memory backend, it did not inherit the dead one's
    # charges either, so nothing of theirs is counted twice (nor once again here).
    url = stack.metrics_url
    assert metric(url, "fairway_requests_total", tenant="load") == 0
    assert metric(url, "fairway_service_tokens_total", tenant="load") == 0
    assert metric(url, "fairway_weighted_service_total", tenant="load") == 0
    assert metric(url, "fairway_virtual_service", tenant="load") == 0
    assert metric(url, "fairway_meter_unclaimed_total") == 0
    assert _records(stack, "load") == cut


def test_sigterm_refuses_the_queued_and_lets_the_running_finish(stack: Stack) -> None:
    picker = stack.picker_process
    engine_before = engine_requests(stack)
    scrapes: list[ScrapesUntilExit] = []

    def term() -> None:
        # Started before the signal, so it is scraping all through the drain.
        scrapes.append(ScrapesUntilExit(stack, picker))
        os.killpg(picker.pid, signal.SIGTERM)

    seen = asyncio.run(_load_then(stack, term))
    ok = [s for s in seen if s[0] == 200]
    refused = [s for s in seen if s[0] != 200]
    assert ok and refused, [s[0] for s in seen]
    for status, headers, body in refused:
        assert_openai_error(status, headers, body, 503, "shutting_down", retryable=True)
    # The running ones were not cut: each got its whole answer within the grace.
    for _, _, body in ok:
        assert body["usage"]["completion_tokens"] == OUTPUT
    assert picker.wait(GRACE + 15) == 0
    (last,) = scrapes
    last.wait()
    # Only the requests that were answered reached the engine; the refused never did.
    assert engine_requests(stack) - engine_before == len(ok)

    # The draining picker was not ready any more. Whether it left anything in flight is its
    # last log line: its last metrics page may predate the last settlement, as the drain ends
    # and the picker exits within a few milliseconds of it (a scrape every 10 ms missed it).
    assert last.last, ("no scrape of the draining picker", last.pages, last.errors[-3:])
    assert last.value("fairway_ready") == 0
    assert "picker stopped, 0 requests left unsettled" in \
        (stack.workdir / "picker.log").read_text()
    # Per request, in the metering records: each answered one at its engine usage, each refused
    # one never sent and at 0.
    records = _records(stack, "load")
    assert len(records) == LOAD, records
    served = sorted((r["prompt_tokens"], r["completion_tokens"], r["cost"])
                    for r in records if r["outcome"] == "ok")
    assert served == sorted((b["usage"]["prompt_tokens"], OUTPUT,
                             _cost(b["usage"]["prompt_tokens"], OUTPUT)) for _, _, b in ok)
    dropped = [r for r in records if r["outcome"] != "ok"]
    assert len(dropped) == len(refused), records
    for record in dropped:
        assert record["outcome"] == "shutdown", record
        assert record["endpoint"] is None, record
        assert (record["prompt_tokens"], record["completion_tokens"], record["cost"]) == \
            (0, 0, 0), record

    stack.restart_picker()
    _served_after_restart(stack)
