"""Endpoint selection: KV budgets, when an endpoint has room, and the order candidates come in."""

from __future__ import annotations

from typing import Any

from picker.core.selection import (
    CapacityRules,
    EndpointState,
    LeastLoaded,
    figures_decide,
    has_room,
    rank,
)

RULES = CapacityRules(fallback_budget=1000, max_waiting=2, stale_after=1.0)
NOW = 100.0


def _endpoint(address: str = "10.0.0.1:8000", **fields: Any) -> EndpointState:
    return EndpointState(address, **fields)


def _addresses(endpoints: list[EndpointState]) -> list[str]:
    return [e.address for e in endpoints]


# -- budgets --

def test_configured_budget_wins_over_learned_and_fallback() -> None:
    assert _endpoint(configured_budget=500, learned_budget=700).budget(1000) == 500


def test_learned_budget_wins_over_fallback() -> None:
    assert _endpoint(learned_budget=700).budget(1000) == 700


def test_fallback_budget_when_nothing_else_is_known() -> None:
    assert _endpoint().budget(1000) == 1000


# -- room --

def test_room_while_own_inflight_tokens_are_under_the_budget() -> None:
    assert has_room(_endpoint(inflight_tokens=999), NOW, RULES)
    assert not has_room(_endpoint(inflight_tokens=1000), NOW, RULES)
    assert not has_room(_endpoint(inflight_tokens=1500), NOW, RULES)


def test_room_uses_the_endpoints_own_budget() -> None:
    assert not has_room(_endpoint(inflight_tokens=600, learned_budget=600), NOW, RULES)
    assert has_room(_endpoint(inflight_tokens=600, configured_budget=2000, learned_budget=600),
                    NOW, RULES)


def test_fresh_scraped_kv_usage_above_own_count_takes_the_room() -> None:
    # Other clients fill the server: the picker's own count is low, the scrape says full.
    full = _endpoint(inflight_tokens=100, kv_usage=1.0, scraped_at=NOW - 0.5)
    assert not has_room(full, NOW, RULES)
    partly = _endpoint(inflight_tokens=100, kv_usage=0.5, scraped_at=NOW - 0.5)
    assert has_room(partly, NOW, RULES)


def test_scraped_kv_usage_lower_than_own_count_does_not_free_room() -> None:
    endpoint = _endpoint(inflight_tokens=1000, kv_usage=0.1, scraped_at=NOW)
    assert not has_room(endpoint, NOW, RULES)


def test_stale_kv_usage_is_ignored() -> None:
    endpoint = _endpoint(inflight_tokens=100, kv_usage=1.0, scraped_at=NOW - 1.5)
    assert has_room(endpoint, NOW, RULES)


def test_fresh_waiting_queue_at_the_threshold_has_no_room() -> None:
    assert has_room(_endpoint(waiting=1, scraped_at=NOW), NOW, RULES)
    assert not has_room(_endpoint(waiting=2, scraped_at=NOW), NOW, RULES)
    assert not has_room(_endpoint(waiting=5, scraped_at=NOW - 1.0), NOW, RULES)


def test_stale_waiting_queue_is_ignored() -> None:
    assert has_room(_endpoint(waiting=50, scraped_at=NOW - 1.01), NOW, RULES)
    assert has_room(_endpoint(waiting=50, scraped_at=None), NOW, RULES)


def test_draining_endpoint_never_has_room() -> None:
    assert not has_room(_endpoint(draining=True), NOW, RULES)
    assert not has_room(_endpoint(draining=True, configured_budget=10**9, scraped_at=NOW,
                                  waiting=0, kv_usage=0.0), NOW, RULES)


# -- scoring and ranking --

def test_least_loaded_prefers_the_shorter_waiting_queue_over_free_budget() -> None:
    scorer = LeastLoaded()
    empty_but_waiting = _endpoint("a:1", waiting=1, scraped_at=NOW)
    busy_not_waiting = _endpoint("b:1", inflight_tokens=900, waiting=0, scraped_at=NOW)
    assert (scorer.score(busy_not_waiting, 10, NOW, RULES)
            > scorer.score(empty_but_waiting, 10, NOW, RULES))


def test_least_loaded_prefers_more_free_budget() -> None:
    scorer = LeastLoaded()
    light = _endpoint("a:1", inflight_tokens=100)
    heavy = _endpoint("b:1", inflight_tokens=700)
    assert scorer.score(light, 10, NOW, RULES) > scorer.score(heavy, 10, NOW, RULES)


def test_least_loaded_compares_free_budget_as_a_fraction_of_each_budget() -> None:
    scorer = LeastLoaded()
    big = _endpoint("a:1", inflight_tokens=1000, configured_budget=10000)  # 90% free
    small = _endpoint("b:1", inflight_tokens=100, configured_budget=200)  # 50% free
    assert scorer.score(big, 10, NOW, RULES) > scorer.score(small, 10, NOW, RULES)


def test_least_loaded_ignores_a_stale_waiting_queue() -> None:
    scorer = LeastLoaded()
    stale = _endpoint("a:1", waiting=9, scraped_at=NOW - 5)
    assert scorer.score(stale, 10, NOW, RULES) == 1.0


def test_rank_orders_endpoints_with_room_least_loaded_first() -> None:
    endpoints = [_endpoint("a:1", inflight_tokens=500), _endpoint("b:1", inflight_tokens=100),
                 _endpoint("c:1", inflight_tokens=300), _endpoint("d:1", inflight_tokens=1000)]
    ranked = rank(endpoints, 10, NOW, RULES, LeastLoaded())
    assert _addresses(ranked) == ["b:1", "c:1", "a:1"]


def test_rank_without_room_required_keeps_full_endpoints_but_not_draining_ones() -> None:
    endpoints = [_endpoint("full:1", inflight_tokens=5000),
                 _endpoint("free:1", inflight_tokens=10),
                 _endpoint("drain:1", draining=True),
                 _endpoint("waiting:1", waiting=7, scraped_at=NOW)]
    ranked = rank(endpoints, 10, NOW, RULES, LeastLoaded(), require_room=False)
    assert set(_addresses(ranked)) == {"full:1", "free:1", "waiting:1"}
    assert ranked[0].address == "free:1"
    assert _addresses(rank(endpoints, 10, NOW, RULES, LeastLoaded())) == ["free:1"]


def test_rank_of_no_endpoint_is_empty() -> None:
    assert rank([], 10, NOW, RULES, LeastLoaded()) == []


# -- the request's own size, and figures that went stale since the scrape --

def test_a_prompt_must_fit_beside_what_is_in_flight() -> None:
    busy = _endpoint(inflight_tokens=700, inflight_requests=2)
    assert has_room(busy, NOW, RULES, prompt_tokens=300)
    assert not has_room(busy, NOW, RULES, prompt_tokens=301)


def test_an_empty_endpoint_takes_even_a_prompt_larger_than_its_budget() -> None:
    assert has_room(_endpoint(), NOW, RULES, prompt_tokens=5000)


def test_completions_since_the_scrape_discount_its_waiting_count() -> None:
    full_queue = _endpoint(waiting=2, scraped_at=NOW)
    assert not has_room(full_queue, NOW, RULES)
    full_queue.completed_since_scrape = 1  # one finished: the engine admitted a waiting one
    assert has_room(full_queue, NOW, RULES)


def test_tokens_released_since_the_scrape_discount_its_kv_use() -> None:
    full = _endpoint(kv_usage=1.0, scraped_at=NOW, inflight_requests=2, inflight_tokens=400,
                     inflight_at_scrape=400)
    assert not has_room(full, NOW, RULES)
    full.inflight_tokens -= 400  # the request finished: what it held is free
    full.inflight_requests -= 1
    assert has_room(full, NOW, RULES, prompt_tokens=400)
    assert not has_room(full, NOW, RULES, prompt_tokens=401)


def test_requests_sent_since_the_scrape_add_to_a_higher_scraped_kv_use() -> None:
    # The engine holds more than the picker counts (streams whose growth the access-log path
    # does not show): each request sent since the scrape takes from the scraped figure's room,
    # or every request until the next scrape would be let into the same room.
    endpoint = _endpoint(kv_usage=0.6, scraped_at=NOW, inflight_requests=2, inflight_tokens=200,
                         inflight_at_scrape=200)
    assert has_room(endpoint, NOW, RULES, prompt_tokens=300)
    endpoint.inflight_tokens += 300  # one sent: 600 + 300 of 1000 in use
    endpoint.inflight_requests += 1
    assert has_room(endpoint, NOW, RULES, prompt_tokens=100)
    assert not has_room(endpoint, NOW, RULES, prompt_tokens=101)


# -- when scraped figures decide the room (the scraper's cadence) --

def test_figures_decide_until_a_fresh_read_exists() -> None:
    assert figures_decide(_endpoint(), NOW, RULES)  # never read
    assert figures_decide(_endpoint(kv_usage=0.0, waiting=0, scraped_at=NOW - 1.5), NOW, RULES)


def test_own_accounting_decides_while_the_engine_holds_what_the_picker_sent() -> None:
    # 300 tokens sent; the engine reports 32 % of 1000 (block rounding): within the margin.
    endpoint = _endpoint(inflight_tokens=300, kv_usage=0.32, waiting=0, scraped_at=NOW)
    assert not figures_decide(endpoint, NOW, RULES)
    assert not figures_decide(_endpoint(waiting=0, scraped_at=NOW), NOW, RULES)  # no KV figure


def test_figures_decide_when_the_engine_holds_more_than_the_picker_sent() -> None:
    # Another client's 100 tokens: more than the 5 % margin above the picker's 300.
    endpoint = _endpoint(inflight_tokens=300, kv_usage=0.40, waiting=0, scraped_at=NOW)
    assert figures_decide(endpoint, NOW, RULES)
    endpoint.released_since_scrape = 100  # finished since the read: the excess is gone
    assert not figures_decide(endpoint, NOW, RULES)


def test_figures_decide_while_the_engine_queues() -> None:
    endpoint = _endpoint(inflight_tokens=300, kv_usage=0.30, waiting=1, scraped_at=NOW)
    assert figures_decide(endpoint, NOW, RULES)
    endpoint.completed_since_scrape = 1  # the one waiting was admitted since
    assert not figures_decide(endpoint, NOW, RULES)


def test_figures_decide_once_the_endpoint_is_nearly_full_by_own_count() -> None:
    endpoint = _endpoint(inflight_tokens=790, kv_usage=0.79, waiting=0, scraped_at=NOW)
    assert not figures_decide(endpoint, NOW, RULES)
    endpoint.inflight_tokens = 800  # 80 % of 1000: its engine may queue at any moment
    assert figures_decide(endpoint, NOW, RULES)
    endpoint.share = 0.5  # beside other replicas, nearly full is judged on this one's part
    endpoint.inflight_tokens = 400
    assert figures_decide(endpoint, NOW, RULES)
