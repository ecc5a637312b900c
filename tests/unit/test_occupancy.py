"""``picker.core.occupancy``: the tokens each tenant holds in a lane's running requests, against
its weighted share of them."""

from __future__ import annotations

import pytest

from picker.core.occupancy import Occupancy


def test_nothing_running_means_no_share() -> None:
    occupancy = Occupancy()
    assert occupancy.share("default", "a", {}) is None
    occupancy.add("default", "a", 100)
    occupancy.add("default", "a", -100)
    assert occupancy.share("default", "a", {}) is None
    assert occupancy.tenants() == 0


def test_share_is_held_over_the_weighted_fair_share() -> None:
    occupancy = Occupancy()
    occupancy.add("default", "a", 300)
    occupancy.add("default", "b", 100)
    # Equal weights: a fair share is half of 400 each.
    assert occupancy.share("default", "a", {}) == pytest.approx(1.5)
    assert occupancy.share("default", "b", {}) == pytest.approx(0.5)
    # b weighs 3: fair shares are 100 for a and 300 for b.
    weights = {"b": 3.0}
    assert occupancy.share("default", "a", weights) == pytest.approx(3.0)
    assert occupancy.share("default", "b", weights) == pytest.approx(1 / 3)


def test_a_tenant_holding_nothing_is_counted_among_those_sharing() -> None:
    occupancy = Occupancy()
    occupancy.add("default", "flood", 1000)
    assert occupancy.share("default", "newcomer", {}) == 0.0
    # Alone, the flood holds exactly its share; beside the newcomer it holds twice its share.
    assert occupancy.share("default", "flood", {}) == pytest.approx(1.0)
    occupancy.add("default", "newcomer", 1)
    assert occupancy.share("default", "flood", {}) == pytest.approx(2 * 1000 / 1001)


def test_lanes_are_apart_and_released_tenants_are_forgotten() -> None:
    occupancy = Occupancy()
    occupancy.add("online", "a", 50)
    occupancy.add("batch", "a", 500)
    occupancy.add("batch", "b", 500)
    assert occupancy.share("online", "a", {}) == pytest.approx(1.0)
    assert occupancy.share("batch", "a", {}) == pytest.approx(1.0)
    assert occupancy.tenants() == 3
    occupancy.add("batch", "b", -500)
    assert occupancy.held("batch", "b") == 0 and occupancy.tenants() == 2
