"""``picker.core.shared``: replicas exchanging their changes through a store end with the
counters and budget levels one picker alone would have, with nothing counted twice or lost.

The store is ``StoreModel``, the Lua script's rules in Python (``picker.state``): add a change
where a value is held, take the sender's own value where none is; a lift is a floor; a bucket
absent is full. ``tests/integration/test_redis_script.py`` holds the real script to the model.
"""

from __future__ import annotations

import pytest

from picker.core import Request, Usage
from picker.core.admission import Admission, Admitted, BucketRule, TenantRules
from picker.core.estimates import TenantEstimates
from picker.core.lanes import Scheduler
from picker.core.shared import Changes, StoreModel, apply_view, start_sharing, take_changes

BURST = TenantRules(burst=BucketRule(1000, 3600.0))


class Store:
    """``StoreModel`` (the script's rules in Python) at t=0, each exchange its own batch."""

    def __init__(self) -> None:
        self.model = StoreModel()
        self.batches = 0

    @property
    def counters(self) -> dict[tuple[str, str], float]:
        return self.model.counters

    @property
    def levels(self) -> dict[tuple[str, str], float]:
        return {key: level for key, (level, *_) in self.model.buckets.items()}

    def exchange(self, changes: Changes) -> tuple[dict, dict]:
        self.batches += 1
        reply = self.model.exchange(f"replica{self.batches}", 1, changes, 0.0)
        return reply.counters, reply.levels


class Replica:
    def __init__(self) -> None:
        self.scheduler = Scheduler()
        self.admission = Admission({"a": BURST, "b": BURST}, TenantRules())
        start_sharing(self.scheduler, self.admission)

    def serve(self, tenant: str, prompt: int, output: int) -> None:
        request = Request(tenant, prompt)
        self.scheduler.enqueue(request, 0.0)
        self.scheduler.dispatch(request, 0.0)
        self.scheduler.charge_output(request, output)
        self.scheduler.finish(request)

    def spend(self, tenant: str, tokens: int) -> None:
        admitted = self.admission.admit(tenant, "default", tokens, 0, 0, 0.0)
        assert isinstance(admitted, Admitted)
        self.admission.finish(admitted.reservation, tokens, 0.0)

    def sync(self, store: Store) -> None:
        counters, levels = store.exchange(take_changes(self.scheduler, self.admission, 0.0))
        apply_view(self.scheduler, self.admission, counters, levels, 0.0)

    def level(self, tenant: str) -> float:
        return dict(self.admission.budget_state(0.0).get(tenant, {"burst": (1000.0, 1000)})
                    )["burst"][0]


def test_replicas_see_the_sum_of_everyone_s_charges() -> None:
    store, one, two = Store(), Replica(), Replica()
    one.serve("a", 100, 50)
    two.serve("a", 30, 20)
    two.serve("b", 10, 0)
    one.spend("a", 300)
    two.spend("a", 200)
    for replica in (one, two, one):
        replica.sync(store)
    for replica in (one, two):  # output tokens cost 2 (the default LinearCost)
        assert replica.scheduler.counter("a") == pytest.approx(100 + 2 * 50 + 30 + 2 * 20)
        # b entered two's queue after a left it: lifted to a's counter there (70), then 10
        assert replica.scheduler.counter("b") == pytest.approx(70 + 10)
        assert replica.level("a") == pytest.approx(500.0)
        assert replica.level("b") == pytest.approx(1000.0)


def test_changes_made_during_an_exchange_are_neither_lost_nor_counted_twice() -> None:
    store, one = Store(), Replica()
    one.serve("a", 100, 0)
    one.spend("a", 100)
    changes = take_changes(one.scheduler, one.admission, 0.0)
    one.serve("a", 40, 0)  # while the exchange is under way
    one.spend("a", 40)
    counters, levels = store.exchange(changes)
    apply_view(one.scheduler, one.admission, counters, levels, 0.0)
    assert one.scheduler.counter("a") == pytest.approx(140.0)
    assert one.level("a") == pytest.approx(860.0)
    one.sync(store)
    assert store.counters[("default", "a")] == pytest.approx(140.0)
    assert store.levels[("a", "burst")] == pytest.approx(860.0)
    one.sync(store)  # nothing new: nothing changes
    assert one.scheduler.counter("a") == pytest.approx(140.0)
    assert one.level("a") == pytest.approx(860.0)


def test_a_restarted_replica_resumes_from_the_store() -> None:
    store, before = Store(), Replica()
    before.serve("a", 100, 100)
    before.spend("a", 700)
    before.sync(store)
    after = Replica()  # a new process: fresh counters and full buckets
    after.sync(store)
    assert after.scheduler.counter("a") == pytest.approx(100 + 2 * 100)
    assert after.level("a") == pytest.approx(300.0)
    refused = after.admission.admit("a", "default", 400, 0, 0, 0.0)
    assert not isinstance(refused, Admitted)  # the spent burst budget stays spent


def test_a_store_that_lost_its_state_gets_the_whole_view_back() -> None:
    store, one, two = Store(), Replica(), Replica()
    one.serve("a", 100, 0)
    one.spend("a", 600)
    two.serve("b", 50, 0)
    one.sync(store)
    two.sync(store)
    one.sync(store)
    empty = Store()  # restarted without persistence
    for replica in (one, two):
        counters, levels = empty.exchange(take_changes(replica.scheduler, replica.admission, 0.0,
                                                       every=True))
    apply_view(one.scheduler, one.admission, counters, levels, 0.0)
    assert empty.counters == {("default", "a"): 100.0, ("default", "b"): 50.0}
    assert empty.levels == {("a", "burst"): 400.0}
    assert one.level("a") == pytest.approx(400.0)


def test_a_negative_settlement_travels_as_a_negative_change() -> None:
    store, one, two = Store(), Replica(), Replica()
    request = Request("a", 100)
    one.scheduler.enqueue(request, 0.0)
    one.scheduler.dispatch(request, 0.0)
    one.scheduler.charge_estimate(request, 400)  # charged ahead on an estimate
    one.sync(store)
    two.sync(store)
    assert two.scheduler.counter("a") == pytest.approx(100 + 2 * 400)
    one.scheduler.finish(request, Usage(100, 50))  # it produced far less
    one.sync(store)
    two.sync(store)
    assert two.scheduler.counter("a") == pytest.approx(100 + 2 * 50)
    assert one.scheduler.counter("a") == pytest.approx(100 + 2 * 50)


def test_a_lift_is_a_change_peers_see() -> None:
    store, one = Store(), Replica()
    one.serve("b", 500, 0)
    busy = Request("b", 10)
    one.scheduler.enqueue(busy, 0.0)  # b backlogged at counter 500
    one.scheduler.enqueue(Request("a", 10), 0.0)  # a returns: lifted to b's counter
    one.sync(store)
    assert store.counters[("default", "a")] == pytest.approx(500.0)


def test_a_budget_change_is_kept_until_taken_even_when_the_tenant_could_be_forgotten() -> None:
    one = Replica()
    spent = one.admission.admit("a", "default", 100, 0, 0, 0.0)
    assert isinstance(spent, Admitted)
    one.admission.finish(spent.reservation, 100, 0.0)
    one.admission.prune(7200.0)  # refilled to full and idle: a fresh tenant but for its change
    assert one.admission.tracked_tenants() == 1
    changes = take_changes(one.scheduler, one.admission, 7200.0)
    assert [(b.tenant, b.change) for b in changes.budgets] == [("a", pytest.approx(-100.0))]
    one.admission.prune(7200.0)
    assert one.admission.tracked_tenants() == 0


def test_a_refund_that_cancels_the_reservation_is_no_change() -> None:
    one = Replica()
    admitted = one.admission.admit("a", "default", 100, 0, 0, 0.0)
    assert isinstance(admitted, Admitted)
    one.admission.finish(admitted.reservation, 0, 0.0)  # cancelled: everything refunded
    assert take_changes(one.scheduler, one.admission, 0.0).budgets == ()
    assert one.admission.tracked_tenants() == 0


def test_estimates_learned_anywhere_are_everyone_s_unless_a_newer_one_waits_to_be_sent() -> None:
    one, two = TenantEstimates(256), TenantEstimates(256)
    for estimates in (one, two):
        estimates.track_changes()
    one.learn_output("a", 40, 10.0)
    one.learn_prompt("a", "m", 100, 250, 10.0)
    sent = {(kind, tenant, model): (value, 0.0)
            for kind, tenant, model, value, _ in one.take_learned()}
    assert one.take_learned() == []  # taken once
    two.learn_output("b", 7, 10.0)  # learned on two, not sent yet
    sent[("output", "b", "")] = (300.0, 0.0)  # an older value from the store
    apply_view(Scheduler(), Admission({}, TenantRules()), {}, {}, 11.0, estimates=two,
               learned=sent)
    assert two.output("a", 11.0) == 40.0
    assert two.prompt_scale("a", "m", 11.0) == pytest.approx(2.5)
    assert two.output("b", 11.0) == 7.0  # its own newer sample is kept until sent


def test_an_estimate_from_the_store_ages_from_when_it_was_learned() -> None:
    estimates = TenantEstimates(256, ttl=600.0)
    apply_view(Scheduler(), Admission({}, TenantRules()), {}, {}, 1000.0, estimates=estimates,
               learned={("stream", "a", ""): (90.0, 550.0)})
    assert estimates.output("a", 1000.0, stream=True) == 90.0
    assert estimates.output("a", 1051.0, stream=True) == 256.0  # 601 s old: the default


def test_a_lift_from_a_stale_counter_does_not_inflate_the_store_s() -> None:
    store, one, two = Store(), Replica(), Replica()
    two.serve("a", 1000, 0)  # a is served at two: 1,000
    two.sync(store)
    one.serve("b", 500, 0)
    one.scheduler.enqueue(Request("b", 10), 0.0)  # b backlogged at one at 500
    one.scheduler.enqueue(Request("a", 10), 0.0)  # a reaches one: lifted from 0 (stale) to 500
    one.sync(store)
    assert store.counters[("default", "a")] == pytest.approx(1000.0)  # not 1,500
    assert one.scheduler.counter("a") == pytest.approx(1000.0)


def test_a_lift_above_the_store_s_counter_raises_it_with_what_was_charged_since() -> None:
    store, one, two = Store(), Replica(), Replica()
    two.serve("a", 100, 0)
    two.sync(store)
    one.sync(store)
    one.serve("b", 500, 0)
    one.scheduler.enqueue(Request("b", 10), 0.0)
    request = Request("a", 30)
    one.scheduler.enqueue(request, 0.0)  # lifted from 100 to 500
    one.scheduler.dispatch(request, 0.0)  # then charged 30
    one.sync(store)
    assert store.counters[("default", "a")] == pytest.approx(530.0)


def _admitted(replica: Replica, tokens: int) -> bool:
    admitted = replica.admission.admit("a", "default", tokens, 0, 0, 0.0)
    return isinstance(admitted, Admitted)


@pytest.mark.parametrize(("spent", "most"), [(0, 600), (750, 300)])
def test_replicas_together_overrun_a_budget_by_one_request_each_at_most(
        spent: int, most: int) -> None:
    store, replicas = Store(), [Replica() for _ in range(3)]
    if spent:
        replicas[0].spend("a", spent)
    for replica in (*replicas, *replicas):
        replica.sync(store)
        replica.admission.replicas = 3
    # Between two exchanges each spends no more than a fifth of what is left (1/(2N-1); its
    # first request excepted): 1,000 left -> 3 x 200; 250 left -> one request each.
    admitted = sum(100 for replica in replicas for _ in range(10) if _admitted(replica, 100))
    assert admitted == most
    left = BURST.burst.capacity_tokens - spent  # type: ignore[union-attr]
    assert admitted <= left + 3 * 100


def test_a_picker_over_its_part_is_told_to_retry_after_the_next_exchange() -> None:
    store, one = Store(), Replica()
    one.sync(store)
    one.admission.replicas, one.admission.slice_wait = 4, 0.1
    assert _admitted(one, 200)  # the first request passes
    refused = one.admission.admit("a", "default", 100, 0, 0, 0.0)
    assert not isinstance(refused, Admitted)
    assert refused.retry_after == 0.1 and "part of the burst token budget" in refused.message


def test_a_request_reserved_in_the_store_is_not_sent_again_and_a_refused_one_goes_back() -> None:
    one = Replica()
    one.admission.replicas = 2
    assert one.admission.judged_in_store("a") and not one.admission.judged_in_store("nobody")
    assert one.admission.budget_needs("a", 100, 40, 40) == 140
    admitted = one.admission.admit("a", "default", 100, 40, 40, 0.0, prereserved=150)
    assert isinstance(admitted, Admitted)
    assert one.level("a") == 1000 - 140  # reserved here as usual
    changes = take_changes(one.scheduler, one.admission, 0.0)
    # The store has 150 of it already: only the difference travels.
    assert [(b.tenant, b.change) for b in changes.budgets] == [("a", 10.0)]
    one.admission.return_to_store("a", 70, 0.0)
    changes = take_changes(one.scheduler, one.admission, 0.0)
    assert [(b.tenant, b.change) for b in changes.budgets] == [("a", 70.0)]
    assert one.level("a") == 1000 - 140  # this picker never reserved the returned tokens


def test_a_prereserved_admission_takes_the_store_s_word_over_a_stale_view() -> None:
    one = Replica()
    one.admission.replicas = 2
    one.spend("a", 990)  # this picker's view: 10 left
    assert not isinstance(one.admission.admit("a", "default", 100, 0, 0, 0.0), Admitted)
    assert isinstance(one.admission.admit("a", "default", 100, 0, 0, 0.0, prereserved=100),
                      Admitted)


@pytest.mark.parametrize(("case", "sent_back"), [
    ("refused here", 300), ("no endpoint", 300), ("queue full", 300), ("admitted", 0)])
def test_a_store_reservation_the_gate_does_not_keep_goes_back(case: str, sent_back: int) -> None:
    from picker.core.admission import TenantRules as Rules
    from picker.core.gate import Gate, GateRules, LaneRules, Passage

    rules = {"a": Rules(burst=BucketRule(1000, 3600.0),
                        max_input_tokens=50 if case == "refused here" else None)}
    gate = Gate(GateRules(lanes=(LaneRules("default"),),
                          max_queued=0 if case == "queue full" else 100),
                Scheduler(), Admission(rules, Rules()), now=0.0)
    gate.set_endpoints({} if case == "no endpoint" else {"e:1": 10_000})
    start_sharing(gate.scheduler, gate.admission)
    gate.admission.replicas = 2
    needs = gate.budget_needs("a", model="m", prompt_tokens=200, max_tokens=100, stream=False,
                              now=0.0)
    assert needs == 300
    gate.admit(Passage, "a", None, model="m", prompt_tokens=200, max_tokens=100, stream=False,
               now=0.0, prereserved=needs)
    changes = take_changes(gate.scheduler, gate.admission, 0.0)
    assert sum(b.change for b in changes.budgets) == sent_back


def test_a_lowered_grant_is_left_to_the_others_only_once_its_replica_has_heard_it() -> None:
    """A replica fills its last grant until the next answer reaches it: a grant lowered by an
    exchange still in flight must not be handed to another replica meanwhile (a rolling update
    under load summed 1.01 of the pool)."""
    store, nothing = StoreModel(), Changes((), ())
    assert store.exchange("a", 1, nothing, 0.0, target=0.6).grant == pytest.approx(0.6)
    assert store.exchange("b", 1, nothing, 0.0, target=0.4).grant == pytest.approx(0.4)
    # a asks for less; its answer (0.3) is on its way and a may still fill 0.6 meanwhile.
    assert store.exchange("a", 2, nothing, 0.1, target=0.3).grant == pytest.approx(0.3)
    in_force_a = 0.6
    grant_b = store.exchange("b", 2, nothing, 0.1, target=0.7).grant
    assert in_force_a + grant_b <= 1.0 + 1e-9, grant_b
    # a's next exchange shows it heard 0.3: the rest is b's.
    store.exchange("a", 3, nothing, 0.2, target=0.3)
    assert store.exchange("b", 3, nothing, 0.2, target=0.7).grant == pytest.approx(0.7)


def test_what_a_replica_holds_beyond_its_grants_stays_its_own() -> None:
    store, nothing = StoreModel(), Changes((), ())
    store.exchange("a", 1, nothing, 0.0, target=0.5)
    store.exchange("a", 2, nothing, 0.1, target=0.2, held=0.8)
    store.exchange("a", 3, nothing, 0.2, target=0.2, held=0.8)
    assert store.exchange("b", 1, nothing, 0.2, target=1.0).grant == pytest.approx(0.2)
