"""``state.backend: redis`` against a real ``redis-server`` on 127.0.0.1: pickers (the real
``Dispatcher`` and ``RedisSync``, in this process) share counters and budgets, a restarted
picker resumes, a batch whose reply was lost is applied once, and Redis going away is a mode:
fail soft or fail closed, then re-join without charging anything twice."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from picker.config.schema import load_config
from picker.core import Request
from picker.core.admission import Admitted
from picker.dispatch import Dispatcher
from picker.errors import StateUnavailable
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest
from picker.stack.redis import RedisServer
from picker.state import RedisSync

pytestmark = pytest.mark.integration

BURST = 10_000
#: Over which a's budget refills: so long that refill is nil during a test (10 tokens an hour).
REFILL = "1000h"
#: A picker counts Redis as away after this. Long where a test is not about that: the Redis
#: client's timeouts are half of it (at most 1 s), and a loaded machine can take 0.25 s to answer.
SLOW_TO_STALE = "5s"
#: For the tests of Redis going away: they wait this long to see it counted as away.
STALE = "1s"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


def _config(url: str, **state: Any) -> Any:
    return load_config({
        "tenants": [{"id": "a", "budgets": {"burst": {"tokens": BURST, "per": REFILL}}},
                    {"id": "b", "weight": 2}],
        "endpoints": [{"address": "127.0.0.1:1"}],
        "state": {"backend": "redis", "syncInterval": "50ms", "maxStaleness": SLOW_TO_STALE,
                  **state, "redis": {"url": url, **state.pop("redis", {})}},
    })


class Picker:
    def __init__(self, url: str, **state: Any) -> None:
        config = _config(url, **state)
        self.metrics = PickerMetrics()
        self.dispatcher = Dispatcher(config, metrics=self.metrics)
        self.sync = RedisSync(self.dispatcher, config.state, self.metrics)

    @property
    def scheduler(self) -> Any:
        return self.dispatcher.gate.scheduler

    @property
    def admission(self) -> Any:
        return self.dispatcher.gate.admission

    def serve(self, tenant: str, prompt: int) -> None:
        request = Request(tenant, prompt)
        self.scheduler.enqueue(request, 0.0)
        self.scheduler.dispatch(request, 0.0)
        self.scheduler.finish(request)

    def spend(self, tenant: str, tokens: int) -> None:
        now = self.dispatcher.clock()
        admitted = self.admission.admit(tenant, "default", tokens, 0, 0, now)
        assert isinstance(admitted, Admitted)
        self.admission.finish(admitted.reservation, tokens, now)

    def level(self, tenant: str) -> float:
        state = self.admission.budget_state(self.dispatcher.clock())
        return state.get(tenant, {"burst": (float(BURST), BURST)})["burst"][0]

    def metric(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels or None)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def picker(url: str, **state: Any) -> AsyncIterator[Picker]:
    one = Picker(url, **state)
    try:
        yield one
    finally:
        with contextlib.suppress(Exception):
            await one.sync.client.aclose()


async def test_two_pickers_see_each_other_s_charges(redis_server: RedisServer) -> None:
    async with picker(redis_server.url) as one, picker(redis_server.url) as two:
        one.serve("a", 300)
        two.serve("a", 200)
        two.serve("b", 100)
        one.spend("a", 3000)
        two.spend("a", 1000)
        for side in (one, two, one):
            await side.sync.exchange()
        for side in (one, two):
            assert side.scheduler.counter("a") == pytest.approx(500.0)
            # lifted to a's counter on two (200), then 100 at weight 2
            assert side.scheduler.counter("b") == pytest.approx(200 + 100 / 2)
            assert side.level("a") == pytest.approx(BURST - 4000, abs=1)


async def test_a_debt_deeper_than_the_capacity_is_kept_by_the_store(
        redis_server: RedisServer) -> None:
    """No floor forgives a debt (issue 26): the sync script keeps a level far below minus the
    capacity, and another picker sees all of it."""
    async with picker(redis_server.url) as one, picker(redis_server.url) as two:
        one.spend("a", 3 * BURST)  # a prompt three budgets long, admitted on a full bucket
        for side in (one, two):
            await side.sync.exchange()
        for side in (one, two):
            assert side.level("a") == pytest.approx(-2 * BURST, abs=1)


async def test_a_restarted_picker_resumes_with_the_levels_it_had(
        redis_server: RedisServer) -> None:
    async with picker(redis_server.url) as before:
        before.serve("a", 700)
        before.spend("a", 9000)
        await before.sync.exchange()
        level, counter = before.level("a"), before.scheduler.counter("a")
    async with picker(redis_server.url) as after:
        assert after.level("a") == BURST  # a fresh process knows nothing
        assert await after.sync.load(asyncio.Event())
        assert after.level("a") == pytest.approx(level, abs=1)
        assert after.scheduler.counter("a") == pytest.approx(counter)
        refused = after.admission.admit("a", "default", 2000, 0, 0, after.dispatcher.clock())
        assert not isinstance(refused, Admitted)


async def test_a_restarted_picker_keeps_what_tenants_taught_it(
        redis_server: RedisServer) -> None:
    async with picker(redis_server.url) as before:
        estimates = before.dispatcher.gate.estimates
        now = before.dispatcher.clock()
        estimates.learn_output("a", 900, now)
        estimates.learn_output("a", 900, now, stream=True)
        estimates.learn_prompt("a", "m", 1000, 3000, now)
        await before.sync.exchange()
    async with picker(redis_server.url) as after:
        assert await after.sync.load(asyncio.Event())
        estimates, now = after.dispatcher.gate.estimates, after.dispatcher.clock()
        assert estimates.output("a", now) == 900.0
        assert estimates.output("a", now, stream=True) == pytest.approx(256 + 0.5 * (900 - 256))
        assert estimates.prompt_scale("a", "m", now) == pytest.approx(3.0)


async def test_a_batch_whose_reply_was_lost_is_applied_once(redis_server: RedisServer) -> None:
    async with picker(redis_server.url) as one, picker(redis_server.url) as two:
        one.serve("a", 100)
        one.spend("a", 1000)
        await one.sync.exchange()
        one.serve("a", 40)
        one.spend("a", 400)
        # The batch reaches Redis, the reply is lost (a timeout): the sync re-sends it as is.
        original = one.sync._script
        calls = 0

        async def reply_lost(**kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            await original(**kwargs)
            if calls == 1:
                raise TimeoutError("reply lost")
            return await original(**kwargs)

        one.sync._script = reply_lost
        assert not await one.sync._try()
        assert await one.sync._try()
        await two.sync.exchange()
        assert two.scheduler.counter("a") == pytest.approx(140.0)
        assert two.level("a") == pytest.approx(BURST - 1400, abs=1)


async def test_pickers_of_two_pools_do_not_mix(redis_server: RedisServer) -> None:
    async with picker(redis_server.url, redis={"keyPrefix": "pool-x"}) as x, \
            picker(redis_server.url, redis={"keyPrefix": "pool-y"}) as y:
        x.serve("a", 100)
        await x.sync.exchange()
        await y.sync.exchange()
        assert y.scheduler.counter("a") == 0.0


async def test_a_password_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    with RedisServer(tmp_path / "redis", password="s3cret") as server:
        async with picker(server.url, redis={"passwordFile": str(secret)}) as one:
            assert await one.sync._try()
        async with picker(server.url) as anonymous:
            assert not await anonymous.sync._try()  # NOAUTH: counted, not raised
            assert anonymous.metric("fairway_state_syncs_total", result="error") == 1


async def _until(predicate: Any, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("aof", [True, False], ids=["redis-kept-its-data", "redis-came-back-empty"])
async def test_redis_down_fails_soft_and_rejoins_without_charging_twice(
        tmp_path: Path, aof: bool) -> None:
    with RedisServer(tmp_path / "redis", aof=aof) as server:
        async with picker(server.url, maxStaleness=STALE) as one, \
                picker(server.url, maxStaleness=STALE) as two:
            stop = asyncio.Event()
            loops = [asyncio.create_task(side.sync.run(stop)) for side in (one, two)]
            one.serve("a", 100)
            one.spend("a", 1000)
            await _until(lambda: two.scheduler.counter("a") == 100.0)
            server.kill()
            one.serve("a", 50)  # while Redis is away
            one.spend("a", 500)
            two.serve("a", 30)
            await _until(lambda: one.metric("fairway_state_backend_up") == 0)
            assert not one.dispatcher.state_unavailable  # fail soft: still serving
            assert one.scheduler.counter("a") == pytest.approx(150.0)  # its own view
            server.start()
            await _until(lambda: one.metric("fairway_state_backend_up") == 1
                         and two.metric("fairway_state_backend_up") == 1)
            await _until(lambda: one.scheduler.counter("a") == pytest.approx(180.0)
                         and two.scheduler.counter("a") == pytest.approx(180.0))
            await asyncio.sleep(0.3)  # more exchanges: still nothing counted twice
            for side in (one, two):
                assert side.scheduler.counter("a") == pytest.approx(180.0)
                assert side.level("a") == pytest.approx(BURST - 1500, abs=1)
            stop.set()
            await asyncio.gather(*loops)


async def test_redis_down_fails_closed_when_asked(redis_server: RedisServer) -> None:
    async with picker(redis_server.url, onUnavailable="failClosed", maxStaleness=STALE) as one:
        stop = asyncio.Event()
        loop = asyncio.create_task(one.sync.run(stop))
        await _until(lambda: one.metric("fairway_state_syncs_total", result="ok") >= 1)
        redis_server.kill()
        await _until(lambda: one.dispatcher.state_unavailable)
        with pytest.raises(StateUnavailable) as refused:
            await one.dispatcher.admit("a", InferenceRequest(
                model="m", prompt_tokens=5, max_tokens=5, stream=False, include_usage=False,
                body={}))
        assert refused.value.http_status == 503
        redis_server.start()
        await _until(lambda: not one.dispatcher.state_unavailable)
        stop.set()
        await loop


async def test_a_picker_that_cannot_reach_redis_at_start_starts_as_configured(
        tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    url = server.url
    server.stop()  # nothing listens there
    async with picker(url, maxStaleness=STALE) as soft, \
            picker(url, onUnavailable="failClosed", maxStaleness=STALE) as closed:
        assert not await soft.sync.load(asyncio.Event())
        assert not soft.dispatcher.state_unavailable
        assert not await closed.sync.load(asyncio.Event())
        assert closed.dispatcher.state_unavailable
        assert soft.metric("fairway_state_backend_up") == 0


async def test_a_reservation_in_redis_is_all_of_the_tenant_s_budgets_or_none(
        redis_server: RedisServer) -> None:
    async with picker(redis_server.url) as one, picker(redis_server.url) as two:
        assert await one.sync.reserve("a", 6000) == (True, "", 0.0)  # absent means full
        answer = await two.sync.reserve("a", 6000)  # 4,000 left: refused, the level told
        assert answer is not None and answer[0] is False and answer[1] == "burst"
        assert answer[2] == pytest.approx(BURST - 6000, abs=1)
        assert await two.sync.reserve("a", 3000) == (True, "", 0.0)
        await one.sync.exchange()
        assert one.level("a") == pytest.approx(BURST - 9000, abs=1)  # both reservations


async def test_a_reservation_when_redis_is_away_is_left_to_the_picker(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    url = server.url
    server.stop()
    async with picker(url) as one:
        assert await one.sync.reserve("a", 100) is None


async def test_state_shared_over_tls_verified_against_a_ca_file(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis", tls=True) as server:
        assert server.url.startswith("rediss://")
        async with picker(server.url, redis={"caFile": str(server.ca_file)}) as one, \
                picker(server.url, redis={"caFile": str(server.ca_file)}) as two:
            one.serve("a", 100)
            assert await one.sync._try()
            assert await two.sync._try()
            assert two.scheduler.counter("a") == pytest.approx(100.0)
        async with picker(server.url) as unverified:  # the system's CAs do not know it
            assert not await unverified.sync._try()
