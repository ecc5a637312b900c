"""How much of the pool may each picker replica hold, so that replicas together never over-commit
an endpoint, and tenants get their weighted shares whichever replica their requests reach?

Active-active pickers share endpoints. Each replica may hold at most its *lease*, a fraction of
every endpoint's KV budget; the leases of all replicas sum to at most 1 (the store grants them
atomically: ``picker.state``), so no endpoint is over-committed by the replicas together.

A replica asks for a *target* lease computed here, the same way by every replica, from every
replica's demand (tokens its tenants hold running plus tokens queued, per lane and tenant):

1. The pool's capacity goes to tenants by weighted max-min fairness (``fair_allocation``), lane
   by lane in priority order: a lane's tenants share what the lanes above left. A tenant that
   asks for less than its weighted share gets what it asks; the rest is split by weight among
   those that ask for more.
2. A tenant's allocation is split among replicas in proportion to its demand at each; a replica's
   target is the sum over its tenants, plus an equal part of what nobody asked for (headroom for
   new arrivals).

Within a replica the fair queue orders its own tenants on counters shared through the store, so
a tenant that reaches two replicas is charged once for both. Pure: the caller supplies demands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Demand = Mapping[tuple[str, str], float]
"""Tokens wanted per (lane, tenant): running plus queued."""


def fair_allocation(demands: Mapping[str, float], weights: Mapping[str, float],
                    capacity: float) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity`` (water-filling): no tenant gets more than it
    asks, and capacity left over by those that ask less goes to the others by weight. Tenants
    without a weight weigh 1."""
    allocation = {tenant: 0.0 for tenant in demands}
    wanting = {tenant for tenant, demand in demands.items() if demand > 0}
    left = max(0.0, capacity)
    while wanting and left > 1e-9:
        total_weight = sum(weights.get(t, 1.0) for t in wanting)
        # The tenant that runs out of demand first at this water level caps the level.
        level = min(left / total_weight,
                    min((demands[t] - allocation[t]) / weights.get(t, 1.0) for t in wanting))
        for tenant in list(wanting):
            allocation[tenant] += level * weights.get(tenant, 1.0)
            if allocation[tenant] >= demands[tenant] - 1e-9:
                allocation[tenant] = demands[tenant]
                wanting.discard(tenant)
        left = max(0.0, capacity - sum(allocation.values()))
    return allocation


def replica_targets(demands: Mapping[str, Demand], lanes: Sequence[str],
                    weights: Mapping[str, float], capacity: float) -> dict[str, float]:
    """Each replica's target lease (a fraction of every endpoint's budget, 0..1) from every
    replica's demand (``{replica: {(lane, tenant): tokens}}``); ``capacity`` is the pool's
    total KV budget in tokens. The targets sum to 1 when any replica is named."""
    if not demands or capacity <= 0:
        return {replica: 0.0 for replica in demands}
    targets = {replica: 0.0 for replica in demands}
    left = capacity
    ranked = list(lanes) + sorted({lane for demand in demands.values() for lane, _ in demand}
                                  - set(lanes))
    for lane in ranked:
        totals: dict[str, float] = {}
        for demand in demands.values():
            for (their_lane, tenant), tokens in demand.items():
                if their_lane == lane and tokens > 0:
                    totals[tenant] = totals.get(tenant, 0.0) + tokens
        if not totals:
            continue
        allocation = fair_allocation(totals, weights, left)
        for replica, demand in demands.items():
            for (their_lane, tenant), tokens in demand.items():
                if their_lane == lane and tokens > 0:
                    targets[replica] += allocation[tenant] * tokens / totals[tenant]
        left -= sum(allocation.values())
    spare = max(0.0, left) / len(demands)
    return {replica: min(1.0, (target + spare) / capacity) for replica, target in targets.items()}
