"""The operator's settings: which pool, where its configs live, and where its picker answers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """Settings of one operator process, which serves one pool (``python -m fairway_operator``
    builds them from flags and ``FAIRWAY_*`` environment variables)."""

    pool: str
    """Name of the InferencePool: only TenantPolicies whose ``spec.poolRef.name`` is this are
    rendered."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty: all namespaces. The pool's policies, its base ConfigMap, the
    Secrets they reference and the output ConfigMap are all in the same namespace; each watched
    namespace is rendered on its own."""
    base_configmap: str = "fairway-base"
    """ConfigMap holding the picker config without tenants (lanes, cost, capacity, queue,
    tenancy, tenantDefaults…)."""
    base_key: str = "base.yaml"
    """Key of the base ConfigMap that holds the YAML."""
    output_configmap: str = "fairway-picker-config"
    """ConfigMap the rendered picker config is written to (the picker watches it)."""
    output_key: str = "picker.yaml"
    """Key of the output ConfigMap that holds the YAML."""
    admin_address: str | None = None
    """``host:port`` of the picker's admin API (``fairway.v1.Admin``); None: no live figures in
    the policies' status."""
    status_interval: float = 10.0
    """Seconds between two reads of the live figures (share, queued, running, budgets) into
    each applied policy's status."""
    admin_token_file: Path | None = None
    """A file with the bearer token the picker's admin API asks for (the chart's Secret,
    mounted); read again at each call, so a rotated Secret is followed."""
    admin_timeout: float = 2.0
    """Seconds an admin API call may take before the picker counts as unreachable."""
    kube_timeout: float = 10.0
    """Seconds a Kubernetes API call of the reconciler may take (then it is retried)."""
    whatif_minutes: float = 15.0
    """A dry-run policy replays the picker's requests of the last this many minutes."""
    whatif_max_records: int = 20_000
    """... at most this many (the latest)."""
    whatif_timeout: float = 120.0
    """Seconds one dry run's replay (both configs) may take (the default window, 20,000
    requests over 15 minutes on 2 endpoints, took 38 s of CPU on a shared 2-core machine)."""
    whatif_min_requests: int = 50
    """Fewer requests in the window: the status says it is too short instead of predicting."""
    whatif_min_seconds: float = 60.0
    """Arrivals spanning less: too short as well."""
    whatif_interval: float = 300.0
    """Seconds a dry run's prediction stands before it is replayed on newer traffic (a change
    of its spec or of the live config replays it at once)."""

    def __post_init__(self) -> None:
        if not self.pool:
            raise ValueError("the pool name must not be empty")
        if self.status_interval <= 0:
            raise ValueError("the status interval must be > 0")
        if not (self.whatif_minutes > 0 and self.whatif_timeout > 0
                and self.whatif_interval > 0 and self.whatif_min_seconds >= 0
                and self.whatif_max_records >= 1 and self.whatif_min_requests >= 1):
            raise ValueError("the what-if bounds must be above 0 (records and requests: 1)")
        if self.admin_address is not None and ":" not in self.admin_address:
            raise ValueError(f"the admin address must be host:port, got {self.admin_address!r}")
