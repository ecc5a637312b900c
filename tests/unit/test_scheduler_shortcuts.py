"""The scheduler's shortcuts for the fast replay (``picker.whatif.fast``), each leaving what the
calls it stands for leave: ``dispatch_alone`` (a request that finds every lane empty is queued
and dispatched in one step) and ``finish_tokens`` (``finish`` without a ``Usage``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core import LaneSpec, Request, Scheduler
from picker.core.cost import ContextAwareCost
from picker.core.request import Usage

LANES = (LaneSpec("hi"), LaneSpec("lo", min_share=0.2))
TENANTS = ("a", "b", "c")


def _pair(policy: str) -> tuple[Scheduler, Scheduler]:
    made = []
    for _ in range(2):
        scheduler = Scheduler(LANES, policy=policy)
        scheduler.set_weight("b", 2.0)
        made.append(scheduler)
    return made[0], made[1]


def _state(scheduler: Scheduler) -> tuple[object, ...]:
    lanes = scheduler._lanes
    return (sorted(scheduler.counters()), sorted(scheduler.service.items()),
            [(lane.own_service, lane.total_service) for lane in lanes],
            [getattr(lane.policy, "_last_left", None) for lane in lanes],
            [getattr(lane.policy, "lift_floor", lambda: None)() for lane in lanes],
            scheduler.queued())


# One step: (kind, tenant index, lane index, size). Kinds: "send" (queue, or dispatch at once
# when nothing is queued), "pump" (dispatch the head), "finish" (the oldest running ends).
STEPS = st.lists(st.tuples(st.sampled_from(("send", "send", "pump", "finish", "charge")),
                           st.integers(0, 2), st.integers(0, 1), st.integers(1, 300)),
                 max_size=60)


@settings(max_examples=150, deadline=None)
@given(steps=STEPS, policy=st.sampled_from(("vtc", "lcf", "fcfs")),
       shared=st.one_of(st.none(), st.floats(0, 500)))
def test_dispatch_alone_leaves_what_enqueue_then_dispatch_leave(
        steps: list[tuple[str, int, int, int]], policy: str, shared: float | None) -> None:
    plain, short = _pair(policy)
    if shared is not None:
        for scheduler in (plain, short):
            scheduler.set_shared_floors({"hi": shared, "lo": shared})
    running: list[tuple[Request, Request]] = []
    queued: list[tuple[Request, Request]] = []
    now = 0.0
    for kind, tenant, lane, size in steps:
        now += 1.0
        if kind == "send":
            one, two = (Request(tenant=TENANTS[tenant], prompt_tokens=size,
                                lane=LANES[lane].name, arrival=now) for _ in range(2))
            if not plain.queued():
                plain.enqueue(one, now)
                assert plain.peek(now) is one  # what dispatch_alone stands for
                plain.dispatch(one, now)
                assert short.dispatch_alone(two, now)
                running.append((one, two))
            else:
                assert not short.dispatch_alone(two, now)
                assert two.state == "new"  # nothing changed: it is queued as usual
                plain.enqueue(one, now)
                short.enqueue(two, now)
                queued.append((one, two))
        elif kind == "pump" and plain.queued():
            head = plain.peek(now)
            pair = next(p for p in queued if p[0] is head)
            assert short.peek(now) is pair[1]
            plain.dispatch(pair[0], now)
            short.dispatch(pair[1], now)
            queued.remove(pair)
            running.append(pair)
        elif kind == "charge" and running:
            for request in running[0]:
                (plain if request is running[0][0] else short).charge_output(request, size)
        elif kind == "finish" and running:
            one, two = running.pop(0)
            plain.finish(one, Usage(one.prompt_tokens, size))
            short.finish(two, Usage(two.prompt_tokens, size))
        assert _state(plain) == _state(short)
        assert (plain.peek(now) is None) == (short.peek(now) is None)
    for one, two in running:
        assert (one.seq, one.charged, one.state) == (two.seq, two.charged, two.state)


def test_a_returning_tenant_is_lifted_to_the_last_leavers_counter() -> None:
    scheduler = Scheduler()
    first = Request(tenant="a", prompt_tokens=100)
    assert scheduler.dispatch_alone(first, 0.0)
    assert scheduler.counter("a") == 100.0
    second = Request(tenant="b", prompt_tokens=10)
    assert scheduler.dispatch_alone(second, 1.0)
    # b enters at a's counter (a left last), then pays its prompt.
    assert scheduler.counter("b") == 110.0
    assert (first.state, second.state) == ("running", "running")
    assert second.seq == first.seq + 1


def test_it_declines_while_anything_is_queued_or_the_policy_may_decline() -> None:
    scheduler = Scheduler([LaneSpec("hi"), LaneSpec("lo")])
    waiting = Request(tenant="a", prompt_tokens=1, lane="lo")
    scheduler.enqueue(waiting, 0.0)
    newcomer = Request(tenant="b", prompt_tokens=1, lane="hi")
    assert not scheduler.dispatch_alone(newcomer, 0.0)
    assert newcomer.state == "new" and scheduler.counter("b", "hi") == 0.0
    rpm = Scheduler(policy="rpm", limit=1, window=60)
    assert not rpm.dispatch_alone(Request(tenant="a", prompt_tokens=1), 0.0)
    shared = Scheduler()
    shared.track_changes()  # a shared store records the lift: the plain path does that
    assert not shared.dispatch_alone(Request(tenant="a", prompt_tokens=1), 0.0)


def test_it_refuses_what_enqueue_refuses() -> None:
    scheduler = Scheduler()
    with pytest.raises(KeyError):
        scheduler.dispatch_alone(Request(tenant="a", prompt_tokens=1, lane="nope"), 0.0)
    request = Request(tenant="a", prompt_tokens=1)
    assert scheduler.dispatch_alone(request, 0.0)
    with pytest.raises(ValueError):
        scheduler.dispatch_alone(request, 0.0)  # not new any more
    for policy in ("vtc", "fcfs"):
        busy = Scheduler(policy=policy)
        busy.enqueue(Request(tenant="a", prompt_tokens=1), 0.0)
        with pytest.raises(ValueError):  # the policy's own guard
            busy.policy("default").take_alone(  # type: ignore[attr-defined]
                Request(tenant="b", prompt_tokens=1))


@pytest.mark.parametrize("estimate", [0, 10, 500])
def test_finish_tokens_is_finish_with_a_usage(estimate: int) -> None:
    ends = []
    for shortcut in (False, True):
        scheduler = Scheduler(cost=ContextAwareCost(context_beta=0.01))
        request = Request(tenant="a", prompt_tokens=120, cached_prompt_tokens=20)
        scheduler.enqueue(request, 0.0)
        scheduler.dispatch(request, 0.0)
        scheduler.charge_estimate(request, estimate)
        scheduler.charge_output(request, 30)
        if shortcut:
            scheduler.finish_tokens(request, 120, 75, 20)
        else:
            scheduler.finish(request, Usage(120, 75, 20))
        ends.append((scheduler.counter("a"), scheduler.service["a"], request.charged,
                     request.generated, request.estimated_output, request.state))
    assert ends[0] == ends[1] and ends[0][-1] == "done"
    with pytest.raises(ValueError):
        scheduler.finish_tokens(request, 1, 1)  # not running any more
