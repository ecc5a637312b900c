"""What a simulation scenario may say: the engine, the cost weights, lanes and tenants' traffic.

Loaded strictly (``picker.config.strict``): unknown keys and bad values are errors that name their
path, such as ``tenants[1].arrivals[0].rate: must be >= 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from picker.config.strict import load, load_yaml_file, require_known, require_unique
from picker.errors import ConfigError


@dataclass(frozen=True)
class CostWeights:
    """Linear cost weights, plus the context-aware term."""

    prefill_weight: float = field(default=1.0, metadata={"ge": 0})
    """``w_p``: service per prompt token, charged at admission."""
    decode_weight: float = field(default=2.0, metadata={"ge": 0})
    """``w_q``: service per output token, charged as it is generated."""
    context_beta: float = field(default=0.0, metadata={"ge": 0})
    """``β``: extra service per output token per token of context (0: linear cost)."""


@dataclass(frozen=True)
class Lane:
    """A priority lane; the list order is the priority order."""

    name: str
    min_share: float = field(default=0.0, metadata={"ge": 0, "lt": 1})
    """Fraction of service the lane gets at least while backlogged (0: strict priority)."""


@dataclass(frozen=True)
class Phase:
    """One phase of a tenant's traffic: Poisson arrivals, or a standing backlog."""

    until: int | None = field(default=None, metadata={"ge": 0})
    """Step at which this phase ends (exclusive); only the last phase may omit it."""
    rate: float | None = field(default=None, metadata={"ge": 0})
    """Mean arrivals per step (Poisson)."""
    backlog: int | None = field(default=None, metadata={"ge": 0})
    """Keep this many of the tenant's requests queued, topping up at every step."""

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.backlog is None):
            raise ConfigError("", "a phase needs exactly one of rate or backlog")


@dataclass(frozen=True)
class Tenant:
    """A tenant and its traffic."""

    name: str
    arrivals: tuple[Phase, ...]
    weight: float = field(default=1.0, metadata={"ge": 0.001, "le": 1000})
    """The picker's range (``picker.core.lanes.MIN_WEIGHT`` to ``MAX_WEIGHT``)."""
    lane: str | None = None
    """Lane of all the tenant's requests (default: the first lane)."""
    prompt_tokens: tuple[int, int] = field(default=(64, 512), metadata={"ge": 1})
    """Prompt length range, uniform integers, inclusive."""
    output_tokens: tuple[int, int] = field(default=(32, 384), metadata={"ge": 1})
    """Output length range, uniform integers, inclusive."""

    def __post_init__(self) -> None:
        for key in ("prompt_tokens", "output_tokens"):
            low, high = getattr(self, key)
            if low > high:
                raise ConfigError(key, f"low {low} is above high {high}")
        if not self.arrivals:
            raise ConfigError("arrivals", "needs at least one phase")
        previous = -1
        for i, phase in enumerate(self.arrivals):
            if phase.until is None:
                if i != len(self.arrivals) - 1:
                    raise ConfigError(f"arrivals[{i}].until",
                                      "is required on all but the last phase")
            elif phase.until <= previous:
                raise ConfigError(f"arrivals[{i}].until",
                                  f"must be above the previous phase's {previous}")
            else:
                previous = phase.until


@dataclass(frozen=True)
class Scenario:
    """A whole simulation: engine size, cost, lanes and tenants."""

    tenants: tuple[Tenant, ...]
    steps: int = field(default=20000, metadata={"ge": 1})
    """Decode iterations to simulate."""
    kv_budget_tokens: int = field(default=8192, metadata={"ge": 1})
    """``M``: a running request occupies prompt + generated tokens of it."""
    cost: CostWeights = CostWeights()
    seed: int = 0
    rpm_window_steps: int = field(default=2000, metadata={"ge": 1})
    """The "minute" of the ``rpm`` baseline, in steps."""
    lanes: tuple[Lane, ...] = (Lane("default"),)

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ConfigError("tenants", "needs at least one tenant")
        if not self.lanes:
            raise ConfigError("lanes", "needs at least one lane")
        lane_names = [lane.name for lane in self.lanes]
        require_unique(lane_names, "lanes[{}].name", "lane")
        require_unique([t.name for t in self.tenants], "tenants[{}].name", "tenant")
        for i, tenant in enumerate(self.tenants):
            require_known(tenant.lane, lane_names, f"tenants[{i}].lane", "lane")
            if tenant.prompt_tokens[1] > self.kv_budget_tokens:
                raise ConfigError(f"tenants[{i}].prompt_tokens",
                                  f"a prompt of {tenant.prompt_tokens[1]} can never fit "
                                  f"kv_budget_tokens {self.kv_budget_tokens}")


def load_scenario(source: str | Path | dict) -> Scenario:
    """A scenario from a YAML file path or from already-parsed data."""
    if isinstance(source, dict):
        return load(Scenario, source)
    return load_yaml_file(Scenario, source)
