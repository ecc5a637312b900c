"""Prefix affinity in the pool simulator (issue 28 point 2): on workloads whose requests share
prefixes (chat sessions resending their conversation, agent programs), routing by the picker's
prefix index raises the engines' own prefix hit rate over least-loaded routing, on the same
traffic; and the engines' cached counts reach the gate's settlement (point 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.config.schema import PickerConfig
from picker.config.strict import load
from picker.sim.pool import PoolRun, PoolSpec, simulate
from picker.sim.traffic import load_traffic

TRAFFIC = Path(__file__).resolve().parents[2] / "bench" / "traffic"
POOL = PoolSpec(endpoints=4, kv_budget_tokens=16384, step_s=0.02)


def _run(scenario: str, sections: dict[str, Any], backlog: int) -> PoolRun:
    data = yaml.safe_load((TRAFFIC / scenario).read_text())
    data["duration_s"] = 20  # a third of the scenario: a few seconds of CPU
    for tenant in data["tenants"]:
        tenant["backlog"] = backlog
    config = load(PickerConfig, {"tenants": [{"id": t["name"]} for t in data["tenants"]],
                                 **sections})
    return simulate(config, load_traffic(data), POOL, drain_s=30)


@pytest.mark.parametrize(("scenario", "backlog"), [("prefix_chat.yaml", 4),
                                                   ("prefix_agent.yaml", 4)])
def test_affinity_raises_the_engines_prefix_hit_rate(scenario: str, backlog: int) -> None:
    plain = _run(scenario, {}, backlog)
    affine = _run(scenario, {"routing": {"prefixAffinity": {}}}, backlog)
    for run in (plain, affine):
        assert run.records and all(r.outcome == "ok" for r in run.records)
    # The same requests (closed loop: the same count when every one is served).
    assert affine.prefix_cache_queries == plain.prefix_cache_queries > 0
    plain_rate = plain.prefix_cache_hits / plain.prefix_cache_queries
    affine_rate = affine.prefix_cache_hits / affine.prefix_cache_queries
    # Measured: chat 0.56 -> 0.82, agents 0.63 -> 0.84 (seed 28, 4 engines of 16k tokens).
    assert affine_rate >= plain_rate + 0.1, (plain_rate, affine_rate)


def test_computed_token_charging_settles_on_the_engines_cached_counts() -> None:
    """With ``chargeCachedPrompt: false`` a tenant's service is its computed prompt plus its
    output: the engines' cached tokens reach the settlement (one tenant, so its VTC counter is
    its service, no lift)."""
    runs = {}
    for charge in (True, False):
        data = yaml.safe_load((TRAFFIC / "prefix_chat.yaml").read_text())
        data["duration_s"] = 10
        data["tenants"] = [{**data["tenants"][0], "backlog": 3}]
        config = load(PickerConfig, {"tenants": [{"id": "many-users"}],
                                     "routing": {"prefixAffinity": {}},
                                     "cost": {"chargeCachedPrompt": charge}})
        runs[charge] = simulate(config, load_traffic(data), POOL, drain_s=30)
    sent, computed = runs[True], runs[False]
    records = computed.records
    assert records and all(r.outcome == "ok" for r in records)
    cached = sum(r.cached_tokens or 0 for r in records)
    prompt = sum(r.prompt_tokens for r in records)
    output = sum(r.completion_tokens for r in records)
    assert cached > prompt / 3  # a conversation resent: most of each turn is cached
    assert computed.gate.scheduler.counter("many-users") == pytest.approx(
        prompt - cached + 2 * output)
    assert sent.gate.scheduler.counter("many-users") == pytest.approx(
        sum(r.prompt_tokens + 2 * r.completion_tokens for r in sent.records))
