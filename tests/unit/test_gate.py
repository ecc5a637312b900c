"""The gate (``picker.core.gate``) driven directly, without the dispatcher or an event loop: its
invariants under random operations (a Hypothesis state machine), and each scheduling rule on a
hand-computed example."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, BucketRule, Refused, Reservation, TenantRules
from picker.core.gate import (
    NO_ENDPOINT,
    QUEUE_FULL,
    Gate,
    GateRules,
    LaneRules,
    Passage,
    Turnaway,
    output_limit,
    still_waiting,
)
from picker.core.health import HealthRules
from picker.core.selection import CapacityRules, EndpointState, free_tokens, has_room, rank

HIGH, LOW = "high", "low"
LANES = (LaneRules(HIGH), LaneRules(LOW))
E1, E2, E3 = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


class Recorder:
    """A ``GateListener`` that keeps every event, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Passage, Any]] = []

    def dispatched(self, passage: Any, now: float) -> None:
        self.events.append(("dispatched", passage, now))

    def dropped(self, passage: Any, outcome: str, now: float) -> None:
        self.events.append(("dropped", passage, outcome))

    def settled(self, passage: Any, usage: Usage, outcome: str, now: float,
                estimated: bool) -> None:
        self.events.append(("settled", passage, usage))

    def of(self, passage: Passage) -> list[str]:
        return [kind for kind, p, _ in self.events if p is passage]


class RecordingAdmission(Admission):
    """Admission that remembers what each reservation was finished with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished: list[tuple[Reservation, int]] = []

    def finish(self, reservation: Reservation, actual_tokens: int, now: float) -> None:
        super().finish(reservation, actual_tokens, now)
        self.finished.append((reservation, actual_tokens))

    def finishes_of(self, reservation: Reservation | None) -> list[int]:
        return [tokens for r, tokens in self.finished if r is reservation]


def make_gate(*, budgets: dict[str, int | None] | None = None,
              tenants: dict[str, TenantRules] | None = None, now: float = 0.0,
              **rules: Any) -> tuple[Gate, Recorder]:
    """A gate built the way ``Dispatcher.__init__`` builds one."""
    rules.setdefault("lanes", LANES)
    gate_rules = GateRules(**rules)
    scheduler = Scheduler([LaneSpec(lane.name) for lane in gate_rules.lanes])
    recorder = Recorder()
    gate = Gate(gate_rules, scheduler, RecordingAdmission(tenants or {}, TenantRules()), now=now,
                listener=recorder)
    gate.set_endpoints(budgets if budgets is not None else {E1: 1000})
    return gate, recorder


def admit(gate: Gate, tenant: str, prompt: int, *, now: float = 0.0, lane: str | None = None,
          max_tokens: int | None = None, stream: bool = True,
          subset: frozenset[str] | None = None, output_seen: bool = True) -> Any:
    return gate.admit(Passage, tenant, lane, model="m", prompt_tokens=prompt,
                      max_tokens=max_tokens, stream=stream, now=now, subset=subset,
                      output_seen=output_seen)


def recorded(gate: Gate) -> RecordingAdmission:
    admission = gate.admission
    assert isinstance(admission, RecordingAdmission)
    return admission


def admitted(gate: Gate, tenant: str, prompt: int, **kwargs: Any) -> Passage:
    passage = admit(gate, tenant, prompt, **kwargs)
    assert isinstance(passage, Passage), passage
    return passage


# -- the state machine --

TENANTS = ("a", "b", "c", "d")
TENANT_RULES = {
    "a": TenantRules(max_concurrent=2),
    "b": TenantRules(max_concurrent=1),
    "d": TenantRules(burst=BucketRule(capacity_tokens=4000, refill_seconds=20.0)),
}
TENANT_LANES = {"c": LOW}
ALLOWED_LANES = {"a": frozenset({HIGH, LOW}), "b": frozenset({HIGH, LOW})}
CAPACITY = CapacityRules(fallback_budget=1000, max_waiting=2, stale_after=1.0)
BUDGETS: dict[str, int | None] = {E1: 1000, E2: 600}
REQUESTS = st.tuples(st.sampled_from(TENANTS), st.booleans(), st.integers(1, 900),
                     st.none() | st.integers(0, 400), st.booleans(), st.booleans())
"""tenant, asks for the low lane, prompt tokens, max_tokens, stream, whether the picker sees its
tokens (``Passage.output_seen``; not on the access-log response path)"""


class GateMachine(RuleBasedStateMachine):
    """Random admissions, completions, drops, streamed output, endpoint health, time and scraped
    figures against one gate; the invariants are checked after every step. The adapter's part is
    modelled where the gate leaves it to the adapter: it pumps after a drop (the dispatcher does,
    on timeout and cancellation), and after time passes, a scrape lands or output is charged
    (the scraper's periodic pump)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.gate, self.recorder = make_gate(
            budgets=dict(BUDGETS), tenants=TENANT_RULES, capacity=CAPACITY,
            health=HealthRules(consecutive_failures=2, base_ejection=1.0, max_ejection=5.0),
            max_queued=8, tenant_lanes=TENANT_LANES, allowed_lanes=ALLOWED_LANES)
        self.seq: dict[Passage, int] = {}
        """Every passage the gate returned, in admission order."""
        self.streamed: dict[Passage, int] = {}
        self.e3 = False

    @property
    def admission(self) -> RecordingAdmission:
        admission = self.gate.admission
        assert isinstance(admission, RecordingAdmission)
        return admission

    @initialize(shed=st.booleans(), max_queued=st.integers(2, 10),
                engine_queue=st.sampled_from((0, 1, 2)))
    def configure(self, shed: bool, max_queued: int, engine_queue: int) -> None:
        rules = self.gate.rules
        self.gate.set_rules(GateRules(
            lanes=rules.lanes, capacity=replace(rules.capacity, engine_queue=engine_queue),
            health=rules.health,
            max_queued=max_queued, shed_lower_lanes=shed, tenant_lanes=rules.tenant_lanes,
            allowed_lanes=rules.allowed_lanes))

    # -- what the machine can see --

    def waiting(self) -> list[Passage]:
        return [p for p in self.seq if p.outcome is None and p.dispatched_at is None]

    def queued(self) -> list[Passage]:
        return [p for p in self.waiting() if not p.parked]

    def parked(self) -> list[Passage]:
        return [p for p in self.waiting() if p.parked]

    def running(self) -> list[Passage]:
        return [p for p in self.seq if p.outcome is None and p.dispatched_at is not None]

    # -- rules --

    @rule(requests=st.lists(REQUESTS, min_size=1, max_size=5))
    def admit(self, requests: list[tuple[str, bool, int, int | None, bool, bool]]) -> None:
        for request in requests:
            self.admit_one(*request)

    def admit_one(self, tenant: str, low: bool, prompt: int, max_tokens: int | None,
                  stream: bool, seen: bool) -> None:
        gate = self.gate
        lane = gate.choose_lane(tenant, LOW if low else None)
        if lane is None:
            assert low and LOW not in ALLOWED_LANES.get(tenant, ())
            return
        ranks = gate.rules.lane_rank()
        lower = [p for p in self.waiting() if ranks[p.lane] > ranks[lane]]
        full = gate.queued_total() >= gate.rules.max_queued
        in_service = any(e.in_service(self.now) for e in gate.endpoints.values())
        events, finished = len(self.recorder.events), len(self.admission.finished)
        result = admit(gate, tenant, prompt, now=self.now, lane=lane, max_tokens=max_tokens,
                       stream=stream, output_seen=seen)
        shed = [(p, outcome) for kind, p, outcome in self.recorder.events[events:]
                if kind == "dropped"]
        if isinstance(result, Turnaway):
            assert not shed
            if result.reason == NO_ENDPOINT:
                assert not in_service
                assert len(self.admission.finished) == finished
            else:
                assert result.reason == QUEUE_FULL
                assert full and not (gate.rules.shed_lower_lanes and lower)
                # Its reservation was made, then released uncharged.
                assert [t for _, t in self.admission.finished[finished:]] == [0]
                assert self.admission.queued(tenant) == sum(
                    p.tenant == tenant for p in self.waiting())
            return
        if isinstance(result, Refused):
            assert tenant == "d" and not shed  # only d has a budget
            return
        assert isinstance(result, Passage) and result.lane == lane
        assert in_service
        if full:
            # The newest waiting request of the lowest lane below the new one's was shed.
            assert gate.rules.shed_lower_lanes and lower
            victim = max(lower, key=lambda p: (ranks[p.lane], self.seq[p]))
            assert shed == [(victim, "shed")]
            assert victim.shed_for == lane and victim.outcome == "shed"
        else:
            assert not shed
        self.seq[result] = len(self.seq)

    @rule(data=st.data(), tokens=st.none() | st.tuples(st.integers(0, 900), st.integers(0, 500)),
          outcome=st.sampled_from(("ok", "error", "cancelled", "unmetered")))
    def complete(self, data: st.DataObject, tokens: tuple[int, int] | None, outcome: str) -> None:
        running = self.running()
        if not running:
            return
        passage = data.draw(st.sampled_from(running))
        usage = None if tokens is None else Usage(*tokens)
        self.gate.complete(passage, usage, outcome, self.now)
        assert passage.outcome == outcome
        settled = [u for kind, p, u in self.recorder.events if kind == "settled" and p is passage]
        assert len(settled) == 1
        if usage is not None:
            assert settled[0] == usage
        charged = settled[0].prompt_tokens + settled[0].completion_tokens
        assert self.admission.finishes_of(passage.reservation) == [charged]
        self.gate.complete(passage, usage, outcome, self.now)  # again: nothing happens
        assert self.recorder.of(passage).count("settled") == 1

    @rule(data=st.data(), outcome=st.sampled_from(("queue_timeout", "cancelled")))
    def drop(self, data: st.DataObject, outcome: str) -> None:
        waiting = self.waiting()
        if not waiting:
            return
        passage = data.draw(st.sampled_from(waiting))
        self.gate.drop(passage, outcome, self.now)
        self.gate.drop(passage, outcome, self.now)  # again: nothing happens
        assert passage.outcome == outcome
        self.gate.pump(self.now)  # as the dispatcher does after a drop

    @rule(data=st.data(), tokens=st.integers(1, 200))
    def charge_output(self, data: st.DataObject, tokens: int) -> None:
        running = self.running()
        if not running:
            return
        passage = data.draw(st.sampled_from(running))
        self.gate.charge_output(passage, tokens)
        self.streamed[passage] = self.streamed.get(passage, 0) + tokens
        # A charge can reorder the fair queue (a tie broken), making a request that fits its
        # head; the gate leaves that to the next pump (the scraper pumps every interval) rather
        # than pump on each streamed chunk.
        self.gate.pump(self.now)

    @rule(address=st.sampled_from((E1, E2, E3)))
    def endpoint_failed(self, address: str) -> None:
        self.gate.endpoint_failed(address, "scrape failed", self.now)

    @rule(address=st.sampled_from((E1, E2, E3)))
    def endpoint_ok(self, address: str) -> None:
        self.gate.endpoint_ok(address, self.now)

    @rule(data=st.data(), address=st.sampled_from((E1, E2, E3)))
    def served_by(self, data: st.DataObject, address: str) -> None:
        running = self.running()
        if not running:
            return
        passage = data.draw(st.sampled_from(running))
        self.gate.served_by(passage, address, self.now)
        if address in self.gate.endpoints:
            assert passage.endpoint is self.gate.endpoints[address]

    @rule(data=st.data())
    def upstream_failed(self, data: st.DataObject) -> None:
        running = self.running()
        if not running:
            return
        passage = data.draw(st.sampled_from(running))
        self.gate.upstream_failed(passage, "connect failure", self.now)
        assert passage.outcome == "upstream_failed"
        assert self.admission.finishes_of(passage.reservation) == [0]

    @rule(tenant=st.sampled_from(TENANTS), weight=st.sampled_from((0.5, 1.0, 3.0)))
    def reweigh(self, tenant: str, weight: float) -> None:
        self.gate.set_weight(tenant, weight)

    @rule(seconds=st.sampled_from((0.1, 0.5, 1.5, 6.0)))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.gate.pump(self.now)  # the scraper's pump

    @rule(address=st.sampled_from((E1, E2, E3)), waiting=st.none() | st.integers(0, 4),
          kv=st.none() | st.floats(0.0, 1.0))
    def scrape(self, address: str, waiting: int | None, kv: float | None) -> None:
        endpoint = self.gate.endpoints.get(address)
        if endpoint is not None:
            self.read(endpoint, waiting, kv)

    @rule(data=st.data())
    def scrape_where_prefill_is_unseen(self, data: st.DataObject) -> None:
        """A read of an endpoint with streams whose first token the picker cannot see, the
        engine's waiting count around their number."""
        unseen = [p for p in self.running() if p.prefilling and not p.output_seen]
        if not unseen:
            return
        endpoint = data.draw(st.sampled_from([p.endpoint for p in unseen]))
        assert endpoint is not None
        self.read(endpoint, data.draw(st.integers(0, len(unseen) + 1)), None)

    def read(self, endpoint: EndpointState, waiting: int | None, kv: float | None) -> None:
        unseen = [p for p in self.running() if p.endpoint is endpoint and p.prefilling
                  and not p.output_seen]
        # The read went out after every dispatch so far, and its answer comes a moment later.
        sent_at, answered = self.now + 0.001, self.now + 0.002
        self.gate.scraped(endpoint, waiting, None, kv, None, sent_at=sent_at, now=answered)
        assert (endpoint.waiting, endpoint.kv_usage, endpoint.scraped_at) == (waiting, kv,
                                                                             answered)
        # Of the streams whose tokens the picker does not see, the read leaves as many in
        # prefill as the engine says wait (those it serves last), or all when it does not say.
        left = [p for p in unseen if p.prefilling]
        assert len(left) == (len(unseen) if waiting is None else min(waiting, len(unseen)))
        assert set(left) == still_waiting(unseen, len(unseen) if waiting is None else waiting)
        self.gate.pump(self.now)

    @rule()
    def toggle_growth_room(self) -> None:
        """A reload turns the growth room on or off with requests running."""
        rules = self.gate.rules
        self.gate.set_rules(replace(rules, capacity=replace(
            rules.capacity, growth_room=not rules.capacity.growth_room)))
        self.gate.pump(self.now)

    @rule()
    def toggle_third_endpoint(self) -> None:
        self.e3 = not self.e3
        self.gate.set_endpoints({**BUDGETS, **({E3: 800} if self.e3 else {})})
        self.gate.pump(self.now)

    # -- invariants --

    @invariant()
    def fair_queue_requests_may_all_be_dispatched(self) -> None:
        for tenant in TENANTS:
            queued = [p for p in self.queued() if p.tenant == tenant]
            cap = TENANT_RULES.get(tenant, TenantRules()).max_concurrent
            if cap is not None:
                assert len(queued) + self.admission.running(tenant) <= cap
            parked = [p for p in self.parked() if p.tenant == tenant]
            assert self.gate._parked.get(tenant, []) == parked  # FIFO: admission order
            if parked:
                assert max(self.seq[p] for p in [*queued, parked[0]]) == self.seq[parked[0]]
            assert self.gate._in_queue.get(tenant, []) == queued
            assert self.admission.running(tenant) == sum(
                p.tenant == tenant for p in self.running())
            assert self.admission.queued(tenant) == len(queued) + len(parked)

    @invariant()
    def single_holds_exactly_the_light_tenants(self) -> None:
        expected = {}
        for tenant in TENANTS:
            queued = [p for p in self.queued() if p.tenant == tenant]
            if len(queued) == 1 and not any(p.tenant == tenant for p in self.parked()):
                expected[tenant] = queued[0]
        assert self.gate._single == expected

    @invariant()
    def endpoint_ledger_is_the_sum_of_its_running_requests(self) -> None:
        endpoints = list(self.gate.endpoints.values())
        for passage in self.running():
            assert any(passage.endpoint is e for e in endpoints)
            request = passage.request
            if passage.stream:
                expected = request.prompt_tokens + self.streamed.get(passage, 0)
            else:
                expected = request.prompt_tokens + request.estimated_output
            assert passage.reserved_tokens == expected
        for endpoint in endpoints:
            mine = [p for p in self.running() if p.endpoint is endpoint]
            assert endpoint.inflight_requests == len(mine)
            # Shared prompt blocks count once (tests/unit/test_prefix_room.py); none here.
            blocks = self.gate.inflight_blocks.tokens(endpoint.address)
            assert endpoint.inflight_tokens == sum(
                p.reserved_tokens - p.prefix_tokens for p in mine) + blocks
            assert endpoint.projected_tokens == sum(
                p.projected_tokens - p.prefix_tokens for p in mine) + blocks
            # Outstanding prefill: streams sent here whose first token has not come back (and,
            # of those whose tokens the picker does not see, that no read has let go).
            for passage in mine:
                first_token = passage.stream and not self.streamed.get(passage)
                if passage.output_seen:
                    assert passage.prefilling == first_token
                else:
                    assert first_token or not passage.prefilling
            assert set(self.gate._unseen_prefill.get(endpoint.address, {})) == {
                p for p in mine if p.prefilling and not p.output_seen}
        # The growth room's registry of what runs where (``Gate._peak_growth``), kept only
        # while the growth room is on (nothing to maintain on the default's hot path).
        registry = self.gate._running
        if not self.gate.rules.capacity.growth_room:
            assert registry is None
        else:
            assert registry is not None
            for endpoint in endpoints:
                mine = [p for p in self.running() if p.endpoint is endpoint]
                assert set(registry.get(endpoint.address, {})) == set(mine)
            assert all(registry.values())  # an endpoint with nothing running: no entry
        for endpoint in endpoints:
            mine = [p for p in self.running() if p.endpoint is endpoint]
            assert endpoint.prefill_tokens == sum(p.request.prompt_tokens for p in mine
                                                  if p.prefilling)
            # Sent beyond the room into the engine's queue: until its prefill ends (a stream)
            # or it ends.
            assert endpoint.engine_queued == sum(p.engine_queued for p in mine)
            for passage in mine:
                assert not passage.engine_queued or passage.prefilling or not passage.stream
        held: dict[tuple[str, str], int] = {}
        for passage in self.running():
            key = (passage.lane, passage.tenant)
            held[key] = held.get(key, 0) + passage.reserved_tokens
        occupancy = self.gate.occupancy
        assert occupancy.tenants() == sum(1 for tokens in held.values() if tokens)
        weights = self.gate.scheduler.weights
        for (lane, tenant), tokens in held.items():
            assert occupancy.held(lane, tenant) == tokens
        for lane in {lane for lane, _ in held}:
            holders = [t for (other, t), tokens in held.items() if other == lane and tokens]
            assert occupancy.weight_sum(lane) == pytest.approx(
                sum(weights.get(t, 1.0) for t in holders))

    @invariant()
    def passages_are_the_waiting_and_the_running(self) -> None:
        gate = self.gate
        expected = {p.request: p for p in self.waiting() + self.running()}
        assert gate.passages == expected
        assert gate.scheduler.queued() == len(self.queued())
        assert gate.queued_total() == len(self.waiting())
        # The per-lane index of waiting requests, in arrival order (what shedding reads).
        by_lane: dict[str, list[Passage]] = {}
        for passage in self.waiting():  # in the order admitted
            by_lane.setdefault(passage.lane, []).append(passage)
        assert {lane: list(w.values()) for lane, w in gate._waiting.items()} == by_lane
        for passage in self.queued():
            assert passage.request.state == "queued"
        for passage in self.parked():
            assert passage.request.state == "new"
        for passage in self.running():
            assert passage.request.state == "running"

    @invariant()
    def each_passage_dispatched_at_most_once_and_ended_once(self) -> None:
        for passage in self.seq:
            kinds = self.recorder.of(passage)
            assert kinds.count("dispatched") == (passage.dispatched_at is not None)
            if passage.outcome is None:
                assert kinds == ["dispatched"] * (passage.dispatched_at is not None)
                continue
            if passage.dispatched_at is None:
                assert kinds == ["dropped"]
                assert self.admission.finishes_of(passage.reservation) == [0]
                assert passage.request.charged == 0
            else:
                assert kinds == ["dispatched", "settled"]
                assert len(self.admission.finishes_of(passage.reservation)) == 1

    @invariant()
    def work_is_conserved(self) -> None:
        """With the reserve off: when the fair queue holds a request, no endpoint has room for
        its head, nor for a light tenant's request of the head's lane or higher that fits
        beside the tokens in flight (``Gate._light_request``). Not while the growth room is on
        (``toggle_growth_room``): it holds a backlogged tenant's request on purpose."""
        gate, now = self.gate, self.now
        if gate.rules.capacity.growth_room:
            return
        head_request = gate.scheduler.peek(now)
        if head_request is None:
            return
        head = gate.passages[head_request]
        pool = list(gate.endpoints.values())
        assert not rank(pool, head_request.prompt_tokens, now, CAPACITY, gate.scorer), head
        assert not any(has_room(e, now, CAPACITY, head_request.prompt_tokens) for e in pool)
        ranks = gate.rules.lane_rank()
        free = max((free_tokens(e, now, CAPACITY, projected=False) for e in pool), default=0.0)
        for passage in gate._single.values():
            if passage is head or ranks[passage.lane] > ranks[head.lane]:
                continue
            prompt = passage.request.prompt_tokens
            fits = any(has_room(e, now, CAPACITY, prompt) for e in pool)
            assert not (fits and free > 0 and prompt <= free), passage


GateMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_gate_invariants = GateMachine.TestCase


# -- each rule on an example --


def test_a_light_request_goes_ahead_of_a_waiting_head_but_not_one_of_a_lower_lane() -> None:
    gate, _ = make_gate(tenant_lanes={"lower": LOW})
    running = admitted(gate, "flood", 800)
    heads = [admitted(gate, "flood", 400) for _ in range(2)]  # 800 + 400 > 1000: both wait
    lower = admitted(gate, "lower", 50)
    light = admitted(gate, "light", 50)
    endpoint = gate.endpoints[E1]
    assert light.dispatched_at == 0.0 and light.endpoint is endpoint  # 850 of 1000 now
    assert lower.dispatched_at is None  # light too, but its lane is below the head's
    assert all(head.dispatched_at is None for head in heads)
    assert gate._single == {"lower": lower}  # flood has two queued: not light
    assert (endpoint.inflight_tokens, endpoint.inflight_requests) == (850, 2)

    gate.complete(running, Usage(800, 0), "ok", 1.0)  # 50 in flight: 400 + 400 + 50 fit
    assert all(p.dispatched_at == 1.0 for p in (*heads, lower))
    assert (endpoint.inflight_tokens, endpoint.inflight_requests) == (900, 4)
    assert gate.scheduler.queued() == 0 and gate._single == {}


def test_a_tenant_with_a_parked_request_is_not_light() -> None:
    gate, _ = make_gate(tenants={"capped": TenantRules(max_concurrent=2)})
    admitted(gate, "capped", 600)
    filling = admitted(gate, "flood", 390)  # 990 in flight
    queued = admitted(gate, "capped", 50)  # the head: 990 + 50 > 1000
    parked = admitted(gate, "capped", 5)  # 1 running + 1 queued: at the cap of 2
    assert parked.parked and queued.dispatched_at is None
    assert gate._single == {}
    gate.drop(queued, "cancelled", 1.0)  # the parked one moves into the fair queue, alone
    assert not parked.parked and gate._single == {"capped": parked}
    assert recorded(gate).finishes_of(queued.reservation) == [0]
    gate.pump(1.0)
    assert parked.dispatched_at == 1.0  # 990 + 5 fits
    assert filling.endpoint is parked.endpoint
    assert gate.endpoints[E1].inflight_tokens == 995


@pytest.mark.parametrize("window", [2.0, 0.0])
def test_the_idle_tenant_reserve_keeps_room_for_a_recently_active_light_tenant(
        window: float) -> None:
    gate, _ = make_gate(idle_tenant_reserve=window)
    served = admitted(gate, "light", 60, max_tokens=20, stream=False)  # footprint 60 + 20
    gate.complete(served, Usage(60, 20), "ok", 0.0)
    filling = admitted(gate, "flood", 900, max_tokens=100)
    queued = [admitted(gate, "flood", 400, max_tokens=100) for _ in range(3)]  # each grows to 500
    gate.complete(filling, Usage(900, 0), "ok", 0.5)
    endpoint = gate.endpoints[E1]
    assert queued[0].dispatched_at == 0.5
    if not window:
        # Work-conserving: 400 + 400 fit in 1000, though both are expected to grow to 500.
        assert queued[1].dispatched_at == 0.5 and queued[2].dispatched_at is None
        assert (endpoint.inflight_tokens, endpoint.projected_tokens) == (800, 1000)
        return
    # A second would leave 1000 - 2 × 500 = 0 free, less than light's 80.
    assert queued[1].dispatched_at is None
    assert (endpoint.inflight_tokens, endpoint.projected_tokens) == (400, 500)
    nxt = admitted(gate, "light", 60, max_tokens=20, stream=False, now=1.0)
    assert nxt.dispatched_at == 1.0 and nxt.reserved_tokens == 80  # 60 + its learned 20
    gate.complete(nxt, Usage(60, 20), "ok", 2.5)  # light still recent (1.5 s < 2 s)
    assert queued[1].dispatched_at is None
    gate.complete(queued[0], Usage(400, 100), "ok", 3.5)  # 2.5 s quiet: the reserve lapsed
    assert queued[1].dispatched_at == 3.5 and queued[2].dispatched_at == 3.5


def test_shedding_drops_the_newest_request_of_the_lowest_lane() -> None:
    lanes = (LaneRules(HIGH), LaneRules("mid"), LaneRules(LOW))
    gate, recorder = make_gate(budgets={E1: 100}, lanes=lanes, max_queued=4,
                               shed_lower_lanes=True,
                               tenant_lanes={"m": "mid", "l1": LOW, "l2": LOW, "l3": LOW})
    admitted(gate, "h", 100)  # fills the endpoint
    older = admitted(gate, "l1", 10, now=1.0)
    tied = [admitted(gate, "l2", 10, now=2.0), admitted(gate, "l3", 10, now=2.0)]
    mid = admitted(gate, "m", 10, now=3.0)  # newer, but of a higher lane than low
    assert gate.queued_total() == 4

    new = admitted(gate, "h", 10, now=4.0)
    assert new.dispatched_at is None and gate.queued_total() == 4
    shed = [(p, outcome) for kind, p, outcome in recorder.events if kind == "dropped"]
    assert shed == [(tied[1], "shed")]  # the newest of the lowest lane, by arrival order
    assert tied[1].shed_for == HIGH
    assert recorded(gate).finishes_of(tied[1].reservation) == [0]
    assert admitted(gate, "m", 10, now=5.0).dispatched_at is None
    assert tied[0].shed_for == "mid"  # low before the newer mid
    assert older.outcome is None and mid.outcome is None


def test_a_request_freed_by_shedding_goes_even_when_the_new_one_parks() -> None:
    capped = TenantRules(max_concurrent=1)
    gate, _ = make_gate(budgets={E1: 100}, max_queued=2, shed_lower_lanes=True,
                        tenants={"a": capped, "b": capped},
                        allowed_lanes={"b": frozenset({HIGH, LOW})})
    admitted(gate, "a", 50)
    blocked = admitted(gate, "b", 60, lane=LOW)  # 50 + 60 > 100: waits
    behind = admitted(gate, "b", 10)  # b's cap is 1: parked behind its queued request
    assert behind.parked and gate.queued_total() == 2
    parked = admitted(gate, "a", 10, now=1.0)  # full: sheds b's low request; a is at its cap
    assert blocked.shed_for == HIGH and parked.parked
    # b's parked request entered the fair queue when the shed one left, and 50 + 10 fit.
    assert behind.dispatched_at == 1.0
    assert gate.endpoints[E1].inflight_tokens == 60 and gate.queued_total() == 1


def test_a_full_queue_refuses_new_requests_and_releases_their_reservation() -> None:
    budget = TenantRules(burst=BucketRule(capacity_tokens=1000, refill_seconds=100.0))
    gate, recorder = make_gate(budgets={E1: 100}, max_queued=1, tenants={"b": budget},
                               tenant_lanes={"low": LOW}, shed_lower_lanes=False)
    admitted(gate, "a", 100)
    admitted(gate, "low", 10)  # a lower lane: refuseNew does not shed it
    before = gate.admission.headers("b", 0.0)
    refused = admit(gate, "b", 10, max_tokens=10)
    assert refused == Turnaway(QUEUE_FULL)
    assert [tokens for _, tokens in recorded(gate).finished] == [0]
    assert gate.admission.queued("b") == 0
    assert gate.admission.headers("b", 0.0) == before  # its budget got the estimate back
    assert len(gate.passages) == 2 and not [e for e in recorder.events if e[0] == "dropped"]


def test_no_endpoint_in_service_turns_a_request_away_before_admission() -> None:
    gate, _ = make_gate(budgets={E1: 1000, E2: 1000},
                        health=HealthRules(consecutive_failures=1, base_ejection=10.0))
    assert gate.endpoint_failed(E1, "refused", 0.0)  # ejected: E2 is still in service
    assert not gate.endpoint_failed(E2, "refused", 0.0)  # the last one is never ejected
    assert admit(gate, "a", 10, now=1.0, subset=frozenset({E1})) == Turnaway(NO_ENDPOINT)
    assert gate.admission.queued("a") == 0 and recorded(gate).finished == []
    served = admitted(gate, "a", 10, now=1.0)
    assert served.endpoint is gate.endpoints[E2]
    gate.complete(served, Usage(10, 1), "ok", 1.0)
    gate.set_endpoints({})  # nothing in flight: both are forgotten
    assert gate.endpoints == {}
    assert admit(gate, "a", 10, now=1.0) == Turnaway(NO_ENDPOINT)


def test_pass_through_dispatches_at_once_without_room_or_under_a_cap() -> None:
    gate, _ = make_gate(budgets={E1: 100}, holding=False,
                        tenants={"a": TenantRules(max_concurrent=1)})
    first = admitted(gate, "a", 100)
    second = admitted(gate, "a", 500)  # no room, and past a's cap: still dispatched
    assert first.dispatched_at == second.dispatched_at == 0.0
    assert not second.parked and gate.scheduler.queued() == 0 and gate.queued_total() == 0
    endpoint = gate.endpoints[E1]
    assert (endpoint.inflight_tokens, endpoint.inflight_requests) == (600, 2)
    assert gate.admission.running("a") == 1  # the cap's count is not pushed past it
    gate.complete(second, Usage(500, 3), "ok", 1.0)
    gate.complete(first, Usage(100, 3), "ok", 1.0)
    assert (endpoint.inflight_tokens, endpoint.inflight_requests) == (0, 0)
    assert gate.admission.running("a") == gate.admission.queued("a") == 0


def test_served_by_moves_the_request_to_the_endpoint_that_served_it() -> None:
    gate, recorder = make_gate(budgets={E1: 100, E2: 100})
    first = admitted(gate, "a", 60, max_tokens=40, stream=False)  # 60 + 40 reserved
    e1, e2 = gate.endpoints[E1], gate.endpoints[E2]
    assert first.endpoint is e1
    second = admitted(gate, "b", 100, max_tokens=20)  # a stream: grows to 120
    waiting = admitted(gate, "c", 100)  # no room on either
    assert second.endpoint is e2 and waiting.dispatched_at is None

    assert not gate.served_by(first, E2, 1.0)  # one failure of three: not ejected
    assert first.endpoint is e2 and e1.health.failures == 1
    assert (e2.inflight_tokens, e2.inflight_requests, e2.projected_tokens) == (200, 2, 220)
    # E1 is empty now: the request that waited for room goes there.
    assert waiting.endpoint is e1 and waiting.dispatched_at == 1.0
    assert (e1.inflight_tokens, e1.inflight_requests) == (100, 1)
    assert not gate.served_by(first, E2, 1.0)  # already there: nothing moves
    gate.complete(first, Usage(60, 40), "ok", 2.0)
    assert (e2.inflight_tokens, e2.inflight_requests, e2.projected_tokens) == (100, 1, 120)
    assert recorder.of(first) == ["dispatched", "settled"]


def test_upstream_failed_settles_to_nothing_and_counts_towards_ejection() -> None:
    gate, recorder = make_gate(budgets={E1: 1000, E2: 1000},
                               health=HealthRules(consecutive_failures=2))
    passages = [admitted(gate, "a", 100, max_tokens=50, stream=False) for _ in range(2)]
    assert [p.endpoint.address for p in passages if p.endpoint] == [E1, E2]
    gate.charge_output(passages[0], 30)
    charged, own = gate.scheduler.service["a"], passages[0].request.charged
    assert own > 0 and charged == pytest.approx(2 * own)  # prompt and estimated output each

    assert not gate.upstream_failed(passages[0], "connect failure", 1.0)  # 1 of 2
    settled = [(u, p) for kind, p, u in recorder.events if kind == "settled"]
    assert settled == [(Usage(0, 0, 0), passages[0])]
    assert passages[0].request.charged == 0
    assert gate.scheduler.service["a"] == pytest.approx(charged - own)
    assert recorded(gate).finishes_of(passages[0].reservation) == [0]
    assert gate.endpoints[E1].inflight_tokens == 0
    assert not gate.upstream_failed(passages[0], "connect failure", 1.0)  # settled already

    again = admitted(gate, "a", 100, now=2.0)
    assert again.endpoint is gate.endpoints[E1]
    assert gate.upstream_failed(again, "connect failure", 2.0)  # the second in a row ejects
    assert not gate.endpoints[E1].in_service(2.0)
    assert gate.endpoints[E1].inflight_requests == 0


# -- worst-case reservation through the gate --


def test_n_choices_are_reserved_sized_and_settled_as_n() -> None:
    """``n: 8`` with max_tokens 100: reserved as 8 choices, its expected size on the endpoint
    is 8 choices', and the tenant's output estimate learns one choice's output."""
    budget = TenantRules(burst=BucketRule(capacity_tokens=10_000, refill_seconds=100.0))
    gate, _ = make_gate(budgets={E1: 100_000}, tenants={"a": budget})
    passage = gate.admit(Passage, "a", None, model="m", prompt_tokens=50, max_tokens=100,
                         stream=False, now=0.0, choices=8)
    assert isinstance(passage, Passage) and passage.choices == 8
    assert passage.reservation is not None
    assert passage.reservation.reserved_tokens == 50 + 8 * 100
    assert gate.budget_needs("a", model="m", prompt_tokens=50, max_tokens=100, stream=False,
                             now=0.0, choices=8) == 850
    estimate = gate.expected_output("a", 100, False, 0.0)
    assert passage.projected_tokens == 50 + 8 * estimate
    gate.complete(passage, Usage(50, 8 * 40), "ok", 0.0)
    assert gate.admission.budget_state(0.0)["a"]["burst"][0] == pytest.approx(10_000 - 370)
    one = gate.admit(Passage, "b", None, model="m", prompt_tokens=50, max_tokens=100,
                     stream=False, now=0.0)
    assert isinstance(one, Passage) and one.choices == 1


def test_a_request_without_max_tokens_is_bounded_by_the_model_and_the_budget() -> None:
    budget = TenantRules(burst=BucketRule(capacity_tokens=3000, refill_seconds=60.0))
    gate, _ = make_gate(budgets={E1: 100_000}, tenants={"a": budget, "b": budget})
    # The model's context (2048) bounds it below the budget: reserved, nothing sent.
    small = gate.admit(Passage, "a", None, model="m", prompt_tokens=48, max_tokens=None,
                       stream=True, now=0.0, max_model_len=2048)
    assert isinstance(small, Passage) and small.reservation is not None
    assert small.reservation.reserved_tokens == 2048 and small.max_tokens is None
    # Unknown context: the budget bounds it, and the engine is told (Passage.max_tokens).
    big = gate.admit(Passage, "b", None, model="m", prompt_tokens=100, max_tokens=None,
                     stream=True, now=0.0)
    assert isinstance(big, Passage) and big.max_tokens == 2900 and big.output_cap == 2900
    refused = gate.admit(Passage, "b", None, model="m", prompt_tokens=10, max_tokens=10,
                         stream=True, now=0.0)
    assert isinstance(refused, Refused)
    # Settled to usage: the worst case was only held, never charged.
    gate.complete(big, Usage(100, 200), "ok", 0.0)
    assert gate.admission.budget_state(0.0)["b"]["burst"][0] == pytest.approx(2700)


def test_output_limit_is_the_context_less_the_smaller_prompt_estimate() -> None:
    assert output_limit(None, 10, 10) is None
    assert output_limit(4096, 1000, 800) == 3296
    assert output_limit(4096, 5000, 5000) == 1


# -- a body read after its route (Envoy's STREAMED mode) --


@pytest.mark.parametrize("outcome", ["unmetered", "ok"])
def test_a_lost_count_of_a_body_read_after_its_route_is_settled_on_the_bodys_cap(
        outcome: str) -> None:
    """Admitted on its headers (one non-streaming choice, no cap), the body then asks for at most
    4 tokens: a count lost later is settled on those 4, not on the tenant's whole estimate
    (256 with nothing learned: what CI once charged for such a request)."""
    gate, recorder = make_gate()
    passage = admitted(gate, "a", 20, stream=False)
    assert passage.dispatched_at is not None and passage.output_cap is None
    gate.body_read(passage, 4, stream=False, choices=1)
    gate.complete(passage, None, outcome, 1.0)
    settled = [u for kind, p, u in recorder.events if kind == "settled" and p is passage]
    assert settled == [Usage(20, 4)]


def test_a_streaming_body_read_after_its_route_is_charged_what_was_counted() -> None:
    """The headers said nothing of streaming; the body does: its output is what the meter
    counted (2 tokens), not the non-streaming estimate."""
    gate, recorder = make_gate()
    passage = admitted(gate, "a", 20, stream=False)
    gate.body_read(passage, 50, stream=True, choices=1)
    gate.charge_output(passage, 2, 0.5)
    gate.complete(passage, None, "ok", 1.0)
    settled = [u for kind, p, u in recorder.events if kind == "settled" and p is passage]
    assert settled == [Usage(20, 2)]
    assert passage.stream


def test_a_body_read_after_its_route_shares_admissions_cap_over_its_choices() -> None:
    """Admission capped it at 90 as one choice; the body asks for 3 choices of up to 50: each
    choice may then make 30 (the body is rewritten so), and the passage says so."""
    gate, _ = make_gate(tenants={"a": TenantRules(max_output_tokens=90)})
    passage = admitted(gate, "a", 20, stream=False)
    assert passage.max_tokens == 90
    gate.body_read(passage, 50, stream=False, choices=3)
    assert (passage.output_cap, passage.choices, passage.body_max_tokens) == (30, 3, 50)
    gate.body_read(passage, 10, stream=False, choices=3)  # a smaller own cap of the body wins
    assert passage.output_cap == 10
