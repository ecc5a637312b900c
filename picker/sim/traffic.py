"""What a load-generator traffic file may say: each tenant's arrivals, request shapes and headers.

It answers: *which requests does each tenant send to the gateway, when, and what do they look
like?* The load generator (``picker.sim.load``) turns a ``Traffic`` into real HTTP requests.

Loaded strictly (``picker.config.strict``): unknown keys and bad values are errors that name their
path, such as ``tenants[1].rate: must be >= 0`` or
``tenants[0].backlog: cannot be combined with rate > 0``.

A tenant sends open-loop traffic (Poisson ``rate`` inside its ``start_s``/``stop_s`` window, plus
``bursts`` of requests sent at once), or is closed-loop ``backlog``: it keeps that many requests
outstanding for the whole window, like a client that always has more work than it is served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from picker.config.strict import load, load_yaml_file, require_unique
from picker.errors import ConfigError

DEFAULT_TENANT_HEADER = "x-gateway-inference-fairness-id"


@dataclass(frozen=True)
class Burst:
    """``count`` requests sent at the same moment."""

    at_s: float = field(metadata={"ge": 0})
    """Seconds after the run's start; must be before the run's ``duration_s``."""
    count: int = field(metadata={"ge": 1})
    """How many requests the burst sends at once."""


@dataclass(frozen=True)
class TenantTraffic:
    """One tenant: when it sends, what its requests look like, and which headers they carry."""

    name: str
    """Tenant id, sent in the run's ``tenant_header`` (unless ``send_tenant_header`` is false)."""
    rate: float = field(default=0.0, metadata={"ge": 0})
    """Mean requests per second, Poisson arrivals, inside the tenant's window (0: none)."""
    start_s: float = field(default=0.0, metadata={"ge": 0})
    """Start of the tenant's window (Poisson and backlog traffic), seconds after the run's start."""
    stop_s: float | None = field(default=None, metadata={"gt": 0})
    """End of the tenant's window (exclusive); default: the end of the run."""
    bursts: tuple[Burst, ...] = ()
    """Extra requests sent at once at given moments, independent of the window."""
    backlog: int | None = field(default=None, metadata={"ge": 1})
    """Closed loop: keep this many requests outstanding during the window (exclusive with rate)."""
    prompt_tokens: tuple[int, int] = field(default=(32, 256), metadata={"ge": 1})
    """Prompt length range in tokens (filler words), uniform integers, inclusive."""
    output_tokens: tuple[int, int] = field(default=(16, 128), metadata={"ge": 1})
    """Output length range (``max_tokens``, with ``ignore_eos``), uniform integers, inclusive."""
    stream_fraction: float = field(default=0.0, metadata={"ge": 0, "le": 1})
    """Share of requests sent with ``stream: true``."""
    api: Literal["chat", "completions"] = "chat"
    """``chat``: /v1/chat/completions, one user message; ``completions``: /v1/completions."""
    include_usage: bool = False
    """Streaming requests ask for a usage chunk (``stream_options: {include_usage: true}``)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Extra request headers."""
    send_tenant_header: bool = True
    """Send ``tenant_header: name``; false for anonymous traffic (or an id set in ``headers``)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("name", "must not be empty")
        for key in ("prompt_tokens", "output_tokens"):
            low, high = getattr(self, key)
            if low > high:
                raise ConfigError(key, f"low {low} is above high {high}")
        if self.stop_s is not None and self.stop_s <= self.start_s:
            raise ConfigError("stop_s", f"must be above start_s {self.start_s:g}")
        if self.backlog is not None and self.rate > 0:
            raise ConfigError("backlog", "cannot be combined with rate > 0 (closed or open loop)")
        if self.backlog is None and self.rate == 0 and not self.bursts:
            raise ConfigError("", "sends nothing: give it a rate, bursts or a backlog")


@dataclass(frozen=True)
class Traffic:
    """A whole load-generator run: how long, which model, and every tenant's traffic."""

    duration_s: float = field(metadata={"gt": 0})
    """Sending stops this many seconds after the start; stragglers get ``timeout_s`` more."""
    tenants: tuple[TenantTraffic, ...]
    model: str = "sim-model"
    """The request body's ``model``."""
    tenant_header: str = DEFAULT_TENANT_HEADER
    """Header carrying the tenant id."""
    seed: int = 0
    """Seeds arrival times, lengths, streaming choices and prompt words (same seed, same run)."""
    max_in_flight: int = field(default=2000, metadata={"ge": 1})
    """Safety cap on concurrent connections for the whole run (later requests wait for one)."""
    timeout_s: float = field(default=120.0, metadata={"gt": 0})
    """Per-request timeout, also how long the run waits for stragglers after ``duration_s``."""

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ConfigError("tenants", "needs at least one tenant")
        if not self.tenant_header:
            raise ConfigError("tenant_header", "must not be empty")
        require_unique([t.name for t in self.tenants], "tenants[{}].name", "tenant")
        for i, tenant in enumerate(self.tenants):
            where = f"tenants[{i}]"
            if tenant.start_s >= self.duration_s:
                raise ConfigError(f"{where}.start_s",
                                  f"must be below duration_s {self.duration_s:g}")
            if tenant.stop_s is not None and tenant.stop_s > self.duration_s:
                raise ConfigError(f"{where}.stop_s",
                                  f"must be at most duration_s {self.duration_s:g}")
            for j, burst in enumerate(tenant.bursts):
                if burst.at_s >= self.duration_s:
                    raise ConfigError(f"{where}.bursts[{j}].at_s",
                                      f"must be below duration_s {self.duration_s:g}")
            lowered = {k.lower() for k in tenant.headers}
            if tenant.send_tenant_header and self.tenant_header.lower() in lowered:
                raise ConfigError(f"{where}.headers",
                                  f"sets {self.tenant_header!r}, which send_tenant_header already "
                                  "sends; set send_tenant_header: false to send your own")

    def tenant(self, name: str) -> TenantTraffic:
        """The tenant called ``name`` (KeyError if there is none)."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise KeyError(name)


def load_traffic(source: str | Path | dict) -> Traffic:
    """A traffic description from a YAML file path or from already-parsed data."""
    if isinstance(source, dict):
        return load(Traffic, source)
    return load_yaml_file(Traffic, source)
