"""How much of the pool to keep free for tenants that are not backlogged (the idle-tenant reserve).

It answers, per tenant seen recently: how often does it send, how big are its requests, how long
does one hold its room, and so how many tokens must stay free for its next requests to start at
once, without counting the tenant as a flood because it has a few requests in flight.

The first rule kept room for one typical request: enough for a tenant that sends now and then,
too little for one that sends a few requests a second of long prompts, whose requests overlap.
With ``quantile`` set the reserve follows Little's law: the tenant's expected requests in flight
are its arrival rate times the time one holds its room; with Poisson arrivals the number in
flight is Poisson of that mean, so the reserve is room for its ``quantile`` (e.g. 0.9) of
requests at once, less what the tenant already holds (that room is in use, not to be kept free
again). A tenant whose expected demand reaches its fair share of the pool is no light tenant:
it gets no reserve and is judged backlogged, like a flood. All reserves together stay within
``max_share`` of the pool: past that, holding the flood would cost more tokens than the
isolation goal allows.

With ``quantile``, a tenant flooding the pool alone (no other tenant seen within the window)
still leaves room for one request as large as its own (``standing_room``) on one endpoint, for
a tenant not yet seen: without it a newcomer's first requests found every block taken, and
the engines do not make room for them either (in priority mode vLLM preempts only when a
running request needs a block it cannot get, which growth room prevents), so they waited for
a flood request to end (pool simulator, 2 x 8k and 2 x 64k, light 1-3 requests/s: its first
5 s at up to 4.3x its steady p95 alone). Only then: beside tenants already seen, light ones
have their reserve and heavy ones are no newcomers, and room kept for nobody is tokens lost.

Pure: time is passed in; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

FOOTPRINT_EWMA_ALPHA = 0.2
"""How fast a tenant's large-request footprint comes down (it goes up at once)."""
MEAN_EWMA_ALPHA = 0.1
"""How fast the mean size and the holding time follow new requests."""
MAX_RESERVED_REQUESTS = 256
"""Bound on the Poisson quantile's search (a tenant that needs more is no light tenant)."""


@dataclass(frozen=True, slots=True)
class ReserveRules:
    """What the reserve keeps (``picker.config.schema.Capacity``)."""

    window: float = 0.0
    """Seconds a tenant counts as recently active (``idleTenantReserve``; 0: no reserve)."""
    quantile: float = 0.0
    """0: room for one typical request of each light tenant (the first rule). Else the quantile
    of the tenant's requests in flight (Little's law, Poisson arrivals) the room is kept for,
    and a tenant is light only while its expected demand is below its fair share."""
    max_share: float = 1.0
    """The reserves together at most this fraction of the pool's tokens (with ``quantile``)."""


@dataclass(slots=True)
class Demand:
    """One tenant's recent requests, as the reserve sees them."""

    last: float
    """Its last arrival."""
    footprint: float
    """Its large requests' size (tokens: prompt + expected output): up at once, down slowly."""
    mean: float
    """Its requests' mean size (moving average)."""
    first: float = 0.0
    """Its first arrival in the window."""
    arrivals: float = 1.0
    """Arrivals, each decayed by ``exp(-age / window)`` (as of ``last``): over a steady rate r
    and a long history it averages ``r × window``."""
    holding: float = 0.0
    """Seconds a request of its holds its room, dispatch to end (moving average; 0: none has
    ended yet)."""

    def arrived(self, tokens: float, now: float, window: float) -> None:
        """Another request of ``tokens`` arrived at ``now``."""
        self.arrivals = self.arrivals * _decay(now - self.last, window) + 1.0
        self.last = now
        self.footprint = max(tokens, self.footprint + FOOTPRINT_EWMA_ALPHA
                             * (tokens - self.footprint))
        self.mean += MEAN_EWMA_ALPHA * (tokens - self.mean)

    def ended(self, seconds: float) -> None:
        """One of its requests ended after holding its room ``seconds``."""
        seconds = max(0.0, seconds)
        self.holding = seconds if not self.holding else \
            self.holding + MEAN_EWMA_ALPHA * (seconds - self.holding)

    def rate(self, now: float, window: float) -> float:
        """Requests a second, as of ``now`` (falls while it sends nothing): the arrivals after
        the first over the span they were counted in, ``window × (1 - exp(-span / window))``
        (a young tenant's rate is not diluted over a window it has not yet been seen for; the
        span at least a tenth of the window, so a burst at one instant is not an infinite rate)."""
        if window <= 0 or self.arrivals < 1.5:
            return 0.0
        history = _decay(self.last - self.first, window)
        span = max(window * (1.0 - history), window / 10)
        return (self.arrivals - history) / span * _decay(now - self.last, window)

    def in_flight(self, now: float, window: float) -> float:
        """Expected requests in flight (Little's law: rate × holding time)."""
        return self.rate(now, window) * self.holding


def new_demand(tokens: float, now: float) -> Demand:
    """A tenant's first request in the window."""
    return Demand(last=now, footprint=float(tokens), mean=float(tokens), first=now)


def _decay(age: float, window: float) -> float:
    return math.exp(-max(0.0, age) / window) if window > 0 else 0.0


def poisson_quantile(mean: float, quantile: float) -> int:
    """The smallest k with P(N ≤ k) ≥ ``quantile`` for N Poisson of ``mean`` (at most
    ``MAX_RESERVED_REQUESTS``)."""
    if mean <= 0:
        return 0
    term = math.exp(-mean) if mean < 700 else 0.0
    if term == 0.0:  # past floats' range: the normal approximation is exact enough there
        return min(MAX_RESERVED_REQUESTS, math.ceil(mean + 3 * math.sqrt(mean)))
    total, k = term, 0
    while total < quantile and k < MAX_RESERVED_REQUESTS:
        k += 1
        term *= mean / k
        total += term
    return k


def expected_in_flight(demand: Demand, now: float, rules: ReserveRules, running: int) -> float:
    """The tenant's expected requests in flight: Little's law, or the ``running`` now if more
    (before its first request has ended, the holding time is unknown; and it is a floor)."""
    return max(demand.in_flight(now, rules.window), float(running))


def reserved_requests(demand: Demand, now: float, rules: ReserveRules, running: int = 0) -> int:
    """How many of the tenant's requests the reserve is for (at least one)."""
    if not rules.quantile:
        return 1
    return max(1, poisson_quantile(expected_in_flight(demand, now, rules, running),
                                   rules.quantile))


def is_light(demand: Demand, now: float, rules: ReserveRules, fair_tokens: float,
             running: int = 0) -> bool:
    """Whether the tenant's expected demand (requests in flight by Little's law × mean size,
    the low end of its estimate: ``light_in_flight``) stays below its fair share of the pool's
    tokens; always, without ``quantile`` (the queue
    alone decides). Judged on its rate, not on the requests it has running now: a light tenant
    whose requests wait behind a flood has more running at once, and judging it heavy then
    would take its reserve away when it needs it most. Until one of its requests has ended
    (no holding time yet), the ``running`` count stands in."""
    if not rules.quantile:
        return True
    expected = demand.in_flight(now, rules.window) if demand.holding else float(running)
    return light_in_flight(expected, rules.quantile) * demand.mean < fair_tokens


def light_in_flight(expected: float, quantile: float) -> int:
    """The requests in flight a tenant is judged on: the low ``1 - quantile`` end of Poisson of
    its ``expected`` (e.g. its 10th percentile when the reserve is for its 90th), so that it is
    heavy only when even that exceeds its fair share. The expected count is an estimate (a rate
    over a window's few arrivals, or the requests running now, one Poisson draw): a tenant
    near its fair share reads above it about half the time, and judging it heavy whenever it
    does took its reserve and its engine priority away for seconds at a time (pool simulator,
    2 x 64k, light 1.5 requests/s under a 30 requests/s flood: light TTFT p95 5.3x alone)."""
    return poisson_quantile(expected, 1.0 - quantile) if expected > 0 else 0


def tenant_reserve(demand: Demand, now: float, rules: ReserveRules, held: float,
                   running: int = 0) -> float:
    """Tokens to keep free for a light tenant: one large request, or, with ``quantile``, its
    quantile of requests in flight less what it holds now, whichever is more."""
    one = demand.footprint
    if not rules.quantile:
        return one
    n = reserved_requests(demand, now, rules, running)
    return max(one, one + (n - 1) * demand.mean - held)


def standing_room(footprint: float, pool_tokens: float, rules: ReserveRules) -> float:
    """Room kept for a tenant not yet seen while one tenant, whose large requests are
    ``footprint`` tokens, floods the pool alone: one such request, within ``max_share`` of the
    pool; none without ``quantile`` (the first rule keeps room only for tenants seen)."""
    if not rules.quantile or footprint <= 0:
        return 0.0
    return min(footprint, rules.max_share * pool_tokens)


def pool_reserve(reserves: Mapping[str, tuple[float, float]], pool_tokens: float,
                 rules: ReserveRules) -> tuple[float, float]:
    """From each light tenant's (one request, its whole reserve, ``tenant_reserve``): the room
    one endpoint keeps (the largest request, as the first rule) and the room the pool keeps
    (the reserves' sum, within ``max_share`` of the pool; the first without ``quantile``)."""
    if not reserves:
        return 0.0, 0.0
    largest = max(one for one, _ in reserves.values())
    if not rules.quantile:
        return largest, largest
    total = min(sum(whole for _, whole in reserves.values()), rules.max_share * pool_tokens)
    return min(largest, total), total
