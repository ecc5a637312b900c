"""What does a picker tell the store it shares with other pickers, and how does what the store
answers become its own view?

With a shared state backend (``state.backend: redis``) every replica keeps deciding on its own
in-memory state (the fair queue's counters, the budget buckets) and exchanges, every sync
interval, the *changes* it made since the last exchange for the store's totals:

* A counter change is what was charged to a tenant in a lane (a negative settlement lowers
  it), and a lift: the floor the fair queue lifted the tenant to, plus what was charged since.
  The store adds the charges and then raises the counter to the lift's floor if it is below: a
  lift is a floor, not an amount, as the counter it was lifted from may lag the store's (adding
  it would inflate the counter of a tenant that reaches a replica rarely and is lifted there
  each time). A counter the store does not hold yet starts at the picker's own value.
* A budget change is what admissions reserved and settlements refunded or charged; refill is not
  a change, every holder refills by the clock (the store by its own). A bucket the store does not
  return is full there.
* An estimate (``picker.core.estimates``) travels as its value: the last learned anywhere
  is everyone's, unless a picker learned a newer one it has not sent yet.
* The view after an exchange is the store's value plus this picker's changes made while the
  exchange was under way (not yet taken): nothing is counted twice and nothing is lost.
* A store that lost its state (restarted without persistence) gets each picker's whole view
  (``take_changes(every=True)``): every change carries the picker's own value, which the store
  takes for what it does not hold, and adds the change to what it does.

Others' charges reach a picker one interval late: its view is stale by at most the interval (plus
the round trip) while the store answers, and a budget can be overrun by what all replicas admit
within one interval. Pure: no I/O; the syncer (``picker.state``) drives it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from picker.core.admission import MAX_DEBT, Admission
from picker.core.estimates import TenantEstimates
from picker.core.gate import Gate
from picker.core.lanes import Scheduler
from picker.core.leases import replica_targets

SEPARATOR = "\x1f"
"""Between the parts of a store key's field (lane and tenant; tenant and window): a control
character no lane, tenant id or window name contains."""


@dataclass(frozen=True, slots=True)
class CounterChange:
    lane: str
    tenant: str
    change: float
    """What was charged (normalized by weight)."""
    value: float
    """The picker's own counter: where the store starts a counter it does not hold."""
    lift_to: float | None = None
    """A lift's floor: the counter is at least this plus ``since_lift``."""
    since_lift: float = 0.0


@dataclass(frozen=True, slots=True)
class BudgetChange:
    tenant: str
    window: str
    change: float
    level: float
    """The picker's own level: where the store starts a bucket it does not hold."""
    capacity: int
    rate: float
    """Tokens a second the bucket refills at (the store refills by it)."""


@dataclass(frozen=True, slots=True)
class Learned:
    kind: str
    """``scale`` (prompt calibration, per model), ``output`` or ``stream``."""
    tenant: str
    model: str
    value: float


@dataclass(frozen=True, slots=True)
class Changes:
    counters: tuple[CounterChange, ...]
    budgets: tuple[BudgetChange, ...]
    estimates: tuple[Learned, ...] = ()


def start_sharing(scheduler: Scheduler, admission: Admission,
                  estimates: TenantEstimates | None = None) -> None:
    """Make the scheduler, admission and estimates keep their changes until
    ``take_changes``."""
    scheduler.track_changes()
    admission.shared = True
    if estimates is not None:
        estimates.track_changes()


def take_changes(scheduler: Scheduler, admission: Admission, now: float, *,
                 estimates: TenantEstimates | None = None, every: bool = False) -> Changes:
    """This picker's changes since the last call (each is taken once). ``every``: also every
    counter and bucket without a change, with a change of 0 (for a store that lost its state)."""
    counter_changes = scheduler.take_counter_changes()
    counters = [CounterChange(lane, tenant, change.charges, scheduler.counter(tenant, lane),
                              change.lift_to, change.since_lift)
                for lane, changes in counter_changes.items()
                for tenant, change in changes.items()]
    if every:
        counters += [CounterChange(lane, tenant, 0.0, value)
                     for lane, tenant, value in scheduler.counters()
                     if tenant not in counter_changes.get(lane, ())]
    budgets = tuple(
        BudgetChange(tenant, window, change, level, rule.capacity_tokens, rule.rate)
        for (tenant, window), (change, level, rule)
        in admission.take_budget_changes(now, every=every).items())
    learned = () if estimates is None else tuple(
        Learned(kind, tenant, model, value)
        for kind, tenant, model, value, _ in estimates.take_learned())
    return Changes(tuple(counters), budgets, learned)


def apply_view(scheduler: Scheduler, admission: Admission,
               counters: Mapping[tuple[str, str], float],
               budgets: Mapping[tuple[str, str], float], now: float, *,
               estimates: TenantEstimates | None = None,
               learned: Mapping[tuple[str, str, str], tuple[float, float]] | None = None
               ) -> None:
    """Take the store's answer: ``counters`` by (lane, tenant), the levels of the buckets that
    are not full by (tenant, window) as of ``now``, and the estimates by (kind, tenant, model)
    as (value, seconds since learned). Lanes this picker does not have are ignored, as are
    windows a tenant's rules lack."""
    if estimates is not None:
        for (kind, tenant, model), (value, age) in (learned or {}).items():
            estimates.set_learned(kind, tenant, model, value, now - age)
    lanes = set(scheduler.lane_names)
    for (lane, tenant), value in counters.items():
        if lane in lanes:
            scheduler.set_counter(lane, tenant, scheduler.with_untaken(lane, tenant, value))
    full = [key for key in admission.tracked_budgets() if key not in budgets]
    for tenant, window in full:
        admission.set_level(tenant, window, None, now)
    for (tenant, window), level in budgets.items():
        admission.set_level(tenant, window, level, now)


@dataclass(frozen=True, slots=True)
class StoreReply:
    """What an exchange returns: the store's counters and the levels of the buckets that are
    not full, the estimates (value, age), this replica's lease and the live peers' demands and
    floors."""

    counters: dict[tuple[str, str], float]
    levels: dict[tuple[str, str], float]
    learned: dict[tuple[str, str, str], tuple[float, float]]
    grant: float
    peers: dict[str, tuple[dict[tuple[str, str], float], dict[str, float]]]


class StoreModel:
    """The shared store's rules (``picker.state``'s Lua script) in Python: for the multi-picker
    simulator, and to test the script against. Time is passed in; one call is one exchange,
    atomic as the script is."""

    def __init__(self, lease_expiry: float = 2.0, estimate_ttl: float = 600.0) -> None:
        self.lease_expiry, self.estimate_ttl = lease_expiry, estimate_ttl
        self.counters: dict[tuple[str, str], float] = {}
        self.buckets: dict[tuple[str, str], tuple[float, float, int, float]] = {}
        """(tenant, window) -> (level, stamp, capacity, rate)."""
        self.estimates: dict[tuple[str, str, str], tuple[float, float]] = {}
        self.applied: dict[str, int] = {}
        self.leases: dict[str, tuple[float, float, float]] = {}
        """replica -> (what it may hold: its grant, its previous grant or what it holds, the
        largest; granted; stamp)."""
        self.demands: dict[str, tuple[dict[tuple[str, str], float], dict[str, float]]] = {}

    def _refilled(self, key: tuple[str, str], now: float) -> float:
        level, stamp, capacity, rate = self.buckets[key]
        if now > stamp and level < capacity:
            level = min(float(capacity), level + rate * (now - stamp))
        return level

    def exchange(self, replica: str, batch: int, changes: Changes, now: float, *,
                 target: float = 1.0, held: float = 0.0,
                 demand: dict[tuple[str, str], float] | None = None,
                 floors: dict[str, float] | None = None) -> StoreReply:
        if batch > self.applied.get(replica, 0):
            self._apply(changes, now)
            self.applied[replica] = batch
        levels = {}
        for key in list(self.buckets):
            level = self._refilled(key, now)
            if level >= self.buckets[key][2]:
                del self.buckets[key]
            else:
                levels[key] = level
        learned = {}
        for estimate, (value, stamp) in list(self.estimates.items()):
            if now - stamp > self.estimate_ttl:
                del self.estimates[estimate]
            else:
                learned[estimate] = (value, max(0.0, now - stamp))
        others = previous = 0.0
        for other, (holds, granted, stamp) in list(self.leases.items()):
            if now - stamp > self.lease_expiry:
                del self.leases[other]
                self.demands.pop(other, None)
            elif other != replica:
                others += holds
            else:
                previous = granted
        grant = max(0.0, min(target, 1.0 - others))
        # Until this answer reaches the replica it may still fill its previous grant: a lower
        # grant is left to the others only from its next exchange.
        self.leases[replica] = (max(grant, held, previous), grant, now)
        self.demands[replica] = (dict(demand or {}), dict(floors or {}))
        peers = {r: d for r, d in self.demands.items() if r != replica and r in self.leases}
        return StoreReply(dict(self.counters), levels, learned, grant, peers)

    def _apply(self, changes: Changes, now: float) -> None:
        for c in changes.counters:
            key = (c.lane, c.tenant)
            if key in self.counters:
                value = self.counters[key] + c.change
                if c.lift_to is not None:
                    value = max(value, c.lift_to + c.since_lift)
            else:
                value = c.value
            self.counters[key] = value
        for b in changes.budgets:
            key = (b.tenant, b.window)
            level = self._refilled(key, now) + b.change if key in self.buckets else b.level
            # No floor but MAX_DEBT: a debt is owed in full (``picker.core.admission``).
            self.buckets[key] = (max(-MAX_DEBT, min(float(b.capacity), level)), now,
                                 b.capacity, b.rate)
        for e in changes.estimates:
            self.estimates[(e.kind, e.tenant, e.model)] = (e.value, now)


KEEP_MARGIN = 1e-9
"""Kept above a queued request's share, so that share times the budget does not round below
the request's tokens."""
TARGET_SMOOTHING = 0.2
"""How far a replica's lease target moves toward the fair one at each exchange: demands jitter
from one interval to the next (queues fill and drain), and a lease given up is reclaimed only as
its requests finish, so the target follows the trend, not the jitter."""


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """What a replica asks of the store about the pool beside its changes."""

    target: float
    """The lease it asks for (``picker.core.leases``), smoothed."""
    held: float
    """The largest fraction of an endpoint it holds now (its lease covers at least that)."""
    demand: dict[tuple[str, str], float]
    floors: dict[str, float]


class Replica:
    """One picker's side of the exchange, whatever carries it (Redis in the server, a
    ``StoreModel`` in the simulator): what it sends, and how the answer becomes its view."""

    def __init__(self, gate: Gate, sync_interval: float) -> None:
        self.gate = gate
        self.sync_interval = sync_interval
        self.lease = 1.0
        """The share of every endpoint this picker may hold, as last granted."""
        self.peers: dict[str, tuple[dict[tuple[str, str], float], dict[str, float]]] = {}
        """The other live replicas' demands and fair-queue floors, as last seen."""
        self._target = 1.0
        start_sharing(gate.scheduler, gate.admission, gate.estimates)

    def changes(self, now: float, *, every: bool = False) -> Changes:
        gate = self.gate
        return take_changes(gate.scheduler, gate.admission, now, estimates=gate.estimates,
                            every=every)

    def lease_request(self, me: str, now: float, *, releasing: bool = False) -> LeaseRequest:
        """``me``: this replica's name among the peers. ``releasing``: a stopping picker asks
        for nothing."""
        gate = self.gate
        mine = gate.demand(now)
        if releasing:
            target = 0.0
        else:
            demands = {replica: demand for replica, (demand, _) in self.peers.items()}
            targets = replica_targets({**demands, me: mine}, gate.scheduler.lane_names,
                                      gate.scheduler.weights, gate.pool_capacity())
            self._target += TARGET_SMOOTHING * (targets[me] - self._target)
            # A tenant's part is split among replicas by their demand for it, so a replica left
            # with a few requests of a tenant backlogged elsewhere (a draining one's last) is
            # sized below one of them: its peers, sized on demands, never hand the room back.
            # What it holds already it keeps, down to its largest queued request's room.
            keep = min(self.lease, gate.queued_share(now) * (1 + KEEP_MARGIN))
            target = max(self._target, keep)
        return LeaseRequest(target, gate.held_fraction(), mine, gate.scheduler.floors())

    def receive(self, reply: StoreReply, now: float, *, view: bool = True) -> None:
        """The store's answer: peers, their floors, this picker's lease and (``view``) the
        counters, levels and estimates."""
        gate = self.gate
        self.peers = reply.peers
        floors: dict[str, float] = {}
        for _, theirs in self.peers.values():
            for lane, floor in theirs.items():
                floors[lane] = min(floor, floors.get(lane, floor))
        gate.scheduler.set_shared_floors(floors)
        gate.admission.replicas = 1 + len(self.peers)
        gate.admission.slice_wait = self.sync_interval
        self.lease = reply.grant
        gate.set_capacity_share(self.lease, now)
        if view:
            apply_view(gate.scheduler, gate.admission, reply.counters, reply.levels, now,
                       estimates=gate.estimates, learned=reply.learned)
            gate.pump(now)  # counters moved: someone else may be next

    def out_of_touch(self, now: float) -> None:
        """The store has not answered for longer than peers wait for a silent replica: they
        may take its lease, so it keeps no more than an equal part, and it judges budgets as if
        alone (none of the others' spending is seen)."""
        self.lease = min(self.lease, 1.0 / (1 + len(self.peers)))
        self.gate.set_capacity_share(self.lease, now)
        self.gate.admission.replicas = 1
