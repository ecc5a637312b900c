"""What the picker's config means for the core: the config-to-core factories.

It answers: *given a ``PickerConfig``, which cost function, capacity rules, gate rules, admission
rules, identity and metering sink does the picker use?* One mapping each, so neither the
dispatcher (``picker.dispatch``, the server's asyncio) nor the pool simulator (``picker.sim.pool``,
the same gate in discrete time) reads raw config for them, and both build the same gate. It lives
in the config layer, which may import the core (the core imports nothing of the picker), so the
simulator needs nothing of the server.
"""

from __future__ import annotations

from picker.config.schema import Budget, PickerConfig, TenantPolicy
from picker.core import ComputedTokenCost, ContextAwareCost, LinearCost
from picker.core.admission import BucketRule, TenantRules
from picker.core.cost import CostFunction
from picker.core.gate import GateRules, LaneRules
from picker.core.health import HealthRules
from picker.core.prefix import AffinityRules
from picker.core.selection import CapacityRules
from picker.core.sessions import SessionRules
from picker.errors import ConfigError
from picker.identity import Identity, KeyEntry
from picker.metering import MeteringSink, open_sink


def cost_function(config: PickerConfig) -> CostFunction:
    """What a tenant is charged for prompt and output tokens."""
    c = config.cost
    if c.context_beta:
        return ContextAwareCost(c.prefill_weight, c.decode_weight, c.context_beta,
                                1.0 if c.charge_cached_prompt else c.cached_prompt_weight)
    if not c.charge_cached_prompt:
        return ComputedTokenCost(c.prefill_weight, c.decode_weight, c.cached_prompt_weight)
    return LinearCost(c.prefill_weight, c.decode_weight)


def capacity_rules(config: PickerConfig) -> CapacityRules:
    """When an endpoint has room."""
    c = config.capacity
    fallback = c.kv_budget_tokens if isinstance(c.kv_budget_tokens, int) else \
        c.fallback_kv_budget_tokens
    return CapacityRules(fallback_budget=fallback, max_waiting=c.max_waiting,
                         stale_after=c.metrics_stale_after, growth_room=c.growth_room,
                         max_prefill_tokens=c.max_prefill_tokens,
                         ready_reserve=c.ready_reserve, engine_queue=c.engine_queue)


def gate_rules(config: PickerConfig) -> GateRules:
    """Lanes, capacity, health, queue limits and routing, as the gate applies them."""
    lanes = config.lanes
    cache = engine_cache(config)
    return GateRules(
        lanes=tuple(LaneRules(lane.name, lane.engine_priority) for lane in lanes),
        holding=config.scheduling.policy != "fcfs",
        capacity=capacity_rules(config),
        health=HealthRules(config.health.consecutive_failures, config.health.base_ejection_time,
                           config.health.max_ejection_time),
        max_queued=config.queue.max_queued,
        newest_first_after=config.queue.newest_first_after,
        shed_lower_lanes=config.queue.overload == "shedLowerLanes",
        fallback_endpoints=config.routing.fallback_endpoints,
        engine_policy=config.scheduling.engine_policy,
        preempt=config.scheduling.preempt,
        idle_tenant_reserve=config.capacity.idle_tenant_reserve,
        reserve_quantile=config.capacity.reserve_quantile,
        reserve_max_share=config.capacity.reserve_max_share,
        default_output_tokens=config.capacity.default_output_tokens,
        tenant_lanes={t.id: t.lane for t in config.tenants if t.lane is not None},
        allowed_lanes={t.id: frozenset((t.lane or lanes[0].name, *t.allowed_lanes))
                       for t in config.tenants},
        configured_tenants=frozenset(t.id for t in config.tenants),
        engine_cache=cache is not False,
        learn_engine_cache=cache == "auto",
        affinity=affinity_rules(config),
        sessions=session_rules(config),
        charge_sent_to_budgets=config.cost.budget_tokens == "sent")


def engine_cache(config: PickerConfig) -> bool | str:
    """``capacity.engineCache``, unset read as ``auto`` with prefix affinity, else ``false``."""
    setting = config.capacity.engine_cache
    if setting is None:
        return "auto" if config.routing.prefix_affinity is not None else False
    return setting


def affinity_rules(config: PickerConfig) -> AffinityRules | None:
    """Prefix affinity, when configured."""
    a = config.routing.prefix_affinity
    if a is None:
        return None
    return AffinityRules(weight=a.weight, block_chars=a.block_chars,
                         max_blocks_per_endpoint=a.max_blocks_per_endpoint,
                         patience=a.patience,
                         prefill_s_per_token=a.prefill_ms_per_1k_tokens / 1e6)


def session_rules(config: PickerConfig) -> SessionRules | None:
    """Programs and sessions, when configured."""
    s = config.routing.sessions
    if s is None:
        return None
    return SessionRules(max_sessions=s.max_sessions, idle_timeout=s.idle_timeout,
                        sticky=s.sticky, resume_first=s.resume_first)


def endpoint_budgets(config: PickerConfig) -> dict[str, int | None]:
    """The configured endpoints and each one's KV budget (``None``: learned or the fallback)."""
    pool = config.capacity.kv_budget_tokens
    return {e.address: e.kv_budget_tokens or (pool if isinstance(pool, int) else None)
            for e in config.endpoints}


def _bucket(budget: Budget | None) -> BucketRule | None:
    return None if budget is None else BucketRule(budget.tokens, budget.per)


def _tenant_rules(policy: TenantPolicy) -> TenantRules:
    limits = policy.limits
    return TenantRules(
        burst=_bucket(policy.budgets.burst), sustained=_bucket(policy.budgets.sustained),
        over_budget=policy.over_budget.action, demote_lane=policy.over_budget.lane,
        max_queued=limits.max_queued, max_concurrent=limits.max_concurrent,
        max_input_tokens=limits.max_input_tokens, max_output_tokens=limits.max_output_tokens,
        output_limit_action=limits.output_limit,
        reserve="expected" if policy.budgets.reserve == "expected" else "worst_case")


def admission_rules(config: PickerConfig) -> tuple[dict[str, TenantRules], TenantRules]:
    """Each configured tenant's budgets and caps, and those of every other tenant."""
    defaults = config.tenant_defaults
    return ({t.id: _tenant_rules(t.policy(defaults)) for t in config.tenants},
            _tenant_rules(defaults))


def identity(config: PickerConfig) -> Identity:
    """How a request's tenant is found (trusted header or API key)."""
    tenancy = config.tenancy
    if tenancy.mode == "apiKey":
        return Identity.api_keys([KeyEntry(k.sha256, k.tenant) for k in tenancy.api_keys])
    return Identity.trusted_header([tenancy.header, *tenancy.also_accept], tenancy.default_tenant)


def metering_sink(config: PickerConfig) -> MeteringSink:
    """Where metering records go; a target that cannot be opened is a config error."""
    try:
        return open_sink(config.metering.output)
    except ConfigError as exc:
        raise exc.under("metering.output") from None

