"""Budgets that concurrency cannot outrun, through real Envoy and the simulated vLLM server
(issue 26, point 1).

The attack: a tenant with a 3,000-token burst budget sends 15 streams at once, each with
``max_tokens: 1000`` and ``ignore_eos`` (so each uses all of it). Each used to reserve its prompt
and the *expected* output (256), so 11 were admitted and 11,000 output tokens served (3.7x the
budget); the level stopped at -3,000 and the rest was forgiven. Now each reserves its worst case
(prompt + 1000): two are admitted, the rest get 429 with ``Retry-After``, the tenant is served
no more than its budget (plus what refill gave back meanwhile), and the level left is the
budget less everything served: nothing forgiven.

The variant of the report, 25 concurrent requests with ``min_tokens: 600`` and no
``max_tokens`` on a 5,000-token budget (15,200 tokens served), holds too: the simulated server
honours ``min_tokens`` (it is raised to it, as vLLM does), and a request without ``max_tokens``
is reserved at what the budget can pay, with that cap written into the body the engine reads.

``n: 8`` (the simulated server generates n choices, as vLLM does) is reserved as 8 choices, and
without ``max_tokens`` each choice is capped so that the 8 fit a full budget.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, wait_until
from tests.faults.helpers import CHAT, post, usage_records

USAGE = "usage.jsonl"
PER_S = 3600.0
"""Every budget refills over an hour: a few tokens a second, so what refill gives back while
a test runs is small beside a request, and it is counted in the bound all the same."""
BURST = 3000
FLOOR_BURST = 5000


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("overrun")
    per = f"{PER_S:g}s"
    config = {"tenants": [
                  {"id": "attacker", "budgets": {"burst": {"tokens": BURST, "per": per}}},
                  {"id": "floor", "budgets": {"burst": {"tokens": FLOOR_BURST, "per": per}}},
                  {"id": "expected", "budgets": {"burst": {"tokens": BURST, "per": per},
                                                 "reserve": "expected"}},
                  {"id": "choices", "budgets": {"burst": {"tokens": BURST, "per": per}}},
                  {"id": "uncapped", "budgets": {"burst": {"tokens": BURST, "per": per}}}],
              "metering": {"output": str(workdir / USAGE)}}
    # A big cache, so the engine could run every stream at once: only the budget stops them.
    with Stack(workdir, endpoints=1, picker_config=config,
               server_args=["--step-ms", "1", "--kv-budget-tokens", "131072"]) as running:
        yield running


async def _stream(session: aiohttp.ClientSession, stack: Stack, tenant: str, body: bytes
                  ) -> tuple[int, dict[str, str], int]:
    """One streamed request: its status, headers and the completion tokens its last usage
    chunk reported (0 when refused)."""
    async with session.post(stack.gateway_url + CHAT, data=body, headers={
            TENANT_HEADER: tenant, "content-type": "application/json"}) as response:
        raw = await response.read()
        headers = {k.lower(): v for k, v in response.headers.items()}
        completion = 0
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: "):]).get("usage")
                if usage:
                    completion = usage["completion_tokens"]
        return response.status, headers, completion


async def _at_once(stack: Stack, tenant: str, body: bytes, count: int
                   ) -> list[tuple[int, dict[str, str], int]]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(_stream(session, stack, tenant, body)
                                      for _ in range(count)))


def _served(stack: Stack, tenant: str, count: int) -> list[dict[str, Any]]:
    """The tenant's metering records once all ``count`` served requests are settled."""
    path = stack.workdir / USAGE
    assert wait_until(lambda: len(usage_records(path, tenant)) >= count, 15.0)
    return usage_records(path, tenant)


def _level(stack: Stack, tenant: str) -> float:
    return metric(stack.metrics_url, "fairway_budget_remaining_tokens", tenant=tenant,
                  window="burst")


def _attack(stack: Stack, tenant: str, budget: int, body: bytes, count: int, *,
            one_worst_case: int = 0
            ) -> tuple[list[tuple[int, dict[str, str], int]], list[dict[str, Any]], float]:
    """``count`` of ``body`` at once from ``tenant``: what it was served is within its budget,
    refill and ``one_worst_case`` (0 with worst-case reservation), and the level left says so."""
    started = time.monotonic()
    answers = asyncio.run(_at_once(stack, tenant, body, count))
    ok = [a for a in answers if a[0] == 200]
    records = _served(stack, tenant, len(ok))
    elapsed = time.monotonic() - started
    assert {a[0] for a in answers} <= {200, 429}, [a[0] for a in answers]
    for status, headers, _ in answers:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
    # The records are the engine's own counts, as the streams reported them.
    assert sorted(r["completion_tokens"] for r in records) == sorted(a[2] for a in ok)
    served = sum(r["prompt_tokens"] + r["completion_tokens"] for r in records)
    refill = budget / PER_S * elapsed
    assert served <= budget + refill + one_worst_case, (served, budget, refill, len(ok))
    # The level left is the whole charge: the budget less all that was served, plus refill
    # since (no floor forgave any of it).
    left = _level(stack, tenant)
    assert budget - served - 1 <= left <= budget - served + refill + 1, (left, served)
    return answers, records, served


def test_fifteen_concurrent_streams_of_max_tokens_1000_get_no_more_than_the_budget(
        stack: Stack) -> None:
    body = chat_body(words=8, max_tokens=1000, stream=True,
                     stream_options={"include_usage": True})
    answers, records, _ = _attack(stack, "attacker", BURST, body, 15)
    ok = [a for a in answers if a[0] == 200]
    # Each may use its prompt + 1000: two fit in 3,000 (before: 11 and 11,000 output tokens).
    assert len(ok) == 2, [a[0] for a in answers]
    assert all(r["completion_tokens"] == 1000 for r in records)  # ignore_eos: used in full
    assert sum(r["completion_tokens"] for r in records) == 2000 <= BURST


def test_min_tokens_without_max_tokens_is_capped_at_what_the_budget_can_pay(
        stack: Stack) -> None:
    """25 concurrent requests with ``min_tokens: 600`` and no ``max_tokens`` on a 5,000 budget
    (before: 15,200 tokens served). A request without a cap is reserved at what a full budget
    can pay, and that cap is written into its body: one is served at a time."""
    body = json.dumps({"model": "sim-model", "stream": True, "min_tokens": 600,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": "tell me a long story"}]}
                      ).encode()
    answers, records, _ = _attack(stack, "floor", FLOOR_BURST, body, 25)
    ok = [a for a in answers if a[0] == 200]
    assert len(ok) == 1, [a[0] for a in answers]
    assert 600 <= records[0]["completion_tokens"] <= FLOOR_BURST


def test_reserve_expected_overshoots_by_at_most_one_worst_case_and_owes_it(
        stack: Stack) -> None:
    """The documented alternative, the same attack: each request reserves its prompt and the
    expected output (256) and is admitted while the worst case of those in flight fits the
    level, so three are served, one request's worst case at most over the budget, and the
    level left is negative by what they overshot: owed, not forgiven."""
    body = chat_body(words=8, max_tokens=1000, stream=True,
                     stream_options={"include_usage": True})
    answers, _, served = _attack(stack, "expected", BURST, body, 15,
                                  one_worst_case=1000 + 64)
    assert sum(a[0] == 200 for a in answers) == 3, [a[0] for a in answers]
    assert served > BURST and _level(stack, "expected") < 0


def test_n_choices_are_reserved_as_n_and_capped_to_what_the_budget_can_pay(
        stack: Stack) -> None:
    """``n: 8`` was charged as 8 choices but admitted and reserved as one. Now it is reserved
    as 8 (the rate-limit headers of its answer show it), and without ``max_tokens`` each choice
    is capped so that the 8 fit the budget: the engine, which generates all 8, is sent that cap.
    """
    status, headers, body = post(stack, "choices", chat_body(words=8, max_tokens=100, n=8))
    assert status == 200, body
    assert len(body["choices"]) == 8
    assert body["usage"]["completion_tokens"] == 800
    remaining = int(headers["x-ratelimit-remaining-tokens"])  # as reserved, at dispatch
    assert BURST - 800 - 64 <= remaining <= BURST - 800 - 1
    (record,) = _served(stack, "choices", 1)
    spent = record["prompt_tokens"] + record["completion_tokens"]
    assert wait_until(lambda: _level(stack, "choices") <= BURST - spent + 1)
    # Without max_tokens its 8 choices may take a whole budget: they wait for a full one.
    body_n = json.dumps({"model": "sim-model", "n": 8, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "write"}]}).encode()
    status, headers, refusal = post(stack, "choices", body_n)
    assert status == 429 and int(headers["retry-after"]) >= 1, refusal
    # On a full budget each choice is capped at (budget - prompt) // 8, and uses all of it.
    status, _, answer = post(stack, "uncapped", body_n)
    assert status == 200, answer
    assert len(answer["choices"]) == 8
    used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    assert answer["usage"]["completion_tokens"] % 8 == 0
    assert BURST - 64 <= used <= BURST  # a full budget's worth, no more
