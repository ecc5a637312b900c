"""``state.backend: redis`` through real Envoy, a real picker process and a real ``redis-server``:
a picker SIGKILLed and restarted keeps every tenant's budget level and counter (a tenant that
spent its burst budget stays refused), and Redis killed for 30 s under load loses no request,
wedges nothing, and afterwards holds exactly what was charged (nothing twice)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis

from picker.stack.launcher import Stack
from picker.stack.redis import RedisServer
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, wait_until
from tests.faults.helpers import apost, gauges_drain, post

BURST = 6000
"""Tokens; refilled over 24 h, so a few seconds of a test refill a few hundredths of a token."""
LARGE_BURST = 1_000_000
"""Tokens, refilled over 30 days (0.39 a second): what the outage's load never exhausts."""
OUTAGE_SECONDS = 30.0


@pytest.fixture
def shared(request: pytest.FixtureRequest, tmp_path: Path
           ) -> Iterator[tuple[Stack, RedisServer]]:
    tokens, per = request.param
    with RedisServer(tmp_path / "redis", aof=True) as store, \
            Stack(tmp_path / "stack", endpoints=1, server_args=["--step-ms", "2"],
                  picker_config={
                      "tenants": [{"id": "a", "budgets": {"burst": {"tokens": tokens,
                                                                    "per": per}}}],
                      "state": {"backend": "redis", "redis": {"url": store.url},
                                "syncInterval": "50ms", "maxStaleness": "500ms"}}) as stack:
        yield stack, store


def _url(shared: tuple[Stack, RedisServer]) -> str:
    return shared[1].url


def _level(stack: Stack) -> float:
    return metric(stack.metrics_url, "fairway_budget_remaining_tokens", tenant="a",
                  window="burst")


def _level_in_redis(store: RedisServer) -> float:
    """Tenant a's burst level as Redis holds it (its refill since is a few hundredths)."""
    client = redis.Redis(port=store.port, decode_responses=True)
    try:
        stored = client.hget("{fairway}:budgets", "a\x1fburst")
    finally:
        client.close()
    return float(BURST) if stored is None else float(stored.split()[0])


def _counter_in_redis(store: RedisServer) -> float:
    client = redis.Redis(port=store.port, decode_responses=True)
    try:
        return float(client.hget("{fairway}:counters", "default\x1fa") or 0.0)
    finally:
        client.close()


@pytest.mark.parametrize("shared", [(BURST, "24h")], indirect=True)
def test_a_restarted_picker_keeps_the_budget_a_tenant_spent(
        shared: tuple[Stack, RedisServer]) -> None:
    stack, store = shared
    for _ in range(200):
        status, _, answer = post(stack, "a", chat_body(words=200, max_tokens=40))
        if status == 429:
            break
        assert status == 200, answer
    assert status == 429 and answer["error"]["code"] == "rate_limit_exceeded", answer
    before = _level(stack)
    assert before < 0.2 * BURST
    # Everything charged reaches Redis within a few exchanges (waited for, not slept: on a loaded
    # machine an exchange can take longer than its interval); a SIGKILL loses what has not.
    assert wait_until(lambda: abs(_level_in_redis(store) - before) < 1.0, 10), \
        (before, _level_in_redis(store))
    stack.restart_picker()  # SIGKILL, then a new process
    after = _level(stack)
    assert after == pytest.approx(before, abs=0.02 * BURST), (before, after)
    status, _, answer = post(stack, "a", chat_body(words=200, max_tokens=40))
    assert status == 429, (before, after, answer)  # a fresh budget would have let it through
    assert _counter_in_redis(store) > 0


async def _load(stack: Stack, until: float) -> list[int]:
    """Four clients each sending a request every 20 ms or so until ``until``; every status
    seen."""
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async def client() -> None:
            while time.monotonic() < until:
                status, _, _ = await apost(session, stack, "a", chat_body(words=20,
                                                                          max_tokens=8))
                statuses.append(status)
                await asyncio.sleep(0.02)
        await asyncio.gather(*(client() for _ in range(4)))
    return statuses


@pytest.mark.parametrize("shared", [(LARGE_BURST, "720h")], indirect=True)
def test_redis_killed_for_30s_under_load_loses_nothing_and_charges_nothing_twice(
        shared: tuple[Stack, RedisServer]) -> None:
    stack, store = shared

    async def scenario() -> list[int]:
        nonlocal start
        start = time.monotonic()
        load = asyncio.create_task(_load(stack, start + OUTAGE_SECONDS + 6))
        await asyncio.sleep(2)
        store.kill()
        assert await asyncio.to_thread(wait_until, lambda: metric(
            stack.metrics_url, "fairway_state_backend_up") == 0, 5)
        await asyncio.sleep(OUTAGE_SECONDS)
        await asyncio.to_thread(store.start)  # AOF: it comes back with what it had
        assert await asyncio.to_thread(wait_until, lambda: metric(
            stack.metrics_url, "fairway_state_backend_up") == 1, 5)
        return await load

    start = 0.0
    statuses = asyncio.run(scenario())
    assert len(statuses) > 100 and set(statuses) == {200}, sorted(set(statuses))
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained
    time.sleep(0.3)  # the last exchanges
    # One tenant alone in its lane is never lifted: its counter is exactly its weighted service,
    # and its budget spent exactly its tokens. A batch applied twice would show in both.
    service = metric(stack.metrics_url, "fairway_weighted_service_total", tenant="a")
    tokens = (metric(stack.metrics_url, "fairway_service_tokens_total", tenant="a",
                     kind="prompt")
              + metric(stack.metrics_url, "fairway_service_tokens_total", tenant="a",
                       kind="completion"))
    assert _counter_in_redis(store) == pytest.approx(service, rel=1e-6)
    refilled = LARGE_BURST / (720 * 3600) * (time.monotonic() - start)
    assert LARGE_BURST - _level(stack) == pytest.approx(tokens - refilled, abs=5)
    assert metric(stack.metrics_url, "fairway_state_syncs_total", result="error") > 0


@pytest.mark.parametrize("shared", [(LARGE_BURST, "720h")], indirect=True)
def test_shares_over_a_run_with_a_picker_restart_follow_the_weights(
        shared: tuple[Stack, RedisServer]) -> None:
    # Backlogged tenants weighted 1:2:3 (the stack's config gives "a" only a budget; these get
    # their weights through a config rewrite), the picker SIGKILLed and restarted halfway: the
    # counters it loads keep the shares of the whole run, as measured by the clients.
    stack, _ = shared
    weights = {"w1": 1, "w2": 2, "w3": 3}
    stack.write_picker_config({"tenants": [{"id": t, "weight": w} for t, w in weights.items()],
                               "state": {"backend": "redis", "redis": {"url": _url(shared)},
                                         "syncInterval": "50ms", "maxStaleness": "500ms"}})
    stack.restart_picker()  # the new tenants from the start
    served = dict.fromkeys(weights, 0)

    async def tenant(session: aiohttp.ClientSession, name: str, since: float,
                     until: float) -> None:
        async def one_after_another() -> None:
            while time.monotonic() < until:
                sent = time.monotonic()
                async with session.post(stack.gateway_url + "/v1/chat/completions",
                                        data=chat_body(words=200, max_tokens=60), headers={
                                            TENANT_HEADER: name,
                                            "content-type": "application/json"}) as response:
                    answer = await response.json()
                    if response.status != 200:
                        await asyncio.sleep(0.05)  # the picker is restarting: retry
                    elif sent >= since:  # past the start's transient (every queue filling)
                        usage = answer["usage"]
                        served[name] += usage["prompt_tokens"] + 2 * usage["completion_tokens"]
        await asyncio.gather(*(one_after_another() for _ in range(30)))

    async def scenario() -> None:
        start = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            load = asyncio.gather(*(tenant(session, name, start + 3, start + 16)
                                    for name in weights))
            await asyncio.sleep(8)
            await asyncio.to_thread(stack.restart_picker)
            await load

    asyncio.run(scenario())
    total = sum(served.values())
    for name, weight in weights.items():
        assert served[name] / total == pytest.approx(weight / 6, rel=0.05), served
