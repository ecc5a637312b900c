"""Admission: per-request caps, the tenant queue cap, burst and sustained budgets, settling,
the concurrency cap, rule updates, rate-limit headers and forgetting idle tenants."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core.admission import (
    MAX_DEBT,
    Admission,
    Admitted,
    BucketRule,
    Refused,
    Reservation,
    TenantRules,
    format_duration,
)

LANE = "interactive"


def admission(rules: TenantRules, default: TenantRules | None = None) -> Admission:
    """An Admission where tenant ``t`` has ``rules`` and everyone else ``default`` (no limits)."""
    return Admission({"t": rules}, default if default is not None else TenantRules())


def admitted(a: Admission, tokens: int, now: float = 0.0, tenant: str = "t",
             max_output: int | None = 0, expected: int = 0) -> Admitted:
    """Admit a request of ``tokens`` prompt tokens and insist it was admitted (by default one
    without output, whose worst case is its prompt)."""
    outcome = a.admit(tenant, LANE, tokens, max_output, expected, now)
    assert isinstance(outcome, Admitted), outcome
    return outcome


def refused(a: Admission, tokens: int, now: float = 0.0, tenant: str = "t",
            max_output: int | None = 0, expected: int = 0) -> Refused:
    outcome = a.admit(tenant, LANE, tokens, max_output, expected, now)
    assert isinstance(outcome, Refused), outcome
    return outcome


def level(a: Admission, now: float, window: str = "burst", tenant: str = "t") -> float:
    """What is left in a tenant's bucket (full when the tenant is not tracked)."""
    state = a.budget_state(now).get(tenant)
    if state is None:
        return float(a.rules_for(tenant).budgets[0][1].capacity_tokens)
    return state[window][0]


BURST_1000 = BucketRule(1000, 100.0)  # 10 tokens a second


# -- rule validation --


@pytest.mark.parametrize("capacity, seconds", [(0, 1.0), (-5, 1.0), (1.5, 1.0), (True, 1.0),
                                               (10, 0.0), (10, -1.0), (10, float("inf")),
                                               (10, float("nan"))])
def test_bucket_rule_refuses_non_positive_or_non_finite_values(capacity: object,
                                                                seconds: object) -> None:
    with pytest.raises(ValueError):
        BucketRule(capacity, seconds)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [
    {"over_budget": "demote"},
    {"over_budget": "throttle"},
    {"output_limit_action": "truncate"},
    {"max_queued": 0},
    {"max_concurrent": -1},
    {"max_input_tokens": 2.5},
    {"max_output_tokens": False},
    {"burst": (100, 60)},
    {"demote_lane": ""},
])
def test_tenant_rules_refuse_invalid_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TenantRules(**kwargs)  # type: ignore[arg-type]


def test_tenant_rules_list_their_budgets_burst_first() -> None:
    rules = TenantRules(sustained=BucketRule(10, 1), burst=BucketRule(5, 1))
    assert [w for w, _ in rules.budgets] == ["burst", "sustained"]
    assert TenantRules(over_budget="demote", demote_lane="batch").demote_lane == "batch"


# -- per-request caps --


def test_a_prompt_over_the_input_limit_is_a_bad_request_without_retry() -> None:
    a = admission(TenantRules(max_input_tokens=100))
    r = refused(a, 101)
    assert (r.reason, r.status, r.retry_after, r.window) == ("input_too_long", "bad_request",
                                                             None, None)
    assert "101" in r.message and "100" in r.message
    assert a.tracked_tenants() == 0  # a refusal before the budgets creates no state
    assert admitted(a, 100).reservation.reserved_tokens == 100


def test_max_tokens_over_the_limit_is_refused_when_the_action_is_reject() -> None:
    a = admission(TenantRules(max_output_tokens=4096))
    r = refused(a, 10, max_output=4097, expected=100)
    assert (r.reason, r.status, r.retry_after) == ("output_too_long", "bad_request", None)
    assert admitted(a, 10, max_output=4096).max_output_tokens == 4096


def test_max_tokens_over_the_limit_is_clamped_and_so_is_the_expected_output() -> None:
    a = admission(TenantRules(max_output_tokens=4096, output_limit_action="clamp"))
    ok = admitted(a, 100, max_output=8000, expected=5000)
    assert (ok.max_output_tokens, ok.expected_output_tokens) == (4096, 4096)
    assert ok.reservation.reserved_tokens == 100 + 4096
    assert not ok.demoted and ok.lane == LANE


def test_a_request_without_max_tokens_gets_the_tenant_limit() -> None:
    a = admission(TenantRules(max_output_tokens=512))
    ok = admitted(a, 10, max_output=None, expected=2000)
    assert (ok.max_output_tokens, ok.expected_output_tokens) == (512, 512)
    unlimited = admitted(a, 10, tenant="other", max_output=None, expected=2000)
    assert (unlimited.max_output_tokens, unlimited.expected_output_tokens) == (None, 2000)


def test_expected_output_is_capped_by_the_requests_own_max_tokens() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    assert admitted(a, 100, max_output=50, expected=700).reservation.reserved_tokens == 150


def test_checks_run_in_order_input_output_queue_budget() -> None:
    rules = TenantRules(burst=BucketRule(100, 10), max_queued=1, max_input_tokens=50,
                        max_output_tokens=10)
    a = admission(rules)
    admitted(a, 50, max_output=10, expected=10)  # queue now full, bucket at 40
    assert refused(a, 51, max_output=11).reason == "input_too_long"
    assert refused(a, 50, max_output=11).reason == "output_too_long"
    assert refused(a, 50, max_output=10).reason == "tenant_queue_full"


@pytest.mark.parametrize("args", [(-1, None, 0), (1, -1, 0), (1, None, -1), (1.5, None, 0)])
def test_admit_refuses_nonsense_counts(args: tuple[object, object, object]) -> None:
    with pytest.raises(ValueError):
        Admission({}, TenantRules()).admit("t", LANE, *args, 0.0)  # type: ignore[arg-type]


# -- the tenant's queue cap --


def test_the_tenant_queue_cap_counts_queued_requests_only() -> None:
    a = admission(TenantRules(max_queued=2))
    first, _ = admitted(a, 1), admitted(a, 1)
    r = refused(a, 1)
    assert (r.reason, r.status) == ("tenant_queue_full", "rate_limited")
    assert r.retry_after is not None and r.retry_after > 0
    admitted(a, 1, tenant="someone-else")  # other tenants are not affected
    a.start(first.reservation)  # running no longer counts against the queue
    admitted(a, 1)
    assert (a.queued("t"), a.running("t")) == (2, 1)


# -- budgets --


def test_over_budget_retry_after_is_the_time_until_the_estimate_fits() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    a.finish(admitted(a, 900).reservation, 900, now=0.0)
    r = refused(a, 200, max_output=100, now=0.0)  # needs 300, has 100, refills 10/s
    assert (r.reason, r.status, r.window) == ("over_budget", "rate_limited", "burst")
    assert r.retry_after == pytest.approx(20.0)
    assert "100 of 1000" in r.message and "20s" in r.message
    assert refused(a, 300, now=19.9).retry_after == pytest.approx(0.1)
    admitted(a, 300, now=20.0)
    assert level(a, 20.0) == pytest.approx(0.0)


def test_buckets_refill_continuously_up_to_their_capacity() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    a.finish(admitted(a, 1000).reservation, 1000, now=0.0)
    assert level(a, 0.0) == pytest.approx(0.0)
    assert level(a, 2.5) == pytest.approx(25.0)
    assert level(a, 50.0) == pytest.approx(500.0)
    assert level(a, 500.0) == pytest.approx(1000.0)


def test_the_budget_that_must_wait_longest_decides_retry_after_and_window() -> None:
    rules = TenantRules(burst=BucketRule(1000, 10), sustained=BucketRule(2000, 1000))
    a = admission(rules)
    a.finish(admitted(a, 1000).reservation, 1000, now=0.0)
    # At t=10 the sustained bucket has 1000 + 20 refilled, less 900: 120 left.
    a.finish(admitted(a, 900, now=10.0).reservation, 900, now=10.0)
    r = refused(a, 500, now=10.0)  # burst: 400 short at 100/s, 4 s; sustained: 380 at 2/s
    assert r.window == "sustained"
    assert (r.reason, r.status) == ("insufficient_quota", "rate_limited")
    assert r.retry_after == pytest.approx(190.0)


def test_an_estimate_above_capacity_waits_for_a_full_bucket_and_is_then_admitted() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    a.finish(admitted(a, 500).reservation, 500, now=0.0)
    r = refused(a, 1500, now=0.0)
    assert r.retry_after == pytest.approx(50.0)  # until full, not until 1500 (never)
    assert "exceed" in r.message and "full" in r.message
    ok = admitted(a, 1500, now=50.0)
    assert level(a, 50.0) == pytest.approx(-500.0)  # the debt delays what comes next
    a.finish(ok.reservation, 1500, now=50.0)
    assert refused(a, 100, now=50.0).retry_after == pytest.approx(60.0)


def test_reservations_stop_concurrent_requests_from_overshooting_together() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    outcomes = [a.admit("t", LANE, 100, 0, 0, 0.0) for _ in range(20)]
    assert sum(isinstance(o, Admitted) for o in outcomes) == 10


def test_every_budget_is_charged() -> None:
    a = admission(TenantRules(burst=BucketRule(1000, 10), sustained=BucketRule(5000, 1000)))
    admitted(a, 300)
    assert a.budget_state(0.0) == {"t": {"burst": (700.0, 1000), "sustained": (4700.0, 5000)}}


def test_over_budget_demote_admits_into_the_demote_lane_and_still_charges() -> None:
    a = admission(TenantRules(burst=BURST_1000, over_budget="demote", demote_lane="batch"))
    first = admitted(a, 800)
    assert (first.lane, first.demoted) == (LANE, False)
    second = admitted(a, 300)
    assert (second.lane, second.demoted) == ("batch", True)
    assert level(a, 0.0) == pytest.approx(-100.0)
    assert admitted(a, 1, now=10.0).demoted  # still in debt 10 s later (level 0 < 1)
    assert not admitted(a, 100, now=30.0).demoted


def test_debt_is_owed_in_full_and_waited_out_at_the_refill_rate() -> None:
    """No floor forgives a debt: 50 demoted requests of 1000 leave 49,000 owed, and the next
    request waits (debt + its need) / rate = (49,000 + 1000) / 10 = 5000 s."""
    a = admission(TenantRules(burst=BURST_1000, over_budget="demote", demote_lane="batch"))
    for _ in range(50):
        admitted(a, 1000)
    assert level(a, 0.0) == pytest.approx(-49_000.0)
    a.update({"t": TenantRules(burst=BURST_1000)}, TenantRules(), now=0.0)  # now reject
    assert refused(a, 1000, now=0.0).retry_after == pytest.approx(5000.0)
    assert refused(a, 1000, now=4999.0).retry_after == pytest.approx(1.0)
    admitted(a, 1000, now=5000.0)


def test_levels_stay_finite_whatever_is_reported() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    ok = admitted(a, 10)
    a.finish(ok.reservation, 10**400, now=0.0)  # an absurd usage: charged, and finite
    assert -MAX_DEBT <= level(a, 0.0) < -MAX_DEBT / 2
    assert refused(a, 1, now=0.0).retry_after < math.inf


# -- settling --


def test_finish_refunds_what_was_reserved_but_not_used() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    ok = admitted(a, 100, max_output=800, expected=400)
    assert level(a, 0.0) == pytest.approx(100.0)  # its worst case: 100 + 800
    a.finish(ok.reservation, 200, now=0.0)
    assert level(a, 0.0) == pytest.approx(800.0)
    assert ok.reservation.state == "done" and a.queued("t") == 0


def test_finish_charges_what_was_used_beyond_the_reservation() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    ok = admitted(a, 100)
    a.finish(ok.reservation, 400, now=0.0)
    assert level(a, 0.0) == pytest.approx(600.0)


def test_cancelling_a_queued_request_refunds_everything() -> None:
    a = admission(TenantRules(burst=BURST_1000, sustained=BucketRule(10_000, 1000)))
    a.finish(admitted(a, 300).reservation, 300, now=0.0)
    ok = admitted(a, 600, now=0.0)
    a.finish(ok.reservation, 0, now=0.0)
    assert a.budget_state(0.0)["t"] == {"burst": (700.0, 1000), "sustained": (9700.0, 10_000)}
    assert a.queued("t") == 0


def test_a_refund_never_fills_a_bucket_beyond_its_capacity() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    ok = admitted(a, 500)
    admitted(a, 1)  # keeps the tenant tracked
    a.finish(ok.reservation, 0, now=1000.0)
    assert level(a, 1000.0) == 1000.0


def test_finishing_twice_or_a_foreign_reservation_raises() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    ok = admitted(a, 100)
    a.finish(ok.reservation, 100, now=0.0)
    with pytest.raises(ValueError, match="already finished"):
        a.finish(ok.reservation, 100, now=0.0)
    with pytest.raises(ValueError):
        a.finish(Reservation("t", 10), 10, now=0.0)
    with pytest.raises(ValueError):
        a.finish(admitted(a, 1).reservation, -1, now=0.0)


# -- the concurrency cap, at dispatch --


def test_the_concurrency_cap_is_applied_at_dispatch() -> None:
    a = admission(TenantRules(max_concurrent=2))
    r1, r2, r3 = (admitted(a, 1).reservation for _ in range(3))  # all three may queue
    assert a.may_start("t")
    a.start(r1)
    a.start(r2)
    assert not a.may_start("t")
    assert a.may_start("unlimited")
    with pytest.raises(ValueError, match="concurrency cap"):
        a.start(r3)
    assert (a.queued("t"), a.running("t")) == (1, 2)
    a.finish(r1, 1, now=1.0)
    assert a.may_start("t")
    a.start(r3)
    with pytest.raises(ValueError, match="not queued"):
        a.start(r3)
    assert (a.queued("t"), a.running("t")) == (0, 2)


# -- updates --


def test_update_keeps_the_absolute_level_and_refills_at_the_new_rate() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    keep = admitted(a, 900)  # level 100
    # Up to t=10 the old rate (10/s): 200. Double the capacity, same period: 20/s from then on.
    a.update({"t": TenantRules(burst=BucketRule(2000, 100))}, TenantRules(), now=10.0)
    assert level(a, 10.0) == pytest.approx(200.0)
    assert level(a, 20.0) == pytest.approx(400.0)
    assert a.queued("t") == 1
    a.finish(keep.reservation, 900, now=20.0)
    assert level(a, 20.0) == pytest.approx(400.0)


def test_update_clamps_a_level_to_a_smaller_capacity() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    admitted(a, 200)  # level 800
    a.update({"t": TenantRules(burst=BucketRule(500, 50))}, TenantRules(), now=0.0)
    assert a.budget_state(0.0)["t"]["burst"] == (500.0, 500)


def test_update_adds_full_budgets_and_drops_removed_ones() -> None:
    a = admission(TenantRules(burst=BURST_1000))
    ok = admitted(a, 300)
    sustained = BucketRule(10_000, 1000)
    a.update({"t": TenantRules(sustained=sustained)}, TenantRules(), now=0.0)
    assert a.budget_state(0.0)["t"] == {"sustained": (10_000.0, 10_000)}
    # The new bucket held no reservation: settling charges it what was used, refunds nothing.
    a.finish(ok.reservation, 100, now=0.0)
    assert a.budget_state(0.0)["t"] == {"sustained": (9900.0, 10_000)}


def test_update_changes_who_gets_the_default() -> None:
    a = Admission({}, TenantRules(max_input_tokens=10))
    assert refused(a, 11).reason == "input_too_long"
    a.update({"t": TenantRules()}, TenantRules(max_input_tokens=10), now=0.0)
    admitted(a, 11)
    assert refused(a, 11, tenant="u").reason == "input_too_long"


# -- headers --


@pytest.mark.parametrize("seconds, text", [
    (0.0, "0s"), (-3.0, "0s"), (0.02, "20ms"), (0.0004, "1ms"), (1.0, "1s"), (1.5, "1.5s"),
    (8.64, "8.64s"), (59.9999, "1m0s"), (360.0, "6m0s"), (61.25, "1m1.25s"), (3600.0, "1h0m0s"),
    (86400.0, "24h0m0s"),
])
def test_durations_are_written_as_openai_does(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_headers_describe_the_tightest_budget() -> None:
    rules = TenantRules(burst=BucketRule(20_000, 60), sustained=BucketRule(100_000, 86_400))
    a = admission(rules)
    assert a.headers("t", 0.0) == {"x-ratelimit-limit-tokens": "20000",
                                   "x-ratelimit-remaining-tokens": "20000",
                                   "x-ratelimit-reset-tokens": "0s"}
    a.finish(admitted(a, 10_000).reservation, 10_000, now=0.0)
    # burst: half left; sustained: 90% left.
    assert a.headers("t", 0.0) == {"x-ratelimit-limit-tokens": "20000",
                                   "x-ratelimit-remaining-tokens": "10000",
                                   "x-ratelimit-reset-tokens": "30s"}
    # A minute later the burst bucket is full and the sustained one is the tightest.
    assert a.headers("t", 60.0) == {"x-ratelimit-limit-tokens": "100000",
                                    "x-ratelimit-remaining-tokens": "90069",
                                    "x-ratelimit-reset-tokens": "2h23m0s"}


def test_headers_reset_time_and_debt() -> None:
    a = admission(TenantRules(burst=BucketRule(1000, 600)))
    a.finish(admitted(a, 1000).reservation, 1600, now=0.0)  # 600 tokens of debt
    assert a.headers("t", 0.0) == {"x-ratelimit-limit-tokens": "1000",
                                   "x-ratelimit-remaining-tokens": "0",
                                   "x-ratelimit-reset-tokens": "16m0s"}
    assert a.headers("t", 0.0) == a.headers("t", 0.0)  # reading changes nothing


def test_headers_for_the_concurrency_cap_and_for_a_tenant_without_limits() -> None:
    a = admission(TenantRules(max_concurrent=3, max_queued=10))
    a.start(admitted(a, 1).reservation)
    assert a.headers("t", 0.0) == {"x-fairway-limit-concurrent-requests": "3",
                                   "x-fairway-remaining-concurrent-requests": "2"}
    assert a.headers("nobody", 0.0) == {}
    assert a.tracked_tenants() == 1  # reading headers of an unknown tenant tracks nothing


# -- memory --


def random_tenants(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"tenant-{rng.getrandbits(64):016x}" for _ in range(n)]


def test_tenants_without_budgets_are_forgotten_when_their_last_request_finishes() -> None:
    a = Admission({}, TenantRules(max_concurrent=4, max_queued=8))
    most = 0
    for i, tenant in enumerate(random_tenants(10_000)):
        ok = admitted(a, 10, tenant=tenant, now=float(i))
        a.start(ok.reservation)
        most = max(most, a.tracked_tenants())
        a.finish(ok.reservation, 10, now=float(i))
    assert most == 1
    assert a.tracked_tenants() == 0


def test_tenants_with_budgets_are_pruned_once_their_buckets_have_refilled() -> None:
    a = Admission({}, TenantRules(burst=BucketRule(1000, 10), sustained=BucketRule(10_000, 50)))
    most = 0
    for i, tenant in enumerate(random_tenants(10_000)):
        now = i * 0.01  # 100 new tenants a second, each idle afterwards
        a.finish(admitted(a, 100, tenant=tenant, now=now).reservation, 100, now=now)
        if i % 100 == 0:
            a.prune(now)
            most = max(most, a.tracked_tenants())
    # Bounded by the tenants seen within the time their buckets take to refill what they used:
    # 100 tokens at 100/s (burst), 1 s, so about 100 tenants.
    assert most <= 150
    assert a.prune(100.0 + 5.0) > 0
    assert a.tracked_tenants() == 0


def test_prune_keeps_busy_or_indebted_tenants_and_forgetting_changes_nothing() -> None:
    a = admission(TenantRules(burst=BURST_1000), default=TenantRules(burst=BURST_1000))
    busy = admitted(a, 10, tenant="busy")
    a.finish(admitted(a, 500, tenant="spent").reservation, 500, now=0.0)
    before = a.headers("spent", 10.0)
    assert a.prune(10.0) == 0
    assert a.tracked_tenants() == 2
    assert a.headers("spent", 10.0) == before
    a.finish(busy.reservation, 0, now=10.0)  # refunded to full and idle: forgotten at once
    assert a.tracked_tenants() == 1
    assert a.prune(50.0) == 1
    assert a.tracked_tenants() == 0
    assert a.headers("spent", 50.0)["x-ratelimit-remaining-tokens"] == "1000"


def test_budget_state_lists_tracked_tenants_with_budgets() -> None:
    a = Admission({"capped": TenantRules(max_concurrent=1)}, TenantRules(burst=BURST_1000))
    admitted(a, 250, tenant="a")
    admitted(a, 1, tenant="capped")
    assert a.budget_state(5.0) == {"a": {"burst": (800.0, 1000)}}


# -- the overshoot bound --


@settings(max_examples=150, deadline=None)
@given(
    burst=st.tuples(st.integers(100, 5000), st.integers(1, 100)),
    sustained=st.tuples(st.integers(1000, 50_000), st.integers(100, 2000)),
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 3000), st.integers(0, 1000), st.integers(0, 2000),
                  st.integers(0, 19)),
        max_size=60,
    ),
    data=st.data(),
)
def test_overshoot_is_bounded_by_estimation_error_not_by_concurrency(
        burst: tuple[int, int], sustained: tuple[int, int],
        steps: list[tuple[bool, int, int, int, int]], data: st.DataObject) -> None:
    """For each budget and any interval, the tokens charged (reservations, then settlements to
    the actual usage) stay within capacity + refill over the interval + the overruns (actual −
    estimate) settled so far, however many requests were in flight at once; a prompt that
    alone fills the budget adds what its one output token takes beyond it."""
    rules = TenantRules(burst=BucketRule(*burst), sustained=BucketRule(*sustained))
    a = admission(rules)
    smallest = min(burst[0], sustained[0])
    now = 0.0
    live: list[tuple[Reservation, int]] = []  # up to 20 in flight, with their actual usage
    charges: list[tuple[float, int]] = []  # (time, tokens charged to every bucket)
    overruns: list[tuple[float, int]] = []
    settled_actual = 0

    def settle(index: int) -> None:
        nonlocal settled_actual
        reservation, actual = live.pop(index)
        a.finish(reservation, actual, now)
        charges.append((now, actual - reservation.reserved_tokens))
        overruns.append((now, max(0, actual - reservation.reserved_tokens)))
        settled_actual += actual

    for is_admit, dt_ms, estimate_permille, actual_permille, pick in steps:
        now += dt_ms / 1000
        if is_admit and len(live) < 20:
            estimate = smallest * estimate_permille // 1000
            outcome = a.admit("t", LANE, estimate, None, 0, now)
            if isinstance(outcome, Admitted):
                live.append((outcome.reservation, smallest * actual_permille // 1000))
                charges.append((now, outcome.reservation.reserved_tokens))
                # The documented exception (docs/budgets.md): a prompt that fills the smallest
                # budget alone is admitted on a full bucket with one output token, beyond it.
                overruns.append((now, max(0, outcome.reservation.worst_case_tokens - smallest)))
        elif live:
            settle(pick % len(live))
    while live:
        settle(data.draw(st.integers(0, len(live) - 1)))

    for capacity, seconds in (burst, sustained):
        rate = capacity / seconds
        for i, (start, _) in enumerate(charges):
            window = 0
            for end, amount in charges[i:]:
                window += amount
                overrun = sum(o for t, o in overruns if t <= end)
                assert window <= capacity + rate * (end - start) + overrun + 1e-6 * len(charges)
        assert settled_actual <= capacity + rate * now + sum(o for _, o in overruns) + 1e-3


def test_oversized_estimate_is_settled_to_actual_use_not_forgiven() -> None:
    """An estimate larger than the bucket is clipped by the debt cap when reserved; settling must
    give back only what was taken, so the tokens actually used stay charged."""
    admission = Admission({"t": TenantRules(burst=BucketRule(40, 3600))}, TenantRules())
    admitted = admission.admit("t", "lane", 7, 100, 100, now=0.0)
    assert isinstance(admitted, Admitted)
    admission.start(admitted.reservation)
    admission.finish(admitted.reservation, 15, now=0.0)
    remaining, capacity = admission.budget_state(0.0)["t"]["burst"]
    assert (remaining, capacity) == (pytest.approx(40 - 15), 40)


# -- admission that cannot be outrun (worst-case reservation, choices, debt owed) --


BURST_3000 = BucketRule(3000, 60.0)  # 50 tokens a second


def test_a_request_reserves_its_worst_case_prompt_plus_max_tokens_times_choices() -> None:
    a = admission(TenantRules(burst=BucketRule(10_000, 60.0)))
    ok = a.admit("t", LANE, 100, 200, 50, 0.0, choices=8)
    assert isinstance(ok, Admitted)
    assert ok.reservation.reserved_tokens == ok.reservation.worst_case_tokens == 100 + 200 * 8
    assert ok.max_output_tokens == 200 and ok.expected_output_tokens == 50
    assert level(a, 0.0) == pytest.approx(10_000 - 1700)
    assert a.budget_needs("t", 100, 200, 50, choices=8) == 1700


def test_n_choices_are_reserved_as_n_and_their_cap_split_to_fit_the_budget() -> None:
    """``n: 8`` without max_tokens on a 3,000 budget: each choice may produce (3000-100)//8."""
    a = admission(TenantRules(burst=BURST_3000))
    ok = a.admit("t", LANE, 100, None, 50, 0.0, choices=8)
    assert isinstance(ok, Admitted)
    assert ok.max_output_tokens == 362  # sent to the engine: 8 x 362 + 100 <= 3000
    assert ok.reservation.reserved_tokens == 100 + 8 * 362
    assert refused(a, 10, now=0.0).reason == "over_budget"  # 4 tokens left


def test_without_max_tokens_the_models_context_bounds_the_worst_case() -> None:
    a = admission(TenantRules(burst=BucketRule(100_000, 60.0)))
    ok = a.admit("t", LANE, 1000, None, 50, 0.0, output_limit=4096 - 1000)
    assert isinstance(ok, Admitted)
    assert ok.reservation.reserved_tokens == 4096
    assert ok.max_output_tokens is None  # the engine applies its own context: nothing sent


def test_a_worst_case_over_a_full_budget_is_capped_to_what_the_budget_can_pay() -> None:
    a = admission(TenantRules(burst=BURST_3000, sustained=BucketRule(2000, 3600.0)))
    ok = a.admit("t", LANE, 100, 5000, 300, 0.0)  # the smallest budget binds: 2000
    assert isinstance(ok, Admitted)
    assert ok.max_output_tokens == 1900 and ok.reservation.reserved_tokens == 2000
    unbounded = admission(TenantRules(burst=BURST_3000)).admit("t", LANE, 100, None, 300, 0.0)
    assert isinstance(unbounded, Admitted) and unbounded.max_output_tokens == 2900
    # A tenant without budgets has nothing to bound it: its request goes as it came.
    free = admission(TenantRules()).admit("t", LANE, 100, None, 300, 0.0)
    assert isinstance(free, Admitted) and free.max_output_tokens is None


def test_a_request_whose_worst_case_does_not_fit_waits_until_it_does() -> None:
    a = admission(TenantRules(burst=BURST_3000))
    admitted(a, 10, max_output=2000)  # 990 left
    r = refused(a, 10, max_output=1000)  # needs 1010
    assert r.retry_after == pytest.approx(20 / 50)
    assert "1010" in r.message
    admitted(a, 10, max_output=1000, now=0.4)


def test_fifteen_concurrent_streams_of_max_tokens_1000_get_no_more_than_the_budget() -> None:
    """The attack: a 3,000-token burst budget, 15 concurrent requests with max_tokens 1000
    that each use all of it. Before: 11 served, 11,000 output tokens. Now: 2 (2 x 1010)."""
    a = admission(TenantRules(burst=BURST_3000))
    outcomes = [a.admit("t", LANE, 10, 1000, 100, 0.0) for _ in range(15)]
    served = [o for o in outcomes if isinstance(o, Admitted)]
    assert len(served) == 2
    for ok in served:
        a.start(ok.reservation)
        a.finish(ok.reservation, 10 + 1000, now=0.0)
    assert level(a, 0.0) == pytest.approx(3000 - 2 * 1010)


def test_reserve_expected_refuses_while_the_outstanding_worst_case_exceeds_the_level() -> None:
    a = admission(TenantRules(burst=BURST_3000, reserve="expected"))
    outcomes = [a.admit("t", LANE, 10, 1000, 100, 0.0) for _ in range(15)]
    served = [o for o in outcomes if isinstance(o, Admitted)]
    # Each reserves 110 and may use 900 more: admitted while 900 x (admitted) <= 3000 - 110 x
    # (admitted), so 3 (2,700 <= 2,670 is false for the fourth).
    assert len(served) == 3
    assert served[0].reservation.reserved_tokens == 110
    assert served[0].reservation.worst_case_tokens == 1010
    refusal = a.admit("t", LANE, 10, 1000, 100, 0.0)
    assert isinstance(refusal, Refused) and "in flight may still use 2700" in refusal.message
    for ok in served:
        a.finish(ok.reservation, 1010, now=0.0)
    # The overshoot is at most one request's worst case, and it is owed.
    assert level(a, 0.0) == pytest.approx(3000 - 3 * 1010)
    assert -1010 <= level(a, 0.0) < 0
    # The debt is waited out, then the next request's need: (30 + 110) / 50 s.
    assert refused(a, 10, max_output=1000, expected=100).retry_after == pytest.approx(2.8)


def test_reserve_expected_admits_again_once_requests_in_flight_settle() -> None:
    a = admission(TenantRules(burst=BucketRule(3000, 3600.0), reserve="expected"))
    first = a.admit("t", LANE, 10, 1000, 100, 0.0)
    assert isinstance(first, Admitted)
    for _ in range(2):
        assert isinstance(a.admit("t", LANE, 10, 1000, 100, 0.0), Admitted)
    assert isinstance(a.admit("t", LANE, 10, 1000, 100, 0.0), Refused)
    a.finish(first.reservation, 60, now=0.0)  # used little: 900 less outstanding, 50 back
    assert isinstance(a.admit("t", LANE, 10, 1000, 100, 0.0), Admitted)


def test_a_prereserved_request_is_still_held_to_the_outstanding_worst_case() -> None:
    """Beside other pickers the store judged the level; the outstanding worst case only this
    picker knows, so ``reserve: expected`` still refuses on it."""
    a = admission(TenantRules(burst=BucketRule(1000, 3600.0), reserve="expected"))
    for _ in range(2):
        assert isinstance(a.admit("t", LANE, 10, 500, 10, 0.0, prereserved=20), Admitted)
    # Level 960, outstanding 980: the third is refused whatever the store reserved.
    assert isinstance(a.admit("t", LANE, 10, 500, 10, 0.0, prereserved=20), Refused)


def test_choices_and_output_limit_must_make_sense() -> None:
    a = admission(TenantRules())
    for kwargs in ({"choices": 0}, {"choices": True}, {"output_limit": -1}):
        with pytest.raises(ValueError):
            a.admit("t", LANE, 10, 10, 10, 0.0, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TenantRules(reserve="sometimes")  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(500, 20_000),
    seconds=st.integers(1, 1000),
    expected_mode=st.booleans(),
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 2000), st.integers(1, 3000),
                  st.one_of(st.none(), st.integers(0, 5000)), st.integers(1, 8),
                  st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 39)),
        max_size=80,
    ),
    data=st.data(),
)
def test_served_tokens_never_exceed_the_budget_plus_one_worst_case(
        capacity: int, seconds: int, expected_mode: bool,
        steps: list[tuple[bool, int, int, int | None, int, int, int, int]],
        data: st.DataObject) -> None:
    """Whatever requests a tenant sends concurrently (prompt, max_tokens or none, 1-8 choices,
    up to 40 in flight), each using anything up to its worst case (prompt estimated right):
    over any interval from the start, the tokens served stay within capacity + refill (+ one
    request's worst case with ``reserve: expected``), every worst case within a full budget,
    and the bucket's level is exactly capacity − used + refill: no overshoot is forgiven."""
    rule = BucketRule(capacity, float(seconds))
    a = admission(TenantRules(burst=rule, reserve="expected" if expected_mode else "worst_case"))
    now = 0.0
    live: list[tuple[Reservation, int]] = []
    served = 0
    largest = 0  # the largest worst case admitted
    model_len = 4096
    # The level, tracked exactly: it refills up to the capacity plus the outstanding worst
    # case (0 with worst-case reservation), and a refund never fills it beyond that.
    expected_level = float(capacity)
    outstanding = 0

    def settle(index: int) -> None:
        nonlocal served, expected_level, outstanding
        reservation, actual = live.pop(index)
        a.finish(reservation, actual, now)
        served += actual
        outstanding -= reservation.worst_case_tokens - reservation.reserved_tokens
        expected_level = min(float(capacity + outstanding),
                             expected_level + reservation.reserved_tokens - actual)

    for is_admit, dt_ms, prompt, cap, choices, expected_pm, used_pm, pick in steps:
        if dt_ms:
            now += dt_ms / 1000
            expected_level = min(float(capacity + outstanding),
                                 expected_level + rule.rate * dt_ms / 1000)
        if is_admit and len(live) < 40:
            limit = max(1, model_len - prompt)
            outcome = a.admit("t", LANE, prompt, cap, expected_pm, now, choices=choices,
                              output_limit=limit if pick % 2 else None)
            if isinstance(outcome, Admitted):
                r = outcome.reservation
                assert r.worst_case_tokens <= max(capacity, prompt + choices)
                largest = max(largest, r.worst_case_tokens)
                output = outcome.max_output_tokens
                if output is None:
                    output = limit if pick % 2 else 10**6  # a tenant without caps (unused)
                worst_output = r.worst_case_tokens - prompt
                assert output * choices <= worst_output or outcome.max_output_tokens is None
                actual = prompt + worst_output * used_pm // 1000
                live.append((r, actual))
                expected_level -= r.reserved_tokens
                outstanding += r.worst_case_tokens - r.reserved_tokens
        elif live:
            settle(pick % len(live))
    while live:
        settle(data.draw(st.integers(0, len(live) - 1)))

    bound = capacity + rule.rate * now + (largest if expected_mode else 0)
    oversized = max(0, largest - capacity)  # a prompt alone larger than the budget
    assert served <= bound + oversized + 1e-6 * (1 + len(steps))
    assert level(a, now) == pytest.approx(min(capacity, expected_level),
                                          abs=1e-6 * (1 + capacity))


def test_reserve_expected_keeps_the_refill_that_comes_while_requests_run() -> None:
    """The bucket refills up to its capacity plus the outstanding worst case, so ``reserve:
    expected`` admits whenever worst-case reservation would, and one request more (the level
    shown stays capped at the capacity)."""
    rule = BucketRule(1000, 10.0)  # 100 tokens a second
    worst = admission(TenantRules(burst=rule))
    expected = admission(TenantRules(burst=rule, reserve="expected"))
    for a, at_once in ((worst, 2), (expected, 3)):
        for _ in range(at_once):
            assert isinstance(a.admit("t", LANE, 0, 500, 10, 0.0), Admitted)
        assert isinstance(a.admit("t", LANE, 0, 500, 10, 0.0), Refused)
    # 5 s later refill has brought 500 while they run: each admits one more.
    assert isinstance(worst.admit("t", LANE, 0, 500, 10, 5.0), Admitted)
    assert isinstance(expected.admit("t", LANE, 0, 500, 10, 5.0), Admitted)
    # Its level is 1000 - 40 + 500 = 1460, above the capacity while 1,960 is outstanding:
    # shown full, and the next must wait until the level covers the outstanding worst case.
    assert level(expected, 5.0) == 1000
    refusal = expected.admit("t", LANE, 0, 500, 10, 5.0)
    assert isinstance(refusal, Refused) and refusal.retry_after == pytest.approx(5.0)
