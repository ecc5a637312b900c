"""How much of a lane's running work does each tenant hold, against its weighted share of it?

The fair queue's counters say who has been served most; they cannot say who is *using* the pool
now, because the fair queue lifts a returning tenant to the floor (it banks no credit) and so a
light tenant and a flood look alike on arrival. Engine priority needs the second view: a tenant
that holds far less of the running work than its weight entitles it to is under-served whatever
its queue looks like for a moment (two requests arriving together), and one that holds more than
its share is not light even while its queue is empty. The gate keeps one ``Occupancy`` and
reports every request's tokens into it as they are dispatched, grow and are released.
"""

from __future__ import annotations

from collections.abc import Mapping


class Occupancy:
    """Tokens each tenant holds in requests running in each lane (reserved at dispatch, plus
    the output a stream has delivered).

    ``share`` is asked at every dispatch to a priority engine, so it is O(1): each lane keeps
    the sum of its holders' weights, updated when a tenant starts or stops holding there and
    when a holder's weight changes (``reweigh``). Invariant: ``_sharing[lane]`` equals the sum
    of ``_weights[lane]`` (checked against the brute-force sum in the tests).
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[str, int]] = {}
        """Per lane, per tenant with tokens held, those tokens."""
        self._weights: dict[str, dict[str, float]] = {}
        """Per lane, each holder's weight (as of its entry or its last ``reweigh``)."""
        self._sharing: dict[str, float] = {}
        """Per lane, the sum of its holders' weights."""
        self._totals: dict[str, int] = {}

    def add(self, lane: str, tenant: str, tokens: int, weights: Mapping[str, float]) -> None:
        """``tokens`` more held (negative: released); a tenant at zero is forgotten. ``weights``
        (tenant to weight, 1.0 when absent) is read only when the tenant starts holding."""
        held = self._held.get(lane)
        if held is None:
            held = self._held[lane] = {}
            self._weights[lane] = {}
            self._sharing[lane] = 0.0
        before = held.get(tenant, 0)
        now_held = before + tokens
        if now_held:
            held[tenant] = now_held
            if not before:
                weight = self._weights[lane][tenant] = weights.get(tenant, 1.0)
                self._sharing[lane] += weight
        elif before:
            del held[tenant]
            self._sharing[lane] -= self._weights[lane].pop(tenant)
        total = self._totals.get(lane, 0) + tokens
        if total:
            self._totals[lane] = total
        else:
            # Nobody holds anything here: dropping the lane also resets its float sum.
            for ledger in (self._totals, self._held, self._weights, self._sharing):
                ledger.pop(lane, None)

    def reweigh(self, tenant: str, weight: float) -> None:
        """The tenant's weight is now ``weight``: lanes where it holds count it so."""
        for lane, weights in self._weights.items():
            old = weights.get(tenant)
            if old is not None:
                weights[tenant] = weight
                self._sharing[lane] += weight - old

    def held(self, lane: str, tenant: str) -> int:
        return self._held.get(lane, {}).get(tenant, 0)

    def weight_sum(self, lane: str) -> float:
        """The sum of the weights of the tenants holding tokens in ``lane``."""
        return self._sharing.get(lane, 0.0)

    def share(self, lane: str, tenant: str, weight: float) -> float | None:
        """The tenant's held tokens over its weighted fair share of all held in the lane, the
        tenant (of weight ``weight``) counted among those sharing it: 1.0 holds exactly its
        share, 0.0 holds nothing. None when nothing runs in the lane (nobody can be under- or
        over-served)."""
        total = self._totals.get(lane, 0)
        if total <= 0:
            return None
        held = self._held[lane].get(tenant, 0)
        if not held:
            return 0.0
        return held * self._sharing[lane] / (weight * total)

    def tenants(self) -> int:
        """Tenants holding tokens in any lane (memory accounting)."""
        return sum(len(h) for h in self._held.values())
