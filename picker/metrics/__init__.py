"""The picker's Prometheus metrics: who is being served, who is waiting, and who is owed.

They answer, per tenant and lane: how many requests ended and how (``fairway_requests_total``),
why some were refused or demoted, how many tokens were served, waiting and in flight, how far
each tenant is ahead of its fair share (``fairway_fairness_debt``) and how much of its token
budget is left; per endpoint, how loaded it is; and, per picker, what it runs
(``fairway_build_info``), with which capacity profile (``fairway_capacity_profile``) and
whether it is the one serving (``fairway_leader``, ``fairway_ready``). Everything is on an
injected registry so tests read the values.

Names carry the ``fairway_`` prefix and their unit (seconds, tokens, ratio; ``_total`` on
counters), and pass ``promtool check metrics`` (no type in a name: VTC's counter is exported as
``fairway_virtual_service``). Tenant labels are capped so random tenant ids cannot blow up the
series count: configured tenants (``set_known_tenants``) keep their name, and every other
tenant is

- summed into ``other`` where a sum means something: request counts, token counts, waits and
  latencies (the event metrics, and the queued/running gauges);
- left out where it does not: ``fairway_virtual_service``, ``fairway_fairness_debt`` and the
  ``fairway_budget_*`` gauges are per-tenant positions, and the sum of many tenants' positions
  is no tenant's position.

Folding happens here, on every event metric's ``labels()``, so a caller cannot forget it. A
configured tenant literally named ``other`` shares its series with the unknown tenants. A tenant
dropped from the config on reload keeps its past counter series; its new events go to ``other``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import metadata
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# The ``*_created`` series double every counter for no use here.
disable_created_metrics()

OTHER_TENANT = "other"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

COMMIT_ENV = "FAIRWAY_COMMIT"
"""Environment variable carrying the source commit the image was built from (the
``fairway_build_info`` ``commit`` label; ``unknown`` when unset)."""

ESTIMATE_REASONS = ("meter_unclaimed", "meter_cut", "log_unclaimed", "no_usage",
                    "response_unseen")
"""Why a request was settled on an estimate (``fairway_settlements_estimated_total``)."""

_Metric = TypeVar("_Metric", Counter, Histogram)


def build_labels() -> dict[str, str]:
    """``fairway_build_info``'s labels: the installed package's version, Python's, the commit."""
    try:
        version = metadata.version("fairway")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        version = "unknown"
    return {"version": version, "python_version": platform.python_version(),
            "commit": os.environ.get(COMMIT_ENV) or "unknown"}


CHILDREN_KEPT = 4096
"""Label value combinations a ``TenantCapped`` metric keeps the child of (past that, each is
asked of the metric): more than configured tenants × lanes × outcomes, and a bound on the
memory that tenants not configured (all folded into ``other``) can take."""


class TenantCapped(Generic[_Metric]):
    """A metric whose first label is ``tenant``, folded through the cap on every ``labels()``.

    Folding is idempotent (``other`` folds to ``other``), so callers that already pass
    ``tenant_label(...)`` get the same series. Other attributes reach the wrapped metric.
    """

    def __init__(self, metric: _Metric, fold: Callable[[str], str]) -> None:
        self.metric: _Metric = metric
        self._fold = fold
        self._children: dict[tuple[Any, ...], _Metric] = {}
        """Children by the label values asked for (positional), kept until the fold changes
        (``forget_children``): the requests path asks for the same few on every request, and
        a child kept is a dict look-up where the metric's own ``labels`` takes a lock."""

    def labels(self, *values: Any, **named: Any) -> _Metric:
        """The child for these label values, with the tenant folded."""
        if named:
            if "tenant" in named:
                named["tenant"] = self._fold(str(named["tenant"]))
            return self.metric.labels(**named)
        child = self._children.get(values)
        if child is None:
            child = self.metric.labels(self._fold(str(values[0])), *values[1:])
            if len(self._children) < CHILDREN_KEPT:
                self._children[values] = child
        return child

    def forget_children(self) -> None:
        """The fold changed (the tenants named in the config): children are asked for anew."""
        self._children.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric, name)


class PickerMetrics:
    """Event metrics (counters, histograms) plus a collector for live state (gauges)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._known_tenants: frozenset[str] = frozenset()
        r, fold = self.registry, self.tenant_label
        self.requests = TenantCapped(Counter(
            "fairway_requests", "Requests by final outcome.",
            ["tenant", "lane", "outcome"], registry=r), fold)
        self.rejections = TenantCapped(Counter(
            "fairway_rejections", "Requests refused, by reason.",
            ["tenant", "reason"], registry=r), fold)
        self.demotions = TenantCapped(Counter(
            "fairway_demotions",
            "Requests admitted into a lower lane because their tenant was over budget.",
            ["tenant", "from_lane", "to_lane"], registry=r), fold)
        self.service_tokens = TenantCapped(Counter(
            "fairway_service_tokens", "Tokens served, by kind: prompt (as sent), completion, "
            "and cached (of the prompt, what the engine reported found in its prefix cache).",
            ["tenant", "lane", "kind"], registry=r), fold)
        self.weighted_service = TenantCapped(Counter(
            "fairway_weighted_service", "Weighted service charged (cost units, not ÷ weight).",
            ["tenant", "lane"], registry=r), fold)
        self.queue_wait = TenantCapped(Histogram(
            "fairway_queue_wait_seconds", "Time held in the fair queue.",
            ["tenant", "lane"], buckets=LATENCY_BUCKETS, registry=r), fold)
        self.ttft = TenantCapped(Histogram(
            "fairway_ttft_seconds", "Arrival at the picker to the first response byte.",
            ["tenant", "lane"], buckets=LATENCY_BUCKETS, registry=r), fold)
        self.config_reloads = Counter("fairway_config_reloads", "Config reloads by result.",
                                      ["result"], registry=r)
        self.faults = Counter("fairway_faults", "Faults of the picker's own (bugs) met while "
                              "serving a request, by exception type; each got a clear 500.",
                              ["kind"], registry=r)
        self.peers_refused = Counter(
            "fairway_ext_proc_peers_refused", "ext_proc and access-log streams refused because "
            "their connection is not an authenticated gateway's (--client-auth), by reason.",
            ["reason"], registry=r)
        self.meter_unclaimed = Counter(
            "fairway_meter_unclaimed", "Routed requests whose meter stream never came within "
            "the claim timeout (the gateway's metering filter missing, or the picker far behind): "
            "settled on their estimate, not on usage.", registry=r)
        self.settlements_estimated = Counter(
            "fairway_settlements_estimated", "Requests settled on an estimate of their output "
            "instead of the usage the response carried, by reason: meter_unclaimed (no meter "
            "stream came), meter_cut (the meter stream was reset while the picker was behind "
            "reading it), log_unclaimed (no access log entry came), no_usage (the log entry "
            "carried no count), response_unseen (the gateway shows the picker no response).",
            ["reason"], registry=r)
        for reason in ESTIMATE_REASONS:  # exported at 0 from the start, so alerts see the first
            self.settlements_estimated.labels(reason)
        self.buffered_body_bytes = Gauge(
            "fairway_buffered_body_bytes", "Request body bytes held at once, all streams "
            "(limits.maxBufferedBytes bounds it).", registry=r)
        self.state_up = Gauge(
            "fairway_state_backend_up", "1 while the shared state store (state.backend: redis) "
            "answered within state.maxStaleness, else 0; absent with the memory backend.",
            registry=r)
        self.state_syncs = Counter(
            "fairway_state_syncs", "Exchanges with the shared state store, by result "
            "(ok, error).", ["result"], registry=r)
        self.state_sync_seconds = Histogram(
            "fairway_state_sync_seconds", "Duration of one exchange with the shared state "
            "store (sending this picker's changes and reading everyone's).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r)
        self.state_lease = Gauge(
            "fairway_state_lease_ratio", "The share of every endpoint's KV budget this picker "
            "may hold beside its active-active peers (1 alone).", registry=r)
        self.state_staleness = Gauge(
            "fairway_state_staleness_seconds", "Age of this picker's view of the shared state "
            "(time since its last successful exchange).", registry=r)
        self.capacity_profile = Gauge(
            "fairway_capacity_profile", "1 for the capacity.profile in force (throughput: "
            "work-conserving; isolation: a light tenant's latency first), 0 for the others.",
            ["profile"], registry=r)
        self.capacity_idle_tenant_reserve = Gauge(
            "fairway_capacity_idle_tenant_reserve_seconds", "capacity.idleTenantReserve in "
            "force (the profile's, or written out).", registry=r)
        self.capacity_growth_room = Gauge(
            "fairway_capacity_growth_room", "capacity.growthRoom in force (1 on, 0 off).",
            registry=r)
        self.capacity_max_prefill_tokens = Gauge(
            "fairway_capacity_max_prefill_tokens", "capacity.maxPrefillTokens in force "
            "(0: no bound).", registry=r)
        self.capacity_ready_reserve = Gauge(
            "fairway_capacity_ready_reserve", "capacity.readyReserve in force (1 on, 0 off).",
            registry=r)
        self.capacity_reserve_quantile = Gauge(
            "fairway_capacity_reserve_quantile", "capacity.reserveQuantile in force (0: the "
            "idle-tenant reserve is one request; else sized from a light tenant's rate).",
            registry=r)
        self.capacity_reserve_max_share = Gauge(
            "fairway_capacity_reserve_max_share", "capacity.reserveMaxShare in force (the "
            "share of the pool the rate-sized reserves may keep together).", registry=r)
        self.scheduling_preempt = Gauge(
            "fairway_scheduling_preempt", "scheduling.preempt in force (1 on, 0 off; unset: "
            "the capacity profile's).", registry=r)
        labels = build_labels()
        Gauge("fairway_build_info", "Always 1; the labels say which fairway and Python run.",
              list(labels), registry=r).labels(**labels).set(1)

    def set_capacity(self, profile: str, profiles: Iterable[str], *,
                     idle_tenant_reserve: float, growth_room: bool, max_prefill_tokens: int,
                     ready_reserve: bool, reserve_quantile: float,
                     reserve_max_share: float, preempt: bool = False) -> None:
        """The capacity profile in force (1; the other ``profiles`` 0) and the settings it
        sets, as loaded: a key written out over the profile shows its own value
        (``preempt``: ``scheduling.preempt``)."""
        for name in profiles:
            self.capacity_profile.labels(name).set(1 if name == profile else 0)
        self.capacity_idle_tenant_reserve.set(idle_tenant_reserve)
        self.capacity_growth_room.set(1 if growth_room else 0)
        self.capacity_max_prefill_tokens.set(max_prefill_tokens)
        self.capacity_ready_reserve.set(1 if ready_reserve else 0)
        self.capacity_reserve_quantile.set(reserve_quantile)
        self.capacity_reserve_max_share.set(reserve_max_share)
        self.scheduling_preempt.set(1 if preempt else 0)

    def set_known_tenants(self, tenants: Iterable[str]) -> None:
        """Tenants that get their own label value; all others are counted as ``other``."""
        self._known_tenants = frozenset(tenants)
        for metric in vars(self).values():
            if isinstance(metric, TenantCapped):
                metric.forget_children()

    @property
    def known_tenants(self) -> frozenset[str]:
        """The tenants labelled by name."""
        return self._known_tenants

    def tenant_label(self, tenant: str) -> str:
        """The ``tenant`` label value for ``tenant``: its name if configured, else ``other``."""
        return tenant if tenant in self._known_tenants else OTHER_TENANT

    def tenant_lane(self, tenant: str, lane: str) -> tuple[str, str]:
        """``(tenant label, lane)``, for the metrics labelled by both."""
        return self.tenant_label(tenant), lane

    def add_state_collector(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Register gauges read from ``snapshot()`` at scrape time."""
        self.registry.register(_StateCollector(snapshot, self))

    def add_role_collector(self, leading: Callable[[], bool], ready: Callable[[], bool]) -> None:
        """Register ``fairway_leader`` and ``fairway_ready``, read from the callables at scrape
        time (they run on the metrics server's thread: they must only read).

        ``leading()``: this replica holds the Lease, or no election is configured. ``ready()``:
        its readiness is SERVING (leading, endpoints synced, not draining), i.e. the gateway's
        requests reach a picker that answers them. Until this is called neither is exported.
        """
        self.registry.register(_RoleCollector(leading, ready))


class _RoleCollector(Collector):
    """``fairway_leader`` and ``fairway_ready``: whether this replica is the one serving."""

    def __init__(self, leading: Callable[[], bool], ready: Callable[[], bool]) -> None:
        self._leading = leading
        self._ready = ready

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "fairway_leader", "1 while this replica is the leader (holds the Lease) or no leader "
            "election is configured; 0 on a standby.", value=1 if self._leading() else 0)
        yield GaugeMetricFamily(
            "fairway_ready", "1 while this replica answers the gateway: leader, endpoints "
            "synced, not draining (its gRPC readiness is SERVING); else 0.",
            value=1 if self._ready() else 0)


class _StateCollector(Collector):
    """Gauges computed from the dispatcher's snapshot at each scrape: one pass over each map."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], metrics: PickerMetrics) -> None:
        self._snapshot = snapshot
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self._snapshot()
        # Read once per scrape: a reload mid-scrape must not mix two tenant sets.
        known = self._metrics.known_tenants
        yield _summed(state.get("queued", {}), known, "fairway_queued_requests",
                      "Requests held in the fair queue.")
        yield _summed(state.get("running", {}), known, "fairway_running_requests",
                      "Requests dispatched and not finished.")
        yield _summed(state.get("queued_tokens", {}), known, "fairway_queued_tokens",
                      "Estimated prompt tokens of the requests held in the fair queue.")
        yield _summed(state.get("running_tokens", {}), known, "fairway_running_tokens",
                      "Tokens in flight: prompt plus output so far (or reserved).")
        yield _known_only(state.get("counters", {}), known, "fairway_virtual_service",
                          "VTC's virtual counter, in cost units: weighted service ÷ weight, "
                          "with lifts. Configured tenants only.")
        yield _known_only(state.get("debt", {}), known, "fairway_fairness_debt",
                          "Virtual counter minus the smallest among the lane's backlogged "
                          "tenants: 0 for the most owed, large for a tenant served more than "
                          "its share. Configured tenants only.")
        yield _known_only(state.get("weights", {}), known, "fairway_tenant_weight",
                          "The tenant's configured weight in its lane (its share among the "
                          "lane's backlogged tenants is weight ÷ their sum). Configured tenants "
                          "only.")
        yield from _budgets(state.get("budgets", {}), known)
        yield from _endpoints(state.get("endpoints", []))
        yield CounterMetricFamily(
            "fairway_vtc_faults", "Virtual counters found not finite (an infinite or NaN "
            "charge, or such a value from the shared store) and set back to their lane's floor: "
            "a fault, each one; the lane kept its fair order.",
            value=state.get("counter_faults", 0))


def _summed(values: Mapping[tuple[str, str], float], known: frozenset[str], name: str,
            documentation: str) -> GaugeMetricFamily:
    """A ``{tenant, lane}`` gauge with unknown tenants summed into ``other``."""
    family = GaugeMetricFamily(name, documentation, labels=["tenant", "lane"])
    totals: dict[tuple[str, str], float] = {}
    for (tenant, lane), value in values.items():
        label = (tenant if tenant in known else OTHER_TENANT, lane)
        totals[label] = totals.get(label, 0) + value
    for labels, value in totals.items():
        family.add_metric(list(labels), value)
    return family


def _known_only(values: Mapping[tuple[str, str], float], known: frozenset[str], name: str,
                documentation: str) -> GaugeMetricFamily:
    """A ``{tenant, lane}`` gauge for configured tenants; the rest are left out, not summed."""
    family = GaugeMetricFamily(name, documentation, labels=["tenant", "lane"])
    for (tenant, lane), value in values.items():
        if tenant in known:
            family.add_metric([tenant, lane], value)
    return family


def _budgets(budgets: Mapping[str, Mapping[str, tuple[float, int]]],
             known: frozenset[str]) -> Iterator[GaugeMetricFamily]:
    """Remaining tokens and utilisation of each configured tenant's budget windows."""
    remaining_family = GaugeMetricFamily(
        "fairway_budget_remaining_tokens",
        "Tokens left in the tenant's budget bucket; negative when the bucket is in debt. "
        "Configured tenants only.", labels=["tenant", "window"])
    utilisation_family = GaugeMetricFamily(
        "fairway_budget_utilisation_ratio",
        "Share of the budget bucket used: (capacity − remaining) ÷ capacity. Above 1 when the "
        "bucket is in debt (settled use exceeded the estimate). Configured tenants only.",
        labels=["tenant", "window"])
    # Walk the smaller side: usually the configured tenants, but a snapshot may hold only a few.
    tenants: Iterable[str] = known if len(known) < len(budgets) else budgets
    for tenant in tenants:
        windows = budgets.get(tenant)
        if windows is None or tenant not in known:
            continue
        for window, (remaining, capacity) in windows.items():
            remaining_family.add_metric([tenant, window], remaining)
            if capacity > 0:  # a zero-capacity bucket has no meaningful ratio
                used = max(0.0, (capacity - remaining) / capacity)
                utilisation_family.add_metric([tenant, window], used)
    yield remaining_family
    yield utilisation_family


def _endpoints(endpoints: Iterable[Any]) -> Iterator[GaugeMetricFamily]:
    """Per-endpoint load: the picker's own in-flight tokens and what the engine last reported."""
    inflight = GaugeMetricFamily("fairway_endpoint_inflight_tokens",
                                 "Tokens the picker has in flight on each endpoint.",
                                 labels=["endpoint"])
    prefill = GaugeMetricFamily(
        "fairway_endpoint_prefill_tokens",
        "Prompt tokens of the streams sent to each endpoint that the picker counts as not yet "
        "computed: no first token back (on the access-log path: no read of the engine has "
        "shown them out of its waiting queue). What capacity.maxPrefillTokens and readyReserve "
        "judge.", labels=["endpoint"])
    waiting = GaugeMetricFamily("fairway_endpoint_waiting_requests",
                                "Scraped vllm:num_requests_waiting.", labels=["endpoint"])
    kv = GaugeMetricFamily("fairway_endpoint_kv_usage_ratio",
                           "Scraped vllm:kv_cache_usage_perc (0..1).", labels=["endpoint"])
    ejected = GaugeMetricFamily("fairway_endpoint_ejected",
                                "1 while the endpoint is ejected for failing (or being probed "
                                "after an ejection), else 0.", labels=["endpoint"])
    for endpoint in endpoints:
        inflight.add_metric([endpoint.address], endpoint.inflight_tokens)
        prefill.add_metric([endpoint.address], endpoint.prefill_tokens)
        health = getattr(endpoint, "health", None)
        ejected.add_metric([endpoint.address],
                           float(health is not None and health.ejected_until is not None))
        if endpoint.waiting is not None:
            waiting.add_metric([endpoint.address], endpoint.waiting)
        if endpoint.kv_usage is not None:
            kv.add_metric([endpoint.address], endpoint.kv_usage)
    yield from (inflight, prefill, waiting, kv, ejected)
