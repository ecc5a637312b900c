"""``capacity.engineQueue``: an endpoint without room still takes a few requests into its
engine's own queue (``picker.core.selection.queue_slot``), so that a request the engine finishes
is replaced at its next step; the fair queue still decides which requests those are."""

from __future__ import annotations

from dataclasses import replace

from picker.core import Usage
from picker.core.gate import Gate, Passage
from picker.core.selection import CapacityRules, EndpointState, fits, has_room, queue_slot
from tests.unit.test_gate import E1, E2, admitted, make_gate

RULES = CapacityRules(fallback_budget=1000, engine_queue=2)


def full_gate(engine_queue: int) -> tuple[Gate, Passage]:
    """One 1,000-token endpoint holding a 900-token stream of tenant ``heavy``."""
    gate, _ = make_gate(budgets={E1: 1000},
                        capacity=replace(RULES, engine_queue=engine_queue))
    first = admitted(gate, "heavy", 900, max_tokens=50)
    assert first.endpoint is gate.endpoints[E1] and not first.engine_queued
    return gate, first


def test_without_a_queue_a_request_that_does_not_fit_waits_in_the_picker() -> None:
    gate, _ = full_gate(0)
    held = admitted(gate, "heavy", 300, max_tokens=50)
    assert held.dispatched_at is None
    assert gate.endpoints[E1].engine_queued == 0


def test_an_endpoint_without_room_takes_engine_queue_requests_and_no_more() -> None:
    gate, _ = full_gate(2)
    endpoint = gate.endpoints[E1]
    sent = [admitted(gate, "heavy", 300, max_tokens=50) for _ in range(3)]
    assert [p.dispatched_at is not None for p in sent] == [True, True, False]
    assert [p.engine_queued for p in sent] == [True, True, False]
    assert endpoint.engine_queued == 2
    # Their prompts count in flight like any other: the fit stays shut until they run.
    assert endpoint.inflight_tokens == 900 + 2 * 300


def test_a_first_token_frees_the_slot_and_the_next_request_goes_at_once() -> None:
    gate, _ = full_gate(1)
    endpoint = gate.endpoints[E1]
    queued = admitted(gate, "heavy", 300, max_tokens=50)
    held = admitted(gate, "heavy", 300, max_tokens=50)
    assert queued.engine_queued and held.dispatched_at is None
    gate.charge_output(queued, 1, 2.0)  # the engine started it
    assert not queued.engine_queued and not queued.prefilling
    assert held.dispatched_at == 2.0 and held.engine_queued
    assert endpoint.engine_queued == 1


def test_the_fair_queue_still_decides_which_request_takes_a_slot() -> None:
    gate, _ = full_gate(1)
    flood = [admitted(gate, "heavy", 300, max_tokens=50, now=0.1) for _ in range(4)]
    assert [p.dispatched_at is not None for p in flood] == [True, False, False, False]
    light = admitted(gate, "light", 300, max_tokens=50, now=0.2)
    assert light.dispatched_at is None  # the one slot is taken
    gate.charge_output(flood[0], 1, 1.0)
    # The light tenant's counter is the lower: it takes the freed slot, not the flood's next.
    assert light.dispatched_at == 1.0 and light.engine_queued
    assert all(p.dispatched_at is None for p in flood[1:])


def test_a_non_streaming_request_holds_its_slot_until_it_ends() -> None:
    gate, first = full_gate(1)
    endpoint = gate.endpoints[E1]
    queued = admitted(gate, "heavy", 300, max_tokens=50, stream=False)
    assert queued.engine_queued and endpoint.engine_queued == 1
    gate.complete(queued, Usage(300, 50), "ok", 1.0)
    assert not queued.engine_queued and endpoint.engine_queued == 0
    gate.complete(first, Usage(900, 50), "ok", 1.0)
    assert endpoint.inflight_requests == 0


def test_a_request_that_fits_is_not_counted_in_the_engine_queue() -> None:
    gate, _ = make_gate(budgets={E1: 1000, E2: 1000}, capacity=RULES)
    first = admitted(gate, "heavy", 900, max_tokens=50)
    second = admitted(gate, "heavy", 900, max_tokens=50)
    third = admitted(gate, "heavy", 50, max_tokens=10)  # fits beside either
    assert {first.endpoint.address, second.endpoint.address} == {E1, E2}
    assert not any(p.engine_queued for p in (first, second, third))
    # With neither fitting, the queue slot goes to the least loaded endpoint.
    fourth = admitted(gate, "heavy", 400, max_tokens=10)
    assert fourth.engine_queued and fourth.endpoint.engine_queued == 1


def test_served_by_moves_the_slot_with_the_request() -> None:
    gate, _ = make_gate(budgets={E1: 1000, E2: 1000}, capacity=replace(RULES, engine_queue=1))
    e1, e2 = gate.endpoints[E1], gate.endpoints[E2]
    admitted(gate, "heavy", 900, max_tokens=50)
    admitted(gate, "heavy", 900, max_tokens=50)
    queued = admitted(gate, "heavy", 400, max_tokens=50)
    primary = queued.endpoint
    other = e2 if primary is e1 else e1
    assert queued.engine_queued and primary.engine_queued == 1
    gate.served_by(queued, other.address, 1.0)
    assert (primary.engine_queued, other.engine_queued) == (0, 1)


def test_queue_slot_is_refused_beside_replicas_on_an_empty_endpoint_and_at_the_depth() -> None:
    busy = EndpointState(E1, configured_budget=1000, inflight_tokens=1000, inflight_requests=1)
    assert not fits(busy, 0.0, RULES, 100) and queue_slot(busy, RULES)
    assert has_room(busy, 0.0, RULES, 100)
    assert not has_room(busy, 0.0, replace(RULES, engine_queue=0), 100)
    assert not queue_slot(replace(busy, engine_queued=2), RULES)
    assert not queue_slot(replace(busy, share=0.5), RULES)
    assert not queue_slot(EndpointState(E1, configured_budget=1000), RULES)
    draining = replace(busy, draining=True)
    assert queue_slot(draining, RULES) and not has_room(draining, 0.0, RULES, 100)
