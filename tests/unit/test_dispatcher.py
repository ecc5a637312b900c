"""The asyncio dispatcher: holding requests until an endpoint has room, in fair order, and the
accounting around them (endpoint in-flight tokens, charges, settlement, metrics)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from picker.config.schema import PickerConfig, load_config
from picker.core import Usage
from picker.dispatch import Dispatcher, Ticket
from picker.errors import NoEndpoint, QueueFull, QueueTimeout, ShuttingDown
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
LANE = "default"


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _config(endpoints: Iterable[str] = (A,), *, budget: int | str = 1000,
            tenants: Iterable[dict[str, Any]] = (), policy: str = "vtc",
            **sections: dict[str, Any]) -> PickerConfig:
    data: dict[str, Any] = {
        "endpoints": [{"address": a} for a in endpoints],
        "capacity": {"kvBudgetTokens": budget, **sections.pop("capacity", {})},
        "scheduling": {"policy": policy},
        "tenants": list(tenants),
        **sections,
    }
    return load_config(data)


def _dispatcher(config: PickerConfig, clock: FakeClock | None = None) -> Dispatcher:
    metrics = PickerMetrics(CollectorRegistry())
    return Dispatcher(config, clock=clock or FakeClock(), metrics=metrics)


def _request(prompt: int = 100, *, stream: bool = True,
             max_tokens: int | None = None) -> InferenceRequest:
    return InferenceRequest(model="m", prompt_tokens=prompt, max_tokens=max_tokens, stream=stream,
                            include_usage=stream, body={})


def _sample(d: Dispatcher, name: str, **labels: str) -> float:
    value = d.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def _spin(rounds: int = 5) -> None:
    """Let tasks that are ready run (enqueue, or wake after dispatch)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def _admit(d: Dispatcher, tenant: str, request: InferenceRequest,
                 subset: frozenset[str] | None = None) -> Ticket:
    """Admit a request that should be dispatched at once (fails instead of hanging)."""
    return await asyncio.wait_for(d.admit(tenant, request, subset), 1.0)


async def _hold(d: Dispatcher, tenant: str, prompt: int = 100,
                **request: Any) -> asyncio.Task[Ticket]:
    """Start an admit and let it reach the queue (or be dispatched)."""
    task = asyncio.create_task(d.admit(tenant, _request(prompt, **request)))
    await _spin()
    return task


# -- dispatching --

async def test_request_is_dispatched_at_once_when_an_endpoint_has_room() -> None:
    d = _dispatcher(_config([A]))
    ticket = await _admit(d, "a", _request(100))
    assert ticket.destinations == [A]
    assert ticket.endpoint is d.endpoints[A]
    assert ticket.dispatched_at is not None
    assert d.endpoints[A].inflight_tokens == 100
    assert d.endpoints[A].inflight_requests == 1
    assert d.busy == 1


@pytest.mark.parametrize(("fallbacks", "expected"), [(0, [B]), (2, [B, D, C])])
async def test_destinations_name_the_least_loaded_first_and_the_configured_fallbacks(
        fallbacks: int, expected: list[str]) -> None:
    d = _dispatcher(_config([A, B, C, D], routing={"fallbackEndpoints": fallbacks}))
    d.endpoints[A].inflight_tokens = 400
    d.endpoints[B].inflight_tokens = 100
    d.endpoints[C].inflight_tokens = 300
    d.endpoints[D].inflight_tokens = 200
    ticket = await _admit(d, "a", _request(50))
    assert ticket.destinations == expected
    assert ticket.endpoint is d.endpoints[B]
    assert d.endpoints[B].inflight_tokens == 150


async def test_the_served_endpoint_takes_over_the_accounting_of_the_primary() -> None:
    d = _dispatcher(_config([A, B]))
    ticket = await _admit(d, "a", _request(100))
    primary = ticket.endpoint
    assert primary is not None
    other = d.endpoints[B if primary.address == A else A]
    d.served_by(ticket, other.address)
    assert (primary.inflight_tokens, primary.inflight_requests) == (0, 0)
    assert (other.inflight_tokens, other.inflight_requests) == (100, 1)
    d.served_by(ticket, "10.1.1.1:80")  # not an endpoint of the pool: ignored
    assert ticket.endpoint is other
    d.complete(ticket, None, "ok")
    assert other.inflight_tokens == other.inflight_requests == 0


async def test_requests_are_held_while_every_endpoint_is_full() -> None:
    d = _dispatcher(_config([A, B], budget=100))
    first = await _admit(d, "a", _request(100))
    second = await _admit(d, "a", _request(100))
    assert {first.destinations[0], second.destinations[0]} == {A, B}
    held = await _hold(d, "b")
    assert not held.done()
    assert d.scheduler.queued() == 1
    d.complete(first, None, "ok")
    await _spin()
    assert held.done()
    assert held.result().destinations[0] == first.destinations[0]


async def test_held_requests_are_released_in_vtc_order_as_capacity_frees() -> None:
    d = _dispatcher(_config([A], budget=100))
    running = await _admit(d, "a", _request(100))
    tasks = [await _hold(d, "a") for _ in range(3)] + [await _hold(d, "b")]
    order: list[str] = []
    while len(order) < 4:
        d.complete(running, Usage(100, 0), "ok")
        await _spin()
        done = [t for t in tasks if t.done()]
        assert len(done) == 1, "exactly one held request goes per completion"
        tasks.remove(done[0])
        running = done[0].result()
        order.append(running.tenant)
    # First come first served would give a, a, a, b: VTC lets b in after a's first.
    assert order == ["a", "b", "a", "a"]


async def test_weights_one_to_two_give_a_one_to_two_dispatch_ratio() -> None:
    config = _config([A], budget=100, tenants=[{"id": "a", "weight": 1}, {"id": "b", "weight": 2}])
    d = _dispatcher(config)
    running = await _admit(d, "a", _request(100))
    tasks = []
    for _ in range(30):
        tasks.append(await _hold(d, "a"))
        tasks.append(await _hold(d, "b"))
    dispatched: list[str] = []
    for _ in range(30):
        d.complete(running, Usage(100, 50), "ok")
        await _spin()
        done = [t for t in tasks if t.done()]
        assert len(done) == 1
        tasks.remove(done[0])
        running = done[0].result()
        dispatched.append(running.tenant)
    assert abs(dispatched.count("a") - 10) <= 1
    assert abs(dispatched.count("b") - 20) <= 1
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_queue_full_is_refused_at_once() -> None:
    d = _dispatcher(_config([A], budget=100, queue={"maxQueued": 2}))
    await _admit(d, "a", _request(100))
    held = [await _hold(d, "a"), await _hold(d, "b")]
    with pytest.raises(QueueFull):
        await _admit(d, "c", _request(10))
    assert d.scheduler.queued() == 2
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)


async def test_queue_timeout_leaves_the_scheduler_and_does_not_charge_the_tenant() -> None:
    d = _dispatcher(_config([A], budget=100, queue={"maxWait": "50ms"},
                            tenants=[{"id": "a"}, {"id": "late"}]))
    await _admit(d, "a", _request(100))
    with pytest.raises(QueueTimeout) as caught:
        await asyncio.wait_for(d.admit("late", _request(100)), 2.0)
    assert caught.value.http_status == 503 and caught.value.retry_after
    assert d.scheduler.queued() == 0
    assert d.busy == 1
    assert d.scheduler.service.get("late", 0.0) == 0.0
    assert _sample(d, "fairway_requests_total", tenant="late", lane=LANE,
                   outcome="queue_timeout") == 1
    # Counted as a rejection by whoever refuses it to the client (ext_proc calls reject()).
    assert _sample(d, "fairway_rejections_total", tenant="late", reason="queue_timeout") == 0


async def test_cancel_while_queued_removes_the_request_uncharged() -> None:
    d = _dispatcher(_config([A], budget=100, tenants=[{"id": "a"}, {"id": "b"}]))
    running = await _admit(d, "a", _request(100))
    held = await _hold(d, "b")
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert d.scheduler.queued() == 0
    assert d.busy == 1
    assert d.scheduler.service.get("b", 0.0) == 0.0
    assert _sample(d, "fairway_requests_total", tenant="b", lane=LANE, outcome="cancelled") == 1
    d.complete(running, None, "ok")
    assert d.endpoints[A].inflight_tokens == 0


async def test_cancel_after_dispatch_settles_to_what_was_delivered() -> None:
    # The client went away mid-stream: the exchange completes the ticket as cancelled.
    d = _dispatcher(_config([A], budget=100, tenants=[{"id": "a"}, {"id": "b"}]))
    ticket = await _admit(d, "b", _request(100))
    held = await _hold(d, "a", 50)
    d.on_output_tokens(ticket, 4)
    assert not held.done()
    d.complete(ticket, None, "cancelled")
    assert d.busy == 1  # only the request it made room for
    assert d.scheduler.service["b"] == 100 + 2 * 4
    assert _sample(d, "fairway_requests_total", tenant="b", lane=LANE, outcome="cancelled") == 1
    assert _sample(d, "fairway_weighted_service_total", tenant="b", lane=LANE) == 108
    await _spin()
    assert held.done()
    assert d.endpoints[A].inflight_tokens == 50
    assert d.endpoints[A].inflight_requests == 1


async def test_pass_through_never_holds_even_when_full() -> None:
    d = _dispatcher(_config([A, B], budget=100, policy="fcfs"))
    assert not d.holding
    tickets = [await _admit(d, "a", _request(100)) for _ in range(6)]
    assert all(t.dispatched_at is not None for t in tickets)
    assert d.scheduler.queued() == 0
    assert d.endpoints[A].inflight_tokens + d.endpoints[B].inflight_tokens == 600
    for ticket in tickets:
        d.complete(ticket, None, "ok")
    assert d.endpoints[A].inflight_tokens == d.endpoints[B].inflight_tokens == 0


# -- accounting --

async def test_streamed_output_charges_and_grows_then_complete_releases_what_was_reserved() -> None:
    d = _dispatcher(_config([A], budget=10_000))
    ticket = await _admit(d, "a", _request(100, stream=True))
    assert d.scheduler.service["a"] == 100.0  # the prompt, at dispatch
    d.on_output_tokens(ticket, 3)
    d.on_output_tokens(ticket, 2)
    assert d.endpoints[A].inflight_tokens == 105
    assert ticket.reserved_tokens == 105
    assert d.scheduler.service["a"] == 100.0 + 2.0 * 5
    d.complete(ticket, None, "ok")
    assert d.endpoints[A].inflight_tokens == 0
    assert d.endpoints[A].inflight_requests == 0
    assert d.scheduler.service["a"] == 110.0
    d.on_output_tokens(ticket, 4)  # after completion: ignored
    d.complete(ticket, None, "ok")  # again: nothing
    assert d.endpoints[A].inflight_tokens == 0
    assert d.scheduler.service["a"] == 110.0


async def test_non_streaming_reserves_default_output_capped_by_max_tokens() -> None:
    d = _dispatcher(_config([A], budget=10_000, capacity={"defaultOutputTokens": 50}))
    capped = await _admit(d, "a", _request(100, stream=False, max_tokens=20))
    assert capped.reserved_tokens == 120
    assert d.scheduler.service["a"] == 100.0 + 2.0 * 20  # the estimate is charged up front
    uncapped = await _admit(d, "b", _request(100, stream=False))
    assert uncapped.reserved_tokens == 150
    assert d.endpoints[A].inflight_tokens == 270
    d.on_output_tokens(uncapped, 5)  # non-streaming: the footprint was reserved already
    assert d.endpoints[A].inflight_tokens == 270
    d.complete(capped, Usage(100, 20), "ok")
    d.complete(uncapped, Usage(100, 50), "ok")
    assert d.endpoints[A].inflight_tokens == 0


async def test_non_streaming_estimate_follows_the_tenants_moving_average() -> None:
    d = _dispatcher(_config([A], budget=10_000, capacity={"defaultOutputTokens": 50}))
    first = await _admit(d, "a", _request(10, stream=False))
    d.complete(first, Usage(10, 30), "ok")
    second = await _admit(d, "a", _request(10, stream=False))
    assert d.output_estimate(second) == 30  # the first sample replaces the default
    assert second.reserved_tokens == 40
    d.complete(second, Usage(10, 80), "ok")
    third = await _admit(d, "a", _request(10, stream=False))
    assert d.output_estimate(third) == 40  # 30 + 0.2 × (80 − 30)
    capped = await _admit(d, "a", _request(10, stream=False, max_tokens=7))
    assert d.output_estimate(capped) == 7
    other = await _admit(d, "b", _request(10, stream=False))
    assert d.output_estimate(other) == 50  # per tenant


async def test_failed_or_streaming_requests_do_not_move_the_average() -> None:
    d = _dispatcher(_config([A], budget=10_000, capacity={"defaultOutputTokens": 50}))
    failed = await _admit(d, "a", _request(10, stream=False))
    d.complete(failed, Usage(10, 1), "error")
    streamed = await _admit(d, "a", _request(10, stream=True))
    d.complete(streamed, Usage(10, 900), "ok")
    probe = await _admit(d, "a", _request(10, stream=False))
    assert d.output_estimate(probe) == 50


async def test_complete_with_usage_settles_to_the_cost_of_usage() -> None:
    d = _dispatcher(_config([A], budget=10_000, tenants=[{"id": "a"}]))
    ticket = await _admit(d, "a", _request(100, stream=False))
    d.complete(ticket, Usage(200, 10, 150), "ok")
    assert d.scheduler.service["a"] == 200 + 2 * 10
    assert _sample(d, "fairway_weighted_service_total", tenant="a", lane=LANE) == 220
    assert _sample(d, "fairway_service_tokens_total", tenant="a", lane=LANE, kind="prompt") == 200
    assert _sample(d, "fairway_service_tokens_total", tenant="a", lane=LANE,
                   kind="completion") == 10
    # The engine's cached share of the prompt, for the dashboard's cached / computed panel.
    assert _sample(d, "fairway_service_tokens_total", tenant="a", lane=LANE, kind="cached") == 150
    other = await _admit(d, "a", _request(100, stream=False))
    d.complete(other, Usage(100, 5), "ok")
    assert _sample(d, "fairway_service_tokens_total", tenant="a", lane=LANE, kind="cached") == 150
    assert _sample(d, "fairway_service_tokens_total", tenant="a", lane=LANE, kind="prompt") == 300


async def test_uncharged_cached_prompt_settles_to_computed_tokens() -> None:
    d = _dispatcher(_config([A], budget=10_000, tenants=[{"id": "a"}],
                            cost={"chargeCachedPrompt": False}))
    ticket = await _admit(d, "a", _request(200))
    d.complete(ticket, Usage(200, 10, 150), "ok")
    assert d.scheduler.service["a"] == (200 - 150) + 2 * 10


async def test_queue_wait_is_measured_on_the_injected_clock() -> None:
    clock = FakeClock(10.0)
    d = _dispatcher(_config([A], budget=100, tenants=[{"id": "a"}, {"id": "b"}]), clock)
    running = await _admit(d, "a", _request(100))
    held = await _hold(d, "b")
    clock.now = 12.5
    d.complete(running, None, "ok")
    ticket = await held
    assert ticket.arrived_at == 10.0 and ticket.dispatched_at == 12.5
    assert _sample(d, "fairway_queue_wait_seconds_sum", tenant="b", lane=LANE) == 2.5
    clock.now = 13.0
    d.on_first_byte(ticket)
    assert _sample(d, "fairway_ttft_seconds_sum", tenant="b", lane=LANE) == 3.0


# -- endpoints --

async def test_no_endpoint_when_none_is_configured() -> None:
    d = _dispatcher(_config([]))
    with pytest.raises(NoEndpoint):
        await _admit(d, "a", _request())
    assert d.busy == 0 and d.scheduler.queued() == 0


async def test_no_endpoint_when_the_subset_matches_none() -> None:
    d = _dispatcher(_config([A, B]))
    with pytest.raises(NoEndpoint):
        await _admit(d, "a", _request(), subset=frozenset({"10.9.9.9:8000"}))


async def test_subset_restricts_the_choice() -> None:
    d = _dispatcher(_config([A, B, C], routing={"fallbackEndpoints": 2}))
    d.endpoints[B].inflight_tokens = 900
    ticket = await _admit(d, "a", _request(50), subset=frozenset({B, C}))
    assert ticket.destinations == [C, B]
    ticket = await _admit(d, "a", _request(50), subset=frozenset({B}))
    assert ticket.destinations == [B]


async def test_learned_budget_is_used_with_auto() -> None:
    d = _dispatcher(_config([A], budget="auto", capacity={"fallbackKvBudgetTokens": 100}))
    d.endpoints[A].learned_budget = 300
    tickets = [await _admit(d, "a", _request(100)) for _ in range(3)]
    held = await _hold(d, "a")
    assert not held.done()
    d.complete(tickets[0], None, "ok")
    await _spin()
    assert held.done()


async def test_pump_dispatches_when_a_scrape_frees_room() -> None:
    clock = FakeClock(5.0)
    d = _dispatcher(_config([A]), clock)
    endpoint = d.endpoints[A]
    endpoint.waiting, endpoint.scraped_at = 4.0, 5.0
    held = await _hold(d, "a")
    assert not held.done()
    endpoint.waiting = 0.0
    d.pump()
    await _spin()
    assert held.done()


# -- live config --

async def test_apply_config_changes_weights_without_resetting_counters() -> None:
    d = _dispatcher(_config([A], tenants=[{"id": "a", "weight": 1}]))
    ticket = await _admit(d, "a", _request(100))
    d.complete(ticket, Usage(100, 50), "ok")
    assert d.scheduler.counter("a") == 200.0
    d.apply_config(_config([A], tenants=[{"id": "a", "weight": 2}]))
    assert d.scheduler.counter("a") == 200.0
    ticket = await _admit(d, "a", _request(100))
    d.complete(ticket, Usage(100, 50), "ok")
    assert d.scheduler.counter("a") == 200.0 + 200.0 / 2
    assert d.scheduler.service["a"] == 400.0


async def test_apply_config_adds_endpoints() -> None:
    d = _dispatcher(_config([A], budget=100))
    await _admit(d, "a", _request(100))
    held = await _hold(d, "a")
    d.apply_config(_config([A, B], budget=100))
    await _spin()
    assert held.done()
    assert held.result().destinations == [B]


async def test_removed_endpoint_drains_then_is_forgotten() -> None:
    d = _dispatcher(_config([A, B]))
    d.endpoints[B].inflight_tokens = 500  # so the first request goes to A
    on_a = await _admit(d, "a", _request(100))
    d.endpoints[B].inflight_tokens = 0
    assert on_a.destinations[0] == A
    d.apply_config(_config([B]))
    assert d.endpoints[A].draining
    assert [e.address for e in d.candidates(require_room=False)] == [B]
    for _ in range(3):
        assert (await _admit(d, "a", _request(10))).destinations == [B]
    d.complete(on_a, None, "ok")
    assert A not in d.endpoints


async def test_removed_idle_endpoint_is_forgotten_at_once_and_may_come_back() -> None:
    d = _dispatcher(_config([A, B]))
    d.apply_config(_config([B]))
    assert list(d.endpoints) == [B]
    d.apply_config(_config([A, B]))
    assert set(d.endpoints) == {A, B}
    assert not d.endpoints[A].draining


async def test_readded_draining_endpoint_is_used_again() -> None:
    d = _dispatcher(_config([A]))
    ticket = await _admit(d, "a", _request(100))
    d.apply_config(_config([A, B]))
    d.apply_config(_config([B]))
    assert d.endpoints[A].draining
    d.apply_config(_config([A, B]))
    assert not d.endpoints[A].draining
    d.complete(ticket, None, "ok")
    assert A in d.endpoints and d.endpoints[A].inflight_tokens == 0


async def test_lane_change_is_refused_while_requests_are_in_flight() -> None:
    d = _dispatcher(_config([A]))
    ticket = await _admit(d, "a", _request(100))
    old = d.config
    new = _config([A], lanes=[{"name": "interactive"}, {"name": "batch"}])
    with pytest.raises(ValueError, match="only while no request"):
        d.apply_config(new)
    assert d.config is old
    assert d.scheduler.lane_names == [LANE]
    d.complete(ticket, None, "ok")
    d.apply_config(new)
    assert d.scheduler.lane_names == ["interactive", "batch"]
    assert (await _admit(d, "a", _request(10))).lane == "interactive"


async def test_policy_change_to_pass_through_when_idle() -> None:
    d = _dispatcher(_config([A], budget=100))
    d.apply_config(_config([A], budget=100, policy="fcfs"))
    assert not d.holding
    await _admit(d, "a", _request(100))
    await _admit(d, "a", _request(100))
    assert d.endpoints[A].inflight_tokens == 200


# -- shutdown --

async def test_close_refuses_queued_requests_and_new_ones() -> None:
    d = _dispatcher(_config([A], budget=100, tenants=[{"id": "a"}, {"id": "b"}]))
    running = await _admit(d, "a", _request(100))
    held = await _hold(d, "b")
    d.close()
    with pytest.raises(ShuttingDown):
        await held
    with pytest.raises(ShuttingDown):
        await _admit(d, "a", _request(10))
    assert d.scheduler.queued() == 0
    assert d.scheduler.service.get("b", 0.0) == 0.0
    assert _sample(d, "fairway_requests_total", tenant="b", lane=LANE, outcome="shutdown") == 1
    d.complete(running, None, "ok")  # what was running still finishes
    assert d.busy == 0 and d.endpoints[A].inflight_tokens == 0


# -- metrics --

async def test_requests_total_counts_outcomes() -> None:
    d = _dispatcher(_config([A], tenants=[{"id": "a"}]))
    for outcome in ("ok", "ok", "error"):
        d.complete(await _admit(d, "a", _request(10)), None, outcome)
    assert _sample(d, "fairway_requests_total", tenant="a", lane=LANE, outcome="ok") == 2
    assert _sample(d, "fairway_requests_total", tenant="a", lane=LANE, outcome="error") == 1


async def test_rejections_total_counts_by_reason() -> None:
    d = _dispatcher(_config([A], tenants=[{"id": "a"}]))
    d.reject("a", QueueFull("full"))
    d.reject("a", QueueFull("full"))
    d.reject("a", NoEndpoint("none"))
    assert _sample(d, "fairway_rejections_total", tenant="a", reason="queue_full") == 2
    assert _sample(d, "fairway_rejections_total", tenant="a", reason="no_endpoint") == 1


async def test_queued_and_running_gauges_come_from_the_snapshot() -> None:
    d = _dispatcher(_config([A], budget=100, tenants=[{"id": "a"}, {"id": "b"}]))
    await _admit(d, "a", _request(100))
    held = [await _hold(d, "a"), await _hold(d, "b"), await _hold(d, "b")]
    assert _sample(d, "fairway_queued_requests", tenant="a", lane=LANE) == 1
    assert _sample(d, "fairway_queued_requests", tenant="b", lane=LANE) == 2
    assert _sample(d, "fairway_running_requests", tenant="a", lane=LANE) == 1
    assert _sample(d, "fairway_endpoint_inflight_tokens", endpoint=A) == 100
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert _sample(d, "fairway_queued_requests", tenant="b", lane=LANE) == 0


async def test_unconfigured_tenants_share_the_other_label() -> None:
    d = _dispatcher(_config([A], budget=100, tenants=[{"id": "known"}]))
    await _admit(d, "known", _request(100))
    held = [await _hold(d, "stranger-1"), await _hold(d, "stranger-2")]
    assert _sample(d, "fairway_queued_requests", tenant="other", lane=LANE) == 2
    assert d.metrics.registry.get_sample_value(
        "fairway_queued_requests", {"tenant": "stranger-1", "lane": LANE}) is None
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert _sample(d, "fairway_requests_total", tenant="other", lane=LANE, outcome="cancelled") == 2
    assert _sample(d, "fairway_running_requests", tenant="known", lane=LANE) == 1


async def test_tenant_becomes_labelled_once_configured() -> None:
    d = _dispatcher(_config([A]))
    d.complete(await _admit(d, "late", _request(10)), None, "ok")
    d.apply_config(_config([A], tenants=[{"id": "late"}]))
    d.complete(await _admit(d, "late", _request(10)), None, "ok")
    assert _sample(d, "fairway_requests_total", tenant="other", lane=LANE, outcome="ok") == 1
    assert _sample(d, "fairway_requests_total", tenant="late", lane=LANE, outcome="ok") == 1


# -- regressions found in review --


async def test_cancellation_landing_just_after_dispatch_settles_and_frees_the_slot() -> None:
    d = _dispatcher(_config(budget=100))
    running = await _admit(d, "t", _request(100))
    held = await _hold(d, "u", 80)
    d.complete(running, None, "ok")  # dispatches the held request...
    held.cancel()  # ...and its client leaves before the task resumes
    with pytest.raises(asyncio.CancelledError):
        await held
    assert d.busy == 0
    assert d.endpoints[A].inflight_tokens == 0


async def test_a_blocked_head_timing_out_lets_the_others_through() -> None:
    d = _dispatcher(_config((A, B), budget=100, queue={"maxWait": "200ms"}))
    d.endpoints[A].inflight_tokens = 100  # A is full, B is empty
    restricted = asyncio.create_task(d.admit("t", _request(10), frozenset({A})))
    await _spin()
    free = asyncio.create_task(d.admit("u", _request(10)))
    await _spin()
    with pytest.raises(QueueTimeout):
        await restricted
    ticket = await asyncio.wait_for(free, 1.0)
    assert ticket.destinations[0] == B


async def test_non_streaming_answer_without_usage_keeps_its_estimate() -> None:
    d = _dispatcher(_config())
    ticket = await _admit(d, "t", _request(10, stream=False, max_tokens=50))
    estimate = ticket.request.estimated_output
    assert estimate == 50
    d.complete(ticket, None, "ok")
    assert d.scheduler.service["t"] == 10 * 1.0 + 50 * 2.0
    # Nothing was learnt about the tenant's output, so its estimate is unchanged.
    again = await _admit(d, "t", _request(10, stream=False, max_tokens=50))
    assert again.request.estimated_output == 50


async def test_a_tenant_removed_from_config_weighs_one_again() -> None:
    d = _dispatcher(_config(tenants=[{"id": "x", "weight": 5}]))
    assert d.scheduler.weights["x"] == 5.0
    d.apply_config(_config())
    assert d.scheduler.weights["x"] == 1.0


async def test_a_lane_change_while_idle_keeps_counters_and_service() -> None:
    d = _dispatcher(_config())
    ticket = await _admit(d, "t", _request(100))
    d.complete(ticket, Usage(100, 10), "ok")
    counter, service = d.scheduler.counter("t", LANE), d.scheduler.service["t"]
    assert counter > 0
    d.apply_config(_config(lanes=[{"name": LANE}, {"name": "batch", "minShare": 0.1}]))
    assert d.scheduler.lane_names == [LANE, "batch"]
    assert d.scheduler.counter("t", LANE) == counter
    assert d.scheduler.service["t"] == service


async def test_prompt_estimates_learn_the_engines_tokenizer_per_model() -> None:
    d = _dispatcher(_config())
    for _ in range(30):  # the engine keeps reporting 1.5× the body estimate
        ticket = await _admit(d, "t", _request(100))
        d.complete(ticket, Usage(150, 1), "ok")
    calibrated = await _admit(d, "t", _request(100))
    assert 140 <= calibrated.request.prompt_tokens <= 150
    other = InferenceRequest(model="other", prompt_tokens=100, max_tokens=None, stream=True,
                             include_usage=True, body={})
    assert (await _admit(d, "t", other)).request.prompt_tokens == 100
