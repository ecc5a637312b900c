"""``picker.core.leases``: replicas' shares of the pool follow their tenants' weighted fair shares,
checked against a brute-force water-filling."""

from __future__ import annotations

import random

import pytest

from picker.core.leases import fair_allocation, replica_targets


def _brute_force(demands: dict[str, float], weights: dict[str, float],
                 capacity: float) -> dict[str, float]:
    # Raise a common water level in small steps: each tenant gets min(demand, level x weight).
    low, high = 0.0, max(demands.values()) / min(weights.values()) + 1
    for _ in range(200):
        level = (low + high) / 2
        used = sum(min(d, level * weights[t]) for t, d in demands.items())
        low, high = (level, high) if used <= capacity else (low, level)
    return {t: min(d, low * weights[t]) for t, d in demands.items()}


def test_equal_weights_split_evenly_and_a_small_demand_is_met() -> None:
    assert fair_allocation({"a": 100, "b": 100}, {}, 100) == {"a": 50, "b": 50}
    assert fair_allocation({"a": 10, "b": 100}, {}, 100) == pytest.approx({"a": 10, "b": 90})
    assert fair_allocation({"a": 10, "b": 20}, {}, 100) == {"a": 10, "b": 20}


def test_weights_set_the_split_among_tenants_that_want_more() -> None:
    shares = fair_allocation({"a": 1000, "b": 1000, "c": 1000}, {"a": 1, "b": 2, "c": 3}, 600)
    assert shares == pytest.approx({"a": 100, "b": 200, "c": 300})


def test_the_allocation_matches_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(300):
        tenants = [f"t{i}" for i in range(rng.randint(1, 8))]
        demands = {t: rng.choice([0.0, rng.uniform(1, 500)]) for t in tenants}
        if not any(demands.values()):
            continue
        weights = {t: rng.choice([0.5, 1.0, 2.0, 3.0]) for t in tenants}
        capacity = rng.uniform(10, 2000)
        got = fair_allocation(demands, weights, capacity)
        want = _brute_force(demands, weights, capacity)
        assert got == pytest.approx(want, abs=1e-3)
        assert sum(got.values()) <= capacity + 1e-6


def test_a_tenant_s_share_follows_it_to_the_replicas_it_reaches() -> None:
    # Weights 1:2:3, all backlogged; a arrives mostly at r1, b and c at r2 and r3.
    demands = {"r1": {("default", "a"): 8000.0},
               "r2": {("default", "a"): 2000.0, ("default", "b"): 10000.0},
               "r3": {("default", "c"): 10000.0}}
    targets = replica_targets(demands, ["default"], {"a": 1, "b": 2, "c": 3}, 6000.0)
    # a gets 1/6 of 6,000 (1,000), 80 % of it at r1; b 2,000 at r2; c 3,000 at r3.
    assert targets == pytest.approx({"r1": 800 / 6000, "r2": 2200 / 6000, "r3": 3000 / 6000})
    assert sum(targets.values()) == pytest.approx(1.0)


def test_capacity_nobody_asks_for_is_split_evenly_as_headroom() -> None:
    targets = replica_targets({"r1": {("default", "a"): 600.0}, "r2": {}}, ["default"], {},
                              1000.0)
    assert targets == pytest.approx({"r1": 0.6 + 0.2, "r2": 0.2})


def test_a_higher_lane_is_served_first() -> None:
    demands = {"r1": {("online", "a"): 700.0}, "r2": {("batch", "b"): 5000.0}}
    targets = replica_targets(demands, ["online", "batch"], {}, 1000.0)
    assert targets == pytest.approx({"r1": 0.7, "r2": 0.3})
