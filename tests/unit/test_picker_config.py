"""The picker config: the good example loads; each bad file fails naming the bad field; the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.config.__main__ import main
from picker.config.schema import (
    Capacity,
    Endpoint,
    Lane,
    PickerConfig,
    Tenant,
    load_config,
)
from picker.errors import ConfigError
from tests.expect import expected_message

FIXTURES = Path(__file__).parent.parent / "fixtures" / "config"
GOOD = FIXTURES / "good.yaml"
BAD = sorted((FIXTURES / "bad").glob("*.yaml"))



def test_good_config_loads_with_its_values() -> None:
    config = load_config(GOOD)
    assert isinstance(config, PickerConfig)
    assert config.tenancy.header == "x-gateway-inference-fairness-id"
    assert config.tenancy.also_accept == ("x-llm-d-inference-fairness-id",)
    assert config.tenancy.default_tenant == "anonymous"
    assert config.scheduling.policy == "vtc"
    assert (config.cost.prefill_weight, config.cost.decode_weight) == (1.0, 2.0)
    assert config.lanes == (Lane("interactive", 0.0, 0), Lane("batch", 0.1, 10))
    assert config.queue.max_queued == 10000
    assert config.queue.max_wait == 60.0
    assert config.capacity.kv_budget_tokens == "auto"
    assert config.capacity.scrape_interval == pytest.approx(0.05)
    assert config.capacity.metrics_stale_after == 1.0
    assert config.endpoints == (Endpoint("10.0.0.7:8000"),
                                Endpoint("vllm-1.pool.svc:8000", 65536))
    assert config.tenants == (Tenant("team-a", 2.0, "interactive"), Tenant("team-b", 1.0, None),
                              Tenant("nightly", 0.5, "batch"))
    assert config.tenant("nightly") == Tenant("nightly", 0.5, "batch")
    assert config.tenant("nobody") is None


def test_empty_mapping_gives_the_defaults() -> None:
    config = load_config({})
    assert config == PickerConfig()
    assert config.lanes == (Lane("default"),)
    assert config.capacity == Capacity()
    assert config.endpoints == () and config.tenants == ()


@pytest.mark.parametrize(("text", "seconds"),
                         [("250ms", 0.25), ("60s", 60.0), ("5m", 300.0), ("24h", 86400.0),
                          ("1d", 86400.0), ("1.5s", 1.5), ("30", 30.0)])
def test_durations_are_read_in_seconds(text: str, seconds: float) -> None:
    value: str | int = int(text) if text.isdigit() else text
    config = load_config({"queue": {"maxWait": value}})
    assert config.queue.max_wait == pytest.approx(seconds)


def test_kv_budget_tokens_takes_an_integer() -> None:
    assert load_config({"capacity": {"kvBudgetTokens": 4096}}).capacity.kv_budget_tokens == 4096


def test_capacity_profile_sets_the_four_isolation_settings() -> None:
    throughput = load_config({}).capacity
    assert throughput.profile == "throughput"
    assert (throughput.idle_tenant_reserve, throughput.growth_room, throughput.max_prefill_tokens,
            throughput.ready_reserve) == (0.0, False, 0, False)
    isolation = load_config({"capacity": {"profile": "isolation"}}).capacity
    assert (isolation.idle_tenant_reserve, isolation.growth_room, isolation.max_prefill_tokens,
            isolation.ready_reserve) == (10.0, True, 4096, True)


def test_a_key_written_out_wins_over_the_profile() -> None:
    capacity = load_config({"capacity": {"profile": "isolation", "maxPrefillTokens": 8192,
                                         "growthRoom": False}}).capacity
    assert (capacity.idle_tenant_reserve, capacity.growth_room, capacity.max_prefill_tokens,
            capacity.ready_reserve) == (10.0, False, 8192, True)
    # and under the default profile, as before profiles existed
    capacity = load_config({"capacity": {"idleTenantReserve": "2s"}}).capacity
    assert (capacity.profile, capacity.idle_tenant_reserve, capacity.growth_room) == \
        ("throughput", 2.0, False)


def test_the_profiles_ready_reserve_goes_with_a_reserve_written_out_as_none() -> None:
    # idleTenantReserve: 0s leaves the ready reserve nothing to place: off, not an error the
    # user did not write (written out, readyReserve: true is refused: a bad fixture).
    capacity = load_config({"capacity": {"profile": "isolation",
                                         "idleTenantReserve": "0s"}}).capacity
    assert (capacity.idle_tenant_reserve, capacity.ready_reserve, capacity.growth_room) == \
        (0.0, False, True)


def test_bad_fixtures_cover_every_kind_of_failure() -> None:
    assert len(BAD) >= 30


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_config_is_rejected_with_its_path(path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert expected_message(path) in str(caught.value)


def test_config_error_carries_the_path_separately() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"tenants": [{"id": "a"}, {"id": "b", "weight": -1}]})
    assert caught.value.path == "tenants[1].weight"
    assert caught.value.message == "must be >= 0.001"


def test_missing_file_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(FIXTURES / "no-such-file.yaml")


# -- the CLI --

def test_check_of_a_good_file_exits_0_with_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(GOOD)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == (f"{GOOD}: ok (3 tenants, 2 lanes, 2 endpoints, policy vtc)")
    assert err == ""


CLI_BAD = [FIXTURES / "bad" / f"{name}.yaml" for name in
           ("unknown_tenant_key", "bad_duration_unit", "duplicate_tenant", "unknown_tenant_lane",
            "endpoint_without_port", "policy_unknown", "invalid_yaml")]


@pytest.mark.parametrize("path", CLI_BAD, ids=lambda p: p.stem)
def test_check_of_a_bad_file_exits_1_naming_the_path(path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"{path}: ")
    assert expected_message(path) in err


def test_check_without_a_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["check"])
    assert caught.value.code == 2


def test_the_slow_scrape_cadence_stays_between_the_fast_one_and_half_the_staleness() -> None:
    def cadence(**capacity: str) -> float:
        return load_config({"capacity": capacity}).capacity.slow_scrape_cadence
    assert cadence() == 0.5
    assert cadence(scrapeInterval="1s", metricsStaleAfter="5s") == 1.0  # never below the fast
    assert cadence(metricsStaleAfter="600ms") == 0.3  # read before the figures go stale
    assert cadence(slowScrapeInterval="2s", metricsStaleAfter="10s") == 2.0
