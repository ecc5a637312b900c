"""``capacity.profile``: what a profile puts in force, in the gate's rules and on ``/metrics``.

The loading rules (a profile's values, a key written out winning, a bad name refused with its
path) are in ``test_picker_config.py``; here, what the picker does with the result: the rules it
builds and the gauges that say which profile and settings are in force, after a reload too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from picker.config.build import capacity_rules, gate_rules
from picker.config.schema import load_config
from picker.dispatch import Dispatcher
from picker.metrics import PickerMetrics

ISOLATION = {"capacity": {"profile": "isolation", "maxPrefillTokens": 8192},
             "endpoints": [{"address": "10.0.0.1:8000"}]}


def _value(metrics: PickerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_the_isolation_profile_reaches_the_gates_rules() -> None:
    config = load_config(ISOLATION)
    rules = capacity_rules(config)
    assert (rules.growth_room, rules.max_prefill_tokens, rules.ready_reserve) == (True, 8192, True)
    assert gate_rules(config).idle_tenant_reserve == 10.0
    default = capacity_rules(load_config({}))
    assert (default.growth_room, default.max_prefill_tokens, default.ready_reserve) == \
        (False, 0, False)
    assert gate_rules(load_config({})).idle_tenant_reserve == 0.0


def test_metrics_say_which_profile_and_settings_are_in_force_and_follow_a_reload() -> None:
    metrics = PickerMetrics(CollectorRegistry())
    dispatcher = Dispatcher(load_config(ISOLATION), clock=lambda: 100.0, metrics=metrics)
    assert _value(metrics, "fairway_capacity_profile", profile="isolation") == 1
    assert _value(metrics, "fairway_capacity_profile", profile="throughput") == 0
    assert _value(metrics, "fairway_capacity_idle_tenant_reserve_seconds") == 10.0
    assert _value(metrics, "fairway_capacity_growth_room") == 1
    assert _value(metrics, "fairway_capacity_max_prefill_tokens") == 8192  # written out: wins
    assert _value(metrics, "fairway_capacity_ready_reserve") == 1
    assert _value(metrics, "fairway_capacity_reserve_quantile") == 0.9
    assert _value(metrics, "fairway_capacity_reserve_max_share") == 0.15
    assert _value(metrics, "fairway_scheduling_preempt") == 1

    dispatcher.apply_config(load_config({"endpoints": ISOLATION["endpoints"]}))
    assert _value(metrics, "fairway_capacity_profile", profile="isolation") == 0
    assert _value(metrics, "fairway_capacity_profile", profile="throughput") == 1
    assert _value(metrics, "fairway_capacity_idle_tenant_reserve_seconds") == 0.0
    assert _value(metrics, "fairway_capacity_growth_room") == 0
    assert _value(metrics, "fairway_capacity_max_prefill_tokens") == 0
    assert _value(metrics, "fairway_capacity_ready_reserve") == 0
    assert _value(metrics, "fairway_capacity_reserve_quantile") == 0.0
    assert _value(metrics, "fairway_capacity_reserve_max_share") == 1.0
    assert _value(metrics, "fairway_scheduling_preempt") == 0
