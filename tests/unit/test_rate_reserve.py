"""The idle-tenant reserve sized from a light tenant's rate (``picker.core.reserve``, issue 27
point 3): Little's law and a Poisson quantile, pure; then through the gate, that the reserve
grows with a light tenant's rate and lapses when it leaves, is never kept for a backlogged
tenant, leaves the default (throughput) profile as it was, and never changes which tenant goes
next."""

from __future__ import annotations

import math
import random

import pytest

from picker.config.build import gate_rules
from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, TenantRules
from picker.core.gate import Gate, GateRules, Passage
from picker.core.reserve import (
    MAX_RESERVED_REQUESTS,
    ReserveRules,
    is_light,
    light_in_flight,
    new_demand,
    poisson_quantile,
    pool_reserve,
    reserved_requests,
    standing_room,
    tenant_reserve,
)
from picker.core.selection import CapacityRules
from picker.errors import ConfigError

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
WINDOW = 10.0
RATE = ReserveRules(window=WINDOW, quantile=0.9, max_share=0.5)


def _steady(rate: float, holding: float, tokens: float = 100.0, seconds: float = 60.0):
    """A tenant that sent ``tokens``-sized requests at ``rate`` a second for ``seconds``, each
    holding its room ``holding`` seconds."""
    demand = new_demand(tokens, 0.0)
    step = 1.0 / rate
    t = step
    while t <= seconds:
        demand.arrived(tokens, t, WINDOW)
        demand.ended(holding)
        t += step
    return demand


def test_poisson_quantile_matches_the_distribution() -> None:
    assert poisson_quantile(0.0, 0.9) == 0
    # P(N <= 1) for mean 1 is 2/e = 0.736 < 0.9; P(N <= 2) = 2.5/e = 0.920.
    assert poisson_quantile(1.0, 0.9) == 2 and poisson_quantile(1.0, 0.7) == 1
    assert poisson_quantile(6.0, 0.5) == 6 and poisson_quantile(6.0, 0.9) == 9
    assert 200 < poisson_quantile(200.0, 0.9) <= 200 + 1.3 * math.sqrt(200) + 1
    # Past exp()'s range (the normal approximation), and bounded.
    assert poisson_quantile(800.0, 0.9) == MAX_RESERVED_REQUESTS


def test_the_rate_follows_arrivals_and_falls_when_they_stop() -> None:
    demand = _steady(2.0, 3.0)
    assert demand.rate(60.0, WINDOW) == pytest.approx(2.0, rel=0.05)
    assert demand.in_flight(60.0, WINDOW) == pytest.approx(6.0, rel=0.05)  # Little: 2/s × 3 s
    # A young tenant is not diluted over the window it has not been seen for: 4 arrivals in
    # 1.5 s read about 2/s, not 0.4/s.
    young = new_demand(100, 0.0)
    for t in (0.5, 1.0, 1.5):
        young.arrived(100, t, WINDOW)
    assert young.rate(1.5, WINDOW) == pytest.approx(2.0, rel=0.1)
    assert demand.rate(80.0, WINDOW) == pytest.approx(2.0 * math.exp(-2), rel=0.05)


def test_the_reserve_grows_with_the_rate() -> None:
    sizes = [tenant_reserve(_steady(rate, 3.0), 60.0, RATE, held=0.0)
             for rate in (0.02, 1.0, 2.0, 4.0)]
    assert sizes == sorted(sizes) and sizes[0] == 100.0 and sizes[-1] > 5 * sizes[0]
    demand = _steady(2.0, 3.0)
    n = reserved_requests(demand, 60.0, RATE)
    assert n == poisson_quantile(demand.in_flight(60.0, WINDOW), 0.9) == 9
    # What the tenant holds already is room in use, not kept free again; at least one request.
    assert tenant_reserve(demand, 60.0, RATE, held=600.0) == pytest.approx(100 + 8 * 100 - 600)
    assert tenant_reserve(demand, 60.0, RATE, held=5000.0) == 100.0


def test_without_a_quantile_the_reserve_is_one_large_request() -> None:
    first = ReserveRules(window=WINDOW)
    demand = _steady(4.0, 3.0)
    assert tenant_reserve(demand, 60.0, first, held=0.0) == demand.footprint == 100.0
    assert reserved_requests(demand, 60.0, first) == 1
    assert is_light(demand, 60.0, first, fair_tokens=1.0)  # the queue alone decides
    assert pool_reserve({"a": (100.0, 100.0), "b": (300.0, 300.0)}, 0.0, first) == \
        (300.0, 300.0)


def test_light_is_below_the_fair_share_and_reserves_stay_within_the_cap() -> None:
    demand = _steady(2.0, 3.0)  # about 6 requests in flight × 100 tokens
    assert is_light(demand, 60.0, RATE, fair_tokens=650.0)
    # Judged on the low end of its estimate (Poisson of 6 at 0.1: 3 requests), not the mean.
    assert light_in_flight(6.0, 0.9) == poisson_quantile(6.0, 0.1) == 3
    assert not is_light(demand, 60.0, RATE, fair_tokens=250.0)
    # (one request, all its requests) per tenant: the largest one, the sum within the cap.
    reserves = {"a": (100.0, 400.0), "b": (300.0, 900.0)}
    assert pool_reserve(reserves, 2000.0, RATE) == (300.0, 1000.0)
    assert pool_reserve(reserves, 400.0, RATE) == (200.0, 200.0)


def test_a_tenant_near_its_fair_share_stays_light() -> None:
    """Its expected demand a little above its fair share is within its estimate's noise: it
    keeps its reserve (the old rule judged it heavy, took the reserve and its engine
    priority; 2 x 64k, light 1.5/s under a flood: light TTFT p95 5.3x alone, now 0.94x)."""
    demand = _steady(2.0, 3.0)  # about 6 in flight × 100 tokens: 600
    assert is_light(demand, 60.0, RATE, fair_tokens=550.0)
    assert is_light(new_demand(100.0, 0.0), 0.0, RATE, fair_tokens=550.0, running=6)
    # Twice its fair share and more is no noise: heavy, by its rate and by its running count.
    assert not is_light(demand, 60.0, RATE, fair_tokens=300.0)
    assert not is_light(new_demand(100.0, 0.0), 0.0, RATE, fair_tokens=300.0, running=6)
    assert light_in_flight(0.0, 0.9) == 0


# -- through the gate --

def _gate(quantile: float = 0.9, *, share: float = 1.0, window: float = WINDOW) -> Gate:
    rules = GateRules(capacity=CapacityRules(fallback_budget=10_000),
                      idle_tenant_reserve=window, reserve_quantile=quantile,
                      reserve_max_share=share)
    gate = Gate(rules, Scheduler([LaneSpec("default")]), Admission({}, TenantRules()), now=0.0)
    gate.set_endpoints({E1: 10_000, E2: 10_000})
    return gate


def _send(gate: Gate, tenant: str, prompt: int, now: float, output: int = 100) -> Passage:
    passage = gate.admit(Passage, tenant, None, model="m", prompt_tokens=prompt,
                         max_tokens=output, stream=False, now=now)
    assert isinstance(passage, Passage), passage
    return passage


def _light_traffic(gate: Gate, rate: float, until: float, holding: float = 2.0,
                   start: float = 0.0) -> float:
    """A light tenant's 400-token requests (300 prompt, 100 output) at ``rate``, each ended
    ``holding`` seconds after it arrived; returns the time of the last."""
    t, running = start, []
    while t < until:
        for end, passage in running:
            if end <= t:
                gate.complete(passage, Usage(300, 100), "ok", end)
        running = [(end, p) for end, p in running if end > t]
        running.append((t + holding, _send(gate, "light", 300, t)))
        t += 1.0 / rate
    for end, passage in running:
        gate.complete(passage, Usage(300, 100), "ok", end)
    return max(t, max((end for end, _ in running), default=t))


def test_the_reserve_grows_with_a_light_tenants_rate_and_lapses_when_it_leaves() -> None:
    reserves = []
    for rate in (0.5, 2.0, 4.0):
        gate = _gate()
        end = _light_traffic(gate, rate, 30.0)
        one, total = gate._idle_reserve(end, "flood")
        assert one == pytest.approx(400.0, rel=0.01)  # room for its next request on one endpoint
        reserves.append(total)
    # Little's law: 0.5/s × 2 s = 1 in flight, 4, 8 (a little less, read 2 s after the last
    # arrival); their 0.9 quantiles 2, 7, 12 requests.
    assert reserves == sorted(reserves) and reserves[0] < 1000 < 2500 < reserves[2]
    assert 9 * 400 <= reserves[2] <= 12 * 400
    # It shrinks as the tenant goes quiet, and lapses after the window.
    gate = _gate()
    end = _light_traffic(gate, 4.0, 30.0)
    later = gate._idle_reserve(end + 5.0, "flood")[1]
    assert 400 <= later < reserves[2]
    assert gate._idle_reserve(end + WINDOW + 1.0, "flood") == (0.0, 0.0)
    assert "light" not in gate._recent


def test_the_first_rule_keeps_one_request_whatever_the_rate() -> None:
    gate = _gate(quantile=0.0)
    end = _light_traffic(gate, 4.0, 30.0)
    assert gate._idle_reserve(end, "flood") == pytest.approx((400.0, 400.0), rel=0.01)


def test_no_reserve_for_a_backlogged_tenant() -> None:
    gate = _gate()
    end = _light_traffic(gate, 2.0, 30.0)
    assert gate._idle_reserve(end, "flood")[1] > 0
    assert not gate._backlogged("light", end)
    # A tenant whose expected demand reaches its fair share (half the pool beside one other):
    # 20/s × 2 s in flight × 400 tokens = 16,000 >= 10,000.
    heavy = _gate()
    end = _light_traffic(heavy, 20.0, 30.0)
    _send(heavy, "other", 10, end)
    assert heavy._backlogged("light", end)
    assert heavy._idle_reserve(end, "other") == (0.0, 0.0)
    # A light tenant with more requests waiting than its reserve is for: a burst, backlogged.
    burst = _gate()
    end = _light_traffic(burst, 0.5, 30.0)
    filler = [_send(burst, "flood", 9_000, end, output=1) for _ in range(2)]
    assert all(p.dispatched_at == end for p in filler)
    waiting = [_send(burst, "light", 3_000, end) for _ in range(4)]
    assert all(p.dispatched_at is None for p in waiting)
    assert burst._backlogged("light", end)
    assert burst._idle_reserve(end, "flood") == (0.0, 0.0)


def test_the_reserves_stay_within_their_share_of_the_pool() -> None:
    gate = _gate(share=0.1)  # 2,000 of the pool's 20,000
    end = _light_traffic(gate, 4.0, 30.0)
    assert gate._idle_reserve(end, "flood") == pytest.approx((400.0, 2000.0), rel=0.01)


def test_the_reserve_holds_the_flood_not_the_fair_order() -> None:
    """Two backlogged tenants take turns, alternating while both have requests waiting, under
    the rate reserve as under the first reserve rule (one request) and without a reserve; only
    when they go differs. (Once one has a single request left, it may go out of turn while the
    other's waits for room: the light-request rule, which the timing decides.)"""
    orders = []
    for quantile, window in ((0.9, WINDOW), (0.0, WINDOW), (0.0, 0.0)):
        gate = _gate(quantile, window=window)
        end = _light_traffic(gate, 2.0, 20.0)
        fill = [_send(gate, "x", 9_000, end, output=1), _send(gate, "y", 9_000, end, output=1)]
        queued = [_send(gate, tenant, 2_000, end, output=1) for tenant in ("x", "y") * 6]
        t = end
        for passage in fill:
            t += 1.0
            gate.complete(passage, Usage(9_000, 1), "ok", t)
        while any(p.dispatched_at is None for p in queued):
            t += 1.0
            for passage in queued:
                if passage.dispatched_at is not None and passage.outcome is None:
                    gate.complete(passage, Usage(2_000, 1), "ok", t)
        orders.append([p.tenant for p in sorted(queued, key=lambda p: p.dispatch_seq)])
    for order in orders:
        assert order[:8] == ["x", "y"] * 4 and sorted(order) == ["x"] * 6 + ["y"] * 6


def test_the_reserve_keys_load_strictly_and_the_throughput_profile_keeps_no_reserve() -> None:
    default = gate_rules(load(PickerConfig, {}))
    assert (default.idle_tenant_reserve, default.reserve_quantile) == (0.0, 0.0)
    isolation = load(PickerConfig, {"capacity": {"profile": "isolation"}}).capacity
    assert (isolation.reserve_quantile, isolation.reserve_max_share) == (0.9, 0.15)
    first = load(PickerConfig, {"capacity": {"profile": "isolation", "reserveQuantile": 0}})
    assert (gate_rules(first).reserve_quantile, gate_rules(first).reserve_max_share) == \
        (0.0, 0.15)
    with pytest.raises(ConfigError, match=r"capacity\.reserveQuantile"):
        load(PickerConfig, {"capacity": {"reserveQuantile": 1}})
    with pytest.raises(ConfigError, match=r"capacity\.reserveMaxShare"):
        load(PickerConfig, {"capacity": {"reserveMaxShare": 0}})
    # A quantile needs a reserve to size: refused when written out without one, off when the
    # profile's reserve is turned off (idleTenantReserve: 0s).
    with pytest.raises(ConfigError, match=r"capacity\.reserveQuantile"):
        load(PickerConfig, {"capacity": {"reserveQuantile": 0.5}})
    off = load(PickerConfig, {"capacity": {"profile": "isolation", "idleTenantReserve": "0s"}})
    assert (off.capacity.reserve_quantile, off.capacity.ready_reserve) == (0.0, False)


@pytest.mark.parametrize("quantile", [0.9, 0.0])
def test_a_light_tenants_oldest_waiting_request_may_take_the_room_kept_for_it(
        quantile: float) -> None:
    """Room kept for a light tenant with two requests waiting is of use only if they may take
    it while the fair queue's head waits: under the rate rule its oldest may go ahead, as a
    tenant's single waiting request may under the first rule; under the first rule a second
    waiting request makes it a flood."""
    gate = _gate(quantile)
    end = _light_traffic(gate, 2.0, 20.0)
    fill = [_send(gate, "flood", 9_800, end, output=1) for _ in range(2)]
    assert all(p.dispatched_at == end for p in fill)
    waiting = [_send(gate, "light", 600, end + 0.1) for _ in range(2)]
    assert all(p.dispatched_at is None for p in waiting)  # 200 free on each endpoint
    heads = list(gate._light_heads(end + 0.1))
    assert heads == ([waiting[0]] if quantile else [])
    assert gate._backlogged("light", end + 0.1) is (not quantile)


@pytest.mark.parametrize("quantile", [0.9, 0.0])
def test_a_flood_alone_leaves_room_for_a_tenant_not_yet_seen(quantile: float) -> None:
    """Under the rate rule a tenant flooding the pool alone leaves one request's room as large
    as its own (the standing room), so a newcomer's first request starts at once; under the
    first rule the flood takes every block that frees and the newcomer waits for one of its
    requests to end. Beside a tenant already seen no standing room is kept."""
    gate = _gate(quantile)
    flood = [_send(gate, "flood", 1_900, 0.0) for _ in range(40)]
    running = [p for p in flood if p.dispatched_at is not None]
    assert len(running) == 10  # 5 of 2,000 tokens on each 10,000-token endpoint; 30 wait
    assert gate._backlogged("flood", 0.0)
    for passage in running[:2]:
        gate.complete(passage, Usage(1_900, 100), "ok", 1.0)
    refilled = [p for p in flood if p.dispatched_at == 1.0]
    assert len(refilled) == (1 if quantile else 2)
    assert gate._standing_room(1.0, "flood") == (2_000.0 if quantile else 0.0)
    newcomer = _send(gate, "new", 1_500, 1.1)
    assert (newcomer.dispatched_at == 1.1) is bool(quantile)
    assert gate._standing_room(1.2, "flood") == 0.0  # "new" is seen now


def _standing_room_by_scan(gate: Gate, now: float, tenant: str) -> float:
    """``Gate._standing_room`` as it was, a walk over every tenant seen recently."""
    window = gate.rules.idle_tenant_reserve
    demand = gate._recent.get(tenant)
    if demand is None or any(other != tenant and now - d.last <= window
                             for other, d in gate._recent.items()):
        return 0.0
    return standing_room(demand.footprint, gate._pool_tokens(), gate._reserve)


@pytest.mark.parametrize("seed", range(5))
def test_the_standing_room_needs_no_walk_over_the_tenants(seed: int) -> None:
    """``_standing_room`` is O(1), from the last two tenants to arrive, and answers as the walk
    over every recent tenant did: arrivals of a few tenants at random gaps (some past the
    window), the recent ones forgotten now and then (``forget_idle``, ``_idle_reserve``)."""
    rng = random.Random(seed)
    gate = _gate(window=5.0)
    tenants = ["flood", "a", "b", "c"]
    now, asked, kept = 0.0, 0, 0
    for _ in range(400):
        now += rng.choice([0.1, 0.5, 2.0, 6.0])
        tenant = rng.choice(tenants[:1] * 4 + tenants)
        gate._note_arrival(tenant, rng.randrange(500, 3_000), now)
        if rng.random() < 0.1:
            gate.forget_idle(now + rng.choice([0.0, 3.0, 7.0]))
        if rng.random() < 0.1:
            gate._idle_reserve(now, tenant)
        for later in (0.0, 1.0, 4.9, 5.0, 5.1, 12.0):
            for who in tenants:
                expected = _standing_room_by_scan(gate, now + later, who)
                assert gate._standing_room(now + later, who) == expected
                asked += 1
                kept += expected > 0
    assert 0 < kept < asked  # both answers occur
