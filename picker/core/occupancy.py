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
    the output a stream has delivered)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, int]] = {}
        """Per lane, per tenant with tokens held, those tokens."""
        self._totals: dict[str, int] = {}

    def add(self, lane: str, tenant: str, tokens: int) -> None:
        """``tokens`` more held (negative: released); a tenant at zero is forgotten."""
        held = self._held.setdefault(lane, {})
        now_held = held.get(tenant, 0) + tokens
        if now_held:
            held[tenant] = now_held
        else:
            held.pop(tenant, None)
        total = self._totals.get(lane, 0) + tokens
        if total:
            self._totals[lane] = total
        else:
            self._totals.pop(lane, None)
            self._held.pop(lane, None)

    def held(self, lane: str, tenant: str) -> int:
        return self._held.get(lane, {}).get(tenant, 0)

    def share(self, lane: str, tenant: str, weights: Mapping[str, float]) -> float | None:
        """The tenant's held tokens over its weighted fair share of all held in the lane, the
        tenant counted among those sharing it: 1.0 holds exactly its share, 0.0 holds nothing.
        None when nothing runs in the lane (nobody can be under- or over-served)."""
        total = self._totals.get(lane, 0)
        if total <= 0:
            return None
        held = self._held[lane]
        weight = weights.get(tenant, 1.0)
        sharing = sum(weights.get(t, 1.0) for t in held)
        if tenant not in held:
            sharing += weight
        return held.get(tenant, 0) * sharing / (weight * total)

    def tenants(self) -> int:
        """Tenants holding tokens in any lane (memory accounting)."""
        return sum(len(h) for h in self._held.values())
