"""The picker's own identity and role metrics, and the naming rules ``promtool`` enforces.

``fairway_build_info`` says which fairway runs; ``fairway_leader`` and ``fairway_ready`` say
whether this replica is the one the gateway reaches (the "no picker serving" alert reads them).
The live check, ``promtool check metrics`` against a picker that served traffic through real
Envoy, is ``tests/integration/test_observability.py::test_live_metrics_pass_promtool``.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from picker.metrics import COMMIT_ENV, PickerMetrics, build_labels


def _all_families(metrics: PickerMetrics) -> str:
    """The exposition with every family the picker has, each with a sample."""
    endpoint = SimpleNamespace(address="10.0.0.1:8000", inflight_tokens=9, waiting=1,
                               kv_usage=0.5, prefill_tokens=3)
    state = {"queued": {("a", "l"): 1}, "running": {("a", "l"): 1},
             "queued_tokens": {("a", "l"): 1}, "running_tokens": {("a", "l"): 1},
             "counters": {("a", "l"): 1.0}, "debt": {("a", "l"): 0.0},
             "weights": {("a", "l"): 1.0}, "budgets": {"a": {"burst": (1.0, 2)}},
             "endpoints": [endpoint]}
    metrics.set_known_tenants(["a"])
    metrics.add_state_collector(lambda: state)
    metrics.add_role_collector(lambda: True, lambda: True)
    metrics.requests.labels("a", "l", "ok").inc()
    metrics.rejections.labels("a", "queue_full").inc()
    metrics.demotions.labels("a", "l", "m").inc()
    metrics.service_tokens.labels("a", "l", "prompt").inc()
    metrics.weighted_service.labels("a", "l").inc()
    metrics.queue_wait.labels("a", "l").observe(0.1)
    metrics.ttft.labels("a", "l").observe(0.1)
    metrics.config_reloads.labels("success").inc()
    return generate_latest(metrics.registry).decode()


def test_build_info_names_the_version_python_and_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMMIT_ENV, "0123abc")
    metrics = PickerMetrics(CollectorRegistry())
    labels = {"version": importlib.metadata.version("fairway"),
              "python_version": platform.python_version(), "commit": "0123abc"}
    assert metrics.registry.get_sample_value("fairway_build_info", labels) == 1
    monkeypatch.delenv(COMMIT_ENV)
    assert build_labels()["commit"] == "unknown"


def test_leader_and_ready_follow_the_replicas_state() -> None:
    metrics = PickerMetrics(CollectorRegistry())
    state = {"leading": False, "ready": False}
    assert metrics.registry.get_sample_value("fairway_leader") is None  # until registered
    metrics.add_role_collector(lambda: state["leading"], lambda: state["ready"])
    value = metrics.registry.get_sample_value
    assert (value("fairway_leader"), value("fairway_ready")) == (0, 0)
    state["leading"] = True  # leads, endpoints not yet synced
    assert (value("fairway_leader"), value("fairway_ready")) == (1, 0)
    state["ready"] = True
    assert (value("fairway_leader"), value("fairway_ready")) == (1, 1)


# promtool's lint (client_golang's promlint), the rules a name can break
_TYPES = ("counter", "gauge", "histogram", "summary")


def test_every_family_follows_promtools_naming_rules() -> None:
    text = _all_families(PickerMetrics(CollectorRegistry()))
    families = list(text_string_to_metric_families(text))
    assert len(families) >= 23
    for family in families:
        name = family.name
        full = f"{name}_total" if family.type == "counter" else name
        assert re.fullmatch(r"fairway_[a-z0-9_]+", name), name
        assert not any(kind in full.split("_") for kind in _TYPES), \
            f"{full}: a metric name should not include its type"
        assert (family.type == "counter") == full.endswith("_total"), full
        assert family.documentation, f"{full} has no HELP"
        for unit in ("milliseconds", "_ms", "percent", "bytes_ratio"):
            assert unit not in full, f"{full}: use base units (seconds, ratio)"
    names = {family.name for family in families}
    assert {"fairway_virtual_service", "fairway_build_info", "fairway_leader",
            "fairway_ready"} <= names
    assert "fairway_virtual_counter" not in names
