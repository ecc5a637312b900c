"""The scheduler: priority lanes, each a fair queue over tenants, and the charging of service.

It answers: *which queued request goes next, and what has each tenant been served?* Lanes are
ordered, highest priority first. A lane is served only while no higher lane has a request its
policy would dispatch now (only ``rpm`` ever declines a queued one), except that a backlogged lane
with ``min_share > 0`` that has received less than that fraction of the service delivered since
it became backlogged goes first (starvation protection). Within a lane, a fairness policy (VTC by
default) orders tenants.

Charging follows the request's life: the prompt is charged at dispatch, output tokens as they are
produced (or ahead of time on an estimate), and ``settle`` corrects the total to the actual usage,
including on cancellation and failure. Every charge is divided by the tenant's weight before it
reaches the tenant's counter; ``service`` keeps the undivided totals.

Counters stay finite whatever they are charged: weights are bounded (``MIN_WEIGHT`` to
``MAX_WEIGHT``); a lane whose counters pass ``RENORMALISE_ABOVE`` has them all lowered by its
smallest (only their order and differences decide anything); and a counter that is nonetheless
not finite (an infinite or NaN charge, or a value from the shared store) is set back to the
lane's floor and counted in ``counter_faults``: one tenant's bad number must not turn every
counter of its lane to infinity, where all ties break first come, first served, for good.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

from picker.core.cost import CostFunction, LinearCost, request_cost
from picker.core.policy import FairnessPolicy, make_policy
from picker.core.request import Request, Usage

MIN_WEIGHT = 1e-3
MAX_WEIGHT = 1e3
"""The range a tenant's weight must lie in: shares up to a million to one, and a charge divided
by a weight can grow a counter at most a thousandfold."""
RENORMALISE_ABOVE = 2.0 ** 50
"""A counter past this (either sign) lowers its lane's counters by the smallest: at 2**50 a float
still resolves 1/8 of a token."""
_RENORMALISE_BELOW = -RENORMALISE_ABOVE


@dataclass(frozen=True, slots=True)
class LaneSpec:
    """A priority lane."""

    name: str
    min_share: float = 0.0
    """Fraction of service this lane receives at least while it is backlogged (0: strict)."""


def _require(request: Request, state: str) -> None:
    """Raise unless ``request`` is in ``state``. The hot paths (per request, per token) test the
    state themselves and call this only to raise."""
    if request.state != state:
        raise ValueError(f"request is {request.state}, not {state}")


class _Lane:
    __slots__ = ("index", "min_share", "name", "own_service", "policy", "take_alone",
                 "total_service")

    def __init__(self, index: int, spec: LaneSpec, policy: FairnessPolicy) -> None:
        self.index = index
        self.name = spec.name
        self.min_share = spec.min_share
        self.policy = policy
        self.take_alone: Callable[[Request], None] | None = getattr(policy, "take_alone", None)
        """The policy's ``enqueue`` then ``pop`` of a request queued alone, in one call, when it
        has it (``Scheduler.dispatch_alone``)."""
        # Service since this lane last became backlogged: its own, and everyone's.
        self.own_service = 0.0
        self.total_service = 0.0

    def owed(self) -> bool:
        return self.own_service < self.min_share * self.total_service


class CounterChanges:
    """What changed a tenant's counter in a lane since the changes were last taken: charges
    add up; a lift sets a floor (the counter it was lifted to, plus what was charged since)."""

    __slots__ = ("charges", "lift_to", "since_lift")

    def __init__(self) -> None:
        self.charges = 0.0
        self.lift_to: float | None = None
        self.since_lift = 0.0

    def applied_to(self, stored: float) -> float:
        """The counter after these changes, from ``stored`` (the store's value)."""
        value = stored + self.charges
        if self.lift_to is not None:
            value = max(value, self.lift_to + self.since_lift)
        return value


class Scheduler:
    """Lanes of fair queues plus the accounting that drives them.

    ``policy`` names a fairness policy (``vtc``, ``lcf``, ``fcfs``, ``rpm``); ``policy_options``
    go to its constructor (``rpm``: ``limit``, ``window``). Tenants without a weight weigh 1.
    """

    def __init__(
        self,
        lanes: Iterable[LaneSpec] = (LaneSpec("default"),),
        policy: str = "vtc",
        cost: CostFunction | None = None,
        weights: Mapping[str, float] | None = None,
        **policy_options: float,
    ) -> None:
        specs = list(lanes)
        if not specs:
            raise ValueError("a scheduler needs at least one lane")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"lane names must be unique: {names}")
        for spec in specs:
            if not 0.0 <= spec.min_share < 1.0:
                raise ValueError(f"lane {spec.name!r}: min_share must be in [0, 1)")
        self.policy_name = policy
        self.cost: CostFunction = cost if cost is not None else LinearCost()
        self._lanes = [
            _Lane(i, spec, make_policy(policy, **policy_options)) for i, spec in enumerate(specs)
        ]
        self._by_name = {lane.name: lane for lane in self._lanes}
        self._policies = {lane.name: lane.policy for lane in self._lanes}
        self._protected = [lane for lane in self._lanes if lane.min_share > 0]
        self.weights: dict[str, float] = {}
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)
        self.service: dict[str, float] = {}
        """Weighted service charged per tenant, not divided by weight (all lanes)."""
        self._seq = 0
        self._changes: dict[str, dict[str, CounterChanges]] | None = None
        """With a shared state store (``track_changes``): per lane, per tenant, what changed
        its counter since ``take_counter_changes``."""
        self.counter_faults = 0
        """Counters found not finite and set back to their lane's floor (a fault: exported as
        ``fairway_vtc_faults_total``)."""

    # -- configuration --

    @property
    def lane_names(self) -> list[str]:
        return [lane.name for lane in self._lanes]

    def set_weight(self, tenant: str, weight: float) -> None:
        """Set a tenant's weight; charges from now on use it, its counter is kept."""
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ValueError(f"tenant {tenant!r}: weight must be in [{MIN_WEIGHT:g}, "
                             f"{MAX_WEIGHT:g}], not {weight!r}")
        self.weights[tenant] = float(weight)

    # -- shared state (``picker.core.shared``) --

    def track_changes(self) -> None:
        """From now on record every change to a counter, for ``take_counter_changes``."""
        if self._changes is None:
            self._changes = {lane.name: {} for lane in self._lanes}

    def take_counter_changes(self) -> dict[str, dict[str, CounterChanges]]:
        """Per lane, per tenant, the counter changes since the last call (then forgotten)."""
        if self._changes is None:
            return {}
        taken, self._changes = self._changes, {lane.name: {} for lane in self._lanes}
        return {lane: changes for lane, changes in taken.items() if changes}

    def adopt_changes(self, old: Scheduler) -> None:
        """Record changes as ``old`` did, starting with its changes not yet taken (in the lanes
        this scheduler has): for a scheduler rebuilt on a config change."""
        if old._changes is None:
            return
        self.track_changes()
        assert self._changes is not None
        for lane, changes in old._changes.items():
            if lane in self._changes:
                self._changes[lane].update(changes)

    def counters(self) -> Iterator[tuple[str, str, float]]:
        """``(lane, tenant, counter)`` of every counter held."""
        for lane in self._lanes:
            for tenant, counter in getattr(lane.policy, "counters", {}).items():
                yield lane.name, tenant, counter

    def with_untaken(self, lane: str, tenant: str, stored: float) -> float:
        """A counter read from the store, with this picker's changes not yet taken applied as
        the store will apply them."""
        changes = None if self._changes is None else self._changes[lane].get(tenant)
        return stored if changes is None else changes.applied_to(stored)

    def floors(self) -> dict[str, float]:
        """Per lane with backlogged tenants, the lowest of their counters."""
        out = {}
        for lane in self._lanes:
            floor = getattr(lane.policy, "min_backlogged_counter", lambda: None)()
            if floor is not None:
                out[lane.name] = floor
        return out

    def set_shared_floors(self, floors: Mapping[str, float]) -> None:
        """The lowest backlogged counter per lane on the other pickers (none: absent): lifts
        here go no higher (see ``VirtualTokenCounter.shared_floor``)."""
        for lane in self._lanes:
            if hasattr(lane.policy, "shared_floor"):
                lane.policy.shared_floor = floors.get(lane.name)

    def set_counter(self, lane: str, tenant: str, value: float) -> None:
        """Set the tenant's counter in ``lane`` (a value read from the shared store); recorded
        as no change of this picker's."""
        setter = getattr(self._by_name[lane].policy, "set_counter", None)
        if setter is not None:
            setter(tenant, value)
            if not -RENORMALISE_ABOVE < value < RENORMALISE_ABOVE:
                self._keep_finite(self._by_name[lane], tenant)

    def policy(self, lane: str) -> FairnessPolicy:
        """The fairness policy instance serving ``lane``."""
        return self._by_name[lane].policy

    # -- the request lifecycle --

    def enqueue(self, request: Request, now: float) -> None:
        """Queue a request in its lane (the first lane if it names none)."""
        if request.state != "new":
            _require(request, "new")
        if not request.lane:
            request.lane = self._lanes[0].name
        lane = self._by_name.get(request.lane)
        if lane is None:
            raise KeyError(f"unknown lane {request.lane!r}")
        if lane.min_share > 0 and lane.policy.queued() == 0:
            lane.own_service = lane.total_service = 0.0
        request.seq = self._seq
        self._seq += 1
        request.state = "queued"
        changes = self._changes
        if changes is None:
            lane.policy.enqueue(request, now)
            return
        # A lift raises the counter too: peers must see it, as a floor (not an amount: the
        # counter it was lifted from may lag the store's).
        tenant = request.tenant
        before = lane.policy.counter(tenant)
        lane.policy.enqueue(request, now)
        after = lane.policy.counter(tenant)
        if after != before:
            mine = changes[lane.name]
            pending = mine.get(tenant)
            if pending is None:
                pending = mine[tenant] = CounterChanges()
            pending.lift_to, pending.since_lift = after, 0.0

    def _first_queued(self) -> _Lane | None:
        """The best lane with a request queued (a protected lower one may still go first)."""
        for lane in self._lanes:
            if lane.policy.queued():
                return lane
        return None

    def peek(self, now: float) -> Request | None:
        """The request that should be dispatched next, or None if nothing should be."""
        lanes = self._lanes
        first = self._first_queued()
        if first is None:
            return None
        for lane in self._protected:
            if lane.index > first.index and lane.policy.queued() and lane.owed():
                chosen = lane.policy.peek(now)
                if chosen is not None:
                    return chosen
        for lane in lanes[first.index :]:
            if lane.policy.queued():
                chosen = lane.policy.peek(now)
                if chosen is not None:
                    return chosen
        return None

    def peek_besides(self, now: float, tenants: Collection[str]) -> Request | None:
        """The request ``peek`` would choose if ``tenants`` had nothing queued (a head that
        waits lets the next go, ``Gate.pump``), or None: nothing else is queued, or a lane
        that would choose one of them has a policy that cannot look past it (only ``vtc``
        and ``lcf`` can)."""
        if not tenants:
            return self.peek(now)
        lanes = self._lanes
        first = self._first_queued()
        if first is None:
            return None
        order = [lane for lane in self._protected if lane.index > first.index
                 and lane.policy.queued() and lane.owed()]
        order += [lane for lane in lanes[first.index:] if lane.policy.queued()]
        for lane in order:
            besides = getattr(lane.policy, "peek_besides", None)
            if besides is None:
                chosen = lane.policy.peek(now)
                if chosen is not None and chosen.tenant in tenants:
                    return None
            else:
                chosen = besides(now, tenants)
            if chosen is not None:
                return chosen
        return None

    def dispatch(self, request: Request, now: float) -> None:
        """Take a queued request out of the queue and charge its prompt."""
        if request.state != "queued":
            _require(request, "queued")
        self._by_name[request.lane].policy.pop(request, now)
        request.state = "running"
        self._charge(request, self.cost.prompt_cost(request.prompt_tokens,
                                                    request.cached_prompt_tokens))

    def dispatch_alone(self, request: Request, now: float) -> bool:
        """``enqueue`` then ``dispatch`` of a new request while nothing is queued in any lane
        (then ``peek`` would choose it), in one step: its counter is lifted, it is the last to
        leave its lane's queue and its prompt is charged, as by the two calls, without the
        queue's round trip (the fast replay's common case: a request that finds the queue empty
        and an endpoint with room). False, with nothing changed, where this does not apply:
        something is queued, its lane's policy has no ``take_alone`` (``rpm`` may decline
        a request), or counter changes are tracked for a shared store; ``enqueue`` it then."""
        if request.state != "new":
            _require(request, "new")
        if self._changes is not None:
            return False
        for each in self._lanes:
            if each.policy.queued():
                return False
        if not request.lane:
            request.lane = self._lanes[0].name
        lane = self._by_name.get(request.lane)
        if lane is None:
            raise KeyError(f"unknown lane {request.lane!r}")
        take = lane.take_alone
        if take is None:
            return False
        if lane.min_share > 0:
            lane.own_service = lane.total_service = 0.0  # as ``enqueue`` into an empty lane
        request.seq = self._seq
        self._seq += 1
        take(request)
        request.state = "running"
        self._charge(request, self.cost.prompt_cost(request.prompt_tokens,
                                                    request.cached_prompt_tokens))
        return True

    def charge_output(self, request: Request, tokens: int = 1) -> None:
        """Record ``tokens`` output tokens produced; charge those not already estimated."""
        if request.state != "running":
            _require(request, "running")
        before = request.generated
        after = before + tokens
        estimated = request.estimated_output
        billable_from = before if before >= estimated else estimated
        request.generated = after
        if after > billable_from:
            self._charge(request, self.cost.output_cost(request.prompt_tokens, billable_from,
                                                        after - billable_from))

    def charge_estimate(self, request: Request, output_tokens: int) -> None:
        """Charge output ahead of production, on an estimate, up to ``output_tokens`` in total."""
        if request.state != "running":
            _require(request, "running")
        generated, estimated = request.generated, request.estimated_output
        covered = generated if generated >= estimated else estimated
        if output_tokens > covered:
            self._charge(request, self.cost.output_cost(request.prompt_tokens, covered,
                                                        output_tokens - covered))
            request.estimated_output = output_tokens

    def settle(self, request: Request, actual: Usage) -> float:
        """Correct the request's total charge to the cost of ``actual``; returns the difference.

        The difference may be negative (the estimate was too high). Call it when the engine
        reports usage; ``finish`` and ``cancel`` call it for you.
        """
        return self.settle_tokens(request, actual.prompt_tokens, actual.completion_tokens,
                                  actual.cached_prompt_tokens)

    def settle_tokens(self, request: Request, prompt_tokens: int, completion_tokens: int,
                      cached_prompt_tokens: int = 0) -> float:
        """``settle`` to the usage given as counts."""
        if request.state != "running":
            _require(request, "running")
        total = request_cost(self.cost, prompt_tokens, completion_tokens, cached_prompt_tokens)
        delta = total - request.charged
        if delta:
            self._charge(request, delta)
        request.generated = completion_tokens
        request.estimated_output = 0
        return delta

    def finish(self, request: Request, actual: Usage | None = None) -> None:
        """A running request ended: settle to ``actual`` (default: what was counted)."""
        if request.state != "running":
            _require(request, "running")
        if actual is not None:
            self.settle(request, actual)
        elif request.estimated_output:
            self.settle(request, Usage(request.prompt_tokens, request.generated,
                                       request.cached_prompt_tokens))
        # else: charged exactly what was counted already; nothing to settle.
        request.state = "done"

    def finish_tokens(self, request: Request, prompt_tokens: int, completion_tokens: int,
                      cached_prompt_tokens: int = 0) -> None:
        """``finish`` with the actual usage given as counts, without a ``Usage`` to build (the
        fast replay ends millions of requests)."""
        self.settle_tokens(request, prompt_tokens, completion_tokens, cached_prompt_tokens)
        request.state = "done"

    def cancel(self, request: Request) -> None:
        """Drop a request: a queued one is removed uncharged, a running one settles to what it got.

        Cancelling a request that is already done or cancelled does nothing.
        """
        if request.state == "queued":
            self._by_name[request.lane].policy.remove(request)
        elif request.state == "running":
            self.finish(request)
        else:
            return
        request.state = "cancelled"

    # -- memory --

    def forget_idle(self, keep: Collection[str] = (), keep_service: Collection[str] = ()
                    ) -> set[str]:
        """Forget idle tenants' counters where a fresh tenant would get the same (each lane's
        policy decides; see ``VirtualTokenCounter.forget_idle``), and the service totals of
        tenants then held in no lane, except those in ``keep_service`` (say, configured tenants:
        bounded, and shown by the admin API). ``keep``: tenants with requests in the picker.
        Returns the tenants whose service total was dropped. Service totals are accounting
        only: no decision reads them.
        """
        for lane in self._lanes:
            forget = getattr(lane.policy, "forget_idle", None)
            if forget is not None:
                forget(keep)
        held: set[str] = set()
        for lane in self._lanes:
            held.update(getattr(lane.policy, "counters", ()))
        gone = {tenant for tenant in self.service
                if tenant not in held and tenant not in keep and tenant not in keep_service}
        for tenant in gone:
            del self.service[tenant]
        if len(gone) > len(self.service):
            self.service = dict(self.service)  # shrink the table a flood grew
        return gone

    def tenants_held(self) -> int:
        """Distinct tenants with a counter in some lane or a service total (memory use)."""
        held = set(self.service)
        for lane in self._lanes:
            held.update(getattr(lane.policy, "counters", ()))
        return len(held)

    # -- reading state --

    def queued(self, lane: str | None = None) -> int:
        """Queued requests in one lane, or in all."""
        if lane is not None:
            return self._by_name[lane].policy.queued()
        return sum(lane.policy.queued() for lane in self._lanes)

    def counter(self, tenant: str, lane: str | None = None) -> float:
        """The tenant's virtual counter in ``lane`` (default: the first lane)."""
        return self._by_name[lane or self._lanes[0].name].policy.counter(tenant)

    # -- internals --

    def _charge(self, request: Request, amount: float) -> None:
        tenant = request.tenant
        request.charged += amount
        service = self.service
        service[tenant] = service.get(tenant, 0.0) + amount
        normalized = amount / self.weights.get(tenant, 1.0)
        policy = self._policies[request.lane]
        policy.charge(tenant, normalized)
        # Two comparisons per charge of the counter it just set (false for NaN), unchained:
        # each is then a specialised float comparison.
        counter = policy.counters[tenant]
        if not (counter < RENORMALISE_ABOVE and counter > _RENORMALISE_BELOW):
            normalized = self._keep_finite(self._by_name[request.lane], tenant, normalized)
        if self._changes is not None:
            mine = self._changes[request.lane]
            pending = mine.get(tenant)
            if pending is None:
                pending = mine[tenant] = CounterChanges()
            pending.charges += normalized
            if pending.lift_to is not None:
                pending.since_lift += normalized
        for protected in self._protected:
            if protected.policy.queued():
                protected.total_service += amount
                if protected.name == request.lane:
                    protected.own_service += amount

    def _keep_finite(self, lane: _Lane, tenant: str, normalized: float = 0.0) -> float:
        """A counter of ``lane`` left the finite range: a non-finite one is a fault, set back to
        the lane's floor; a large one lowers the lane's counters by their smallest. Returns the
        charge as recorded for the shared store (0 for one that was not finite)."""
        policy = lane.policy
        setter = getattr(policy, "set_counter", None)
        if not math.isfinite(policy.counters.get(tenant, 0.0)):
            self.counter_faults += 1
            finite = [c for c in policy.counters.values() if math.isfinite(c)]
            placeholder = max(finite) if finite else 0.0
            if setter is None:
                policy.counters[tenant] = placeholder
            else:
                setter(tenant, placeholder)  # re-keys it, so the floor below is read right
                lift_floor = getattr(policy, "lift_floor", None)
                if lift_floor is not None:
                    setter(tenant, lift_floor())  # where a tenant entering now would start
            if not math.isfinite(normalized):
                normalized = 0.0
        renormalise = getattr(policy, "renormalise", None)
        if renormalise is not None and self._changes is None:
            # Beside other pickers the store holds the counters in its own frame: not shifted
            # here (2**50 takes some 10**12 tokens at the smallest weight).
            values = policy.counters.values()
            if values and max(map(abs, values)) >= RENORMALISE_ABOVE:
                renormalise(min(values), RENORMALISE_ABOVE / 2)
        return normalized
