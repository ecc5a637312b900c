"""The picker's configuration: what the operator writes and the picker reads.

Keys mirror the ``TenantPolicy`` spec (camelCase, as Kubernetes does). Process settings (ports,
paths) are flags, not config. ``python -m picker.config check FILE`` validates a file with this
same code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from picker.config.strict import load, load_yaml_file, require_known, require_unique
from picker.errors import ConfigError

_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


def _camel(name: str, **rules: object) -> dict:
    parts = name.split("_")
    return {"key": parts[0] + "".join(p.title() for p in parts[1:]), **rules}


@dataclass(frozen=True)
class Tenancy:
    """How a request's tenant is found."""

    header: str = "x-gateway-inference-fairness-id"
    """Trusted header the gateway sets to the caller's tenant id."""
    also_accept: tuple[str, ...] = field(default=("x-llm-d-inference-fairness-id",),
                                         metadata=_camel("also_accept"))
    """Further trusted headers, tried in order when ``header`` is absent."""
    default_tenant: str = field(default="anonymous", metadata=_camel("default_tenant"))
    """Tenant of requests that carry none of the headers."""


@dataclass(frozen=True)
class Cost:
    """Weighted service: what a tenant is charged for its tokens."""

    prefill_weight: float = field(default=1.0, metadata=_camel("prefill_weight", ge=0))
    """``w_p``: per prompt token, charged at dispatch."""
    decode_weight: float = field(default=2.0, metadata=_camel("decode_weight", ge=0))
    """``w_q``: per output token, charged as it streams back."""
    context_beta: float = field(default=0.0, metadata=_camel("context_beta", ge=0))
    """``β``: extra charge per output token per token of context (0: linear cost)."""
    charge_cached_prompt: bool = field(default=True, metadata=_camel("charge_cached_prompt"))
    """False: prompt tokens the engine served from its prefix cache are not charged."""


@dataclass(frozen=True)
class Lane:
    """A priority lane; the list order is the priority order, highest first."""

    name: str = field(metadata={"min_length": 1})
    min_share: float = field(default=0.0, metadata=_camel("min_share", ge=0, lt=1))
    """Fraction of service the lane gets at least while backlogged (0: strict priority)."""
    engine_priority: int | None = field(default=None, metadata=_camel("engine_priority"))
    """vLLM request ``priority`` for this lane's requests (lower runs first); unset: untouched."""


@dataclass(frozen=True)
class Scheduling:
    """Which fairness policy orders the queue."""

    policy: Literal["vtc", "lcf", "fcfs"] = "vtc"
    """``vtc``: fair queueing, requests held until an endpoint has room. ``lcf``: VTC without the
    lift (for comparison). ``fcfs``: pass-through, every request dispatched at once (what a gateway
    without fairness does)."""


@dataclass(frozen=True)
class Queue:
    """Limits of the fair queue."""

    max_queued: int = field(default=10000, metadata=_camel("max_queued", ge=1))
    """Requests held at once, all tenants; beyond it new requests get 429."""
    max_wait: float = field(default=60.0, metadata=_camel("max_wait", gt=0, duration=True))
    """Longest a request may wait for its turn; then 503 with Retry-After."""


@dataclass(frozen=True)
class Capacity:
    """When an endpoint has room for another request."""

    kv_budget_tokens: int | Literal["auto"] = field(default="auto",
                                                   metadata=_camel("kv_budget_tokens"))
    """Tokens an endpoint may hold in flight. ``auto``: learned from the endpoint's
    ``vllm:cache_config_info`` (num_gpu_blocks × block_size), else ``fallbackKvBudgetTokens``."""
    fallback_kv_budget_tokens: int = field(default=8192,
                                           metadata=_camel("fallback_kv_budget_tokens", ge=1))
    """Budget used with ``auto`` until (or unless) the endpoint reports its own."""
    max_waiting: int = field(default=2, metadata=_camel("max_waiting", ge=1))
    """An endpoint whose scraped ``vllm:num_requests_waiting`` is at or above this has no room."""
    scrape_interval: float = field(default=0.05, metadata=_camel("scrape_interval", gt=0,
                                                                 duration=True))
    """How often each endpoint's ``/metrics`` is read."""
    metrics_stale_after: float = field(default=1.0, metadata=_camel("metrics_stale_after", gt=0,
                                                                    duration=True))
    """Scraped figures older than this are ignored (the picker's own accounting is used)."""
    default_output_tokens: int = field(default=256,
                                       metadata=_camel("default_output_tokens", ge=1))
    """Output estimate for a non-streaming request before the tenant has a history."""

    def __post_init__(self) -> None:
        if isinstance(self.kv_budget_tokens, int) and self.kv_budget_tokens < 1:
            raise ConfigError("kvBudgetTokens", "must be >= 1 or auto")


@dataclass(frozen=True)
class Endpoint:
    """A model server of the pool (static; InferencePool discovery comes later)."""

    address: str
    """``ip:port``."""
    kv_budget_tokens: int | None = field(default=None, metadata=_camel("kv_budget_tokens", ge=1))
    """Overrides ``capacity.kvBudgetTokens`` for this endpoint."""

    def __post_init__(self) -> None:
        match = _ADDRESS.match(self.address)
        if not match or not 1 <= int(match.group(2)) <= 65535:
            raise ConfigError("address", f"must be host:port or [ipv6]:port with a port in "
                                         f"1..65535, got {self.address!r}")


@dataclass(frozen=True)
class Tenant:
    """A tenant's share and lane."""

    id: str = field(metadata={"min_length": 1})
    weight: float = field(default=1.0, metadata={"gt": 0})
    """Share relative to other tenants in the same lane."""
    lane: str | None = None
    """Lane of the tenant's requests (default: the first lane)."""


@dataclass(frozen=True)
class Limits:
    """Request limits."""

    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata=_camel("max_body_bytes", ge=1))
    """Larger request bodies get 413."""


@dataclass(frozen=True)
class PickerConfig:
    """The whole picker configuration."""

    endpoints: tuple[Endpoint, ...] = ()
    tenancy: Tenancy = Tenancy()
    scheduling: Scheduling = Scheduling()
    cost: Cost = Cost()
    lanes: tuple[Lane, ...] = (Lane("default"),)
    queue: Queue = Queue()
    capacity: Capacity = Capacity()
    limits: Limits = Limits()
    tenants: tuple[Tenant, ...] = ()

    def __post_init__(self) -> None:
        if not self.lanes:
            raise ConfigError("lanes", "needs at least one lane")
        lane_names = [lane.name for lane in self.lanes]
        require_unique(lane_names, "lanes[{}].name", "lane")
        require_unique([e.address for e in self.endpoints], "endpoints[{}].address", "endpoint")
        require_unique([t.id for t in self.tenants], "tenants[{}].id", "tenant")
        for i, tenant in enumerate(self.tenants):
            require_known(tenant.lane, lane_names, f"tenants[{i}].lane", "lane")

    def tenant(self, tenant_id: str) -> Tenant | None:
        """The configured entry of ``tenant_id``, if any."""
        for tenant in self.tenants:
            if tenant.id == tenant_id:
                return tenant
        return None


def load_config(source: str | Path | dict) -> PickerConfig:
    """The picker config from a YAML file path or already-parsed data."""
    if isinstance(source, dict):
        return load(PickerConfig, source)
    return load_yaml_file(PickerConfig, source)
