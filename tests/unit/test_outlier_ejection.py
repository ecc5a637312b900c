"""Outlier ejection (picker.core.health) and its use by selection and the dispatcher, with an
injected clock."""

from __future__ import annotations

import asyncio

from picker.config.schema import load_config
from picker.core.health import (
    EJECTED,
    HEALTHY,
    PROBING,
    EndpointHealth,
    HealthRules,
    available,
    on_dispatch,
    record_failure,
    record_success,
)
from picker.core.selection import CapacityRules, EndpointState, LeastLoaded, rank
from picker.dispatch import Dispatcher
from picker.openai import InferenceRequest

RULES = HealthRules(consecutive_failures=3, base_ejection=1.0, max_ejection=3.0)


def _fail(health: EndpointHealth, now: float, times: int = 1, may_eject: bool = True) -> bool:
    ejected = False
    for _ in range(times):
        ejected = record_failure(health, now, RULES, "refused", may_eject) or ejected
    return ejected


def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    health = EndpointHealth()
    assert not _fail(health, 0.0, 2)
    record_success(health, 0.1, RULES)
    assert not _fail(health, 0.2, 2)  # the count started again
    assert health.state(0.2) == HEALTHY and available(health, 0.2)
    assert _fail(health, 0.3)
    assert health.state(0.3) == EJECTED and not available(health, 1.2)


def test_after_the_ejection_one_probe_and_success_restores() -> None:
    health = EndpointHealth()
    _fail(health, 0.0, 3)
    assert health.state(1.0) == PROBING and available(health, 1.0)
    on_dispatch(health, 1.0)  # the probe request
    assert not available(health, 1.1)  # one at a time while probing
    assert record_success(health, 1.2, RULES)
    assert health.state(1.2) == HEALTHY and available(health, 1.2)


def test_a_failed_probe_ejects_again_for_longer_up_to_the_cap() -> None:
    health = EndpointHealth()
    _fail(health, 0.0, 3)
    assert health.ejected_until == 1.0
    assert _fail(health, 1.0)  # the probe fails: out again at once, for 2 × base
    assert health.ejected_until == 3.0
    assert _fail(health, 3.0)
    assert health.ejected_until == 6.0  # 3 × base = the cap
    assert _fail(health, 6.0)
    assert health.ejected_until == 9.0  # capped at max_ejection


def test_failures_while_ejected_do_not_extend_it() -> None:
    health = EndpointHealth()
    _fail(health, 0.0, 3)
    assert not _fail(health, 0.5, 5)  # requests sent before the ejection report back late
    assert health.ejected_until == 1.0


def test_the_last_endpoint_in_service_is_not_ejected() -> None:
    health = EndpointHealth()
    assert not _fail(health, 0.0, 10, may_eject=False)
    assert health.state(0.0) == HEALTHY


def test_the_backoff_decays_while_healthy() -> None:
    health = EndpointHealth()
    _fail(health, 0.0, 3)
    _fail(health, 1.0)  # ejections = 2
    record_success(health, 3.0, RULES)
    record_success(health, 6.5, RULES)  # healthy for max_ejection: one ejection forgiven
    assert health.ejections == 1
    _fail(health, 7.0, 3)
    assert health.ejected_until == 9.0  # 2 × base, not 3


def test_rank_skips_ejected_endpoints_though_they_look_least_loaded() -> None:
    busy = EndpointState("10.0.0.1:8000", configured_budget=1000, inflight_tokens=500,
                         inflight_requests=1)
    dead = EndpointState("10.0.0.2:8000", configured_budget=1000)
    rules = CapacityRules()
    assert rank([busy, dead], 10, 0.0, rules, LeastLoaded())[0] is dead
    _fail(dead.health, 0.0, 3)
    for require_room in (True, False):
        assert rank([busy, dead], 10, 0.5, rules, LeastLoaded(), require_room) == [busy]
    assert rank([busy, dead], 10, 1.5, rules, LeastLoaded())[0] is dead  # probing


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _dispatcher(clock: Clock) -> Dispatcher:
    config = load_config({"endpoints": [{"address": "10.0.0.1:8000"},
                                        {"address": "10.0.0.2:8000"}],
                          "health": {"consecutiveFailures": 2, "baseEjectionTime": "1s",
                                     "maxEjectionTime": "10s"},
                          "tenants": [{"id": "a"}]})
    return Dispatcher(config, clock=clock)


def test_a_request_that_never_reached_an_engine_costs_nothing_and_ejects() -> None:
    clock = Clock()
    dispatcher = _dispatcher(clock)

    async def scenario() -> None:
        inference = InferenceRequest(model="m", prompt_tokens=100, max_tokens=50, stream=True,
                                     include_usage=True, body={})
        for _ in range(2):
            ticket = await dispatcher.admit("a", inference)
            assert ticket.endpoint is not None
            dead = ticket.endpoint.address
            dispatcher.on_output_tokens(ticket, 3)  # whatever was counted is settled away too
            dispatcher.upstream_failed(ticket, "upstream_reset_before_response_started")
            assert ticket.outcome == "upstream_failed"
            # Pin the next choice to the same endpoint by making the other one busier.
            other = next(e for e in dispatcher.endpoints.values() if e.address != dead)
            other.inflight_tokens = 10
        assert dispatcher.endpoints[dead].health.state(clock.now) == EJECTED
        assert dispatcher.scheduler.service.get("a", 0.0) == 0.0
        assert dispatcher.endpoints[dead].inflight_tokens == 0
        assert dispatcher.endpoints[dead].inflight_requests == 0
        ticket = await dispatcher.admit("a", inference)
        assert ticket.endpoint is not None and ticket.endpoint.address != dead
        dispatcher.complete(ticket, None, "ok")
        # The dead endpoint is the last one left in service: the other cannot be ejected too.
        other = ticket.endpoint.address
        for _ in range(5):
            dispatcher.endpoint_failed(other, "scrape: refused")
        assert dispatcher.endpoints[other].health.state(clock.now) == HEALTHY
        clock.now = 1.5  # the dead one is due a probe; a scrape answering restores it
        dispatcher.endpoint_ok(dead)
        assert dispatcher.endpoints[dead].health.state(clock.now) == HEALTHY

    asyncio.run(scenario())


def test_a_retry_on_the_fallback_counts_against_the_primary() -> None:
    clock = Clock()
    dispatcher = _dispatcher(clock)

    async def scenario() -> None:
        inference = InferenceRequest(model="m", prompt_tokens=10, max_tokens=5, stream=True,
                                     include_usage=True, body={})
        for _ in range(2):
            ticket = await dispatcher.admit("a", inference)
            assert ticket.endpoint is not None
            primary = ticket.endpoint
            other = next(e for e in dispatcher.endpoints.values() if e is not primary)
            dispatcher.served_by(ticket, other.address)
            dispatcher.complete(ticket, None, "ok")
            other.inflight_tokens = 5  # keep the primary the first choice
        assert primary.health.state(clock.now) == EJECTED
        other.inflight_tokens = 0
        assert dispatcher.candidates() == [other]

    asyncio.run(scenario())
