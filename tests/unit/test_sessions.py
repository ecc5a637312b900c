"""Programs and sessions as first-class (issue 28 point 5): the session table
(``picker.core.sessions``), the fair queue's order within a tenant (``Request.resumes`` in
``picker.core.vtc``), the gate's use of both (where a session's call goes, which of a tenant's
requests goes first, never another tenant's session), fairness for tenants that make many calls,
and the config that turns it on."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.config.build import gate_rules, session_rules
from picker.config.schema import load_config
from picker.core import LaneSpec, Request, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.prefix import AffinityRules
from picker.core.sessions import (
    MAX_KEY_CHARS,
    SessionRules,
    SessionTable,
    prefer,
    session_key,
)
from picker.core.vtc import VirtualTokenCounter
from picker.errors import ConfigError

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"


# -- the key --

def test_a_key_is_the_header_value_trimmed_and_odd_values_are_no_session() -> None:
    assert session_key(" task-7 ") == "task-7"
    assert session_key(None) is None and session_key("") is None and session_key("  ") is None
    assert session_key("x" * MAX_KEY_CHARS) == "x" * MAX_KEY_CHARS
    assert session_key("x" * (MAX_KEY_CHARS + 1)) is None
    assert session_key("a\x00b") is None and session_key("a\nb") is None


# -- the table --

def test_the_table_remembers_the_last_endpoint_of_each_tenant_scoped_session() -> None:
    table = SessionTable(SessionRules())
    table.dispatched(("a", "s1"), E1, 0.0)
    assert table.endpoint(("a", "s1"), 1.0) == E1
    assert table.endpoint(("b", "s1"), 1.0) is None  # the same key of another tenant
    assert not table.in_progress(("b", "s1"), 1.0) and table.in_progress(("a", "s1"), 1.0)
    table.dispatched(("a", "s1"), E2, 2.0)
    assert table.endpoint(("a", "s1"), 2.0) == E2 and table.calls(("a", "s1")) == 2


def test_the_table_is_bounded_least_recently_used_forgotten_first() -> None:
    table = SessionTable(SessionRules(max_sessions=3))
    for i in range(3):
        table.dispatched(("a", f"s{i}"), E1, float(i))
    table.dispatched(("a", "s0"), E1, 3.0)  # s0 used again: s1 is now the least recent
    table.dispatched(("a", "s3"), E1, 4.0)
    assert len(table) == 3
    assert table.endpoint(("a", "s1"), 4.0) is None
    assert all(table.endpoint(("a", s), 4.0) == E1 for s in ("s0", "s2", "s3"))


def test_entries_expire_after_the_idle_timeout_on_lookup_and_on_prune() -> None:
    table = SessionTable(SessionRules(idle_timeout=10.0))
    table.dispatched(("a", "old"), E1, 0.0)
    table.dispatched(("a", "mid"), E1, 5.0)
    table.dispatched(("a", "new"), E1, 20.0)
    assert table.endpoint(("a", "old"), 10.0) == E1  # at the limit: still live
    assert table.endpoint(("a", "old"), 10.5) is None and len(table) == 2
    assert table.prune(15.5) == 1 and len(table) == 1  # "mid" went, "new" stays
    assert table.in_progress(("a", "new"), 30.0)


def test_an_endpoint_leaving_takes_its_sessions_and_a_retry_moves_one() -> None:
    table = SessionTable(SessionRules())
    table.dispatched(("a", "s1"), E1, 0.0)
    table.dispatched(("a", "s2"), E2, 0.0)
    table.moved(("a", "s2"), E1)
    table.forget_endpoint(E1)
    assert len(table) == 0


class _E:
    def __init__(self, address: str) -> None:
        self.address = address


def test_prefer_moves_the_sessions_endpoint_first_and_never_adds_one() -> None:
    ranked = [_E(E1), _E(E2), _E("c")]
    assert [e.address for e in prefer(ranked, "c")] == ["c", E1, E2]
    assert [e.address for e in prefer([_E(E1), _E(E2)], "gone")] == [E1, E2]
    assert [e.address for e in prefer([_E(E1)], E2)] == [E1]
    assert prefer([], E1) == []


# -- the fair queue's order within a tenant --

def _request(tenant: str, seq: int, resumes: bool = False) -> Request:
    return Request(tenant=tenant, prompt_tokens=1, seq=seq, resumes=resumes)


def test_a_tenants_programs_in_progress_go_before_its_new_ones_oldest_first() -> None:
    policy = VirtualTokenCounter()
    order = [("new", False), ("new2", False), ("r1", True), ("new3", False), ("r2", True)]
    requests = {}
    for seq, (name, resumes) in enumerate(order):
        requests[name] = _request("a", seq, resumes)
        requests[name].id = name
        policy.enqueue(requests[name], 0.0)
    taken = []
    while policy.queued():
        head = policy.peek(0.0)
        assert head is not None
        taken.append(head.id)
        policy.pop(head, 0.0)
    assert taken == ["r1", "r2", "new", "new2", "new3"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.integers(0, 3),
                          st.integers(1, 50)), min_size=1, max_size=60))
def test_which_tenant_goes_next_does_not_depend_on_programs_in_progress(
        events: list[tuple[str, bool, int, int]]) -> None:
    """The same arrivals, dispatches and charges with and without ``resumes`` flags: the fair
    queue picks the same tenant each time, with the same counters, unless two tenants' counters
    are equal (the tie goes to the tenant with the oldest request queued, and which of a
    tenant's requests went before can differ): compared up to the first such tie."""
    plain, flagged = VirtualTokenCounter(), VirtualTokenCounter()
    for seq, (tenant, resumes, dispatches, cost) in enumerate(events):
        for policy, flag in ((plain, False), (flagged, resumes)):
            policy.enqueue(_request(tenant, seq, flag), 0.0)
        for _ in range(dispatches):
            heads = [p.peek(0.0) for p in (plain, flagged)]
            if heads[0] is None:
                assert heads[1] is None
                break
            assert heads[1] is not None
            if heads[0].tenant != heads[1].tenant:
                assert plain.counter(heads[0].tenant) == plain.counter(heads[1].tenant)
                return
            for policy, head in zip((plain, flagged), heads, strict=True):
                assert head is not None
                policy.pop(head, 0.0)
                policy.charge(head.tenant, float(cost))
        assert plain.counters == flagged.counters and plain.queued() == flagged.queued()


def test_programs_in_progress_go_oldest_program_first() -> None:
    policy = VirtualTokenCounter()
    arrivals = [("new", False, 0), ("p3", True, 3), ("p1", True, 1), ("p2", True, 2),
                ("p1-again", True, 1)]
    for seq, (name, resumes, program) in enumerate(arrivals):
        request = _request("a", seq, resumes)
        request.program, request.id = program, name
        policy.enqueue(request, 0.0)
    taken = []
    while (head := policy.peek(0.0)) is not None:
        taken.append(head.id)
        policy.pop(head, 0.0)
    assert taken == ["p1", "p1-again", "p2", "p3", "new"]


# -- the gate --

ON = SessionRules()


def make_gate(sessions: SessionRules | None = ON, budgets: dict[str, int] | None = None,
              affinity: AffinityRules | None = None) -> Gate:
    gate = Gate(GateRules(sessions=sessions, affinity=affinity), Scheduler([LaneSpec("default")]),
                Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints(budgets or {E1: 10_000, E2: 10_000})
    return gate


def send(gate: Gate, tenant: str, session: str | None, prompt: int = 500, now: float = 0.0,
         blocks: tuple[int, ...] = ()) -> Passage:
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt, max_tokens=100,
                         stream=True, now=now, session=session, prefix_blocks=blocks,
                         prefix_chars=len(blocks) * 64)
    assert isinstance(passage, Passage), passage
    return passage


def send_home(gate: Gate, tenant: str, session: str) -> tuple[Passage, str]:
    """A session's first call, dispatched, and the address of the endpoint it went to."""
    passage = send(gate, tenant, session)
    assert passage.endpoint is not None
    return passage, passage.endpoint.address


def load(gate: Gate, address: str, tokens: int) -> None:
    gate.endpoints[address].inflight_tokens += tokens
    gate.endpoints[address].inflight_requests += 1


def other(address: str) -> str:
    return E2 if address == E1 else E1


def test_a_sessions_calls_stay_on_its_endpoint_while_it_has_room() -> None:
    gate = make_gate()
    first, home = send_home(gate, "a", "task-1")
    gate.complete(first, Usage(500, 100), "ok", 1.0)
    load(gate, home, 6_000)  # its endpoint is the busier one now; load alone would leave it
    second = send(gate, "a", "task-1", now=2.0)
    assert second.endpoint is not None and second.endpoint.address == home
    assert second.request.resumes  # an earlier call was dispatched: in progress
    fresh = send(gate, "a", "task-2", now=2.0)
    assert fresh.endpoint is not None and fresh.endpoint.address == other(home)
    assert not fresh.request.resumes


def test_a_session_whose_endpoint_is_full_goes_where_it_fits_never_where_it_does_not() -> None:
    gate = make_gate()
    _, home = send_home(gate, "a", "task-1")
    load(gate, home, 9_800)  # its call no longer fits there
    second = send(gate, "a", "task-1", prompt=500, now=1.0)
    assert second.endpoint is not None and second.endpoint.address == other(home)
    # Its context is now on the other endpoint: the next call follows it there.
    third = send(gate, "a", "task-1", now=2.0)
    assert third.endpoint is not None and third.endpoint.address == other(home)


def test_another_tenant_sending_the_same_key_neither_steers_nor_rides_the_session() -> None:
    gate = make_gate()
    _, home = send_home(gate, "a", "shared-id")
    load(gate, home, 4_000)
    theirs = send(gate, "b", "shared-id", now=1.0)
    assert theirs.endpoint is not None and theirs.endpoint.address == other(home)
    assert not theirs.request.resumes  # not "in progress": it is b's first call
    # and b's call did not move a's session
    again = send(gate, "a", "shared-id", now=2.0)
    assert again.endpoint is not None and again.endpoint.address == home
    assert gate.sessions is not None and gate.sessions.calls(("a", "shared-id")) == 2
    assert gate.sessions.calls(("b", "shared-id")) == 1


@pytest.mark.parametrize("sessions", [SessionRules(), None])
def test_session_stickiness_comes_before_prefix_affinity(sessions: SessionRules | None) -> None:
    gate = make_gate(sessions=sessions, affinity=AffinityRules(weight=1.0, block_chars=64))
    blocks = tuple(range(1, 30))
    other_program = send(gate, "a", "p-1", blocks=blocks)
    assert other_program.endpoint is not None
    prefix_home = other_program.endpoint.address
    load(gate, prefix_home, 2_000)
    program = send(gate, "a", "p-2", now=1.0)  # no shared prefix: goes by load
    assert program.endpoint is not None and program.endpoint.address == other(prefix_home)
    # Its next call carries the prefix the other endpoint holds: with sessions its own
    # context wins; without, the call follows the prefix.
    call = send(gate, "a", "p-2", blocks=blocks, now=2.0)
    assert call.endpoint is not None
    assert call.endpoint.address == (prefix_home if sessions is None else other(prefix_home))


def test_in_the_gate_a_tenants_program_in_progress_overtakes_its_new_programs_only() -> None:
    gate = make_gate(budgets={E1: 1_000})
    running = send(gate, "a", "task-1", prompt=900)  # fills the only endpoint
    assert running.dispatched_at is not None
    new_a = send(gate, "a", "task-2", prompt=600, now=1.0)
    b = send(gate, "b", "task-9", prompt=600, now=1.0)
    resumed = send(gate, "a", "task-1", prompt=600, now=2.0)
    assert resumed.request.resumes and not new_a.request.resumes
    order = []
    now = 3.0
    for passage in (running, None, None):
        if passage is None:
            passage = next(p for p in gate.passages.values() if p.dispatched_at is not None)
        gate.complete(passage, Usage(passage.request.prompt_tokens, 10), "ok", now)
        now += 1.0
        order.extend(p for p in (new_a, b, resumed)
                     if p.dispatched_at is not None and p not in order)
    # b's turn comes as the fair queue says (a was served 910, b nothing); within a, the
    # call of the program in progress goes before a's new program.
    assert order == [b, resumed, new_a]


def test_at_its_concurrency_cap_a_tenants_program_in_progress_leaves_the_parking_first() -> None:
    gate = Gate(GateRules(sessions=ON), Scheduler([LaneSpec("default")]),
                Admission({"a": TenantRules(max_concurrent=1)}, TenantRules()), now=0.0)
    gate.set_endpoints({E1: 10_000})
    first = send(gate, "a", "task-1")
    assert first.dispatched_at is not None
    new_program = send(gate, "a", "task-2", now=1.0)
    resumed = send(gate, "a", "task-1", now=2.0)
    assert new_program.parked and resumed.parked and resumed.request.resumes
    gate.complete(first, Usage(500, 10), "ok", 3.0)
    assert resumed.dispatched_at is not None and new_program.dispatched_at is None
    gate.complete(resumed, Usage(500, 10), "ok", 4.0)
    assert new_program.dispatched_at is not None


def test_without_resume_first_the_tenants_oldest_goes_first_and_stickiness_stays() -> None:
    gate = make_gate(sessions=SessionRules(resume_first=False), budgets={E1: 1_000})
    send(gate, "a", "task-1", prompt=900)
    new_a = send(gate, "a", "task-2", prompt=600, now=1.0)
    resumed = send(gate, "a", "task-1", prompt=600, now=2.0)
    assert not resumed.request.resumes and not new_a.request.resumes


def test_sessions_off_ignores_the_key() -> None:
    gate = make_gate(sessions=None)
    first = send(gate, "a", "task-1")
    assert first.session is None and gate.sessions is None


def test_a_drained_endpoint_takes_its_sessions_with_it() -> None:
    gate = make_gate()
    first, home = send_home(gate, "a", "task-1")
    gate.complete(first, Usage(500, 100), "ok", 1.0)
    gate.set_endpoints({other(home): 10_000})
    assert gate.sessions is not None and len(gate.sessions) == 0


# -- fairness for tenants that make many calls --

def _run_programs(calls: dict[str, int], rng: random.Random, resume_first: bool,
                  open_tasks: int = 4, completions: int = 600) -> tuple[dict[str, float], float]:
    """Tenants each keep ``open_tasks`` programs of ``calls[tenant]`` calls going (a call is
    sent when the previous one is answered; a new program when one ends) on one endpoint that
    fits a few calls. Returns each tenant's service and the largest cost of one request."""
    gate = make_gate(sessions=SessionRules(resume_first=resume_first), budgets={E1: 2_000})
    progress: dict[tuple[str, str], int] = {}
    started = {tenant: 0 for tenant in calls}
    largest = 0.0
    now = 0.0

    def call(tenant: str, key: str) -> None:
        nonlocal largest
        prompt, output = rng.randint(50, 300), rng.randint(10, 100)
        largest = max(largest, prompt + 2.0 * output)
        passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                             max_tokens=output, stream=False, now=now, session=key)
        assert isinstance(passage, Passage)

    def start(tenant: str) -> None:
        key = f"{tenant}-{started[tenant]}"
        started[tenant] += 1
        progress[(tenant, key)] = 1
        call(tenant, key)

    for tenant in calls:
        for _ in range(open_tasks):
            start(tenant)
    for _ in range(completions):
        running = [p for p in gate.passages.values() if p.dispatched_at is not None]
        passage = min(running, key=lambda p: p.dispatch_seq)
        now += 0.1
        gate.complete(passage, Usage(passage.request.prompt_tokens,
                                     passage.body_max_tokens or 1), "ok", now)
        assert passage.session is not None
        tenant, key = passage.session
        if progress[(tenant, key)] < calls[tenant]:
            progress[(tenant, key)] += 1
            call(tenant, key)
        else:
            start(tenant)
    return dict(gate.scheduler.service), largest


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 30), st.integers(0, 2**32 - 1), st.booleans())
def test_many_calls_per_task_buy_no_more_than_the_weighted_share(k: int, seed: int,
                                                                  resume_first: bool) -> None:
    """A tenant whose programs make k calls each and one whose make a single call, equal
    weights, both always backlogged: their service differs by no more than VTC's bound,
    2·max(w_p·L, w_q·M) (L the largest prompt, 300; M the endpoint's KV budget, 2,000), with
    its programs in progress first or not, and by under 5 % of either's."""
    service, _ = _run_programs({"many": k, "one": 1}, random.Random(seed), resume_first,
                               open_tasks=8)
    assert abs(service["many"] - service["one"]) <= 2 * max(1 * 300, 2 * 2_000)
    assert abs(service["many"] - service["one"]) < 0.05 * min(service.values())


def test_three_tenants_of_1_10_and_30_calls_share_equally() -> None:
    service, _ = _run_programs({"k1": 1, "k10": 10, "k30": 30}, random.Random(28), True,
                               open_tasks=8, completions=900)
    mean = sum(service.values()) / 3
    assert all(abs(s - mean) <= 2 * max(1 * 300, 2 * 2_000) for s in service.values()), service
    assert all(abs(s - mean) / mean < 0.05 for s in service.values()), service


# -- the config --

def test_routing_sessions_maps_to_the_gates_rules() -> None:
    config = load_config({"routing": {"sessions": {"header": "x-program-id", "maxSessions": 10,
                                                   "idleTimeout": "2m", "sticky": False,
                                                   "resumeFirst": False}}})
    assert config.routing.sessions is not None
    assert config.routing.sessions.header == "x-program-id"
    assert session_rules(config) == SessionRules(max_sessions=10, idle_timeout=120.0,
                                                 sticky=False, resume_first=False)
    assert gate_rules(config).sessions == session_rules(config)
    on = load_config({"routing": {"sessions": {}}})
    assert session_rules(on) == SessionRules() and on.routing.sessions is not None
    assert on.routing.sessions.header == "x-session-id"
    assert gate_rules(load_config({})).sessions is None


@pytest.mark.parametrize(("sections", "path"), [
    ({"routing": {"sessions": {"header": "X Session"}}}, "routing.sessions.header"),
    ({"routing": {"sessions": {"maxSessions": 0}}}, "routing.sessions.maxSessions"),
    ({"routing": {"sessions": {"idleTimeout": "0s"}}}, "routing.sessions.idleTimeout"),
    ({"routing": {"sessions": {"ttl": "5m"}}}, "routing.sessions.ttl"),
])
def test_a_bad_sessions_section_names_its_path(sections: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(sections)
    assert caught.value.path == path
