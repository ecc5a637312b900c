"""A log replayed through the pool simulator under a config (issue 29 point 1): what each tenant
and lane gets, and how a candidate config changes it."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.pool import PoolSpec
from picker.whatif.log import Arrival
from picker.whatif.replay import Quantiles, ReplayResult, replay

SPEC = PoolSpec(endpoints=1, kv_budget_tokens=4096, step_s=0.01)


def config(tenants: list[dict[str, Any]], **sections: Any) -> PickerConfig:
    return load(PickerConfig, {"capacity": {"kvBudgetTokens": 4096}, "tenants": tenants,
                               **sections})


def arrival(at: float, tenant: str, *, line: int = 0, prompt: int = 200, output: int | None = 50,
            max_tokens: int | None = 50, lane: str | None = None) -> Arrival:
    return Arrival(line=line, arrived=at, tenant=tenant, model="m", lane_asked=lane,
                   prompt_tokens=prompt, output_tokens=output, max_tokens=max_tokens,
                   stream=True, finished=at + 1)


def flood(seconds: float = 10.0, rate: float = 30.0) -> list[Arrival]:
    """Tenants a and b each sending ``rate`` requests a second: past what one engine serves
    before clients give up, so what each tenant gets is the scheduler's choice."""
    rng = random.Random(7)
    out = [arrival(t, tenant, line=i)
           for i, (t, tenant) in enumerate(sorted(
               (rng.uniform(0, seconds), tenant) for tenant in ("a", "b")
               for _ in range(int(seconds * rate))))]
    return out


def run(cfg: PickerConfig, arrivals: list[Arrival], **options: Any) -> ReplayResult:
    return replay(cfg, SPEC, arrivals, start=0.0, **options)


def test_a_light_log_is_served_whole_under_its_own_config() -> None:
    log = [arrival(t * 0.5, "a" if t % 2 else "b", line=t) for t in range(40)]
    result = run(config([{"id": "a"}, {"id": "b"}]), log)
    a, b = result.lanes[("a", "default")], result.lanes[("b", "default")]
    assert (a.sent, a.ok, b.sent, b.ok) == (20, 20, 20, 20)
    assert a.tokens == b.tokens == 20 * (200 + 50)  # every prompt and output token served
    assert result.share(("a", "default")) == pytest.approx(0.5)
    assert result.output_tokens == 40 * 50
    assert a.ttft.quantile(0.95) is not None and a.ttft.quantile(0.95) < 0.5
    assert 0 < result.utilisation() <= 1 and result.tokens_per_s() > 0
    assert result.unfinished == 0 and not result.unknown_tenants


def test_weights_move_the_shares_under_contention() -> None:
    log = flood()
    even = run(config([{"id": "a"}, {"id": "b"}]), log, client_timeout_s=5.0)
    tilted = run(config([{"id": "a", "weight": 1}, {"id": "b", "weight": 3}]), log,
                 client_timeout_s=5.0)
    key_a, key_b = ("a", "default"), ("b", "default")
    assert even.share(key_a) == pytest.approx(0.5, abs=0.05)
    assert tilted.share(key_b) > 0.6 and tilted.share(key_a) < 0.4
    assert even.lanes[key_a].refused.get("cancelled", 0) > 0  # contended: clients gave up
    # b waits less for its first token when it weighs more.
    b_even, b_tilted = even.lanes[key_b].ttft.quantile(0.5), tilted.lanes[key_b].ttft.quantile(0.5)
    assert b_even is not None and b_tilted is not None and b_tilted < b_even


def test_a_burst_budget_refuses_with_429_and_says_when_it_ran_out() -> None:
    log = [arrival(t * 0.1, "a", line=t) for t in range(100)]
    budgets = {"burst": {"tokens": 2500, "per": "1h"}}  # 10 requests of 250
    result = run(config([{"id": "a", "budgets": budgets}]), log)
    stats = result.lanes[("a", "default")]
    assert stats.ok == 10 and stats.status_count(429) == 90
    assert stats.refused == {"over_budget": 90}
    assert result.budget_out_s["a"] == pytest.approx(1.0)  # the 11th request, at 1.0 s


def test_demotion_instead_of_refusal_runs_in_the_lower_lane() -> None:
    log = [arrival(t * 0.1, "a", line=t) for t in range(30)]
    cfg = config([{"id": "a", "budgets": {"burst": {"tokens": 2500, "per": "1h"}},
                   "overBudget": {"action": "demote", "lane": "batch"}}],
                 lanes=[{"name": "online"}, {"name": "batch"}])
    result = run(cfg, log)
    assert result.lanes[("a", "online")].ok == 10
    batch = result.lanes[("a", "batch")]
    assert batch.demoted == 20 and batch.ok == 20 and batch.status_count(429) == 0
    assert result.budget_out_s["a"] == pytest.approx(1.0)


def test_a_lane_the_candidate_does_not_allow_is_refused_403_not_429() -> None:
    log = [arrival(0.0, "a", lane="batch"), arrival(0.1, "a")]
    lanes = [{"name": "online"}, {"name": "batch"}]
    allowed = run(config([{"id": "a", "allowedLanes": ["batch"]}], lanes=lanes), log)
    assert allowed.lanes[("a", "batch")].ok == 1
    refused = run(config([{"id": "a"}], lanes=lanes), log)
    stats = refused.lanes[("a", "batch")]
    assert stats.refused == {"lane_not_allowed": 1} and stats.status_count(429) == 0
    assert refused.lanes[("a", "online")].ok == 1


def test_an_unknown_tenant_is_replayed_under_the_defaults_and_named() -> None:
    log = [arrival(0.0, "a"), arrival(0.1, "ghost", line=7), arrival(0.2, "ghost", line=9)]
    result = run(config([{"id": "a"}]), log)
    assert result.unknown_tenants == {"ghost": [7, 2]}
    assert result.lanes[("ghost", "default")].ok == 2


def test_a_request_that_never_ran_produces_what_it_asked_for() -> None:
    never_ran = arrival(0.0, "a", output=None, max_tokens=30)
    no_limit = arrival(0.0, "a", output=None, max_tokens=None)
    result = run(config([{"id": "a"}], capacity={"kvBudgetTokens": 4096,
                                                 "defaultOutputTokens": 77}),
                 [never_ran, no_limit])
    assert result.lanes[("a", "default")].completion_tokens == 30 + 77


def test_idle_stretches_are_jumped_not_stepped() -> None:
    day = 86_400.0
    result = run(config([{"id": "a"}]), [arrival(0.0, "a"), arrival(day, "a")])
    assert result.lanes[("a", "default")].ok == 2
    assert result.duration_s == pytest.approx(day, rel=1e-3)
    # Busy only while the two requests ran: about 50 steps each out of 8.6 million.
    assert result.busy_engine_ticks < 200
    assert result.utilisation() < 1e-4


def test_requests_still_in_when_the_drain_ends_are_unfinished() -> None:
    log = [arrival(0.0, "a", output=100_000, max_tokens=100_000, prompt=10)]
    result = run(config([{"id": "a"}]), log, client_timeout_s=1e6, drain_s=0.5)
    assert result.unfinished == 1
    assert result.lanes[("a", "default")].refused == {"unfinished": 1}


def test_quantiles_are_within_one_percent_in_bounded_memory() -> None:
    rng = random.Random(3)
    values = [rng.lognormvariate(-3, 1.5) for _ in range(20_000)]
    q = Quantiles()
    for v in values:
        q.add(v)
    ordered = sorted(values)
    for p in (0.5, 0.95):
        exact = ordered[math.ceil(p * len(values)) - 1]
        assert q.quantile(p) == pytest.approx(exact, rel=0.01)
    assert len(q.bins) < 2000
    assert Quantiles().quantile(0.5) is None
