"""VTC specifics: the counter lift, least-counter-first order, tie-breaks and the lazy heap."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core import LaneSpec, Request, Scheduler
from picker.core.vtc import LeastCounterFirst, VirtualTokenCounter


class Seq:
    """Hands out increasing ``seq`` numbers, as the Scheduler does."""

    def __init__(self) -> None:
        self.next = 0

    def request(self, tenant: str) -> Request:
        request = Request(tenant=tenant, prompt_tokens=1, seq=self.next)
        self.next += 1
        return request


def enqueue(policy: VirtualTokenCounter, seq: Seq, tenant: str) -> Request:
    """Queue one new request of ``tenant`` directly in ``policy``."""
    request = seq.request(tenant)
    policy.enqueue(request, 0.0)
    return request


# -- the lift --


def test_returning_tenant_is_lifted_to_the_minimum_backlogged_counter_not_the_maximum() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    enqueue(policy, seq, "a")
    enqueue(policy, seq, "b")
    policy.charge("a", 100.0)
    policy.charge("b", 50.0)
    enqueue(policy, seq, "c")
    assert policy.counter("c") == 50.0
    assert policy.counter("a") == 100.0
    assert policy.counter("b") == 50.0


def test_lift_with_nobody_backlogged_uses_the_last_tenant_to_leave_the_queue() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    ra = enqueue(policy, seq, "a")
    rb = enqueue(policy, seq, "b")
    policy.charge("a", 100.0)
    policy.charge("b", 30.0)
    policy.pop(ra, 0.0)
    policy.pop(rb, 0.0)  # b leaves last, with the smaller counter
    assert policy.queued() == 0
    enqueue(policy, seq, "c")
    assert policy.counter("c") == 30.0


def test_lift_reads_the_last_leavers_counter_as_it_is_now() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    ra = enqueue(policy, seq, "a")
    policy.pop(ra, 0.0)
    policy.charge("a", 40.0)  # a's running request keeps being charged after it left the queue
    enqueue(policy, seq, "c")
    assert policy.counter("c") == 40.0


def test_a_cancelled_request_counts_as_leaving_the_queue() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    ra = enqueue(policy, seq, "a")
    policy.charge("a", 70.0)
    policy.remove(ra)
    enqueue(policy, seq, "b")
    assert policy.counter("b") == 70.0


def test_no_lift_at_all_before_anyone_has_left() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    policy.charge("x", 500.0)  # service without ever queueing
    enqueue(policy, seq, "a")
    assert policy.counter("a") == 0.0


def test_lift_never_lowers_a_counter() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    policy.charge("a", 500.0)  # a owes service from before
    enqueue(policy, seq, "b")
    policy.charge("b", 100.0)
    enqueue(policy, seq, "a")
    assert policy.counter("a") == 500.0


def test_lift_never_lowers_a_counter_to_the_last_leavers() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    rb = enqueue(policy, seq, "b")
    policy.pop(rb, 0.0)
    policy.charge("a", 500.0)
    enqueue(policy, seq, "a")
    assert policy.counter("a") == 500.0


def test_no_lift_when_the_tenant_already_has_requests_queued() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    enqueue(policy, seq, "a")
    enqueue(policy, seq, "b")
    policy.charge("b", 100.0)
    enqueue(policy, seq, "a")  # a is still backlogged: its lower counter is earned, not idle
    assert policy.counter("a") == 0.0
    # Likewise against a last leaver with a larger counter.
    policy2, seq2 = VirtualTokenCounter(), Seq()
    enqueue(policy2, seq2, "a")
    rc = enqueue(policy2, seq2, "c")
    policy2.charge("c", 100.0)
    policy2.pop(rc, 0.0)
    enqueue(policy2, seq2, "a")
    assert policy2.counter("a") == 0.0


def test_lcf_never_lifts() -> None:
    policy, seq = LeastCounterFirst(), Seq()
    ra = enqueue(policy, seq, "a")
    rb = enqueue(policy, seq, "b")
    policy.charge("a", 100.0)
    policy.charge("b", 30.0)
    enqueue(policy, seq, "c")  # backlogged tenants exist
    assert policy.counter("c") == 0.0
    policy.pop(ra, 0.0)
    policy.pop(rb, 0.0)
    rc = policy.peek(0.0)
    assert rc is not None and rc.tenant == "c"
    policy.remove(rc)
    policy.charge("c", 50.0)
    enqueue(policy, seq, "d")  # nobody backlogged; VTC would lift d to c's 50
    assert policy.counter("d") == 0.0


def test_lcf_lets_a_returning_tenant_monopolise_while_vtc_does_not() -> None:
    def run(policy: VirtualTokenCounter) -> list[str]:
        seq = Seq()
        enqueue(policy, seq, "steady")
        policy.charge("steady", 1000.0)  # steady has been served while "idle" was away
        for _ in range(5):
            enqueue(policy, seq, "idle")
            enqueue(policy, seq, "steady")
        order = []
        for _ in range(6):
            chosen = policy.peek(0.0)
            assert chosen is not None
            policy.pop(chosen, 0.0)
            policy.charge(chosen.tenant, 100.0)
            order.append(chosen.tenant)
        return order

    assert run(LeastCounterFirst()) == ["idle"] * 5 + ["steady"]
    assert run(VirtualTokenCounter()).count("idle") == 3


def test_scheduler_lifts_within_the_tenants_lane_only() -> None:
    scheduler = Scheduler(lanes=[LaneSpec("high"), LaneSpec("low")])
    scheduler.enqueue(Request(tenant="a", prompt_tokens=1, lane="high"), 0.0)
    scheduler.enqueue(Request(tenant="b", prompt_tokens=1, lane="low"), 0.0)
    first = scheduler.peek(0.0)
    assert first is not None and first.lane == "high"
    scheduler.dispatch(first, 0.0)
    scheduler.charge_output(first, 100)  # a's counter in "high" is now 201
    scheduler.enqueue(Request(tenant="c", prompt_tokens=1, lane="low"), 0.0)
    assert scheduler.counter("c", "low") == 0.0  # lifted to b's counter in its own lane
    scheduler.enqueue(Request(tenant="d", prompt_tokens=1, lane="high"), 0.0)
    assert scheduler.counter("d", "high") == 201.0  # a left "high" last


# -- order --


def test_smallest_counter_goes_next() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    requests = {t: enqueue(policy, seq, t) for t in "abc"}
    policy.charge("a", 30.0)
    policy.charge("b", 10.0)
    policy.charge("c", 20.0)
    assert policy.peek(0.0) is requests["b"]
    policy.charge("b", 25.0)
    assert policy.peek(0.0) is requests["c"]
    policy.charge("a", -25.0)  # a settle that refunds
    assert policy.peek(0.0) is requests["a"]
    assert policy.min_backlogged_counter() == 5.0


def test_equal_counters_go_to_the_tenant_with_the_oldest_queued_request() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    z1 = enqueue(policy, seq, "z")
    a1 = enqueue(policy, seq, "a")
    enqueue(policy, seq, "z")
    assert policy.peek(0.0) is z1  # same counter: z's head is older, names do not matter
    policy.pop(z1, 0.0)
    assert policy.peek(0.0) is a1  # now a's head is the oldest queued request


def test_tie_break_uses_the_oldest_request_still_queued_after_a_cancellation() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    a1 = enqueue(policy, seq, "a")
    b1 = enqueue(policy, seq, "b")
    a2 = enqueue(policy, seq, "a")
    policy.remove(a1)
    assert policy.peek(0.0) is b1
    policy.remove(b1)
    assert policy.peek(0.0) is a2


def test_backlogged_count_and_min_counter_follow_the_queue() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    assert policy.backlogged() == 0
    assert policy.min_backlogged_counter() is None
    ra = enqueue(policy, seq, "a")
    enqueue(policy, seq, "a")
    enqueue(policy, seq, "b")
    policy.charge("b", 5.0)
    assert policy.backlogged() == 2
    assert policy.queued() == 3
    assert policy.min_backlogged_counter() == 0.0
    policy.pop(ra, 0.0)
    policy.charge("a", 9.0)
    assert policy.min_backlogged_counter() == 5.0


# -- the lazy heap against a brute-force reference --


@dataclass
class ReferenceVTC:
    """VTC written the obvious way: a min over every backlogged tenant, every time."""

    lift: bool

    def __post_init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.queues: dict[str, list[Request]] = {}
        self.last_left: str | None = None

    def backlogged(self) -> list[str]:
        return [t for t, q in self.queues.items() if q]

    def enqueue(self, request: Request) -> None:
        tenant = request.tenant
        self.counters.setdefault(tenant, 0.0)
        queue = self.queues.setdefault(tenant, [])
        if not queue and self.lift:
            active = self.backlogged()
            floor: float | None = None
            if active:
                floor = min(self.counters[t] for t in active)
            elif self.last_left is not None:
                floor = self.counters[self.last_left]
            if floor is not None:
                self.counters[tenant] = max(self.counters[tenant], floor)
        queue.append(request)

    def choose(self) -> Request | None:
        active = self.backlogged()
        if not active:
            return None
        tenant = min(active, key=lambda t: (self.counters[t], self.queues[t][0].seq))
        return self.queues[tenant][0]

    def take(self, request: Request) -> None:
        queue = self.queues[request.tenant]
        queue.remove(request)  # Request compares by identity
        if not queue:
            self.last_left = request.tenant

    def charge(self, tenant: str, amount: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + amount


Op = tuple[str, int, int]


def run_against_reference(lift: bool, ops: list[Op], tenants: int) -> VirtualTokenCounter:
    """Apply ``ops`` to the real policy and the reference; compare after every one."""
    policy: VirtualTokenCounter = VirtualTokenCounter() if lift else LeastCounterFirst()
    reference = ReferenceVTC(lift)
    seq = Seq()
    names = [f"t{i}" for i in range(tenants)]
    queued: list[Request] = []
    for kind, x, y in ops:
        if kind == "enqueue":
            request = seq.request(names[x % tenants])
            policy.enqueue(request, 0.0)
            reference.enqueue(request)
            queued.append(request)
        elif kind == "dispatch":
            chosen = policy.peek(0.0)
            if chosen is not None:
                policy.pop(chosen, 0.0)
                reference.take(chosen)
                queued.remove(chosen)
        elif kind == "cancel":
            if queued:
                victim = queued.pop(x % len(queued))
                policy.remove(victim)
                reference.take(victim)
        else:  # charge, possibly negative (a settle refund), to any tenant, queued or not
            amount = float(y)
            policy.charge(names[x % tenants], amount)
            reference.charge(names[x % tenants], amount)
        expected = reference.choose()
        got = policy.peek(0.0)
        assert got is expected, (kind, x, y)
        assert policy.queued() == len(queued)
        assert policy.backlogged() == len(reference.backlogged())
        for name in names:
            assert policy.counter(name) == reference.counters.get(name, 0.0), name
        if expected is not None:
            assert policy.min_backlogged_counter() == min(
                reference.counters[t] for t in reference.backlogged())
    return policy


ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("enqueue"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("dispatch"), st.just(0), st.just(0)),
        st.tuples(st.just("cancel"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("charge"), st.integers(0, 7), st.integers(-60, 300)),
    ),
    max_size=200,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops_strategy, lift=st.booleans())
def test_lazy_heap_picks_what_a_brute_force_min_picks(ops: list[Op], lift: bool) -> None:
    run_against_reference(lift, ops, tenants=5)


def test_lazy_heap_matches_brute_force_over_a_long_random_run() -> None:
    rng = random.Random(42)
    ops: list[Op] = []
    for _ in range(15_000):
        roll = rng.random()
        if roll < 0.25:
            ops.append(("enqueue", rng.randrange(12), 0))
        elif roll < 0.45:
            ops.append(("dispatch", 0, 0))
        elif roll < 0.5:
            ops.append(("cancel", rng.randrange(1000), 0))
        else:  # charges dominate, as decoded tokens do in production
            ops.append(("charge", rng.randrange(12), rng.choice([1, 2, 2, 2, 50, -20])))
    for lift in (True, False):
        run_against_reference(lift, ops, tenants=12)


# -- the heap stays bounded --


def test_heap_stays_bounded_under_many_charges_between_decisions() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    for tenant in "abc":
        for _ in range(3):
            enqueue(policy, seq, tenant)
    rng = random.Random(1)
    longest = 0
    for i in range(50_000):
        policy.charge(rng.choice("abc"), 2.0)
        if i % 3 == 0:
            assert policy.peek(0.0) is not None
            longest = max(longest, len(policy._heap))
    assert longest <= 4 * policy.backlogged() + 64


def test_heap_stays_bounded_with_tenants_churning_in_and_out() -> None:
    policy, seq = VirtualTokenCounter(), Seq()
    rng = random.Random(2)
    tenants = [f"t{i}" for i in range(20)]
    most_backlogged = 0
    for _ in range(30_000):
        roll = rng.random()
        if roll < 0.3:
            enqueue(policy, seq, rng.choice(tenants))
        elif roll < 0.55:
            chosen = policy.peek(0.0)
            if chosen is not None:
                policy.pop(chosen, 0.0)
        else:
            policy.charge(rng.choice(tenants), float(rng.randint(1, 9)))
        policy.peek(0.0)
        most_backlogged = max(most_backlogged, policy.backlogged())
        assert len(policy._heap) <= 4 * most_backlogged + 64
    # Charges to tenants that are not backlogged never touch the heap.
    while (chosen := policy.peek(0.0)) is not None:
        policy.pop(chosen, 0.0)
    size = len(policy._heap)
    for _ in range(10_000):
        policy.charge(rng.choice(tenants), 1.0)
        assert policy.peek(0.0) is None
    assert len(policy._heap) <= size


# -- counters stay finite (issue 26: a weight of 1e-307 overflowed a lane to infinity) --


def test_weights_outside_the_bounded_range_are_refused() -> None:
    scheduler = Scheduler()
    for weight in (1e-307, 0.0, -1.0, 1e4, float("inf"), float("nan")):
        try:
            scheduler.set_weight("a", weight)
        except ValueError as error:
            assert "weight must be in" in str(error)
        else:
            raise AssertionError(f"weight {weight!r} was taken")
    scheduler.set_weight("a", 1e-3)
    scheduler.set_weight("b", 1e3)
    assert scheduler.weights == {"a": 1e-3, "b": 1e3}


def _served(scheduler: Scheduler, tenant: str, tokens: int) -> Request:
    request = Request(tenant=tenant, prompt_tokens=tokens)
    scheduler.enqueue(request, 0.0)
    assert scheduler.peek(0.0) is request
    scheduler.dispatch(request, 0.0)
    scheduler.finish(request)
    return request


def test_a_charge_that_overflows_is_a_fault_and_leaves_the_lane_finite_and_fair() -> None:
    scheduler = Scheduler()
    # A weight that escaped validation (set behind set_weight's back): the charge is infinite.
    scheduler.weights["tiny"] = 1e-307
    _served(scheduler, "tiny", 100)
    assert scheduler.counter_faults == 1
    assert scheduler.counter("tiny") == 0.0  # back to the floor: nobody else held a counter
    # Before the fix every tenant entering after "tiny" left was lifted to infinity, and all
    # ties broke first come, first served for good; now the order is by service again.
    scheduler.weights["tiny"] = 1.0
    _served(scheduler, "a", 50)
    heavy, light = Request(tenant="a", prompt_tokens=1), Request(tenant="b", prompt_tokens=1)
    scheduler.enqueue(heavy, 0.0)
    scheduler.enqueue(light, 0.0)
    counters = [c for _, _, c in scheduler.counters()]
    assert all(c == c and abs(c) < 1e300 for c in counters), counters
    assert scheduler.peek(0.0) is heavy  # a lifted b to its own counter: tie, a's is older
    scheduler.dispatch(heavy, 0.0)
    scheduler.charge_output(heavy, 10)
    assert scheduler.peek(0.0) is light


def test_a_non_finite_counter_from_the_shared_store_is_a_fault() -> None:
    scheduler = Scheduler()
    scheduler.enqueue(Request(tenant="a", prompt_tokens=1), 0.0)
    scheduler.set_counter("default", "a", float("nan"))
    assert scheduler.counter_faults == 1
    assert scheduler.counter("a") == 0.0


def test_large_counters_are_lowered_together_keeping_their_order() -> None:
    scheduler = Scheduler(weights={"a": 1e-3, "b": 1e-3})
    policy = scheduler.policy("default")
    assert isinstance(policy, VirtualTokenCounter)
    ra, rb = Request(tenant="a", prompt_tokens=1), Request(tenant="b", prompt_tokens=1)
    scheduler.enqueue(ra, 0.0)
    scheduler.enqueue(rb, 0.0)
    policy.set_counter("a", 2.0 ** 50 - 10)
    policy.set_counter("b", 2.0 ** 50 - 1000)
    assert scheduler.peek(0.0) is rb
    scheduler.dispatch(rb, 0.0)  # charges b 1 / 1e-3 = 1000: b reaches 2**50
    assert (scheduler.counter("a"), scheduler.counter("b")) == (0.0, 10.0)
    assert scheduler.counter_faults == 0
    scheduler.enqueue(Request(tenant="b", prompt_tokens=1), 0.0)
    assert scheduler.peek(0.0) is ra  # the re-keyed heap still picks the smallest
