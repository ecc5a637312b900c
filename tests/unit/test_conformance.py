"""One conformance suite for every fairness policy behind ``picker.core.Scheduler``.

Each property below is asserted only for the policies it applies to (``APPLIES``). ``rpm`` runs
twice: with an unlimited limit (then it is plain FCFS and work-conserving) and with a finite limit
(``rpm-limited``), which holds requests on purpose and so is exempt from work conservation.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from picker.core import POLICIES, LaneSpec, LinearCost, Request, Scheduler, Usage, make_policy


@dataclass(frozen=True)
class PolicyCase:
    """A policy name plus the constructor options one conformance run uses."""

    key: str
    policy: str
    options: dict[str, float] = field(default_factory=dict)
    window: float = math.inf
    """How far ``now`` must advance for a held request to become dispatchable (rpm's window)."""


CASES: dict[str, PolicyCase] = {
    "vtc": PolicyCase("vtc", "vtc"),
    "lcf": PolicyCase("lcf", "lcf"),
    "fcfs": PolicyCase("fcfs", "fcfs"),
    "rpm": PolicyCase("rpm", "rpm", {"limit": math.inf}),
    "rpm-limited": PolicyCase("rpm-limited", "rpm", {"limit": 2.0, "window": 10.0}, window=10.0),
}

ALL = frozenset(CASES)
WORK_CONSERVING = ALL - {"rpm-limited"}

# Which property applies to which policy case.
APPLIES: dict[str, frozenset[str]] = {
    # rpm-limited dispatches everything too, once ``now`` moves past its windows.
    "dispatch_exactly_once": ALL,
    "tenant_fifo": ALL,
    # rpm-limited returns None while every queued tenant is over its limit.
    "peek_none_iff_empty": WORK_CONSERVING,
    "peek_none_when_empty": ALL,
    "cancel_queued": ALL,
    "cancel_running": ALL,
    "settle": ALL,
    "estimate_then_output": ALL,
    "weight_division": ALL,
    "weight_change": ALL,
    # A lane whose rpm tenants are all over their limit lets lower lanes through.
    "strict_priority": WORK_CONSERVING,
    "min_share": WORK_CONSERVING,
    "errors": ALL,
}


def cases_for(prop: str) -> list[object]:
    """``pytest.param`` per policy case the property applies to, with the case key as id."""
    return [pytest.param(CASES[key], id=key) for key in CASES if key in APPLIES[prop]]


def make(case: PolicyCase, lanes: list[LaneSpec] | None = None,
         weights: dict[str, float] | None = None) -> Scheduler:
    """A scheduler with the paper's linear cost (w_p=1, w_q=2) running ``case``'s policy."""
    return Scheduler(
        lanes=lanes if lanes is not None else [LaneSpec("default")],
        policy=case.policy,
        cost=LinearCost(1.0, 2.0),
        weights=weights,
        **case.options,
    )


def next_dispatchable(scheduler: Scheduler, case: PolicyCase, now: float) -> tuple[Request, float]:
    """The request ``peek`` offers, advancing ``now`` by whole windows while the policy holds."""
    for _ in range(1000):
        chosen = scheduler.peek(now)
        if chosen is not None:
            return chosen, now
        assert case.window != math.inf, "a work-conserving policy held a queued request"
        now = (now // case.window + 1) * case.window
    raise AssertionError("nothing became dispatchable")


def drain(scheduler: Scheduler, case: PolicyCase, now: float) -> tuple[list[Request], float]:
    """Dispatch everything still queued, in the scheduler's order."""
    out: list[Request] = []
    while scheduler.queued():
        chosen, now = next_dispatchable(scheduler, case, now)
        assert chosen.state == "queued"
        scheduler.dispatch(chosen, now)
        out.append(chosen)
    return out, now


def test_conformance_table_covers_every_registered_policy() -> None:
    assert {case.policy for case in CASES.values()} == set(POLICIES)
    for prop, keys in APPLIES.items():
        assert keys <= ALL, prop
        assert keys, prop


# -- every request dispatched exactly once --


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", cases_for("dispatch_exactly_once"))
def test_every_enqueued_request_is_dispatched_exactly_once_or_cancelled(
    case: PolicyCase, seed: int
) -> None:
    rng = random.Random(seed)
    scheduler = make(case, lanes=[LaneSpec("high"), LaneSpec("low")])
    enqueued: list[Request] = []
    dispatched: list[Request] = []
    cancelled: list[Request] = []
    running: list[Request] = []
    now = 0.0
    for i in range(300):
        op = rng.random()
        if op < 0.45:
            request = Request(tenant=rng.choice("abcd"), prompt_tokens=rng.randint(1, 50),
                              lane=rng.choice(["high", "low"]), id=str(i))
            scheduler.enqueue(request, now)
            enqueued.append(request)
        elif op < 0.75 and scheduler.queued():
            chosen, now = next_dispatchable(scheduler, case, now)
            assert chosen.state == "queued"
            scheduler.dispatch(chosen, now)
            dispatched.append(chosen)
            running.append(chosen)
        elif op < 0.85:
            queued = [r for r in enqueued if r.state == "queued"]
            if queued:
                victim = rng.choice(queued)
                scheduler.cancel(victim)
                cancelled.append(victim)
        elif running:
            request = running.pop(rng.randrange(len(running)))
            scheduler.charge_output(request, rng.randint(1, 5))
            scheduler.finish(request)
        now += 1.0
    rest, _ = drain(scheduler, case, now)
    dispatched += rest

    counts = Counter(id(r) for r in dispatched)
    assert all(n == 1 for n in counts.values())
    assert not set(counts) & {id(r) for r in cancelled}
    assert set(counts) | {id(r) for r in cancelled} == {id(r) for r in enqueued}
    assert scheduler.queued() == 0
    assert scheduler.peek(now + 10_000) is None


# -- per-tenant FIFO --


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", cases_for("tenant_fifo"))
def test_each_tenant_is_served_in_its_own_arrival_order(case: PolicyCase, seed: int) -> None:
    rng = random.Random(100 + seed)
    scheduler = make(case, weights={"a": 1.0, "b": 2.0, "c": 3.0})
    enqueued: dict[str, list[Request]] = {t: [] for t in "abc"}
    served: dict[str, list[Request]] = {t: [] for t in "abc"}
    now = 0.0
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            tenant = rng.choice("abc")
            request = Request(tenant=tenant, prompt_tokens=rng.randint(1, 200))
            scheduler.enqueue(request, now)
            enqueued[tenant].append(request)
        elif op < 0.9 and scheduler.queued():
            chosen, now = next_dispatchable(scheduler, case, now)
            scheduler.dispatch(chosen, now)
            served[chosen.tenant].append(chosen)
            # Uneven output charges reorder tenants for counter-based policies.
            scheduler.charge_output(chosen, rng.randint(0, 300))
            scheduler.finish(chosen)
        else:
            queued = [r for rs in enqueued.values() for r in rs if r.state == "queued"]
            if queued:
                scheduler.cancel(rng.choice(queued))
        now += 1.0
    rest, _ = drain(scheduler, case, now)
    for request in rest:
        served[request.tenant].append(request)
    for tenant in "abc":
        expected = [r for r in enqueued[tenant] if r.state != "cancelled"]
        assert [r.seq for r in served[tenant]] == [r.seq for r in expected]


# -- peek and work conservation --


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", cases_for("peek_none_iff_empty"))
def test_peek_returns_none_exactly_when_nothing_is_queued(case: PolicyCase, seed: int) -> None:
    rng = random.Random(200 + seed)
    scheduler = make(case, lanes=[LaneSpec("high"), LaneSpec("mid", 0.3), LaneSpec("low")])
    assert scheduler.peek(0.0) is None
    queued: list[Request] = []
    for step in range(400):
        now = float(step)
        op = rng.random()
        if op < 0.45:
            request = Request(tenant=rng.choice("abcde"), prompt_tokens=rng.randint(1, 64),
                              lane=rng.choice(["high", "mid", "low"]))
            scheduler.enqueue(request, now)
            queued.append(request)
        elif op < 0.8:
            chosen = scheduler.peek(now)
            if chosen is not None:
                scheduler.dispatch(chosen, now)
                scheduler.charge_output(chosen, rng.randint(0, 50))
                scheduler.finish(chosen)
        else:
            waiting = [r for r in queued if r.state == "queued"]
            if waiting:
                scheduler.cancel(rng.choice(waiting))
        chosen = scheduler.peek(now)
        assert (chosen is None) == (scheduler.queued() == 0)
        if chosen is not None:
            assert chosen.state == "queued"
            assert scheduler.peek(now) is chosen  # peek does not change the decision


@pytest.mark.parametrize("case", cases_for("peek_none_when_empty"))
def test_peek_is_none_when_queue_is_empty_or_emptied(case: PolicyCase) -> None:
    scheduler = make(case)
    assert scheduler.peek(0.0) is None
    a = Request(tenant="a", prompt_tokens=10)
    b = Request(tenant="b", prompt_tokens=10)
    scheduler.enqueue(a, 0.0)
    scheduler.enqueue(b, 0.0)
    scheduler.dispatch(a, 0.0)
    scheduler.cancel(b)
    assert scheduler.queued() == 0
    assert scheduler.peek(0.0) is None
    assert scheduler.peek(1e6) is None


# -- cancellation --


@pytest.mark.parametrize("case", cases_for("cancel_queued"))
def test_cancelling_a_queued_request_removes_it_and_charges_nothing(case: PolicyCase) -> None:
    scheduler = make(case)
    a1 = Request(tenant="a", prompt_tokens=100)
    b1 = Request(tenant="b", prompt_tokens=100)
    a2 = Request(tenant="a", prompt_tokens=100)
    a3 = Request(tenant="a", prompt_tokens=100)
    for request in (a1, b1, a2, a3):
        scheduler.enqueue(request, 0.0)
    service = dict(scheduler.service)
    counters = {t: scheduler.counter(t) for t in "ab"}

    scheduler.cancel(a2)  # from the middle of a's queue
    scheduler.cancel(a1)  # a's head
    assert a1.state == a2.state == "cancelled"
    assert a1.charged == a2.charged == 0.0
    assert scheduler.queued() == 2
    assert scheduler.service == service
    assert {t: scheduler.counter(t) for t in "ab"} == counters

    scheduler.cancel(a1)  # a second cancel is a no-op
    assert scheduler.queued() == 2
    served, _ = drain(scheduler, case, 0.0)
    assert sorted(r.seq for r in served) == sorted([b1.seq, a3.seq])


@pytest.mark.parametrize("case", cases_for("cancel_running"))
def test_cancelling_a_running_request_settles_to_what_was_generated(case: PolicyCase) -> None:
    scheduler = make(case)
    request = Request(tenant="a", prompt_tokens=100, max_output_tokens=500)
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    scheduler.charge_estimate(request, 50)  # charged ahead: 100 output service
    scheduler.charge_output(request, 7)
    assert scheduler.service["a"] == 100 + 2 * 50

    scheduler.cancel(request)
    assert request.state == "cancelled"
    assert request.charged == 100 + 2 * 7
    assert scheduler.service["a"] == 100 + 2 * 7
    assert scheduler.counter("a") == 100 + 2 * 7

    scheduler.cancel(request)  # already cancelled: nothing changes
    assert scheduler.service["a"] == 100 + 2 * 7


# -- settle, estimates --


@pytest.mark.parametrize("case", cases_for("settle"))
def test_settle_adds_the_difference_to_actual_usage_even_when_negative(case: PolicyCase) -> None:
    scheduler = make(case, weights={"a": 2.0})
    request = Request(tenant="a", prompt_tokens=100)
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    scheduler.charge_output(request, 30)
    assert scheduler.service["a"] == 160

    assert scheduler.settle(request, Usage(100, 10)) == -40
    assert scheduler.service["a"] == 120
    assert request.charged == 120
    assert scheduler.counter("a") == 60

    assert scheduler.settle(request, Usage(100, 50)) == 80
    assert scheduler.service["a"] == 200
    assert scheduler.counter("a") == 100

    assert scheduler.settle(request, Usage(100, 50)) == 0
    assert scheduler.service["a"] == 200


@pytest.mark.parametrize("case", cases_for("estimate_then_output"))
def test_estimate_then_output_never_double_charges_and_finish_settles_to_actual(
    case: PolicyCase,
) -> None:
    scheduler = make(case)
    request = Request(tenant="a", prompt_tokens=10)
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    assert scheduler.service["a"] == 10

    scheduler.charge_estimate(request, 20)
    assert scheduler.service["a"] == 10 + 40
    scheduler.charge_estimate(request, 20)  # same estimate again
    scheduler.charge_estimate(request, 15)  # a lower one
    assert scheduler.service["a"] == 50
    for _ in range(20):
        scheduler.charge_output(request, 1)  # produced tokens already covered by the estimate
    assert scheduler.service["a"] == 50
    scheduler.charge_output(request, 5)  # beyond the estimate
    assert scheduler.service["a"] == 50 + 10
    scheduler.charge_estimate(request, 22)  # below what was produced
    assert scheduler.service["a"] == 60

    scheduler.finish(request)
    assert request.state == "done"
    assert scheduler.service["a"] == 10 + 2 * 25
    assert scheduler.counter("a") == 10 + 2 * 25


@pytest.mark.parametrize("case", cases_for("estimate_then_output"))
def test_finish_refunds_an_estimate_that_was_too_high(case: PolicyCase) -> None:
    scheduler = make(case)
    request = Request(tenant="a", prompt_tokens=10)
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    scheduler.charge_estimate(request, 100)
    scheduler.charge_output(request, 8)
    assert scheduler.service["a"] == 10 + 200
    scheduler.finish(request)
    assert scheduler.service["a"] == 10 + 16
    assert scheduler.counter("a") == 10 + 16


@pytest.mark.parametrize("case", cases_for("estimate_then_output"))
def test_finish_with_reported_usage_overrides_the_counted_tokens(case: PolicyCase) -> None:
    scheduler = make(case)
    request = Request(tenant="a", prompt_tokens=10)
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    scheduler.charge_estimate(request, 30)
    scheduler.charge_output(request, 4)
    scheduler.finish(request, Usage(prompt_tokens=12, completion_tokens=9))
    assert scheduler.service["a"] == 12 + 18
    assert request.charged == 12 + 18


# -- weights --


@pytest.mark.parametrize("case", cases_for("weight_division"))
def test_counters_are_divided_by_weight_while_service_is_not(case: PolicyCase) -> None:
    scheduler = make(case, weights={"a": 2.0, "b": 0.5})
    requests = [Request(tenant=tenant, prompt_tokens=100) for tenant in "abc"]
    for request in requests:  # all queued before any is charged: no VTC lift in play
        scheduler.enqueue(request, 0.0)
    for request in requests:
        scheduler.dispatch(request, 0.0)
        scheduler.charge_output(request, 10)
        scheduler.finish(request)
    assert scheduler.service == {"a": 120.0, "b": 120.0, "c": 120.0}
    assert scheduler.counter("a") == 60.0
    assert scheduler.counter("b") == 240.0
    assert scheduler.counter("c") == 120.0  # no weight configured: weighs 1


@pytest.mark.parametrize("case", cases_for("weight_change"))
def test_weight_change_keeps_the_counter_and_later_charges_use_the_new_weight(
    case: PolicyCase,
) -> None:
    scheduler = make(case, weights={"a": 2.0})
    request = Request(tenant="a", prompt_tokens=100)
    scheduler.enqueue(request, 0.0)
    scheduler.dispatch(request, 0.0)
    assert scheduler.counter("a") == 50.0

    scheduler.set_weight("a", 4.0)
    assert scheduler.counter("a") == 50.0
    assert scheduler.service["a"] == 100.0

    scheduler.charge_output(request, 10)  # 20 service at weight 4
    assert scheduler.counter("a") == 55.0
    scheduler.settle(request, Usage(100, 2))  # -16 service at weight 4
    assert scheduler.counter("a") == 51.0
    assert scheduler.service["a"] == 104.0


# -- lanes --


@pytest.mark.parametrize("case", cases_for("strict_priority"))
def test_lower_lane_waits_while_a_higher_lane_has_queued_requests(case: PolicyCase) -> None:
    scheduler = make(case, lanes=[LaneSpec("high"), LaneSpec("low")])
    low = [Request(tenant="x", prompt_tokens=1, lane="low") for _ in range(3)]
    high = [Request(tenant=t, prompt_tokens=500, lane="high") for t in "abab"]
    for request in low + high:  # low arrived first and its tenant has the smallest counter
        scheduler.enqueue(request, 0.0)
    order = []
    while scheduler.queued():
        chosen = scheduler.peek(0.0)
        assert chosen is not None
        if scheduler.queued("high"):
            assert chosen.lane == "high"
        scheduler.dispatch(chosen, 0.0)
        order.append(chosen.lane)
    assert order == ["high"] * 4 + ["low"] * 3


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", cases_for("strict_priority"))
def test_strict_priority_holds_under_random_traffic(case: PolicyCase, seed: int) -> None:
    rng = random.Random(300 + seed)
    lanes = ["l0", "l1", "l2"]
    scheduler = make(case, lanes=[LaneSpec(name) for name in lanes])
    for step in range(400):
        if rng.random() < 0.55:
            scheduler.enqueue(Request(tenant=rng.choice("abc"), prompt_tokens=rng.randint(1, 99),
                                      lane=rng.choice(lanes)), float(step))
        chosen = scheduler.peek(float(step))
        if chosen is None:
            continue
        highest = next(name for name in lanes if scheduler.queued(name))
        assert chosen.lane == highest
        if rng.random() < 0.5:
            scheduler.dispatch(chosen, float(step))
            scheduler.charge_output(chosen, rng.randint(0, 40))
            scheduler.finish(chosen)


def _serve_two_lanes(case: PolicyCase, min_share: float, rounds: int, seed: int) -> float:
    """Keep both lanes backlogged, serve ``rounds`` requests; the low lane's share of service."""
    rng = random.Random(seed)
    scheduler = make(case, lanes=[LaneSpec("high"), LaneSpec("low", min_share)])

    def refill(tenant: str, lane: str) -> None:
        scheduler.enqueue(Request(tenant=tenant, prompt_tokens=rng.randint(5, 60), lane=lane), 0.0)

    for tenant, lane in (("a", "high"), ("b", "high"), ("a", "high"), ("b", "high"),
                         ("low", "low"), ("low", "low")):
        refill(tenant, lane)
    for _ in range(rounds):
        chosen = scheduler.peek(0.0)
        assert chosen is not None
        scheduler.dispatch(chosen, 0.0)
        refill(chosen.tenant, chosen.lane)  # keep every lane backlogged
        scheduler.charge_output(chosen, rng.randint(1, 60))
        scheduler.finish(chosen)
    return scheduler.service.get("low", 0.0) / sum(scheduler.service.values())


@pytest.mark.parametrize("min_share", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("case", cases_for("min_share"))
def test_lane_with_min_share_gets_its_fraction_while_higher_lane_is_backlogged(
    case: PolicyCase, min_share: float
) -> None:
    share = _serve_two_lanes(case, min_share, rounds=600, seed=7)
    # At least its fraction (minus one request's granularity), but not much more: the higher
    # lane keeps priority for everything beyond what is owed.
    assert min_share - 0.02 <= share <= min_share + 0.08


@pytest.mark.parametrize("case", cases_for("min_share"))
def test_lane_without_min_share_starves_while_higher_lane_is_backlogged(case: PolicyCase) -> None:
    assert _serve_two_lanes(case, 0.0, rounds=200, seed=7) == 0.0


# -- errors --


@pytest.mark.parametrize("case", cases_for("errors"))
def test_unknown_lane_raises(case: PolicyCase) -> None:
    scheduler = make(case, lanes=[LaneSpec("high"), LaneSpec("low")])
    with pytest.raises(KeyError):
        scheduler.enqueue(Request(tenant="a", prompt_tokens=1, lane="nope"), 0.0)
    assert scheduler.queued() == 0
    with pytest.raises(KeyError):
        scheduler.queued("nope")
    with pytest.raises(KeyError):
        scheduler.counter("a", "nope")
    with pytest.raises(KeyError):
        scheduler.policy("nope")


@pytest.mark.parametrize("case", cases_for("errors"))
def test_request_without_lane_goes_to_the_first_lane(case: PolicyCase) -> None:
    scheduler = make(case, lanes=[LaneSpec("high"), LaneSpec("low")])
    request = Request(tenant="a", prompt_tokens=1)
    scheduler.enqueue(request, 0.0)
    assert request.lane == "high"
    assert scheduler.queued("high") == 1


@pytest.mark.parametrize("case", cases_for("errors"))
def test_calls_in_the_wrong_request_state_raise(case: PolicyCase) -> None:
    scheduler = make(case)
    request = Request(tenant="a", prompt_tokens=10)
    with pytest.raises(ValueError):
        scheduler.dispatch(request, 0.0)  # new, not queued
    with pytest.raises(ValueError):
        scheduler.finish(request)  # new, not running
    scheduler.enqueue(request, 0.0)
    with pytest.raises(ValueError):
        scheduler.enqueue(request, 0.0)  # queued twice
    with pytest.raises(ValueError):
        scheduler.finish(request)  # queued, not running
    assert scheduler.queued() == 1
    scheduler.dispatch(request, 0.0)
    with pytest.raises(ValueError):
        scheduler.dispatch(request, 0.0)  # dispatched twice
    with pytest.raises(ValueError):
        scheduler.enqueue(request, 0.0)
    scheduler.finish(request)
    with pytest.raises(ValueError):
        scheduler.finish(request)  # finished twice
    with pytest.raises(ValueError):
        scheduler.dispatch(request, 0.0)
    service = dict(scheduler.service)
    scheduler.cancel(request)  # cancelling a finished request does nothing
    assert request.state == "done"
    assert scheduler.service == service


@pytest.mark.parametrize("case", cases_for("errors"))
def test_invalid_scheduler_configuration_raises(case: PolicyCase) -> None:
    with pytest.raises(ValueError):
        Scheduler(lanes=[], policy=case.policy, **case.options)
    with pytest.raises(ValueError):
        Scheduler(lanes=[LaneSpec("x"), LaneSpec("x")], policy=case.policy, **case.options)
    for bad_share in (-0.1, 1.0):
        with pytest.raises(ValueError):
            Scheduler(lanes=[LaneSpec("x", bad_share)], policy=case.policy, **case.options)
    for bad_weight in (0.0, -1.0):
        with pytest.raises(ValueError):
            Scheduler(policy=case.policy, weights={"a": bad_weight}, **case.options)
    scheduler = make(case)
    with pytest.raises(ValueError):
        scheduler.set_weight("a", 0.0)


def test_unknown_policy_name_raises() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("wfq")
    with pytest.raises(ValueError):
        Scheduler(policy="wfq")


# -- rpm with a finite limit --


def _rpm(limit: float, window: float = 10.0) -> Scheduler:
    return Scheduler(policy="rpm", limit=limit, window=window)


def test_rpm_holds_requests_of_a_tenant_over_its_limit_until_the_next_window() -> None:
    scheduler = _rpm(limit=2)
    requests = [Request(tenant="a", prompt_tokens=1) for _ in range(4)]
    for request in requests:
        scheduler.enqueue(request, 0.0)
    for expected in requests[:2]:
        assert scheduler.peek(0.0) is expected
        scheduler.dispatch(expected, 0.0)
    assert scheduler.peek(0.0) is None
    assert scheduler.peek(9.99) is None
    assert scheduler.queued() == 2
    assert scheduler.peek(10.0) is requests[2]


def test_rpm_serves_a_tenant_under_its_limit_while_another_is_held() -> None:
    scheduler = _rpm(limit=1)
    a1, a2 = Request(tenant="a", prompt_tokens=1), Request(tenant="a", prompt_tokens=1)
    b1 = Request(tenant="b", prompt_tokens=1)
    for request in (a1, a2, b1):
        scheduler.enqueue(request, 0.0)
    scheduler.dispatch(scheduler.peek(0.0) or a1, 0.0)
    assert a1.state == "running"
    assert scheduler.peek(0.0) is b1  # a2 is older but a is over its limit
    scheduler.dispatch(b1, 0.0)
    assert scheduler.peek(5.0) is None


def test_rpm_is_fcfs_among_tenants_under_their_limit() -> None:
    scheduler = _rpm(limit=3)
    order = [Request(tenant=t, prompt_tokens=1) for t in "babca"]
    for request in order:
        scheduler.enqueue(request, 0.0)
    served, _ = drain(scheduler, CASES["rpm-limited"], 0.0)
    assert served == order


def test_rpm_with_zero_limit_never_dispatches() -> None:
    scheduler = _rpm(limit=0)
    scheduler.enqueue(Request(tenant="a", prompt_tokens=1), 0.0)
    for now in (0.0, 10.0, 1e6):
        assert scheduler.peek(now) is None


def test_rpm_cancel_of_a_held_request_charges_nothing_and_frees_the_queue() -> None:
    scheduler = _rpm(limit=1)
    a1, a2 = Request(tenant="a", prompt_tokens=5), Request(tenant="a", prompt_tokens=5)
    scheduler.enqueue(a1, 0.0)
    scheduler.enqueue(a2, 0.0)
    scheduler.dispatch(a1, 0.0)
    assert scheduler.peek(0.0) is None
    scheduler.cancel(a2)
    assert scheduler.queued() == 0
    assert scheduler.service == {"a": 5.0}
    assert scheduler.peek(20.0) is None


@pytest.mark.parametrize("limit,window", [(-1.0, 10.0), (1.0, 0.0), (1.0, -5.0)])
def test_rpm_rejects_a_negative_limit_or_non_positive_window(limit: float, window: float) -> None:
    with pytest.raises(ValueError):
        make_policy("rpm", limit=limit, window=window)


@pytest.mark.parametrize("call", ["charge_output", "charge_estimate", "settle"])
def test_charges_are_refused_outside_a_running_request(call: str) -> None:
    scheduler = Scheduler()
    request = Request(tenant="t", prompt_tokens=10)
    scheduler.enqueue(request, 0.0)
    argument = Usage(10, 5) if call == "settle" else 5
    with pytest.raises(ValueError, match="not running"):
        getattr(scheduler, call)(request, argument)
    scheduler.dispatch(request, 0.0)
    scheduler.finish(request)
    charged = scheduler.service["t"]
    with pytest.raises(ValueError, match="not running"):
        getattr(scheduler, call)(request, argument)
    assert scheduler.service["t"] == charged
