"""``picker.core.occupancy``: the tokens each tenant holds in a lane's running requests, against
its weighted share of them."""

from __future__ import annotations

import random

import pytest

from picker.core.occupancy import Occupancy

EQUAL: dict[str, float] = {}


def test_nothing_running_means_no_share() -> None:
    occupancy = Occupancy()
    assert occupancy.share("default", "a", 1.0) is None
    occupancy.add("default", "a", 100, EQUAL)
    occupancy.add("default", "a", -100, EQUAL)
    assert occupancy.share("default", "a", 1.0) is None
    assert occupancy.tenants() == 0 and occupancy.weight_sum("default") == 0.0


def test_share_is_held_over_the_weighted_fair_share() -> None:
    occupancy = Occupancy()
    occupancy.add("default", "a", 300, EQUAL)
    occupancy.add("default", "b", 100, EQUAL)
    # Equal weights: a fair share is half of 400 each.
    assert occupancy.share("default", "a", 1.0) == pytest.approx(1.5)
    assert occupancy.share("default", "b", 1.0) == pytest.approx(0.5)
    # b weighs 3: fair shares are 100 for a and 300 for b.
    weighted = Occupancy()
    weighted.add("default", "a", 300, {"b": 3.0})
    weighted.add("default", "b", 100, {"b": 3.0})
    assert weighted.share("default", "a", 1.0) == pytest.approx(3.0)
    assert weighted.share("default", "b", 3.0) == pytest.approx(1 / 3)


def test_a_weight_changed_while_running_counts_at_once() -> None:
    occupancy = Occupancy()
    occupancy.add("default", "a", 300, EQUAL)
    occupancy.add("default", "b", 100, EQUAL)
    occupancy.reweigh("b", 3.0)
    occupancy.reweigh("nobody", 5.0)  # holds nothing: changes nothing
    assert occupancy.weight_sum("default") == pytest.approx(4.0)
    assert occupancy.share("default", "a", 1.0) == pytest.approx(3.0)
    assert occupancy.share("default", "b", 3.0) == pytest.approx(1 / 3)


def test_a_tenant_holding_nothing_is_counted_among_those_sharing() -> None:
    occupancy = Occupancy()
    occupancy.add("default", "flood", 1000, EQUAL)
    assert occupancy.share("default", "newcomer", 1.0) == 0.0
    # Alone, the flood holds exactly its share; beside the newcomer it holds twice its share.
    assert occupancy.share("default", "flood", 1.0) == pytest.approx(1.0)
    occupancy.add("default", "newcomer", 1, EQUAL)
    assert occupancy.share("default", "flood", 1.0) == pytest.approx(2 * 1000 / 1001)


def test_lanes_are_apart_and_released_tenants_are_forgotten() -> None:
    occupancy = Occupancy()
    occupancy.add("online", "a", 50, EQUAL)
    occupancy.add("batch", "a", 500, EQUAL)
    occupancy.add("batch", "b", 500, EQUAL)
    assert occupancy.share("online", "a", 1.0) == pytest.approx(1.0)
    assert occupancy.share("batch", "a", 1.0) == pytest.approx(1.0)
    assert occupancy.tenants() == 3
    occupancy.add("batch", "b", -500, EQUAL)
    assert occupancy.held("batch", "b") == 0 and occupancy.tenants() == 2
    assert occupancy.weight_sum("batch") == 1.0


def test_the_kept_weight_sums_match_a_brute_force_sum() -> None:
    rng = random.Random(7)
    tenants = [f"t{i}" for i in range(8)]
    weights = {t: rng.choice((0.5, 1.0, 2.0, 3.0)) for t in tenants}
    occupancy = Occupancy()
    held: dict[tuple[str, str], int] = {}
    for _ in range(5_000):
        lane, tenant = rng.choice(("online", "batch")), rng.choice(tenants)
        if rng.random() < 0.1:
            weights[tenant] = rng.choice((0.5, 1.0, 2.0, 3.0))
            occupancy.reweigh(tenant, weights[tenant])
            continue
        now = held.get((lane, tenant), 0)
        tokens = -now if now and rng.random() < 0.4 else rng.randint(1, 500)
        occupancy.add(lane, tenant, tokens, weights)
        held[(lane, tenant)] = now + tokens
        for check in ("online", "batch"):
            holders = [t for (other, t), n in held.items() if other == check and n]
            assert occupancy.weight_sum(check) == pytest.approx(
                sum(weights[t] for t in holders))
            total = sum(held.get((check, t), 0) for t in holders)
            for t in holders:
                assert occupancy.share(check, t, weights[t]) == pytest.approx(
                    held[(check, t)] * sum(weights[h] for h in holders) / (weights[t] * total))
