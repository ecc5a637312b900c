"""Admission: may this tenant's request enter the queue now, in which lane, with what output limit?

Admission sits in front of the fair queue: it decides *whether* a request may wait for service;
the fair queue (``lanes``, ``vtc``) then decides *when*. Per tenant it enforces caps on each
request (prompt size, ``max_tokens``), a cap on the tenant's queued requests, and two token
buckets: a **burst** budget that absorbs short spikes and a **sustained** budget over a long
period. The concurrency cap is applied at dispatch, not here (``may_start``): a tenant at its cap
stays queued and the dispatcher serves someone else meanwhile.

Budgets work on bounds and settle on actuals. Output length is unknown at admission, so by
default (``reserve="worst_case"``) ``admit`` **reserves** what the request may cost, ``prompt +
output cap × choices`` (the cap: its ``max_tokens``, else the model's context less the prompt,
else none), from every bucket at once, and ``finish`` refunds the difference from what it
actually used. The cap is **bounded by what the budget can pay**: when that worst case is more
than the smallest of the tenant's budgets holds full, the output cap sent to the engine is
lowered until it fits (``Admitted.max_output_tokens``). A request waits (or is demoted) until
its whole worst case fits the level, so no number of concurrent requests overshoots a budget:
the level stays at or above zero, prompt estimate errors aside.

``reserve="expected"`` is the documented alternative: it reserves ``prompt + expected output ×
choices`` and keeps, per tenant, the **outstanding** worst case, the sum over its queued and
running requests of ``worst case − reserved``. A request is admitted only while that
outstanding sum does not exceed the level (and the level covers its own reservation). The
invariant ``level − outstanding`` (what the level would be if every request in flight used its
worst case) then only falls at an admission, which needs it at or above zero, and by that
request's worst case; a settlement or refill only raises it. So the level never ends below
minus one request's worst case: the overshoot is at most one request's worst case, and it is
owed. The bucket refills up to its capacity plus the outstanding worst case (``level −
outstanding`` up to the capacity, as a worst-case level), so the refill that comes while
requests run is not lost, and the rule admits whenever worst-case reservation would; levels
are shown capped at the capacity.

**Debt is owed in full.** A bucket has no floor: what a request used beyond its reservation
(a prompt estimated low, a demoted request) stays charged, and the tenant waits ``(debt +
next request's need) / refill rate`` before its next admission. In reject mode the debt is at
most one request's worst case plus estimate error; levels are kept finite (``MAX_DEBT``).

Choices made on purpose:

- Buckets start full and refill continuously at ``capacity / refill_seconds`` tokens a second.
- A bucket may go negative: a demoted request is charged although the bucket was short (otherwise
  demotion would be free and a tenant could flood the demote lane at no cost to its budget), a
  request may use more than it reserved, and an estimate larger than a bucket's capacity (a
  prompt alone larger than it) is admitted on a full bucket (it could never find that much in
  it: waiting forever would not help). The debt delays the tenant's next admissions, which is
  the point; nothing forgives it. In demote mode it grows with what the demote lane served
  over the budget, and the tenant's requests stay demoted until refill has paid it.
- State is per tenant, created at its first admission and forgotten once it is indistinguishable
  from fresh state (nothing queued or running and every bucket full), so forgetting loses nothing.
  ``finish`` forgets at once when it can, which covers every tenant without budgets; ``prune``
  sweeps tenants whose buckets have refilled since. Call ``prune`` periodically: memory is then
  bounded by the tenants active within the longest refill period.
- ``update`` keeps each bucket's absolute level (clamped to a smaller capacity) and refills at the
  new rate from then on; queued and running counts are kept.

Time is passed in as ``now`` (monotonic seconds); nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

BURST = "burst"
SUSTAINED = "sustained"

OverBudgetAction = Literal["reject", "demote"]
OutputLimitAction = Literal["reject", "clamp"]
ReserveRule = Literal["worst_case", "expected"]

# Refusal reasons (metric labels). The first two are the client's fault and will not pass on retry.
INPUT_TOO_LONG = "input_too_long"
OUTPUT_TOO_LONG = "output_too_long"
TENANT_QUEUE_FULL = "tenant_queue_full"
OVER_BUDGET = "over_budget"
"""The burst budget refused it: a rate limit, lifted within a short wait."""
INSUFFICIENT_QUOTA = "insufficient_quota"
"""The sustained budget refused it: a quota spent for its long window, not worth retrying soon."""

# Bucket comparisons allow this many tokens of float error, so that a client retrying exactly
# ``retry_after`` seconds later is admitted whatever rounding the refill arithmetic did.
_EPSILON = 1e-6
MAX_DEBT = float(2**53)
"""How far below zero a level may go: no floor a tenant can reach (a million tokens a second
for 285 years), only a bound that keeps levels finite and exact whatever is reported."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_positive(name: str, value: int | None) -> None:
    if value is not None and not (_is_int(value) and value > 0):
        raise ValueError(f"{name} must be a positive integer or None, not {value!r}")


def _count(name: str, value: int) -> None:
    if not (_is_int(value) and value >= 0):
        raise ValueError(f"{name} must be a non-negative integer, not {value!r}")


@dataclass(frozen=True, slots=True)
class BucketRule:
    """A token bucket: holds up to ``capacity_tokens``, refilling completely in ``refill_seconds``.

    Refill is continuous, at ``capacity_tokens / refill_seconds`` tokens a second: 20,000 tokens
    per 60 s gives back 333⅓ tokens every second, not 20,000 at the top of each minute.
    """

    capacity_tokens: int
    refill_seconds: float

    def __post_init__(self) -> None:
        if not (_is_int(self.capacity_tokens) and self.capacity_tokens > 0):
            raise ValueError(
                f"capacity_tokens must be a positive integer, not {self.capacity_tokens!r}")
        seconds = self.refill_seconds
        if (isinstance(seconds, bool) or not isinstance(seconds, int | float)
                or not 0 < seconds < math.inf):
            raise ValueError(f"refill_seconds must be a positive finite number, not {seconds!r}")

    @property
    def rate(self) -> float:
        """Tokens given back per second."""
        return self.capacity_tokens / self.refill_seconds


@dataclass(frozen=True, slots=True)
class TenantRules:
    """A tenant's budgets and caps; ``None`` means no limit.

    ``over_budget`` says what happens to a request a budget cannot cover: ``reject`` refuses it
    with the time until it would fit, ``demote`` admits it into ``demote_lane``.
    ``output_limit_action`` says what happens to a ``max_tokens`` above ``max_output_tokens``:
    ``reject`` refuses the request, ``clamp`` lowers it to the limit.
    """

    burst: BucketRule | None = None
    sustained: BucketRule | None = None
    over_budget: OverBudgetAction = "reject"
    demote_lane: str | None = None
    max_queued: int | None = None
    max_concurrent: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    output_limit_action: OutputLimitAction = "reject"
    reserve: ReserveRule = "worst_case"
    """``worst_case``: a request reserves what it may cost (prompt + output cap × choices);
    ``expected``: prompt + expected output × choices, while the tenant's outstanding worst case
    stays within its level (see the module docstring)."""

    def __post_init__(self) -> None:
        # The config loader reports errors by path; this only stops a bad rule from reaching the
        # arithmetic below.
        for name in (BURST, SUSTAINED):
            rule = getattr(self, name)
            if rule is not None and not isinstance(rule, BucketRule):
                raise ValueError(f"{name} must be a BucketRule or None, not {rule!r}")
        if self.over_budget not in ("reject", "demote"):
            raise ValueError(f"over_budget must be 'reject' or 'demote', not {self.over_budget!r}")
        if self.demote_lane is not None and not (
                isinstance(self.demote_lane, str) and self.demote_lane):
            raise ValueError(f"demote_lane must be a lane name, not {self.demote_lane!r}")
        if self.over_budget == "demote" and self.demote_lane is None:
            raise ValueError("over_budget 'demote' needs a demote_lane")
        for name in ("max_queued", "max_concurrent", "max_input_tokens", "max_output_tokens"):
            _optional_positive(name, getattr(self, name))
        if self.output_limit_action not in ("reject", "clamp"):
            raise ValueError("output_limit_action must be 'reject' or 'clamp', "
                             f"not {self.output_limit_action!r}")
        if self.reserve not in ("worst_case", "expected"):
            raise ValueError(f"reserve must be 'worst_case' or 'expected', not {self.reserve!r}")

    @property
    def budgets(self) -> tuple[tuple[str, BucketRule], ...]:
        """The token buckets that apply, as ``(window, rule)``, burst first."""
        return tuple((name, rule) for name, rule in ((BURST, self.burst),
                                                     (SUSTAINED, self.sustained))
                     if rule is not None)


class _Bucket:
    __slots__ = ("above", "level", "rule", "synced", "untaken", "updated")

    def __init__(self, rule: BucketRule, now: float, above: float = 0.0) -> None:
        self.rule = rule
        self.level = float(rule.capacity_tokens)
        self.updated = now
        self.untaken = 0.0
        """Changes made by ``add`` since ``Admission.take_budget_changes`` (not refills)."""
        self.synced: float | None = None
        """The level the shared store last reported (``Admission.set_level``)."""
        self.above = above
        """How far above its capacity the level may go: the tenant's outstanding worst case
        (``reserve: expected``). The level less it is then held within the capacity, as a
        worst-case reservation's level is, so refill during a request is not lost."""

    def refill(self, now: float) -> None:
        # A clock that steps back (it should not: time is monotonic) gives nothing and takes
        # nothing.
        if now > self.updated:
            top = self.rule.capacity_tokens + self.above
            if self.level < top:
                self.level = min(top, self.level + self.rule.rate * (now - self.updated))
            self.updated = now

    def add(self, tokens: float) -> float:
        """Change the level by ``tokens``, up to the capacity (no floor but ``MAX_DEBT``);
        returns the change made."""
        capacity = self.rule.capacity_tokens + self.above
        before = self.level
        self.level = max(-MAX_DEBT, min(capacity, self.level + tokens))
        self.untaken += self.level - before
        return self.level - before

    def full(self) -> bool:
        return self.level >= self.rule.capacity_tokens

    def seconds_until(self, level: float) -> float:
        return max(0.0, (level - self.level) / self.rule.rate)


class _TenantState:
    __slots__ = ("buckets", "outstanding", "queued", "running")

    def __init__(self, rules: TenantRules, now: float) -> None:
        self.buckets: dict[str, _Bucket] = {w: _Bucket(r, now) for w, r in rules.budgets}
        self.queued = 0
        self.running = 0
        self.outstanding = 0
        """Over its queued and running requests: worst case less what was reserved."""

    def owe(self, change: int) -> None:
        """The outstanding worst case changes by ``change``; the buckets may hold that much
        above their capacity."""
        self.outstanding += change
        for bucket in self.buckets.values():
            bucket.above = float(self.outstanding)

    def refilled(self, now: float) -> Iterator[tuple[str, _Bucket]]:
        for window, bucket in self.buckets.items():
            bucket.refill(now)
            yield window, bucket

    def forgettable(self, now: float, shared: bool = False) -> bool:
        # Shared: a change not yet taken for the store must not be forgotten with the state.
        return (self.queued == 0 and self.running == 0
                and all(bucket.full() and not (shared and bucket.untaken)
                        for _, bucket in self.refilled(now)))


@dataclass(eq=False, slots=True)
class Reservation:
    """An admitted request's hold on its tenant's budgets, until ``finish`` settles it.

    Identity is the object (``eq=False``). ``state`` goes ``queued`` → ``running`` → ``done``
    (or straight from ``queued`` to ``done`` when the request is cancelled while it waits).
    """

    tenant: str
    reserved_tokens: int
    """What was taken from every bucket at admission: its worst case, or with ``reserve:
    expected`` prompt + expected output."""
    state: str = "queued"
    _holder: _TenantState | None = field(default=None, repr=False)
    # The buckets the estimate was taken from: a bucket that ``update`` added later was not
    # charged, so settling must not refund it.
    _charged: tuple[tuple[_Bucket, float], ...] = field(default=(), repr=False)
    # With what each was charged: less than the estimate where the debt cap clipped it, so that
    # settling gives back only what was taken and the actual use is always charged.
    worst_case_tokens: int = 0
    """Prompt + output cap × choices (the cap bounded by what the budget can pay); the same as
    ``reserved_tokens`` with ``reserve: worst_case`` (not bounded without budgets)."""


@dataclass(frozen=True, slots=True)
class Admitted:
    """The request may queue: in ``lane``, asking the engine for at most ``max_output_tokens``."""

    reservation: Reservation
    lane: str
    """The lane asked for, or the tenant's demote lane when it was over budget."""
    max_output_tokens: int | None
    """The output limit to send to the engine: the request's own, clamped to the tenant's limit,
    or the tenant's limit when the request set none, lowered to what the budget can pay
    (``None``: no limit on any side; the model's context, which the engine applies itself, is
    not sent)."""
    expected_output_tokens: int
    """The output estimate of one choice (capped by ``max_output_tokens``)."""
    demoted: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    """The request may not queue, and why."""

    reason: str
    """A short snake_case label for metrics: ``input_too_long``, ``output_too_long``,
    ``tenant_queue_full``, ``over_budget`` (the burst budget) or ``insufficient_quota`` (the
    sustained budget)."""
    message: str
    """Human text for an OpenAI-style error body."""
    retry_after: float | None = None
    """Seconds after which the same request would pass this check; ``None``: it never will."""
    window: str | None = None
    """The budget that refused it (``burst`` or ``sustained``), for ``over_budget`` and
    ``insufficient_quota``."""

    @property
    def status(self) -> str:
        """``bad_request`` (400) when the request is at fault, else ``rate_limited`` (429)."""
        return "bad_request" if self.reason in (INPUT_TOO_LONG, OUTPUT_TOO_LONG) else "rate_limited"


class Admission:
    """Per-tenant budgets and caps; tenants not named in ``rules`` get ``default``.

    ``queue_full_retry_after`` is the wait suggested to a tenant whose queue is full: how fast a
    queue drains is not known here.
    """

    def __init__(self, rules: Mapping[str, TenantRules], default: TenantRules, *,
                 queue_full_retry_after: float = 1.0) -> None:
        if not 0 < queue_full_retry_after < math.inf:
            raise ValueError("queue_full_retry_after must be a positive finite number")
        self.queue_full_retry_after = float(queue_full_retry_after)
        self._rules: dict[str, TenantRules] = {}
        self._default = default
        self._set_rules(rules, default)
        self._tenants: dict[str, _TenantState] = {}
        self.shared = False
        """Budget levels are shared with other pickers (``picker.core.shared``): changes are
        kept until taken."""
        self.replicas = 1
        """Pickers sharing the budgets (this one included). With N > 1, each may spend between
        two exchanges no more than 1/(2N - 1) of what the store last reported (a first request
        excepted). Not 1/N: the others' views are up to one interval older than this one's, and
        each may spend a part before this picker's next exchange and another after it; with
        1/N, three replicas exchanging one after another overran a budget by six requests."""
        self.slice_wait = 0.1
        """Seconds until the next exchange: when a request over this picker's part may be
        retried."""

    def _set_rules(self, rules: Mapping[str, TenantRules], default: TenantRules) -> None:
        for tenant, rule in (*rules.items(), ("(default)", default)):
            if not isinstance(rule, TenantRules):
                raise ValueError(f"tenant {tenant!r}: rules must be TenantRules, not {rule!r}")
        self._rules = dict(rules)
        self._default = default

    def rules_for(self, tenant: str) -> TenantRules:
        """The rules that apply to ``tenant``."""
        return self._rules.get(tenant, self._default)

    # -- the request lifecycle --

    def admit(self, tenant: str, lane: str, prompt_tokens: int, max_output_tokens: int | None,
              expected_output_tokens: int, now: float, *,
              cap_prompt_tokens: int | None = None,
              prereserved: int | None = None, choices: int = 1,
              output_limit: int | None = None) -> Admitted | Refused:
        """Decide whether a request may queue; when it may, reserve it (``reserve``).

        ``cap_prompt_tokens`` is what ``max_input_tokens`` is judged on (default
        ``prompt_tokens``): a bound the tenant cannot talk down, where ``prompt_tokens`` is a
        learned estimate (``picker.core.estimates``).

        ``max_output_tokens`` is the request's ``max_tokens`` (``None`` when it set none, 0 for a
        request that produces no output, such as embeddings);
        ``expected_output_tokens`` is the caller's guess of the output of one choice;
        ``choices`` how many the engine generates (``max(n, best_of)``); ``output_limit`` the
        most one choice may produce when the request sets no cap (the model's context less the
        prompt; ``None``: unknown). Checks run in order: prompt size, output limit, the tenant's
        queued requests, then the budgets.
        """
        _count("prompt_tokens", prompt_tokens)
        _count("expected_output_tokens", expected_output_tokens)
        if max_output_tokens is not None:  # 0: a request without output (embeddings)
            _count("max_output_tokens", max_output_tokens)
        rules = self.rules_for(tenant)

        judged = prompt_tokens if cap_prompt_tokens is None else cap_prompt_tokens
        _count("cap_prompt_tokens", judged)
        if rules.max_input_tokens is not None and judged > rules.max_input_tokens:
            return Refused(INPUT_TOO_LONG,
                           f"the prompt has {judged} tokens, more than the "
                           f"{rules.max_input_tokens} allowed")
        plan = self._plan(rules, prompt_tokens, max_output_tokens, expected_output_tokens,
                          choices, output_limit)
        if isinstance(plan, Refused):
            return plan
        max_output_tokens, expected, estimate, worst = plan

        state = self._tenants.get(tenant)
        if (rules.max_queued is not None and state is not None
                and state.queued >= rules.max_queued):
            return Refused(TENANT_QUEUE_FULL,
                           f"{state.queued} requests are already queued for this tenant, the "
                           f"most allowed", retry_after=self.queue_full_retry_after)
        if state is None:
            state = self._tenants[tenant] = _TenantState(rules, now)

        # Reserved already in the shared store (``near_limit``): the store judged the budget,
        # all but the outstanding worst case, which only this picker knows.
        refusal = self._check_budgets(state, estimate, worst, now,
                                      outstanding_only=prereserved is not None)
        demoted = False
        if refusal is not None:
            if rules.over_budget == "reject":
                self._forget_if_idle(tenant, state, now)
                return refusal
            assert rules.demote_lane is not None  # TenantRules guarantees it
            lane, demoted = rules.demote_lane, True
        charged = tuple((bucket, -bucket.add(-estimate)) for bucket in state.buckets.values())
        if prereserved is not None:
            for bucket in state.buckets.values():
                bucket.untaken += prereserved  # the store has it: send only the difference
        state.queued += 1
        state.owe(worst - estimate)
        reservation = Reservation(tenant, estimate, "queued", state, charged,
                                  worst_case_tokens=worst)
        return Admitted(reservation, lane, max_output_tokens, expected, demoted)

    def _plan(self, rules: TenantRules, prompt: int, cap: int | None, expected: int,
              choices: int, output_limit: int | None
              ) -> tuple[int | None, int, int, int] | Refused:
        """``(output cap to send, expected output of one choice, tokens to reserve, worst
        case)`` of a request, or its refusal for a ``max_tokens`` over the tenant's limit."""
        if not (_is_int(choices) and choices > 0):
            raise ValueError(f"choices must be a positive integer, not {choices!r}")
        if output_limit is not None:
            _count("output_limit", output_limit)
        limit = rules.max_output_tokens
        if limit is not None:
            if cap is None:
                # Unbounded output would make the estimate meaningless: the engine gets the limit.
                cap = limit
            elif cap > limit:
                if rules.output_limit_action == "reject":
                    return Refused(OUTPUT_TOO_LONG,
                                   f"max_tokens is {cap}, more than the {limit} allowed")
                cap = limit
        # The most one choice may produce: its cap, else the model's (which the engine applies
        # itself, so it is not sent), else nothing bounds it.
        bound = cap if cap is not None else output_limit
        budgets = rules.budgets
        if budgets:
            # Bounded by what the budget can pay: no request may cost more than a full bucket
            # (its prompt alone excepted), so its output cap is lowered until it fits.
            full = min(rule.capacity_tokens for _, rule in budgets)
            payable = max(1, (full - prompt) // choices)
            if bound is None or bound > payable:
                bound = cap = payable
        if bound is not None:
            expected = min(expected, bound)
        reserved = prompt + expected * choices
        if bound is None:
            return cap, expected, reserved, reserved  # no budget to bound or to protect
        worst = prompt + bound * choices
        return cap, expected, worst if rules.reserve == "worst_case" else reserved, worst

    def _check_budgets(self, state: _TenantState, estimate: int, worst: int, now: float, *,
                       outstanding_only: bool = False) -> Refused | None:
        """The refusal of a request reserving ``estimate`` (worst case ``worst``), if a budget
        cannot take it: a level below the reservation, or below the tenant's outstanding worst
        case (``reserve: expected``; 0 otherwise)."""
        worst_found: tuple[float, str, _Bucket, bool, bool] | None = None
        outstanding = state.outstanding
        for window, bucket in state.refilled(now):
            capacity = bucket.rule.capacity_tokens
            # An estimate above the capacity can never fit: it waits for a full bucket instead.
            oversized = estimate > capacity
            needed = max(outstanding, 0 if outstanding_only else min(estimate, capacity))
            short = bucket.level + _EPSILON < needed
            sliced = not short and not outstanding_only and self._over_slice(bucket, needed)
            if short or sliced:
                # (The outstanding worst case may be above the capacity: so may the level.)
                wait = bucket.seconds_until(needed) if short else self.slice_wait
                if worst_found is None or wait > worst_found[0]:
                    worst_found = (wait, window, bucket, oversized, sliced)
        if worst_found is None:
            return None
        wait, window, bucket, oversized, sliced = worst_found
        capacity = bucket.rule.capacity_tokens
        if sliced:
            message = (f"this picker has spent its part of the {window} token budget until it "
                       f"next hears from the other replicas; retry in {format_duration(wait)}")
        elif oversized:
            message = (f"this request's estimated {estimate} tokens exceed the {window} token "
                       f"budget of {capacity}: it can only be admitted on a full budget, in "
                       f"{format_duration(wait)}")
        else:
            left = max(0, math.floor(min(bucket.level, capacity)))
            need = (f"an estimated {estimate}" if estimate == worst
                    else f"{estimate} (at most {worst})")
            if outstanding > 0:
                need += f" and its requests in flight may still use {outstanding} more"
            message = (f"over the {window} token budget: {left} of {capacity} tokens left, this "
                       f"request needs {need}; retry in {format_duration(wait)}")
        # The bucket that must wait longest binds: when that is the long window, waiting out the
        # burst would not help, and the client is told so (OpenAI's ``insufficient_quota``).
        reason = INSUFFICIENT_QUOTA if window == SUSTAINED and not sliced else OVER_BUDGET
        return Refused(reason, message, retry_after=wait, window=window)

    def judged_in_store(self, tenant: str) -> bool:
        """Beside other pickers: whether the tenant's requests are reserved in the shared store
        one by one, atomically (it has budgets), rather than judged on this picker's view, which
        lags the others' spending by an exchange. Slices (``replicas``) are then only the
        fallback for a store that does not answer."""
        return self.replicas > 1 and bool(self.rules_for(tenant).budgets)

    def budget_needs(self, tenant: str, prompt_tokens: int, max_output_tokens: int | None,
                     expected_output_tokens: int, *, choices: int = 1,
                     output_limit: int | None = None) -> int:
        """The tokens ``admit`` would reserve for this request (a request it refuses for its
        output cap never reaches the budgets: 0)."""
        plan = self._plan(self.rules_for(tenant), prompt_tokens, max_output_tokens,
                          expected_output_tokens, choices, output_limit)
        return 0 if isinstance(plan, Refused) else plan[2]

    def windows(self, tenant: str) -> tuple[tuple[str, BucketRule], ...]:
        """The tenant's budgets: (window, rule)."""
        return self.rules_for(tenant).budgets

    def return_to_store(self, tenant: str, tokens: int, now: float) -> None:
        """A reservation made in the store for a request that was then not admitted here:
        it goes back with the next exchange."""
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState(self.rules_for(tenant), now)
        for bucket in state.buckets.values():
            bucket.untaken += tokens

    def _over_slice(self, bucket: _Bucket, needed: float) -> bool:
        """Beside other pickers: whether this one has spent its part of the store's level
        since the last exchange (the first request of an exchange always passes the slice)."""
        if self.replicas <= 1:
            return False
        # Not yet reported: absent from the store, which means full.
        synced = bucket.rule.capacity_tokens if bucket.synced is None else bucket.synced
        spent = -bucket.untaken
        return spent > 0 and spent + needed > max(0.0, synced) / (2 * self.replicas - 1) + _EPSILON

    def may_start(self, tenant: str) -> bool:
        """Whether ``tenant`` is under its concurrency cap, so one of its requests may start."""
        cap = self.rules_for(tenant).max_concurrent
        return cap is None or self.running(tenant) < cap

    def start(self, reservation: Reservation) -> None:
        """The request was dispatched: it moves from queued to running.

        Raises ValueError when it is not queued, or when its tenant is at its concurrency cap
        (check ``may_start`` first and leave the tenant's requests queued).
        """
        if reservation.state != "queued":
            raise ValueError(f"reservation is {reservation.state}, not queued")
        if not self.may_start(reservation.tenant):
            raise ValueError(f"tenant {reservation.tenant!r} is at its concurrency cap")
        holder = self._holder(reservation)
        holder.queued -= 1
        holder.running += 1
        reservation.state = "running"

    def finish(self, reservation: Reservation, actual_tokens: int, now: float) -> None:
        """Settle a request on the tokens it actually used (prompt + output) and release it.

        Every bucket gets back what was reserved less ``actual_tokens`` (or loses the excess when
        the request used more). Cancelling a queued request is ``finish`` with 0: nothing is
        charged. Finishing twice raises ValueError.
        """
        if reservation.state not in ("queued", "running"):
            raise ValueError(f"reservation is {reservation.state}: it was already finished")
        _count("actual_tokens", actual_tokens)
        holder = self._holder(reservation)
        taken = dict(reservation._charged)
        used = min(actual_tokens, MAX_DEBT)  # a huge int would not fit a float
        for bucket in holder.buckets.values():
            bucket.refill(now)  # up to the top it had while the request was outstanding
        holder.owe(reservation.reserved_tokens - reservation.worst_case_tokens)
        for bucket in holder.buckets.values():
            bucket.add(taken.get(bucket, 0.0) - used)
        if reservation.state == "queued":
            holder.queued -= 1
        else:
            holder.running -= 1
        reservation.state = "done"
        self._forget_if_idle(reservation.tenant, holder, now)

    @staticmethod
    def _holder(reservation: Reservation) -> _TenantState:
        if reservation._holder is None:
            raise ValueError("reservation was not made by Admission.admit")
        return reservation._holder

    # -- configuration and memory --

    def update(self, rules: Mapping[str, TenantRules], default: TenantRules, now: float) -> None:
        """Replace the rules. Each bucket keeps its absolute level (clamped to a smaller
        capacity) and refills at the new rate from ``now``; a new budget starts full, a removed
        one is dropped; queued and running counts are kept."""
        self._set_rules(rules, default)
        for tenant, state in list(self._tenants.items()):
            buckets: dict[str, _Bucket] = {}
            for window, rule in self.rules_for(tenant).budgets:
                bucket = state.buckets.get(window)
                if bucket is None:
                    bucket = _Bucket(rule, now, float(state.outstanding))
                else:
                    # Time up to now refills at the old rate, after it at the new one.
                    bucket.refill(now)
                    bucket.rule = rule
                    untaken = bucket.untaken
                    bucket.add(0)  # clamped to a smaller capacity: not a charge
                    bucket.untaken = untaken
                buckets[window] = bucket
            state.buckets = buckets
            self._forget_if_idle(tenant, state, now)

    def prune(self, now: float) -> int:
        """Forget every tenant with nothing queued or running and full buckets; returns how many.

        O(tenants tracked). Forgetting loses nothing: such a tenant's state is what a fresh one
        would be.
        """
        idle = [tenant for tenant, state in self._tenants.items()
                if state.forgettable(now, self.shared)]
        for tenant in idle:
            del self._tenants[tenant]
        if len(idle) > len(self._tenants):
            self._tenants = dict(self._tenants)  # a dict keeps its largest table: shrink it
        return len(idle)

    def _forget_if_idle(self, tenant: str, state: _TenantState, now: float) -> None:
        if self._tenants.get(tenant) is state and state.forgettable(now, self.shared):
            del self._tenants[tenant]

    def tracked_tenants(self) -> int:
        """How many tenants have state (memory use)."""
        return len(self._tenants)

    # -- shared state (``picker.core.shared``) --

    def take_budget_changes(self, now: float, *, every: bool = False
                            ) -> dict[tuple[str, str], tuple[float, float, BucketRule]]:
        """``{(tenant, window): (change, level, rule)}``: what admissions and settlements
        changed in each bucket since the last call (refill excluded: every holder refills by
        itself), and the bucket's level at ``now``. ``every``: buckets without a change too."""
        taken: dict[tuple[str, str], tuple[float, float, BucketRule]] = {}
        for tenant, state in self._tenants.items():
            for window, bucket in state.buckets.items():
                if bucket.untaken or every:
                    bucket.refill(now)
                    taken[(tenant, window)] = (bucket.untaken, bucket.level, bucket.rule)
                    bucket.untaken = 0.0
        return taken

    def set_level(self, tenant: str, window: str, level: float | None, now: float) -> None:
        """The bucket's level as the store has it at ``now`` (None: full), plus this picker's
        changes not yet taken. A window the tenant's rules do not have is ignored."""
        rule = dict(self.rules_for(tenant).budgets).get(window)
        if rule is None:
            return
        state = self._tenants.get(tenant)
        if state is None:
            state = self._tenants[tenant] = _TenantState(self.rules_for(tenant), now)
        bucket = state.buckets[window]
        capacity = float(rule.capacity_tokens)
        stored = capacity if level is None else level
        bucket.level = max(-MAX_DEBT, min(capacity, stored + bucket.untaken))
        bucket.synced = stored
        bucket.updated = now

    def tracked_budgets(self) -> Iterator[tuple[str, str]]:
        """``(tenant, window)`` of every bucket held here."""
        for tenant, state in self._tenants.items():
            for window in state.buckets:
                yield tenant, window

    # -- reading --

    def queued(self, tenant: str) -> int:
        """Admitted requests of ``tenant`` not yet started."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.queued

    def running(self, tenant: str) -> int:
        """Started requests of ``tenant`` not yet finished."""
        state = self._tenants.get(tenant)
        return 0 if state is None else state.running

    def _levels(self, tenant: str, now: float) -> list[tuple[str, float, BucketRule]]:
        state = self._tenants.get(tenant)
        if state is None:
            # Untracked means full: nothing to create just to read.
            return [(w, float(r.capacity_tokens), r) for w, r in self.rules_for(tenant).budgets]
        # Above the capacity only by an outstanding worst case (``reserve: expected``): shown
        # as full.
        return [(w, min(b.level, b.rule.capacity_tokens), b.rule)
                for w, b in state.refilled(now)]

    def headers(self, tenant: str, now: float) -> dict[str, str]:
        """Rate-limit response headers for ``tenant``.

        The token headers describe the tightest budget (lowest fraction remaining; burst on a
        tie): its capacity, the whole tokens left, and the time until it is full again, under
        OpenAI's ``x-ratelimit-*-tokens`` names. The concurrency cap and what is left of it go
        under fairway's own names: OpenAI's ``x-ratelimit-*-requests`` mean requests per window,
        which clients pace themselves by, and a cap on requests at once is not that. Empty when
        the tenant has neither budgets nor a concurrency cap.
        """
        out: dict[str, str] = {}
        levels = self._levels(tenant, now)
        if levels:
            _, level, rule = min(levels, key=lambda item: item[1] / item[2].capacity_tokens)
            reset = max(0.0, (rule.capacity_tokens - level) / rule.rate)
            out["x-ratelimit-limit-tokens"] = str(rule.capacity_tokens)
            out["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(level)))
            out["x-ratelimit-reset-tokens"] = format_duration(reset)
        cap = self.rules_for(tenant).max_concurrent
        if cap is not None:
            out["x-fairway-limit-concurrent-requests"] = str(cap)
            out["x-fairway-remaining-concurrent-requests"] = str(
                max(0, cap - self.running(tenant)))
        return out

    def budget_state(self, now: float) -> dict[str, dict[str, tuple[float, int]]]:
        """``{tenant: {window: (remaining, capacity)}}`` for metrics, tracked tenants only.

        ``remaining`` is negative while the tenant is in debt. A tenant absent from the answer is
        at full budget.
        """
        out: dict[str, dict[str, tuple[float, int]]] = {}
        for tenant, state in self._tenants.items():
            if state.buckets:
                out[tenant] = {w: (min(b.level, b.rule.capacity_tokens), b.rule.capacity_tokens)
                               for w, b in state.refilled(now)}
        return out


def format_duration(seconds: float) -> str:
    """A duration as OpenAI writes ``x-ratelimit-reset-*``: ``6m0s``, ``1.5s``, ``20ms``, ``0s``.

    That is Go's duration format at millisecond resolution, rounded up so that a client waiting
    the time shown is not early.
    """
    if not seconds > 0:
        return "0s"
    # The small allowance keeps float noise (20.000000000004 ms) from adding a millisecond.
    millis = math.ceil(seconds * 1000 - 1e-6)
    if millis <= 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, fraction = divmod(rest, 1000)
    secs = str(whole) if fraction == 0 else f"{whole}.{fraction:03d}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"
