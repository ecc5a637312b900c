"""Holding requests until the fair queue and the pool's capacity say go, and metering them after.

It answers: *when does this request leave the queue, to which endpoint, and what is its tenant
charged?* The scheduling decisions are the pure core's (``picker.core``); this module adds what
needs a clock and an event loop: waiting with a timeout, cancellation, endpoint accounting, and
re-running the dispatch loop whenever capacity may have appeared (a request finished, a scrape
arrived). ``pump`` runs after every change. A request is held only while no endpoint has room
for it, or while it waits in fair order behind a head that has none (a light tenant's request
need not); ``capacity.idleTenantReserve`` adds one opt-in exception that keeps room for light
tenants. The config's meaning for the core (cost, capacity, admission rules) is in
``from_config``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from picker.config.schema import PickerConfig
from picker.core import LaneSpec, Request, Usage
from picker.core.admission import Admission, Refused, Reservation
from picker.core.estimates import TenantEstimates
from picker.core.health import HealthRules, on_dispatch, record_failure, record_success
from picker.core.lanes import Scheduler
from picker.core.selection import (
    EndpointState,
    LeastLoaded,
    Scorer,
    free_tokens,
    keeps_reserve,
    rank,
)
from picker.dispatch.from_config import (
    admission_rules,
    capacity_rules,
    cost_function,
    identity,
    metering_sink,
    refusal_error,
)
from picker.errors import (
    LaneNotAllowed,
    NoEndpoint,
    NotLeader,
    QueueFull,
    QueueTimeout,
    RequestError,
    ShuttingDown,
)
from picker.identity import OBJECTIVE_HEADER
from picker.metering import MeteringRecord, MeteringSink
from picker.metrics import PickerMetrics
from picker.openai import InferenceRequest

log = logging.getLogger(__name__)

OUTPUT_EWMA_ALPHA = 0.2
SCRAPE_SNAPSHOT_TIMEOUT = 5.0
"""Seconds a Prometheus scrape waits for the event loop to take the state snapshot."""
PRUNE_INTERVAL = 30.0
"""Seconds between sweeps that forget tenants whose budgets have refilled."""


@dataclass(eq=False)
class Ticket:
    """One request's passage through the picker."""

    tenant: str
    lane: str
    inference: InferenceRequest
    request: Request
    arrived_at: float
    subset: frozenset[str] | None = None
    destinations: list[str] = field(default_factory=list)
    endpoint: EndpointState | None = None
    dispatched_at: float | None = None
    first_byte_at: float | None = None
    reserved_tokens: int = 0
    """Tokens this request adds to its endpoint's in-flight count."""
    projected_tokens: int = 0
    """Tokens it is expected to hold at its end (prompt + expected output)."""
    outcome: str | None = None
    reservation: Reservation | None = None
    """Its hold on the tenant's budgets and caps (admission)."""
    max_tokens: int | None = None
    """The output limit the engine must get, when admission clamped or set it."""
    demoted: bool = False
    finish_reason: str | None = None
    """As the engine reported it (``stop``, ``length``), when the response said."""
    ratelimit_headers: dict[str, str] = field(default_factory=dict)
    """``x-ratelimit-*`` for the response, as admission saw the tenant's budgets."""
    parked: bool = False
    """Held outside the fair queue because its tenant is at its concurrency cap."""
    request_id: str = ""
    error: RequestError | None = None
    """Set when the request was shed from the queue for a higher lane."""
    _ready: asyncio.Future[None] | None = None


def _output_cap(ticket: Ticket) -> int | None:
    """The output cap the engine works to: admission's when it set one, else the body's (0, for
    embeddings, is a cap and not "none")."""
    return ticket.max_tokens if ticket.max_tokens is not None else ticket.inference.max_tokens


class Dispatcher:
    """The fair queue in front of the pool. One per picker process."""

    def __init__(self, config: PickerConfig, *, clock: Callable[[], float] = time.monotonic,
                 metrics: PickerMetrics | None = None, scorer: Scorer | None = None,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.wall_clock = wall_clock
        self.metrics = metrics if metrics is not None else PickerMetrics()
        self.scorer: Scorer = scorer if scorer is not None else LeastLoaded()
        self.endpoints: dict[str, EndpointState] = {}
        self._tickets: dict[Request, Ticket] = {}
        self.estimates = TenantEstimates(config.capacity.default_output_tokens)
        """Per tenant: prompt calibration and output estimates (see ``picker.core.estimates``)."""
        self._closed = False
        self.standby = False
        """A replica that is not the elected leader: it refuses requests (retryable 503)."""
        self._parked: dict[str, list[Ticket]] = {}
        """Per tenant, requests waiting for the tenant to drop under its concurrency cap."""
        self._in_queue: dict[str, list[Ticket]] = {}
        """Per tenant, its requests in the fair queue (parked ones not counted)."""
        self._single: dict[str, Ticket] = {}
        """Tenants with exactly one request in the fair queue (and none parked): the requests that
        may go ahead of a head that has to wait (see ``pump``)."""
        self._recent: dict[str, tuple[float, float]] = {}
        """Per tenant: last arrival and typical footprint (tokens), for ``idleTenantReserve``."""
        self.admission = Admission(*admission_rules(config))
        self._next_prune = clock() + PRUNE_INTERVAL
        self.metering: MeteringSink = metering_sink(config)
        self.config = config
        self.scheduler = self._new_scheduler(config)
        self.apply_config(config)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._loop_thread = threading.get_ident()
        self.metrics.add_state_collector(self._scrape_snapshot)

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
        return new

    def apply_config(self, config: PickerConfig) -> None:
        """Take a new config; tenants keep their counters, new charges use the new values.

        Raises ValueError for a change that cannot be applied live (lanes or policy while requests
        are in the picker); the caller keeps the old config.
        """
        old = self.config
        structural = (config.lanes != old.lanes or config.scheduling != old.scheduling
                      or config.cost != old.cost)
        if structural and config is not old and self._tickets:
            raise ValueError("lanes, scheduling policy and cost can change only while no "
                             "request is in the picker; retry when idle or restart")
        if config.metering != old.metering and config is not old:
            sink = metering_sink(config)  # a bad path raises before anything changed
        if structural and config is not old:
            self.scheduler = self._carry_over(self.scheduler, self._new_scheduler(config))
        configured = {tenant.id: tenant.weight for tenant in config.tenants}
        for tenant in list(self.scheduler.weights):
            if tenant not in configured:
                self.scheduler.set_weight(tenant, 1.0)  # back to the default weight
        for tenant, weight in configured.items():
            self.scheduler.set_weight(tenant, weight)
        if config.metering != old.metering and config is not old:
            self.metering.close()
            self.metering = sink
        self.admission.update(*admission_rules(config), self.clock())
        self.estimates.default_output = float(config.capacity.default_output_tokens)
        self.identity = identity(config)
        self.identity_headers = frozenset((*self.identity.header_names,
                                           config.tenancy.lane_header.lower(), OBJECTIVE_HEADER))
        """Headers that name who a request is or where it runs: sent twice, the request is
        refused."""
        self.config = config
        self.rules = capacity_rules(config)
        self.health_rules = HealthRules(config.health.consecutive_failures,
                                        config.health.base_ejection_time,
                                        config.health.max_ejection_time)
        self._tenant_lanes = {t.id: t.lane for t in config.tenants if t.lane is not None}
        self._allowed_lanes = {t.id: frozenset((t.lane or config.lanes[0].name,
                                                *t.allowed_lanes)) for t in config.tenants}
        self._lane_rank = {lane.name: i for i, lane in enumerate(config.lanes)}
        pool_budget = config.capacity.kv_budget_tokens
        wanted = {e.address: e.kv_budget_tokens or (pool_budget if isinstance(pool_budget, int)
                                                     else None)
                  for e in config.endpoints}
        for address, state in self.endpoints.items():
            state.draining = address not in wanted
            state.configured_budget = wanted.get(address, state.configured_budget)
        for address, budget in wanted.items():
            if address not in self.endpoints:
                self.endpoints[address] = EndpointState(address, configured_budget=budget)
        self._forget_drained()
        self.metrics.set_known_tenants(t.id for t in config.tenants)
        self.pump()

    def _forget_drained(self) -> None:
        for address in [a for a, e in self.endpoints.items()
                        if e.draining and e.inflight_requests == 0]:
            del self.endpoints[address]

    @property
    def holding(self) -> bool:
        """False in pass-through (``fcfs``) mode: requests are dispatched at once."""
        return self.config.scheduling.policy != "fcfs"

    def lane_of(self, tenant: str) -> str:
        """The tenant's configured lane, else the first lane."""
        return self._tenant_lanes.get(tenant) or self.config.lanes[0].name

    def choose_lane(self, tenant: str, asked: str | None) -> str:
        """The lane a request runs in: the tenant's own, or one its policy allows it to ask for.

        Raises LaneNotAllowed for any other lane.
        """
        default = self.lane_of(tenant)
        if not asked or asked == default:
            return default
        if asked not in self._allowed_lanes.get(tenant, ()):
            raise LaneNotAllowed(f"lane {asked!r} is not allowed for this tenant")
        return asked

    def engine_priority(self, lane: str) -> int | None:
        """The vLLM ``priority`` the lane's requests carry (``None``: the lane sets none)."""
        return self.config.lanes[self._lane_rank[lane]].engine_priority

    # -- the lifecycle --

    async def admit(self, tenant: str, inference: InferenceRequest,
                    subset: frozenset[str] | None = None, lane: str | None = None,
                    request_id: str = "") -> Ticket:
        """Admit a request, queue it and wait for its turn; returns it dispatched.

        ``lane``: the lane asked for (already checked with ``choose_lane``); default the
        tenant's. Raises a RequestError subclass when the request is refused; cancellation (the
        client went away) removes it from the queue uncharged.
        """
        if self._closed:
            raise ShuttingDown("the picker is shutting down")
        if self.standby:
            raise NotLeader("this picker replica is a standby; the leader serves")
        now = self.clock()
        lane = lane or self.lane_of(tenant)
        # Only whether one exists: ranking them here would be work pump() does again.
        if not any(e.in_service(now) and (subset is None or e.address in subset)
                   for e in self.endpoints.values()):
            raise NoEndpoint("no endpoint is available for this request")
        # The tenant's own calibration only: no other tenant's reports move this estimate, and
        # the cap is judged on at least the body's own size (``TenantEstimates.prompt_floor``).
        prompt = self.estimates.prompt_tokens(tenant, inference.model, inference.prompt_tokens,
                                              now)
        expected = self._expected_output(tenant, inference.max_tokens, inference.stream)
        self._note_arrival(tenant, prompt + expected, now)
        decision = self.admission.admit(
            tenant, lane, prompt, inference.max_tokens, expected, now,
            cap_prompt_tokens=self.estimates.prompt_floor(inference.prompt_tokens, prompt))
        if isinstance(decision, Refused):
            raise refusal_error(decision)
        if self._queued_total() >= self.config.queue.max_queued \
                and not self._shed_for(decision.lane):
            self.admission.finish(decision.reservation, 0, now)
            raise QueueFull("the fair queue is full")
        if decision.demoted:
            self.metrics.demotions.labels(tenant, lane, decision.lane).inc()
        lane = decision.lane
        max_tokens = decision.max_output_tokens
        request = Request(tenant=tenant, prompt_tokens=prompt, lane=lane,
                          max_output_tokens=max_tokens or 0, arrival=now)
        ticket = Ticket(tenant, lane, inference, request, now, subset,
                        reservation=decision.reservation, demoted=decision.demoted,
                        max_tokens=max_tokens if max_tokens != inference.max_tokens else None,
                        request_id=request_id)
        ticket._ready = asyncio.get_running_loop().create_future()
        self._tickets[request] = ticket
        self._place(ticket, now)
        if ticket.dispatched_at is not None:
            return ticket  # an endpoint had room: no wait (the common, uncontended case)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that lands
            # just after the request was dispatched, leaking its slot.
            async with asyncio.timeout(self.config.queue.max_wait):
                await asyncio.shield(ticket._ready)
        except TimeoutError:
            if ticket.dispatched_at is None:
                self._drop_queued(ticket, "queue_timeout")
                self.pump()  # it may have been the head that blocked others
                timeout = QueueTimeout(f"waited {self.config.queue.max_wait:g}s for capacity")
                timeout.metered = True
                raise timeout from None
        except asyncio.CancelledError:
            if ticket.dispatched_at is None:
                self._drop_queued(ticket, "cancelled")
                self.pump()
            else:
                self.complete(ticket, None, "cancelled")
            raise
        if ticket.outcome is not None and ticket.dispatched_at is None:
            error = ticket.error or ShuttingDown("the picker is shutting down")
            error.metered = True
            raise error
        return ticket

    def _note_arrival(self, tenant: str, tokens: int, now: float) -> None:
        """Remember when the tenant last sent and how big its requests are (for the reserve)."""
        if self.config.capacity.idle_tenant_reserve:
            _, footprint = self._recent.get(tenant, (now, float(tokens)))
            self._recent[tenant] = (now, footprint + OUTPUT_EWMA_ALPHA * (tokens - footprint))

    def _place(self, ticket: Ticket, now: float) -> None:
        """Into the fair queue (dispatched at once if it may go), or parked at the tenant's
        concurrency cap; pass-through mode dispatches it at once."""
        tenant = ticket.tenant
        if self._may_queue(tenant) or not self.holding:
            self._enqueue(ticket, now)
        else:
            ticket.parked = True
            self._parked.setdefault(tenant, []).append(ticket)
            self._single.pop(tenant, None)
        if not self.holding:
            self._dispatch(ticket, self.candidates(ticket.subset, require_room=False), now)
        elif not ticket.parked:
            self.pump()

    def _expected_output(self, tenant: str, max_tokens: int | None, stream: bool = False) -> int:
        # Streams have their own estimate, learned from the streams' counted output: a tenant's
        # short non-streaming answers cannot talk down how much room its streams are given.
        average = self.estimates.output(tenant, self.clock(), stream=stream)
        if max_tokens is None:
            return max(1, round(average))
        # A cap of 0 (embeddings) means no output at all: the estimate is 0, not 1.
        return min(max_tokens, max(1, round(min(average, max_tokens))))

    def _queued_total(self) -> int:
        # Counted, not scanned: this runs for every request admitted.
        return self.scheduler.queued() + sum(map(len, self._parked.values()))

    def _enqueue(self, ticket: Ticket, now: float) -> None:
        ticket.parked = False
        self.scheduler.enqueue(ticket.request, now)
        self._queue_add(ticket)

    def _shed_for(self, lane: str) -> bool:
        """Make room in a full queue for a request of ``lane``: refuse the newest queued request
        of the lowest lane below it (``shedLowerLanes``). False when there is none."""
        if self.config.queue.overload != "shedLowerLanes":
            return False
        rank = self._lane_rank.get(lane, 0)
        lower = [t for t in self._tickets.values() if t.dispatched_at is None
                 and self._lane_rank.get(t.lane, 0) > rank]
        if not lower:
            return False
        victim = max(lower, key=lambda t: (self._lane_rank.get(t.lane, 0), t.arrived_at))
        victim.error = QueueFull(f"shed from the full queue for a request of lane {lane!r}")
        self._drop_queued(victim, "shed")
        if victim._ready is not None and not victim._ready.done():
            victim._ready.set_result(None)
        return True

    def _may_queue(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` may enter the fair queue: every request there may be
        dispatched, so queued plus running stays within the tenant's concurrency cap."""
        if tenant in self._parked:
            return False  # first in, first out among the tenant's own requests
        cap = self.admission.rules_for(tenant).max_concurrent
        return cap is None or \
            len(self._in_queue.get(tenant, ())) + self.admission.running(tenant) < cap

    def _queue_add(self, ticket: Ticket) -> None:
        queued = self._in_queue.setdefault(ticket.tenant, [])
        queued.append(ticket)
        self._update_single(ticket.tenant, queued)

    def _queue_remove(self, ticket: Ticket) -> None:
        queued = self._in_queue[ticket.tenant]
        queued.remove(ticket)
        if not queued:
            del self._in_queue[ticket.tenant]
        self._update_single(ticket.tenant, queued)

    def _update_single(self, tenant: str, queued: list[Ticket]) -> None:
        if len(queued) == 1 and tenant not in self._parked:
            self._single[tenant] = queued[0]
        else:
            self._single.pop(tenant, None)

    def _unpark(self, tenant: str, now: float) -> None:
        parked = self._parked.pop(tenant, None)
        while parked and self._may_queue(tenant):
            self._enqueue(parked.pop(0), now)
        if parked:
            self._parked[tenant] = parked
            self._single.pop(tenant, None)

    # -- endpoint health (outlier ejection, ``picker.core.health``) --

    def endpoint_failed(self, address: str, reason: str) -> None:
        """A scrape of ``address`` failed, or a request sent there never reached its engine."""
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            return
        now = self.clock()
        # The last endpoint in service is never ejected (see picker.core.health).
        others = any(e is not endpoint and e.in_service(now) for e in self.endpoints.values())
        if record_failure(endpoint.health, now, self.health_rules, reason, may_eject=others):
            log.warning("endpoint %s ejected for %.3gs after %s", address,
                        endpoint.health.ejected_until - now, reason)

    def endpoint_ok(self, address: str) -> None:
        """``address`` answered (a scrape, or a response from its engine)."""
        endpoint = self.endpoints.get(address)
        if endpoint is not None and record_success(endpoint.health, self.clock(),
                                                   self.health_rules):
            log.warning("endpoint %s restored", address)
            self.pump()

    def upstream_failed(self, ticket: Ticket, reason: str) -> None:
        """The gateway reports that the request never reached an engine (connect failure,
        reset before the response began): its endpoint's failure counts towards ejection and
        the request is settled to nothing (``upstream_failed``)."""
        if ticket.outcome is not None or ticket.dispatched_at is None:
            return
        if ticket.endpoint is not None:
            self.endpoint_failed(ticket.endpoint.address, reason)
        self.complete(ticket, Usage(0, 0, 0), "upstream_failed")

    def served_by(self, ticket: Ticket, address: str) -> None:
        """The gateway reports the endpoint that actually served the request (after a retry it
        may be a fallback): its load moves there, so the endpoint that failed is not charged."""
        served = self.endpoints.get(address)
        primary = ticket.endpoint
        if served is None or primary is None or served is primary or ticket.outcome is not None:
            return
        # The gateway retries only when the primary failed (connect failure, reset).
        self.endpoint_failed(primary.address, "the gateway retried on a fallback")
        for endpoint, sign in ((primary, -1), (served, 1)):
            endpoint.inflight_tokens += sign * ticket.reserved_tokens
            endpoint.projected_tokens += sign * ticket.projected_tokens
            endpoint.inflight_requests += sign
        ticket.endpoint = served

    def on_first_byte(self, ticket: Ticket) -> None:
        if ticket.first_byte_at is None:
            ticket.first_byte_at = self.clock()
            self.metrics.ttft.labels(ticket.tenant, ticket.lane) \
                .observe(ticket.first_byte_at - ticket.arrived_at)

    def on_output_tokens(self, ticket: Ticket, tokens: int) -> None:
        """Tokens streamed back: charge them and count them against the endpoint."""
        if tokens <= 0 or ticket.outcome is not None or ticket.dispatched_at is None:
            return
        self.scheduler.charge_output(ticket.request, tokens)
        if ticket.inference.stream and ticket.endpoint is not None:
            # A streaming request's KV footprint grows with each token; a non-streaming one had
            # its whole estimate reserved at dispatch.
            ticket.endpoint.inflight_tokens += tokens
            ticket.reserved_tokens += tokens

    def complete(self, ticket: Ticket, usage: Usage | None, outcome: str) -> None:
        """The request ended (``ok``, ``error``, ``cancelled``, ``unmetered``,
        ``upstream_failed``): settle and free its slot.

        Without ``usage`` it settles to what was counted: the estimated prompt and the output
        tokens seen (``unmetered``, a response the gateway never showed: the output estimate).
        Calling it again does nothing.
        """
        if ticket.outcome is not None or ticket.dispatched_at is None:
            return
        ticket.outcome = outcome
        request = ticket.request
        reported = usage is not None
        if usage is None:
            # A non-streaming answer without usage: the output is unknown, so the estimate stands;
            # likewise for a response the gateway never showed the picker (``unmetered``).
            output = request.generated
            if outcome == "ok" and not ticket.inference.stream:
                output = max(output, request.estimated_output)
            elif outcome == "unmetered":
                output = max(output, self._expected_output(
                    ticket.tenant, _output_cap(ticket), ticket.inference.stream))
            usage = Usage(request.prompt_tokens, output, 0)
        self.scheduler.finish(request, usage)
        del self._tickets[request]
        if ticket.endpoint is not None:
            ticket.endpoint.inflight_tokens -= ticket.reserved_tokens
            ticket.endpoint.projected_tokens -= ticket.projected_tokens
            ticket.endpoint.inflight_requests -= 1
            ticket.endpoint.completed_since_scrape += 1
            ticket.endpoint.released_since_scrape += ticket.reserved_tokens
            if outcome == "ok":  # its engine answered
                record_success(ticket.endpoint.health, self.clock(), self.health_rules)
        now = self.clock()
        if reported and usage.prompt_tokens > 0:
            # How the engine's tokenizer compares with the body estimate, per tenant and model.
            self.estimates.learn_prompt(ticket.tenant, ticket.inference.model,
                                        ticket.inference.prompt_tokens, usage.prompt_tokens, now)
        # Requests without output (embeddings) would drag the tenant's average towards 0.
        cap = _output_cap(ticket)
        if ticket.inference.stream and cap != 0:
            # A stream's own counted output; one cut short (cancelled, failed, stopped at its
            # max_tokens) may only raise the estimate.
            self.estimates.learn_output(
                ticket.tenant, usage.completion_tokens, now, stream=True,
                complete=outcome == "ok" and (cap is None or usage.completion_tokens < cap))
        elif outcome == "ok" and reported and cap != 0:
            self.estimates.learn_output(ticket.tenant, usage.completion_tokens, now)
        if ticket.reservation is not None and ticket.reservation.state != "done":
            self.admission.finish(ticket.reservation,
                                  usage.prompt_tokens + usage.completion_tokens, now)
        self._unpark(ticket.tenant, now)
        self._record_done(ticket, usage, outcome)
        self._meter(ticket, usage, outcome, now, estimated=not reported)
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_INTERVAL
            self.forget_idle(now)
        self._forget_drained()
        self.pump()

    def forget_idle(self, now: float) -> None:
        """Forget per-tenant state that forgetting cannot change a decision for: admission
        buckets refilled to full, estimates past their ttl (they read as the default), VTC
        counters at or below the lift floor (re-created identically by the lift), and reserve
        entries past their window. Runs every ``PRUNE_INTERVAL`` from ``complete``."""
        self.admission.prune(now)
        self.estimates.prune(now)
        active = {ticket.tenant for ticket in self._tickets.values()}
        self.scheduler.forget_idle(active, {tenant.id for tenant in self.config.tenants})
        window = self.config.capacity.idle_tenant_reserve
        self._recent = {t: seen for t, seen in self._recent.items() if now - seen[0] <= window}

    def tenants_held(self) -> dict[str, int]:
        """How many tenants each part of the picker holds state for (memory, benchmarks)."""
        return {"admission": self.admission.tracked_tenants(),
                "estimates": len(self.estimates.tenants()),
                "scheduler": self.scheduler.tenants_held(),
                "queues": len(self._in_queue) + len(self._parked),
                "recent": len(self._recent)}

    def ratelimit_headers(self, tenant: str) -> dict[str, str]:
        """``x-ratelimit-*`` headers for ``tenant`` now (empty without budgets or caps)."""
        return self.admission.headers(tenant, self.clock())

    def reject(self, tenant: str, error: RequestError, *, model: str | None = None,
               lane: str | None = None, request_id: str = "") -> None:
        """Count a refused request, and meter it unless it already was (it had queued)."""
        self.metrics.rejections.labels(tenant, error.metric_label).inc()
        if error.metered or not self.metering.enabled:
            return
        self.metering.write(MeteringRecord(
            request_id=request_id, timestamp=self.wall_clock(), tenant_id=tenant, model=model,
            priority_lane=lane or self.lane_of(tenant), outcome=error.metric_label,
            finish_reason="rejected",
            endpoint=None, prompt_tokens=0, completion_tokens=0, cached_prompt_tokens=0,
            estimated=False, cost=0.0, demoted=False, queue_ms=0.0, ttft_ms=None, e2e_ms=0.0))

    # -- dispatching --

    def pump(self) -> None:
        """Dispatch queued requests while the fair queue's next choice has an endpoint with room."""
        if not self.holding:
            return
        now = self.clock()
        scheduler = self.scheduler
        while scheduler.queued():
            request = scheduler.peek(now)
            if request is None:
                return
            ticket = self._tickets[request]
            candidates = self.candidates(ticket.subset, require_room=True, now=now,
                                          prompt_tokens=request.prompt_tokens)
            if candidates and self._backlogged(ticket.tenant):
                reserve = self._idle_reserve(now, ticket.tenant)
                if reserve:
                    # Only endpoints that leave the room kept for a light tenant's next request
                    # somewhere: packing a backlogged tenant onto one endpoint keeps another free.
                    pool, size = list(self.endpoints.values()), self._projected(ticket)
                    candidates = [c for c in candidates
                                  if keeps_reserve(pool, c, size, reserve, now, self.rules)]
            if not candidates:
                # The head waits for room. A light tenant's request that fits need not wait
                # behind it: light tenants have one request queued at most, so they cannot
                # starve the head, and holding them would leave room unused.
                light = self._light_request(now, ticket)
                if light is None:
                    return
                ticket, candidates = light
            self._dispatch(ticket, candidates, now)

    def _projected(self, ticket: Ticket) -> int:
        return ticket.request.prompt_tokens + self._expected_output(
            ticket.tenant, _output_cap(ticket), ticket.inference.stream)

    def _backlogged(self, tenant: str) -> bool:
        """More than one request of the tenant is waiting: it keeps the pool busy by itself.
        (A light tenant has at most the one that just arrived.)"""
        return len(self._in_queue.get(tenant, ())) > 1 or tenant in self._parked

    def _idle_reserve(self, now: float, exclude: str) -> float:
        """Tokens to keep free for recently active tenants that are not backlogged."""
        window = self.config.capacity.idle_tenant_reserve
        if not window:
            return 0.0
        reserve = 0.0
        for tenant, (last, footprint) in list(self._recent.items()):
            if now - last > window:
                del self._recent[tenant]
            elif tenant != exclude and not self._backlogged(tenant):
                reserve = max(reserve, footprint)
        return reserve

    def _light_request(self, now: float,
                       head: Ticket) -> tuple[Ticket, list[EndpointState]] | None:
        """The earliest queued request of a light tenant, in the head's lane or a higher one,
        that has room."""
        free = max((free_tokens(e, now, self.rules, projected=False)
                    for e in self.endpoints.values()), default=0.0)
        if free <= 0:
            return None
        head_rank = self._lane_rank.get(head.lane, 0)
        for ticket in self._single.values():  # about arrival order; no sort on this hot path
            if ticket is head or ticket.request.prompt_tokens > free \
                    or self._lane_rank.get(ticket.lane, 0) > head_rank:
                continue
            candidates = self.candidates(ticket.subset, require_room=True, now=now,
                                         prompt_tokens=ticket.request.prompt_tokens)
            if candidates:
                return ticket, candidates
        return None

    def candidates(self, subset: frozenset[str] | None = None, *, require_room: bool = False,
                   now: float | None = None, prompt_tokens: int = 0) -> list[EndpointState]:
        """Endpoints that may take a request (in ``subset``, when given), best first."""
        pool = [e for e in self.endpoints.values() if subset is None or e.address in subset]
        return rank(pool, prompt_tokens, self.clock() if now is None else now, self.rules,
                    self.scorer, require_room=require_room)

    def _dispatch(self, ticket: Ticket, candidates: list[EndpointState], now: float) -> None:
        request = ticket.request
        self.scheduler.dispatch(request, now)
        self._queue_remove(ticket)
        # Past its concurrency cap only in pass-through mode, which dispatches at once.
        if ticket.reservation is not None and (self.holding or
                                               self.admission.may_start(ticket.tenant)):
            self.admission.start(ticket.reservation)
        ticket.ratelimit_headers = self.admission.headers(ticket.tenant, now)
        primary = candidates[0]
        ticket.endpoint = primary
        ticket.destinations = [e.address for e in
                               candidates[: 1 + self.config.routing.fallback_endpoints]]
        ticket.dispatched_at = now
        ticket.reserved_tokens = request.prompt_tokens
        if not ticket.inference.stream:
            estimate = self.output_estimate(ticket)
            self.scheduler.charge_estimate(request, estimate)
            ticket.reserved_tokens += estimate
        primary.inflight_tokens += ticket.reserved_tokens
        primary.inflight_requests += 1
        on_dispatch(primary.health, now)
        ticket.projected_tokens = self._projected(ticket)
        primary.projected_tokens += ticket.projected_tokens
        self.metrics.queue_wait.labels(ticket.tenant, ticket.lane).observe(now - ticket.arrived_at)
        if ticket._ready is not None and not ticket._ready.done():
            ticket._ready.set_result(None)

    def output_estimate(self, ticket: Ticket) -> int:
        """Expected output of a non-streaming request: the tenant's moving average, capped."""
        return self._expected_output(ticket.tenant, _output_cap(ticket))

    def _drop_queued(self, ticket: Ticket, outcome: str) -> None:
        if ticket.outcome is not None:
            return
        ticket.outcome = outcome
        now = self.clock()
        if ticket.parked:
            self._parked[ticket.tenant].remove(ticket)
            if not self._parked[ticket.tenant]:
                del self._parked[ticket.tenant]
                self._update_single(ticket.tenant, self._in_queue.get(ticket.tenant, []))
        else:
            self.scheduler.cancel(ticket.request)
            self._queue_remove(ticket)
        self._tickets.pop(ticket.request, None)
        if ticket.reservation is not None:
            self.admission.finish(ticket.reservation, 0, now)  # nothing was served
        self._unpark(ticket.tenant, now)
        self.metrics.requests.labels(ticket.tenant, ticket.lane, outcome).inc()
        self._meter(ticket, Usage(0, 0, 0), outcome, now)
        # A timeout's rejection is counted where it is refused (``reject``), not here.

    def _meter(self, ticket: Ticket, usage: Usage, outcome: str, now: float,
               estimated: bool = False) -> None:
        """One metering record for a request that got into the queue."""
        if not self.metering.enabled:
            return
        end_ms = (now - ticket.arrived_at) * 1000
        self.metering.write(MeteringRecord(
            request_id=ticket.request_id, timestamp=self.wall_clock(), tenant_id=ticket.tenant,
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
            e2e_ms=end_ms))

    def _record_done(self, ticket: Ticket, usage: Usage, outcome: str) -> None:
        # The metrics fold unconfigured tenants into "other" themselves (TenantCapped).
        m, label = self.metrics, ticket.tenant
        m.requests.labels(label, ticket.lane, outcome).inc()
        m.service_tokens.labels(label, ticket.lane, "prompt").inc(usage.prompt_tokens)
        m.service_tokens.labels(label, ticket.lane, "completion").inc(usage.completion_tokens)
        m.weighted_service.labels(label, ticket.lane).inc(max(0.0, ticket.request.charged))

    # -- state --

    def snapshot(self) -> dict[str, Any]:
        """Live state for metrics and the admin view."""
        queued: dict[tuple[str, str], int] = {}
        running: dict[tuple[str, str], int] = {}
        queued_tokens: dict[tuple[str, str], int] = {}
        running_tokens: dict[tuple[str, str], int] = {}
        for ticket in self._tickets.values():
            key = (ticket.tenant, ticket.lane)
            if ticket.dispatched_at is not None:
                running[key] = running.get(key, 0) + 1
                running_tokens[key] = running_tokens.get(key, 0) + ticket.reserved_tokens
            else:
                queued[key] = queued.get(key, 0) + 1
                queued_tokens[key] = queued_tokens.get(key, 0) + ticket.request.prompt_tokens
        counters = {}
        for tenant in set(self.scheduler.service) | {t.tenant for t in self._tickets.values()}:
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
                "service": dict(self.scheduler.service)}

    def close(self) -> None:
        """Refuse new requests and release every queued one with a retryable 503."""
        self._closed = True
        for ticket in list(self._tickets.values()):
            if ticket.dispatched_at is None:
                self._drop_queued(ticket, "shutdown")
                if ticket._ready is not None and not ticket._ready.done():
                    ticket._ready.set_result(None)

    @property
    def busy(self) -> int:
        """Requests in the picker, queued or running."""
        return len(self._tickets)
