"""``bench.isolation_envoy``'s scaling: the stack's engines and traffic are the simulator's, only
slower, so that the two columns of its tables compare like with like."""

from __future__ import annotations

import pytest

from bench.isolation import SIZES, Size
from bench.isolation_envoy import (
    DEFAULT_MODE,
    _ratios,
    chosen_sizes,
    scaled_spec,
    scaled_traffic,
    server_args,
    tokens_goal_vs_default,
)
from picker.sim.server import build_parser, config_from_args

SCALED = [s for s in SIZES if isinstance(s.traffic, dict)]


@pytest.mark.parametrize("size", SCALED, ids=[s.name for s in SCALED])
def test_the_stacks_servers_are_the_simulators_engines_slowed_down(size: Size) -> None:
    spec = scaled_spec(size.spec, 2.0)
    server = config_from_args(build_parser().parse_args(server_args(spec)))
    assert server.kv_budget_tokens == size.spec.kv_budget_tokens
    assert server.max_num_batched_tokens == size.spec.max_num_batched_tokens
    assert server.scheduling_policy == "priority"
    assert server.step_ms == pytest.approx(2 * size.spec.step_s * 1000)
    assert server.prefill_ms_per_1k_tokens == pytest.approx(
        2 * size.spec.prefill_s_per_token * 1e6)
    # Every request the traffic can draw fits an engine's context.
    traffic = scaled_traffic(size, 2.0)
    longest = max(t.prompt_tokens[1] + t.output_tokens[1] for t in traffic.tenants)
    assert server.max_model_len is None or longest <= server.max_model_len


@pytest.mark.parametrize("size", SCALED, ids=[s.name for s in SCALED])
def test_the_traffic_keeps_its_shapes_and_slows_its_rates(size: Size) -> None:
    original = {t["name"]: t for t in size.traffic["tenants"]}
    slowed = scaled_traffic(size, 2.0)
    assert {t.name for t in slowed.tenants} == set(original)
    for tenant in slowed.tenants:
        assert tenant.rate == pytest.approx(original[tenant.name]["rate"] / 2)
        assert list(tenant.prompt_tokens) == original[tenant.name]["prompt_tokens"]
    assert [t.name for t in scaled_traffic(size, 2.0, light_only=True).tenants] == ["light"]


def test_endpoints_widen_the_pool_and_the_flood_with_it() -> None:
    two, four = chosen_sizes(["8k"]), chosen_sizes(["8k"], 4, light_rate=1.0)
    assert [s.name for s in two] == [s.name for s in four] == ["8k"]
    assert (two[0].spec.endpoints, four[0].spec.endpoints) == (2, 4)
    assert scaled_spec(four[0].spec, 2.0).addresses() == [f"10.0.0.{i}:8000" for i in (1, 2, 3, 4)]
    rates = [{t["name"]: t["rate"] for t in s.traffic["tenants"]}  # type: ignore[index]
             for s in (two[0], four[0])]
    assert rates[1] == {"flood": 2 * rates[0]["flood"], "light": 1.0}


def test_isolation_tokens_are_judged_against_the_default() -> None:
    results = {"light alone": {"light_ttft_p95_ms": 60.0, "tokens_per_s": 10.0},
               DEFAULT_MODE: {"light_ttft_p95_ms": 600.0, "tokens_per_s": 1000.0},
               "isolation profile, priority engines": {"light_ttft_p95_ms": 60.0,
                                                       "tokens_per_s": 850.0}}
    _ratios(results)
    assert results["isolation profile, priority engines"]["tokens_vs_default"] == 0.85
    assert results["light alone"]["tokens_vs_default"] is None  # a baseline: not judged
    assert (tokens_goal_vs_default(2), tokens_goal_vs_default(4)) == (0.80, 0.90)
