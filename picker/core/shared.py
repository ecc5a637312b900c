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

from picker.core.admission import Admission
from picker.core.estimates import TenantEstimates
from picker.core.lanes import Scheduler

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
