"""The picker's Prometheus metrics, on an injected registry so tests read the values.

Names carry the ``fairway_`` prefix and their unit. Tenant labels are capped: configured tenants
by name, every other tenant as ``other``, so random tenant ids cannot blow up the series count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# The ``*_created`` series double every counter for no use here.
disable_created_metrics()

OTHER_TENANT = "other"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PickerMetrics:
    """Event metrics (counters, histograms) plus a collector for live state (gauges)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._known_tenants: frozenset[str] = frozenset()
        r = self.registry
        self.requests = Counter("fairway_requests", "Requests by final outcome.",
                                ["tenant", "lane", "outcome"], registry=r)
        self.rejections = Counter("fairway_rejections", "Requests refused, by reason.",
                                  ["tenant", "reason"], registry=r)
        self.service_tokens = Counter("fairway_service_tokens", "Tokens served, by kind.",
                                      ["tenant", "lane", "kind"], registry=r)
        self.weighted_service = Counter(
            "fairway_weighted_service", "Weighted service charged (cost units, not ÷ weight).",
            ["tenant", "lane"], registry=r)
        self.queue_wait = Histogram("fairway_queue_wait_seconds", "Time held in the fair queue.",
                                    ["tenant", "lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("fairway_ttft_seconds",
                              "Arrival at the picker to the first response byte.",
                              ["tenant", "lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.config_reloads = Counter("fairway_config_reloads", "Config reloads by result.",
                                      ["result"], registry=r)

    def set_known_tenants(self, tenants: Iterable[str]) -> None:
        """Tenants that get their own label value; all others are counted as ``other``."""
        self._known_tenants = frozenset(tenants)

    def tenant_label(self, tenant: str) -> str:
        return tenant if tenant in self._known_tenants else OTHER_TENANT

    def add_state_collector(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Register gauges read from ``snapshot()`` at scrape time."""
        self.registry.register(_StateCollector(snapshot, self.tenant_label))


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]],
                 tenant_label: Callable[[str], str]) -> None:
        self._snapshot = snapshot
        self._tenant_label = tenant_label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._snapshot()
        queued = GaugeMetricFamily("fairway_queued_requests", "Requests held in the fair queue.",
                                   labels=["tenant", "lane"])
        running = GaugeMetricFamily("fairway_running_requests",
                                    "Requests dispatched and not finished.",
                                    labels=["tenant", "lane"])
        counter = GaugeMetricFamily("fairway_virtual_counter",
                                    "VTC counter: weighted service ÷ weight, with lifts.",
                                    labels=["tenant", "lane"])
        for family, key in ((queued, "queued"), (running, "running")):
            totals: dict[tuple[str, str], float] = {}
            for (tenant, lane), value in state[key].items():
                label = (self._tenant_label(tenant), lane)
                totals[label] = totals.get(label, 0) + value
            for labels, value in totals.items():
                family.add_metric(list(labels), value)
        for (tenant, lane), value in state["counters"].items():
            if self._tenant_label(tenant) == tenant:
                counter.add_metric([tenant, lane], value)
        inflight = GaugeMetricFamily("fairway_endpoint_inflight_tokens",
                                     "Tokens the picker has in flight on each endpoint.",
                                     labels=["endpoint"])
        waiting = GaugeMetricFamily("fairway_endpoint_waiting_requests",
                                    "Scraped vllm:num_requests_waiting.", labels=["endpoint"])
        kv = GaugeMetricFamily("fairway_endpoint_kv_usage_ratio",
                               "Scraped vllm:kv_cache_usage_perc (0..1).", labels=["endpoint"])
        for endpoint in state["endpoints"]:
            inflight.add_metric([endpoint.address], endpoint.inflight_tokens)
            if endpoint.waiting is not None:
                waiting.add_metric([endpoint.address], endpoint.waiting)
            if endpoint.kv_usage is not None:
                kv.add_metric([endpoint.address], endpoint.kv_usage)
        yield from (queued, running, counter, inflight, waiting, kv)
