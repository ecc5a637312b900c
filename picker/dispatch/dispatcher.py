"""Holding requests until the gate says go, and metering them after.

It answers: *how does a request wait for its turn, and what is recorded about it?* Every rule
that decides who goes next, where, when and for how much is the pure core's gate
(``picker.core.gate``); this module adds what needs a clock and an event loop: a future per
request, the queue timeout, cancellation, the Prometheus metrics and the metering records. The
config's meaning for the core (cost, capacity, admission rules) is in ``picker.config.build``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from picker.config.build import (
    admission_rules,
    cost_function,
    endpoint_budgets,
    gate_rules,
    identity,
    metering_sink,
)
from picker.config.schema import CAPACITY_PROFILES, PickerConfig, Tenancy
from picker.config.trusted import reload_refusal, strip_list
from picker.core import LaneSpec, Usage
from picker.core.admission import Admission, Refused
from picker.core.estimates import TenantEstimates
from picker.core.gate import QUEUE_FULL, Gate, Passage, Turnaway
from picker.core.lanes import Scheduler
from picker.core.selection import CapacityRules, EndpointState, Scorer
from picker.core.sessions import session_key
from picker.dispatch.log_budget import LogBudget
from picker.dispatch.refusals import refusal_error
from picker.dispatch.trace import PickerTrace
from picker.errors import (
    LaneNotAllowed,
    NoEndpoint,
    NotLeader,
    QueueFull,
    QueueTimeout,
    RequestError,
    ShuttingDown,
    StateUnavailable,
)
from picker.identity import OBJECTIVE_HEADER
from picker.metering import MeteringRecord, MeteringSink, RecentRecords
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest
from picker.openai.prefix import prompt_blocks

log = logging.getLogger(__name__)

SCRAPE_SNAPSHOT_TIMEOUT = 5.0
"""Seconds a Prometheus scrape waits for the event loop to take the state snapshot."""


@dataclass(eq=False)
class Ticket(Passage):
    """One request's passage through the picker: the gate's record, and what waits on it."""

    inference: InferenceRequest = field(kw_only=True)
    lane_asked: str | None = None
    """The lane the request asked for (metered: a replay asks for it again)."""
    error: RequestError | None = None
    """Set when the request was shed from the queue for a higher lane."""
    _ready: asyncio.Future[None] | None = None


class Dispatcher:
    """The fair queue in front of the pool. One per picker process."""

    def __init__(self, config: PickerConfig, *, clock: Callable[[], float] = time.monotonic,
                 metrics: PickerMetrics | None = None, scorer: Scorer | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.metrics = metrics if metrics is not None else PickerMetrics()
        self._closed = False
        self.standby = False
        """A replica that is not the elected leader: it refuses requests (retryable 503)."""
        self.state_unavailable = False
        """The shared state store is unreachable and the config says fail closed: refuse
        requests (retryable 503) until it answers (``picker.state``)."""
        self.reserve_in_store: Callable[[str, int], Awaitable[
            tuple[bool, str, float] | None]] | None = None
        """With a shared state store: reserve a near-limit tenant's request there first
        (``RedisSync.reserve``)."""
        self.metering: MeteringSink = metering_sink(config)
        self.recent: RecentRecords | None = None
        """The latest finished requests' records, kept for the admin API's what-if window
        (``AdminService`` sets it); None: not kept."""
        self.refusal_log = LogBudget(log, "refusals", clock)
        """Refusals' log lines: a few a minute (each is counted in fairway_rejections_total)."""
        self.config = config
        self.gate = Gate(gate_rules(config), self._new_scheduler(config),
                         Admission(*admission_rules(config)), now=clock(), scorer=scorer,
                         listener=self)
        self.apply_config(config)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._loop_thread = threading.get_ident()
        self.metrics.add_state_collector(self._scrape_snapshot)
        self.trace: PickerTrace | None = None
        """The view written for benchmarks (``picker serve --trace``); None: none."""

    # The gate's parts, as the rest of the picker (admin API, scraper, tests) reads them.
    @property
    def scheduler(self) -> Scheduler:
        return self.gate.scheduler

    @property
    def admission(self) -> Admission:
        return self.gate.admission

    @property
    def estimates(self) -> TenantEstimates:
        return self.gate.estimates

    @property
    def endpoints(self) -> dict[str, EndpointState]:
        return self.gate.endpoints

    @property
    def rules(self) -> CapacityRules:
        """When an endpoint has room."""
        return self.gate.rules.capacity

    @property
    def scorer(self) -> Scorer:
        return self.gate.scorer

    def _scrape_snapshot(self) -> dict[str, Any]:
        """``snapshot`` for a Prometheus scrape, taken on the event loop's thread.

        The metrics server answers on a thread of its own while the loop changes the queue; a
        snapshot taken there would iterate dicts that change under it ("dictionary changed size
        during iteration", seen under load as the scrape failing with wsgiref's error page).
        """
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running() \
                or threading.get_ident() == self._loop_thread:
            return self.snapshot()
        taken: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()

        def take() -> None:
            try:
                taken.set_result(self.snapshot())
            except Exception as error:  # the scrape reports it; the loop carries on
                taken.set_exception(error)

        loop.call_soon_threadsafe(take)
        return taken.result(timeout=SCRAPE_SNAPSHOT_TIMEOUT)

    # -- configuration --

    def _new_scheduler(self, config: PickerConfig) -> Scheduler:
        return Scheduler([LaneSpec(lane.name, lane.min_share) for lane in config.lanes],
                         policy=config.scheduling.policy, cost=cost_function(config))

    @staticmethod
    def _carry_over(old: Scheduler, new: Scheduler) -> Scheduler:
        """Keep tenants' counters (in lanes that remain) and service totals across a rebuild."""
        for lane in set(old.lane_names) & set(new.lane_names):
            new.policy(lane).counters.update(old.policy(lane).counters)
        new.service.update(old.service)
        new.counter_faults = old.counter_faults  # exported as a counter: never goes back
        new.adopt_changes(old)
        return new

    def apply_config(self, config: PickerConfig) -> None:
        """Take a new config; tenants keep their counters, new charges use the new values.

        Raises ValueError for a change that cannot be applied live (lanes or policy while requests
        are in the picker); the caller keeps the old config.
        """
        old, gate = self.config, self.gate
        changed = config is not old
        structural = changed and (config.lanes != old.lanes or config.scheduling != old.scheduling
                                  or config.cost != old.cost)
        self._check_live_change(config, structural)
        sink = metering_sink(config) if changed and config.metering != old.metering else None
        # (a bad metering path raises above, before anything changed)
        if structural:
            gate.scheduler = self._carry_over(gate.scheduler, self._new_scheduler(config))
        self._apply_weights(config)
        if sink is not None:
            self.metering.close()
            self.metering = sink
        now = self.clock()
        gate.admission.update(*admission_rules(config), now)
        gate.set_rules(gate_rules(config))
        self.identity = identity(config)
        self.identity_headers = frozenset((*self.identity.header_names,
                                           config.tenancy.lane_header.lower(), OBJECTIVE_HEADER))
        """Headers that name who a request is or where it runs: sent twice, the request is
        refused."""
        self.config = config
        gate.set_endpoints(endpoint_budgets(config))
        self.metrics.set_known_tenants(t.id for t in config.tenants)
        c = config.capacity
        self.metrics.set_capacity(c.profile, CAPACITY_PROFILES,
                                  idle_tenant_reserve=c.idle_tenant_reserve,
                                  growth_room=c.growth_room,
                                  max_prefill_tokens=c.max_prefill_tokens,
                                  ready_reserve=c.ready_reserve,
                                  reserve_quantile=c.reserve_quantile,
                                  reserve_max_share=c.reserve_max_share,
                                  preempt=config.scheduling.preempt)
        gate.pump(now)

    def _check_live_change(self, config: PickerConfig, structural: bool) -> None:
        """Refuse what a running picker cannot take (ValueError; nothing changed yet)."""
        if structural and self.gate.passages:
            raise ValueError("lanes, scheduling policy and cost can change only while no "
                             "request is in the picker; retry when idle or restart")
        if config is not self.config and config.state != self.config.state:
            raise ValueError("state (the shared state backend) changes only with a restart")
        if config is not self.config:
            self._check_tenancy_change(self.config.tenancy, config.tenancy)

    @staticmethod
    def _check_tenancy_change(old: Tenancy, new: Tenancy) -> None:
        """API-key to header mode is refused live (ConfigError: a failed reload, not retried),
        and logged at WARNING; a change of the trusted headers is logged at WARNING."""
        refusal = reload_refusal(old, new)
        if refusal is not None:
            log.warning("refusing a config reload that switches tenancy.mode from apiKey to "
                        "header; restart the picker to switch: %s", refusal.message)
            raise refusal
        if new.mode == "header" and strip_list(old) != strip_list(new):
            log.warning("config reload: the picker now trusts headers %s (was %s); the gateway "
                        "must remove them from clients' requests", list(strip_list(new)),
                        list(strip_list(old)))

    def _apply_weights(self, config: PickerConfig) -> None:
        """Configured tenants get their weights; tenants no longer configured, the default."""
        gate = self.gate
        configured = {tenant.id: tenant.weight for tenant in config.tenants}
        for tenant in list(gate.scheduler.weights):
            if tenant not in configured:
                gate.set_weight(tenant, 1.0)
        for tenant, weight in configured.items():
            gate.set_weight(tenant, weight)

    @property
    def holding(self) -> bool:
        """False in pass-through (``fcfs``) mode: requests are dispatched at once."""
        return self.gate.rules.holding

    def lane_of(self, tenant: str) -> str:
        """The tenant's configured lane, else the first lane."""
        return self.gate.lane_of(tenant)

    def choose_lane(self, tenant: str, asked: str | None) -> str:
        """The lane a request runs in: the tenant's own, or one its policy allows it to ask for.

        Raises LaneNotAllowed for any other lane.
        """
        lane = self.gate.choose_lane(tenant, asked)
        if lane is None:
            raise LaneNotAllowed(f"lane {asked!r} is not allowed for this tenant")
        return lane

    def engine_priority(self, lane: str) -> int | None:
        """The vLLM ``priority`` the lane's requests carry (``None``: the lane sets none)."""
        return self.gate.engine_priority(lane)

    # -- the lifecycle --

    async def admit(self, tenant: str, inference: InferenceRequest,
                    subset: frozenset[str] | None = None, lane: str | None = None,
                    request_id: str = "", output_seen: bool = True,
                    session: str | None = None) -> Ticket:
        """Admit a request, queue it and wait for its turn; returns it dispatched.

        ``lane``: the lane asked for (already checked with ``choose_lane``); default the
        tenant's. ``output_seen``: whether its tokens will reach the picker as they stream
        (``Passage.output_seen``). ``session``: the value of the request's session header
        (``routing.sessions``; checked here, scoped by ``tenant`` in the gate). Raises a
        RequestError subclass when the request is refused;
        cancellation (the client went away) removes it from the queue uncharged.
        """
        self._check_serving()
        prereserved = await self._reserve_in_store(tenant, inference)
        # The prompt's blocks: for the room its shared blocks take once (engines that cache
        # prefixes) and for prefix affinity; none when neither is configured.
        block_chars = self.gate.rules.block_chars()
        blocks, chars = ((), 0) if not block_chars else prompt_blocks(
            inference.model, inference.body, inference.kind, block_chars)
        ticket = _admitted(self.gate.admit(
            functools.partial(Ticket, inference=inference), tenant, lane,
            model=inference.model, prompt_tokens=inference.prompt_tokens,
            max_tokens=inference.max_tokens, stream=inference.stream, now=self.clock(),
            subset=subset, request_id=request_id, prereserved=prereserved,
            output_seen=output_seen, choices=inference.choices,
            max_model_len=self.max_model_len(inference.model), prefix_blocks=blocks,
            prefix_chars=chars, session=session_key(session)))
        ticket.lane_asked = lane
        if ticket.demoted:
            self.metrics.demotions.labels(tenant, lane or self.lane_of(tenant),
                                          ticket.lane).inc()
        if ticket.dispatched_at is not None:
            return ticket  # an endpoint had room: no wait (the common, uncontended case)
        if ticket.outcome is None:
            ticket._ready = asyncio.get_running_loop().create_future()
            await self._wait(ticket)
        if ticket.outcome is not None and ticket.dispatched_at is None:
            error = ticket.error or ShuttingDown("the picker is shutting down")
            error.metered = True
            raise error
        return ticket

    def max_model_len(self, model: str) -> int | None:
        """The model's context length (``models[].maxModelLen``), when configured."""
        entry = self.config.model(model)
        return None if entry is None else entry.max_model_len

    def _check_serving(self) -> None:
        """Raise the refusal of a picker that takes no requests now (shutting down, a standby,
        or its shared state away under failClosed)."""
        if self._closed:
            raise ShuttingDown("the picker is shutting down")
        if self.standby:
            raise NotLeader("this picker replica is a standby; the leader serves")
        if self.state_unavailable:
            raise StateUnavailable("the shared state store is unreachable (state.onUnavailable: "
                                   "failClosed)")

    async def _reserve_in_store(self, tenant: str, inference: InferenceRequest) -> int | None:
        """Beside other pickers, for a tenant with budgets: reserve in the shared store first
        (the tokens reserved), or learn the store's level there so that the gate refuses."""
        reserve, gate, now = self.reserve_in_store, self.gate, self.clock()
        if reserve is None or not gate.admission.judged_in_store(tenant):
            return None
        needs = gate.budget_needs(tenant, model=inference.model,
                                  prompt_tokens=inference.prompt_tokens,
                                  max_tokens=inference.max_tokens, stream=inference.stream,
                                  now=now, choices=inference.choices,
                                  max_model_len=self.max_model_len(inference.model))
        answer = await reserve(tenant, needs)
        if answer is None:
            return None  # the store is away: judged on this picker's view
        reserved, window, level = answer
        if reserved:
            return needs
        gate.admission.set_level(tenant, window, level, self.clock())
        return None

    async def _wait(self, ticket: Ticket) -> None:
        assert ticket._ready is not None
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that lands
            # just after the request was dispatched, leaking its slot.
            async with asyncio.timeout(self.config.queue.max_wait):
                await asyncio.shield(ticket._ready)
        except TimeoutError:
            if ticket.dispatched_at is None:
                self.gate.drop(ticket, "queue_timeout", self.clock())
                self.gate.pump(self.clock())  # it may have been the head that blocked others
                timeout = QueueTimeout(f"waited {self.config.queue.max_wait:g}s for capacity")
                timeout.metered = True
                raise timeout from None
        except asyncio.CancelledError:
            if ticket.dispatched_at is None:
                self.gate.drop(ticket, "cancelled", self.clock())
                self.gate.pump(self.clock())
            else:
                self.complete(ticket, None, "cancelled")
            raise

    def pump(self) -> None:
        """Dispatch queued requests while the gate finds room for them."""
        self.gate.pump(self.clock())

    def candidates(self, subset: frozenset[str] | None = None, *, require_room: bool = False,
                   now: float | None = None, prompt_tokens: int = 0) -> list[EndpointState]:
        """Endpoints that may take a request (in ``subset``, when given), best first."""
        return self.gate.candidates(subset, self.clock() if now is None else now,
                                    require_room=require_room, prompt_tokens=prompt_tokens)

    def output_estimate(self, ticket: Ticket) -> int:
        """Expected output of a non-streaming request: the tenant's moving average, capped."""
        return self.gate.output_estimate(ticket, self.clock())

    # -- what the gate decided (``picker.core.gate.GateListener``) --

    def dispatched(self, passage: Ticket, now: float) -> None:
        if self.trace is not None:
            self.trace.dispatched(passage, now)
        self.metrics.queue_wait.labels(passage.tenant, passage.lane) \
            .observe(now - passage.arrived_at)
        ready = passage._ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    def dropped(self, passage: Ticket, outcome: str, now: float) -> None:
        if passage.shed_for is not None:
            passage.error = QueueFull(
                f"shed from the full queue for a request of lane {passage.shed_for!r}")
        self.metrics.requests.labels(passage.tenant, passage.lane, outcome).inc()
        self._meter(passage, Usage(0, 0, 0), outcome, now)
        # A timeout's rejection is counted where it is refused (``reject``), not here.
        ready = passage._ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    def settled(self, passage: Ticket, usage: Usage, outcome: str, now: float,
                estimated: bool) -> None:
        if self.trace is not None:
            self.trace.settled(passage, now)
        self._record_done(passage, usage, outcome)
        self._meter(passage, usage, outcome, now, estimated=estimated)

    # -- endpoint health (outlier ejection, ``picker.core.health``) --

    def endpoint_failed(self, address: str, reason: str) -> None:
        """A scrape of ``address`` failed, or a request sent there never reached its engine."""
        now = self.clock()
        if self.gate.endpoint_failed(address, reason, now):
            self._log_ejected(address, reason, now)

    def _log_ejected(self, address: str, reason: str, now: float) -> None:
        endpoint = self.endpoints.get(address)
        until = endpoint.health.ejected_until if endpoint is not None else None
        log.warning("endpoint %s ejected for %.3gs after %s", address,
                    (until or now) - now, reason)

    def endpoint_ok(self, address: str) -> None:
        """``address`` answered (a scrape, or a response from its engine)."""
        if self.gate.endpoint_ok(address, self.clock()):
            log.warning("endpoint %s restored", address)

    def upstream_failed(self, ticket: Ticket, reason: str) -> None:
        """The gateway reports that the request never reached an engine: its endpoint's failure
        counts towards ejection and the request is settled to nothing (``upstream_failed``)."""
        endpoint, now = ticket.endpoint, self.clock()
        if self.gate.upstream_failed(ticket, reason, now) and endpoint is not None:
            self._log_ejected(endpoint.address, reason, now)

    def served_by(self, ticket: Ticket, address: str) -> None:
        """The gateway reports the endpoint that actually served the request (after a retry it
        may be a fallback): its load moves there, so the endpoint that failed is not charged."""
        primary, now = ticket.endpoint, self.clock()
        if self.gate.served_by(ticket, address, now) and primary is not None:
            self._log_ejected(primary.address, "the gateway retried on a fallback", now)

    def on_first_byte(self, ticket: Ticket, at: float | None = None) -> None:
        """The engine's first byte came (``at``, when reported after the fact; else now)."""
        if ticket.first_byte_at is None:
            ticket.first_byte_at = self.clock() if at is None else at
            self.metrics.ttft.labels(ticket.tenant, ticket.lane) \
                .observe(ticket.first_byte_at - ticket.arrived_at)

    def on_output_tokens(self, ticket: Ticket, tokens: int) -> None:
        """Tokens streamed back: charge them and count them against the endpoint (the first
        ends its prefill, which may let a request held by ``capacity.maxPrefillTokens`` go: the
        clock is read for that one only, not per chunk)."""
        self.gate.charge_output(ticket, tokens, self.clock() if ticket.prefilling else None)

    def complete(self, ticket: Ticket, usage: Usage | None, outcome: str) -> None:
        """The request ended (``ok``, ``error``, ``cancelled``, ``unmetered``,
        ``upstream_failed``): settle and free its slot (see ``Gate.complete``). Calling it
        again does nothing."""
        self.gate.complete(ticket, usage, outcome, self.clock())

    def body_read(self, ticket: Ticket, inference: InferenceRequest) -> None:
        """A request routed before its body was read: what the body says (``Gate.body_read``)."""
        ticket.inference = inference
        self.gate.body_read(ticket, inference.max_tokens, inference.stream, inference.choices)

    def forget_idle(self, now: float) -> None:
        """Forget per-tenant state that forgetting cannot change a decision for (see
        ``Gate.forget_idle``); the gate runs it itself every ``PRUNE_INTERVAL``."""
        self.gate.forget_idle(now)

    def tenants_held(self) -> dict[str, int]:
        """How many tenants each part of the picker holds state for (memory, benchmarks)."""
        return self.gate.tenants_held()

    def ratelimit_headers(self, tenant: str) -> dict[str, str]:
        """``x-ratelimit-*`` headers for ``tenant`` now (empty without budgets or caps)."""
        return self.admission.headers(tenant, self.clock())

    def reject(self, tenant: str, error: RequestError, *, model: str | None = None,
               lane: str | None = None, request_id: str = "") -> None:
        """Count a refused request (``fairway_rejections_total``) and log it within the log's
        budget (``refusal_log``). It writes no metering record: a refusal costs nothing, and
        one per request let a client refused ~650 times a second write ~28 GB of metering a
        day; one that had queued was metered by the gate already."""
        self.metrics.rejections.labels(tenant, error.metric_label).inc()
        self.refusal_log.log(logging.INFO, "refused tenant=%s status=%d reason=%s model=%s "
                             "request=%s: %s", tenant, error.http_status, error.metric_label,
                             model, request_id, error.message)

    def _meter(self, ticket: Ticket, usage: Usage, outcome: str, now: float,
               estimated: bool = False) -> None:
        """One metering record for a request that got into the queue."""
        if not self.metering.enabled and self.recent is None:
            return
        end_ms = (now - ticket.arrived_at) * 1000
        wall = self.wall_clock()
        record = MeteringRecord(
            request_id=ticket.request_id, timestamp=wall, tenant_id=ticket.tenant,
            model=ticket.inference.model, priority_lane=ticket.lane, outcome=outcome,
            finish_reason=ticket.finish_reason or outcome,
            endpoint=ticket.endpoint.address if ticket.endpoint is not None else None,
            prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
            cached_prompt_tokens=usage.cached_prompt_tokens, estimated=estimated,
            cost=max(0.0, ticket.request.charged), demoted=ticket.demoted,
            queue_ms=((ticket.dispatched_at if ticket.dispatched_at is not None else now)
                      - ticket.arrived_at) * 1000,
            ttft_ms=None if ticket.first_byte_at is None else
            (ticket.first_byte_at - ticket.arrived_at) * 1000,
            e2e_ms=end_ms, arrived_at=wall - end_ms / 1000, max_tokens=ticket.body_max_tokens,
            stream=ticket.stream, lane_asked=ticket.lane_asked)
        if self.recent is not None:
            self.recent.add(record)
        if self.metering.enabled:
            self.metering.write(record)

    def _record_done(self, ticket: Ticket, usage: Usage, outcome: str) -> None:
        # The metrics fold unconfigured tenants into "other" themselves (TenantCapped).
        m, label = self.metrics, ticket.tenant
        m.requests.labels(label, ticket.lane, outcome).inc()
        m.service_tokens.labels(label, ticket.lane, "prompt").inc(usage.prompt_tokens)
        m.service_tokens.labels(label, ticket.lane, "completion").inc(usage.completion_tokens)
        # Of the prompt, what the engine found in its prefix cache (0 counted too, so every
        # tenant's computed share, prompt - cached, has both series).
        m.service_tokens.labels(label, ticket.lane, "cached").inc(usage.cached_prompt_tokens)
        m.weighted_service.labels(label, ticket.lane).inc(max(0.0, ticket.request.charged))

    # -- state --

    def snapshot(self) -> dict[str, Any]:
        """Live state for metrics and the admin view."""
        queued: dict[tuple[str, str], int] = {}
        running: dict[tuple[str, str], int] = {}
        queued_tokens: dict[tuple[str, str], int] = {}
        running_tokens: dict[tuple[str, str], int] = {}
        for ticket in self.gate.passages.values():
            key = (ticket.tenant, ticket.lane)
            if ticket.dispatched_at is not None:
                running[key] = running.get(key, 0) + 1
                running_tokens[key] = running_tokens.get(key, 0) + ticket.reserved_tokens
            else:
                queued[key] = queued.get(key, 0) + 1
                queued_tokens[key] = queued_tokens.get(key, 0) + ticket.request.prompt_tokens
        counters = {}
        for tenant in set(self.scheduler.service) | {t.tenant for t in self.gate.passages.values()}:
            lane = self.lane_of(tenant)
            counters[(tenant, lane)] = self.scheduler.counter(tenant, lane)
        for tenant, lane in set(queued) | set(running):
            counters[(tenant, lane)] = self.scheduler.counter(tenant, lane)
        # Debt: how far ahead of the lane's most-owed backlogged tenant a tenant's counter is.
        floor: dict[str, float] = {}
        for (tenant, lane) in queued:
            value = counters[(tenant, lane)]
            floor[lane] = min(floor.get(lane, value), value)
        debt = {key: max(0.0, value - floor[key[1]]) for key, value in counters.items()
                if key[1] in floor}
        weights = {(t.id, self.lane_of(t.id)): t.weight for t in self.config.tenants}
        return {"queued": queued, "running": running, "counters": counters,
                "queued_tokens": queued_tokens, "running_tokens": running_tokens, "debt": debt,
                "weights": weights,
                "budgets": self.admission.budget_state(self.clock()),
                "endpoints": list(self.endpoints.values()),
                "service": dict(self.scheduler.service),
                "counter_faults": self.scheduler.counter_faults}

    def close(self, keep_queued: bool = False) -> None:
        """Refuse new requests and release every queued one with a retryable 503.
        ``keep_queued``: refuse only new ones; the queued keep their turn (a later ``close()``
        releases those still queued)."""
        self._closed = True
        if keep_queued:
            return
        for ticket in list(self.gate.passages.values()):
            if ticket.dispatched_at is None:
                self.gate.drop(ticket, "shutdown", self.clock())

    @property
    def busy(self) -> int:
        """Requests in the picker, queued or running."""
        return len(self.gate.passages)


def _admitted(answer: Ticket | Refused | Turnaway) -> Ticket:
    """The gate's ticket, or the refusal its answer means, raised."""
    if isinstance(answer, Refused):
        raise refusal_error(answer)
    if isinstance(answer, Turnaway):
        if answer.reason == QUEUE_FULL:
            raise QueueFull("the fair queue is full")
        raise NoEndpoint("no endpoint is available for this request")
    return answer
