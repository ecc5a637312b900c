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

    def __post_init__(self) -> None:
        if not self.pool:
            raise ValueError("the pool name must not be empty")
        if self.status_interval <= 0:
            raise ValueError("the status interval must be > 0")
        if self.admin_address is not None and ":" not in self.admin_address:
            raise ValueError(f"the admin address must be host:port, got {self.admin_address!r}")
