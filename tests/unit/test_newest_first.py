"""Adaptive LIFO (``queue.newestFirstAfter``): once a tenant's oldest queued request has waited
that long, its turns go to its newest request; the fair queue still picks the tenant."""

from __future__ import annotations

from typing import Any

from picker.config.build import admission_rules, endpoint_budgets, gate_rules
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.core import Usage
from picker.core.admission import Admission
from picker.core.gate import Gate, Passage
from picker.dispatch.dispatcher import Dispatcher

A = "10.0.0.1:8000"


def _gate(**queue: Any) -> Gate:
    config = load(PickerConfig, {"endpoints": [{"address": A}],
                                 "capacity": {"kvBudgetTokens": 250}, "queue": queue})
    gate = Gate(gate_rules(config), Dispatcher._new_scheduler(None, config),  # type: ignore[arg-type]
                Admission(*admission_rules(config)), now=0.0)
    gate.set_endpoints(endpoint_budgets(config))
    return gate


def _admit(gate: Gate, tenant: str, now: float) -> Passage:
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=200, max_tokens=40,
                         stream=True, now=now)
    assert isinstance(passage, Passage)
    return passage


def _finish(gate: Gate, passage: Passage, now: float) -> None:
    gate.complete(passage, Usage(200, 40, 0), "ok", now)


def test_a_fresh_backlog_goes_oldest_first() -> None:
    gate = _gate(newestFirstAfter="5s")
    running = _admit(gate, "a", 0.0)  # the endpoint holds one request (250 tokens of room)
    queued = [_admit(gate, "a", t) for t in (1.0, 2.0, 3.0)]
    _finish(gate, running, 4.9)  # the oldest has waited 3.9 s
    assert [p.dispatched_at for p in queued] == [4.9, None, None]


def test_a_stale_backlog_sends_its_newest_first() -> None:
    gate = _gate(newestFirstAfter="5s")
    running = _admit(gate, "a", 0.0)
    queued = [_admit(gate, "a", t) for t in (1.0, 2.0, 3.0)]
    _finish(gate, running, 6.0)  # the oldest has waited 5 s
    assert [p.dispatched_at for p in queued] == [None, None, 6.0]
    _finish(gate, queued[2], 7.0)
    assert [p.dispatched_at for p in queued] == [None, 7.0, 6.0]


def test_zero_keeps_the_oldest_first_however_long_it_waited() -> None:
    gate = _gate(newestFirstAfter="0s")
    running = _admit(gate, "a", 0.0)
    queued = [_admit(gate, "a", t) for t in (1.0, 2.0, 3.0)]
    _finish(gate, running, 50.0)
    assert [p.dispatched_at for p in queued] == [50.0, None, None]


def test_the_fair_queue_still_picks_the_tenant() -> None:
    """A stale backlog reorders its own tenant's requests only: the tenant the fair queue
    chooses goes, with its newest request."""
    gate = _gate(newestFirstAfter="5s")
    running = _admit(gate, "a", 0.0)
    a_queued = [_admit(gate, "a", t) for t in (0.5, 1.0)]
    b_queued = [_admit(gate, "b", t) for t in (1.5, 2.0)]
    # b has been served nothing and a one request: b's turn, with its newest.
    _finish(gate, running, 8.0)
    assert [p.dispatched_at for p in b_queued] == [None, 8.0]
    assert all(p.dispatched_at is None for p in a_queued)
