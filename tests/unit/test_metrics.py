"""The picker's metrics: snapshot gauges, the demotion counter, and the tenant-label cap."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from picker.metrics import OTHER_TENANT, PickerMetrics

KNOWN = ("acme", "globex")


def _metrics(snapshot: dict[str, Any] | None = None) -> PickerMetrics:
    metrics = PickerMetrics(CollectorRegistry())
    metrics.set_known_tenants(KNOWN)
    if snapshot is not None:
        metrics.add_state_collector(lambda: snapshot)
    return metrics


def _value(metrics: PickerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _snapshot(**extra: Any) -> dict[str, Any]:
    return {"queued": {}, "running": {}, "counters": {}, "endpoints": [], **extra}


def _tenant_values(metrics: PickerMetrics) -> set[str]:
    return {sample.labels["tenant"] for family in metrics.registry.collect()
            for sample in family.samples if "tenant" in sample.labels}


def test_new_gauges_read_from_the_snapshot() -> None:
    m = _metrics(_snapshot(
        queued_tokens={("acme", "interactive"): 1200},
        running_tokens={("acme", "interactive"): 3400, ("globex", "batch"): 50},
        debt={("acme", "interactive"): 0.0, ("globex", "interactive"): 812.5},
        budgets={"acme": {"burst": (250.0, 1000), "sustained": (9000.0, 10000)}},
    ))
    assert _value(m, "fairway_queued_tokens", tenant="acme", lane="interactive") == 1200
    assert _value(m, "fairway_running_tokens", tenant="acme", lane="interactive") == 3400
    assert _value(m, "fairway_running_tokens", tenant="globex", lane="batch") == 50
    assert _value(m, "fairway_fairness_debt", tenant="acme", lane="interactive") == 0.0
    assert _value(m, "fairway_fairness_debt", tenant="globex", lane="interactive") == 812.5
    assert _value(m, "fairway_budget_remaining_tokens", tenant="acme", window="burst") == 250.0
    assert _value(m, "fairway_budget_utilisation_ratio", tenant="acme",
                  window="burst") == pytest.approx(0.75)
    assert _value(m, "fairway_budget_utilisation_ratio", tenant="acme",
                  window="sustained") == pytest.approx(0.1)


def test_existing_gauges_still_read_from_the_snapshot() -> None:
    endpoint = SimpleNamespace(address="10.0.0.1:8000", inflight_tokens=900, waiting=3,
                               kv_usage=0.4, prefill_tokens=700)
    m = _metrics(_snapshot(queued={("acme", "interactive"): 2},
                           running={("globex", "batch"): 1},
                           counters={("acme", "interactive"): 17.5},
                           endpoints=[endpoint]))
    assert _value(m, "fairway_queued_requests", tenant="acme", lane="interactive") == 2
    assert _value(m, "fairway_running_requests", tenant="globex", lane="batch") == 1
    assert _value(m, "fairway_virtual_service", tenant="acme", lane="interactive") == 17.5
    assert _value(m, "fairway_endpoint_inflight_tokens", endpoint="10.0.0.1:8000") == 900
    assert _value(m, "fairway_endpoint_waiting_requests", endpoint="10.0.0.1:8000") == 3
    assert _value(m, "fairway_endpoint_prefill_tokens", endpoint="10.0.0.1:8000") == 700
    assert _value(m, "fairway_endpoint_kv_usage_ratio", endpoint="10.0.0.1:8000") == 0.4


def test_an_older_snapshot_without_the_new_keys_still_scrapes() -> None:
    m = _metrics(_snapshot(queued={("acme", "interactive"): 1}))
    assert _value(m, "fairway_queued_requests", tenant="acme", lane="interactive") == 1
    assert _value(m, "fairway_queued_tokens", tenant="acme", lane="interactive") is None


def test_unknown_tenants_are_summed_into_other_for_counts_and_tokens() -> None:
    lane = "interactive"
    m = _metrics(_snapshot(
        queued={("acme", lane): 1, ("u1", lane): 2, ("u2", lane): 3},
        running={("u1", lane): 4, ("u2", lane): 5},
        queued_tokens={("u1", lane): 100, ("u2", lane): 250},
        running_tokens={("acme", lane): 7, ("u1", lane): 1000, ("u2", "batch"): 30},
    ))
    assert _value(m, "fairway_queued_requests", tenant="acme", lane=lane) == 1
    assert _value(m, "fairway_queued_requests", tenant=OTHER_TENANT, lane=lane) == 5
    assert _value(m, "fairway_running_requests", tenant=OTHER_TENANT, lane=lane) == 9
    assert _value(m, "fairway_queued_tokens", tenant=OTHER_TENANT, lane=lane) == 350
    assert _value(m, "fairway_running_tokens", tenant=OTHER_TENANT, lane=lane) == 1000
    assert _value(m, "fairway_running_tokens", tenant=OTHER_TENANT, lane="batch") == 30
    assert _value(m, "fairway_running_tokens", tenant="acme", lane=lane) == 7
    assert _value(m, "fairway_queued_tokens", tenant="u1", lane=lane) is None


def test_unknown_tenants_are_left_out_of_counters_debt_and_budgets() -> None:
    lane = "interactive"
    m = _metrics(_snapshot(
        counters={("acme", lane): 10.0, ("u1", lane): 20.0, (OTHER_TENANT, lane): 5.0},
        debt={("acme", lane): 0.0, ("u1", lane): 10.0},
        budgets={"acme": {"burst": (10.0, 100)}, "u1": {"burst": (1.0, 100)}},
    ))
    for name in ("fairway_virtual_service", "fairway_fairness_debt"):
        assert _value(m, name, tenant="acme", lane=lane) is not None
        assert _value(m, name, tenant=OTHER_TENANT, lane=lane) is None
        assert _value(m, name, tenant="u1", lane=lane) is None
    for name in ("fairway_budget_remaining_tokens", "fairway_budget_utilisation_ratio"):
        assert _value(m, name, tenant="acme", window="burst") is not None
        assert _value(m, name, tenant=OTHER_TENANT, window="burst") is None
        assert _value(m, name, tenant="u1", window="burst") is None


def test_a_bucket_in_debt_is_more_than_fully_used() -> None:
    m = _metrics(_snapshot(budgets={"acme": {"burst": (-500.0, 1000), "sustained": (0.0, 0)}}))
    assert _value(m, "fairway_budget_remaining_tokens", tenant="acme", window="burst") == -500
    assert _value(m, "fairway_budget_utilisation_ratio", tenant="acme",
                  window="burst") == pytest.approx(1.5)
    # Zero capacity has no ratio; the remaining tokens are still reported.
    assert _value(m, "fairway_budget_utilisation_ratio", tenant="acme",
                  window="sustained") is None
    assert _value(m, "fairway_budget_remaining_tokens", tenant="acme", window="sustained") == 0


def test_demotions_count_by_tenant_and_lanes() -> None:
    m = _metrics()
    m.demotions.labels("acme", "interactive", "batch").inc()
    m.demotions.labels("acme", "interactive", "batch").inc()
    m.demotions.labels(tenant="stranger", from_lane="interactive", to_lane="batch").inc()
    assert _value(m, "fairway_demotions_total", tenant="acme", from_lane="interactive",
                  to_lane="batch") == 2
    assert _value(m, "fairway_demotions_total", tenant=OTHER_TENANT, from_lane="interactive",
                  to_lane="batch") == 1


def test_event_metrics_fold_raw_tenant_ids_and_accept_folded_labels() -> None:
    m = _metrics()
    m.requests.labels("stranger", "interactive", "ok").inc()
    m.requests.labels(m.tenant_label("stranger"), "interactive", "ok").inc()
    m.requests.labels(*m.tenant_lane("acme", "interactive"), "ok").inc()
    assert m.tenant_lane("stranger", "batch") == (OTHER_TENANT, "batch")
    assert _value(m, "fairway_requests_total", tenant=OTHER_TENANT, lane="interactive",
                  outcome="ok") == 2
    assert _value(m, "fairway_requests_total", tenant="acme", lane="interactive",
                  outcome="ok") == 1
    assert _tenant_values(m) == {"acme", OTHER_TENANT}


def test_ten_thousand_random_tenants_stay_within_the_label_cap() -> None:
    tenants = [str(uuid.uuid4()) for _ in range(10_000)]
    lane = "interactive"
    snapshot = _snapshot(
        queued={(t, lane): 1 for t in tenants}, running={(t, lane): 1 for t in tenants},
        counters={(t, lane): 1.0 for t in tenants}, queued_tokens={(t, lane): 10 for t in tenants},
        running_tokens={(t, lane): 10 for t in tenants}, debt={(t, lane): 1.0 for t in tenants},
        budgets={t: {"burst": (1.0, 10)} for t in tenants})
    m = _metrics(snapshot)
    for tenant in tenants:
        m.requests.labels(tenant, lane, "ok").inc()
        m.rejections.labels(tenant, "over_budget").inc()
        m.service_tokens.labels(tenant, lane, "prompt").inc(3)
        m.ttft.labels(tenant, lane).observe(0.1)
        m.demotions.labels(tenant, lane, "batch").inc()
    assert len(_tenant_values(m)) <= len(KNOWN) + 1
    total = sum(sample.value for family in m.registry.collect()
                if family.name == "fairway_requests" for sample in family.samples
                if sample.name == "fairway_requests_total")
    assert total == 10_000
    assert _value(m, "fairway_queued_tokens", tenant=OTHER_TENANT, lane=lane) == 100_000


def test_configured_weights_are_exported_per_lane() -> None:
    registry = CollectorRegistry()
    metrics = PickerMetrics(registry)
    metrics.set_known_tenants(["a", "b"])
    metrics.add_state_collector(lambda: {
        "queued": {}, "running": {}, "counters": {}, "endpoints": [],
        "weights": {("a", "online"): 2.0, ("b", "batch"): 1.0, ("stranger", "online"): 9.0}})
    assert registry.get_sample_value("fairway_tenant_weight",
                                     {"tenant": "a", "lane": "online"}) == 2.0
    assert registry.get_sample_value("fairway_tenant_weight",
                                     {"tenant": "b", "lane": "batch"}) == 1.0
    assert registry.get_sample_value("fairway_tenant_weight",
                                     {"tenant": "stranger", "lane": "online"}) is None


def test_a_kept_child_follows_the_tenants_named_anew() -> None:
    """A child kept for a tenant's labels counts where ``labels`` would put it: by name while the
    tenant is configured, into ``other`` once it is not, and by name again after."""
    metrics = PickerMetrics(CollectorRegistry())
    metrics.set_known_tenants(["a"])
    metrics.requests.labels("a", "default", "ok").inc()
    metrics.requests.labels("a", "default", "ok").inc()
    metrics.set_known_tenants(["b"])
    metrics.requests.labels("a", "default", "ok").inc()
    metrics.set_known_tenants(["a", "b"])
    metrics.requests.labels("a", "default", "ok").inc()
    labels = {"lane": "default", "outcome": "ok"}
    assert _value(metrics, "fairway_requests_total", tenant="a", **labels) == 3
    assert _value(metrics, "fairway_requests_total", tenant="other", **labels) == 1


def test_children_kept_are_bounded_and_past_the_bound_still_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import picker.metrics as module
    monkeypatch.setattr(module, "CHILDREN_KEPT", 2)
    metrics = PickerMetrics(CollectorRegistry())
    metrics.set_known_tenants([])
    for i in range(5):
        metrics.requests.labels(f"stranger-{i}", "default", "ok").inc()
    assert len(metrics.requests._children) == 2
    assert _value(metrics, "fairway_requests_total", tenant="other", lane="default",
                  outcome="ok") == 5
