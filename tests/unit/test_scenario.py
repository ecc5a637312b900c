"""Scenario loading: good files load with defaults; each bad file fails naming the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.errors import ConfigError
from picker.sim.scenario import Lane, Phase, Scenario, load_scenario
from tests.expect import expected_message

FIXTURES = Path(__file__).parent.parent / "fixtures" / "scenarios"
BAD = sorted((FIXTURES / "bad").glob("*.yaml"))



@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_scenario_is_rejected_with_its_path(path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert expected_message(path) in str(caught.value)


def test_there_is_a_fixture_per_failure() -> None:
    assert len(BAD) >= 20


def test_good_scenario_loads_with_defaults() -> None:
    scenario = load_scenario(FIXTURES / "two_backlogged.yaml")
    assert isinstance(scenario, Scenario)
    assert scenario.steps == 20000
    assert scenario.kv_budget_tokens == 8192
    assert scenario.cost.prefill_weight == 1.0 and scenario.cost.decode_weight == 2.0
    assert scenario.lanes == (Lane("default", 0.0),)
    assert scenario.rpm_window_steps == 2000
    a = scenario.tenants[0]
    assert (a.name, a.weight, a.lane) == ("a", 1.0, None)
    assert a.prompt_tokens == (64, 512) and a.output_tokens == (32, 384)
    assert a.arrivals == (Phase(backlog=50),)


def test_issue_example_scenario_loads() -> None:
    scenario = load_scenario({
        "steps": 20000,
        "kv_budget_tokens": 8192,
        "cost": {"prefill_weight": 1, "decode_weight": 2},
        "seed": 0,
        "rpm_window_steps": 2000,
        "lanes": [{"name": "interactive"}, {"name": "batch", "min_share": 0.2}],
        "tenants": [{
            "name": "a", "weight": 1, "lane": "interactive",
            "prompt_tokens": [64, 512], "output_tokens": [32, 384],
            "arrivals": [{"until": 3000, "rate": 0.025}, {"until": 5000, "rate": 0},
                         {"backlog": 50}],
        }],
    })
    assert [lane.name for lane in scenario.lanes] == ["interactive", "batch"]
    assert scenario.lanes[1].min_share == 0.2
    assert scenario.tenants[0].arrivals[2].backlog == 50


def test_scenario_is_frozen() -> None:
    scenario = load_scenario(FIXTURES / "two_backlogged.yaml")
    with pytest.raises(AttributeError):
        scenario.steps = 5  # type: ignore[misc]


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "nope.yaml")
