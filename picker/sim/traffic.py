"""What a load-generator traffic file may say: each tenant's arrivals, request shapes and headers.

It answers: *which requests does each tenant send to the gateway, when, and what do they look
like?* The load generator (``picker.sim.load``) turns a ``Traffic`` into real HTTP requests.

Loaded strictly (``picker.config.strict``): unknown keys and bad values are errors that name their
path, such as ``tenants[1].rate: must be >= 0`` or
``tenants[0].backlog: cannot be combined with rate > 0``.

A tenant sends open-loop traffic (Poisson ``rate`` inside its ``start_s``/``stop_s`` window, plus
``bursts`` of requests sent at once), or is closed-loop ``backlog``: it keeps that many requests
outstanding for the whole window, like a client that always has more work than it is served.

Workloads that share prefixes (``picker.sim.workloads``), each a chat tenant:
``system_prompt_tokens`` starts every request of the tenant with its own system prompt; a
``chat`` section makes each arrival a multi-turn session (each turn resends the conversation,
think time between turns); ``rag`` puts some of a handful of shared documents before each
question; ``agent`` makes each arrival a program of ``calls`` calls, each resending the context so
far plus a tool result, tool latency between calls. For sessions and programs ``rate``, ``bursts``
and ``backlog`` count sessions or programs, not requests: ``backlog: N`` keeps N running, and the
window (``start_s``/``stop_s``) bounds when they start (their later calls go on until
``duration_s``). Each of their requests carries ``session_header`` (default ``x-session-id``),
naming its session or program.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from picker.config.strict import load, load_yaml_file, require_unique
from picker.errors import ConfigError

DEFAULT_TENANT_HEADER = "x-gateway-inference-fairness-id"
DEFAULT_SESSION_HEADER = "x-session-id"


def _check_range(value: tuple[float, float], key: str) -> None:
    low, high = value
    if low > high:
        raise ConfigError(key, f"low {low:g} is above high {high:g}")


@dataclass(frozen=True)
class ChatSessions:
    """Multi-turn chat: each arrival is a session of ``turns`` turns; turn t sends the whole
    conversation so far (questions and replies) plus a new question of ``prompt_tokens``."""

    turns: tuple[int, int] = field(default=(5, 20), metadata={"ge": 1})
    """Turns per session, uniform integers, inclusive."""
    think_s: tuple[float, float] = field(default=(2.0, 10.0), metadata={"ge": 0})
    """Seconds between a reply and the next question, uniform."""

    def __post_init__(self) -> None:
        _check_range(self.turns, "turns")
        _check_range(self.think_s, "think_s")


@dataclass(frozen=True)
class Rag:
    """Questions over a handful of shared documents: each request carries ``per_request`` of
    ``documents`` (a corpus's documents are the same text for every tenant naming it), then a
    question of ``prompt_tokens``."""

    documents: int = field(default=4, metadata={"ge": 1})
    document_tokens: tuple[int, int] = field(default=(1000, 3000), metadata={"ge": 1})
    """Each document's length in filler words (about a token each), uniform, inclusive."""
    per_request: int = field(default=1, metadata={"ge": 1})
    """Documents in one request, in the corpus's order."""
    corpus: str = "shared"
    """Tenants naming the same corpus share its documents."""

    def __post_init__(self) -> None:
        _check_range(self.document_tokens, "document_tokens")
        if self.per_request > self.documents:
            raise ConfigError("per_request", f"must be at most documents {self.documents}")


@dataclass(frozen=True)
class Agent:
    """Agent programs: each arrival is a task of ``calls`` calls; call 0 sends the task (of
    ``prompt_tokens``), each later call the context so far (every earlier call's prompt and
    reply) plus a tool result, sent ``tool_latency_s`` after the previous reply."""

    calls: int = field(metadata={"ge": 1})
    """K, the calls of one task."""
    tool_result_tokens: tuple[int, int] = field(default=(100, 400), metadata={"ge": 1})
    """A tool result's length in filler words, uniform, inclusive."""
    tool_latency_s: tuple[float, float] = field(default=(0.2, 1.0), metadata={"ge": 0})
    """Seconds a tool runs between a reply and the next call, uniform."""

    def __post_init__(self) -> None:
        _check_range(self.tool_result_tokens, "tool_result_tokens")
        _check_range(self.tool_latency_s, "tool_latency_s")


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
    system_prompt_tokens: int = field(default=0, metadata={"ge": 0})
    """The tenant's own system prompt, in filler words, first in every request (0: none)."""
    chat: ChatSessions | None = None
    """Multi-turn chat sessions (at most one of chat, rag, agent)."""
    rag: Rag | None = None
    """Questions over shared documents."""
    agent: Agent | None = None
    """Agent programs of ``agent.calls`` calls."""

    @property
    def workload(self) -> str:
        """``requests`` (independent requests of filler words, as before), ``system_prompt``,
        ``chat``, ``rag`` or ``agent``."""
        for kind in ("chat", "rag", "agent"):
            if getattr(self, kind) is not None:
                return kind
        return "system_prompt" if self.system_prompt_tokens else "requests"

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
        given = [kind for kind in ("chat", "rag", "agent") if getattr(self, kind) is not None]
        if len(given) > 1:
            raise ConfigError(given[1], f"cannot be combined with {given[0]} (one workload a "
                              "tenant)")
        if self.workload != "requests" and self.api != "chat":
            raise ConfigError("api", f"must be chat for a {self.workload} workload")


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
    session_header: str = DEFAULT_SESSION_HEADER
    """Header naming the session or program of a chat or agent tenant's request,
    ``<tenant>-<n>``; the picker reads it with ``routing.sessions`` (its default header)."""
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
        if not self.session_header:
            raise ConfigError("session_header", "must not be empty")
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
