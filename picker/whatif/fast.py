"""The replay's fast mode: events per request, not steps per token (``python -m picker.whatif
--fast``).

It answers: *how can a day of traffic (millions of records) replay in minutes on one core?* The
exact replay (``picker.whatif.replay``) steps every engine every ``step_s`` and charges the gate
once per output token per step, then runs the gate's whole admit / pump / settle path (about
0.15-0.2 ms a request in CPython, most of it the endpoint ranking, the reserve and prefill rules,
health and the prefix and session bookkeeping). Here each request costs a handful of operations:

* **The fair order is the picker's own.** The gate is built from the config exactly as the pool
  simulator builds it (``picker.config.build``), and its core parts decide: ``Gate.choose_lane``
  (a lane the tenant may not ask for is refused), ``Admission.admit`` / ``start`` / ``finish``
  (budgets, caps, demotion, per-tenant queue limits; a tenant whose rules set none of them
  skips it, as it would only count its requests), the lanes' fair queues
  (``Scheduler.enqueue`` / ``peek`` / ``dispatch`` / ``finish``: VTC or the configured policy,
  weights, lane priority and ``minShare``), the tenant's output estimate
  (``Gate.expected_output``, learned as the gate learns it), ``queue.maxWait``,
  ``queue.maxQueued``, concurrency caps (parked as the gate parks them), the adaptive LIFO of a
  stale backlog (``newestFirstAfter``) and the light tenant's pass by a head that must wait.
* **Each endpoint is a batch that decodes one token a request a step**, as the simulator's
  engine does: a request dispatched at ``t`` emits its first token a step later and its last,
  the ``n``-th, ``n`` steps later while the batch fits its KV cache. Past the cache (the gate
  admits on what is held now, and streams grow) vLLM preempts and recomputes; that is modelled
  as the batch slowing to ``cache / held`` of a token a step (``_Endpoint``: a virtual clock
  per endpoint, in closed form), so a request's finish is a clock target fixed at its dispatch
  and only the endpoint's next finish is revised when its batch changes, or a client gives up
  first (``client_timeout_s``). Room is the gate's own rule (``fits``: the prompt beside what
  the endpoint holds, an empty endpoint takes any, least loaded first), on what the gate counts
  there now: prompts, a non-stream's estimate, and every streamed token so far, read off the
  clock, so no per-token work is needed to know it.
* **A stream is charged to the fair queue in ``chunks`` equal parts** at evenly spaced times of
  its decode (1: all at its end; the exact replay: every token), its prompt at dispatch, as the
  gate charges it. With 2 (the default) the counters move at the stream's middle and end.

What it gives up (measured in ``bench/results/whatif.md``): everything the gate decides from the
engines' scraped figures (their own queue, ``maxWaiting``, a scraped KV use above its count) and
the rules that need them or per-token growth: ``growthRoom``, ``maxPrefillTokens``, the idle
tenant reserve, priority engines and the gate's preemption for them, the engine queue, prefix
affinity, sessions, shedding lower lanes (a full queue turns the newcomer away), health; chunked
prefill (a prompt costs one step whatever its size: ``--prefill-ms-per-1k-tokens`` is ignored)
and the engine's own preemption order (its cost is modelled, as a batch slowed in proportion
when it outgrows the cache; which request pays is not). The config's use of any of these rules
is listed by ``unmodelled`` so the CLI can say so.

Memory: the requests in the pool and in the queue, the sums (``ReplayResult``), and per-tenant
state forgotten when idle as the gate forgets it (``prune``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from picker.config.build import admission_rules, cost_function, gate_rules
from picker.config.schema import PickerConfig
from picker.core import LaneSpec, Scheduler
from picker.core.admission import Admission, Refused, Reservation, TenantRules
from picker.core.gate import PRUNE_INTERVAL, QUEUE_FULL, Gate
from picker.core.request import Request
from picker.sim.pool import PoolSpec
from picker.whatif.log import Arrival, Spool
from picker.whatif.replay import (
    EXPIRY_CHECK_STEPS,
    LANE_NOT_ALLOWED,
    ReplayRecord,
    ReplayResult,
    arrival_demand,
)

DEFAULT_CHUNKS = 2
"""Parts a stream's output is charged to the fair queue in (see the module's docstring)."""

_FINISH, _CHARGE, _CANCEL = 0, 1, 2
_INF = math.inf
_ceil = math.ceil
_heappush, _heappop = heapq.heappush, heapq.heappop
SETTLED = 1e-6
"""Virtual tokens of float slack when a request's last token is judged out."""


class _Flow(Request):
    """One request in the fast replay: the scheduler's ``Request`` itself (its tenant, lane,
    prompt and ``arrival``: one object a request), with what the replay keeps of it."""

    __slots__ = ("cap", "demoted", "dispatched", "done", "endpoint", "first", "out_charged",
                 "output", "parked", "reservation", "started", "stream")

    def __init__(self, tenant: str, lane: str, arrived: float, prompt: int, output: int,
                 stream: bool, cap: int | None, reservation: Reservation | None,
                 demoted: bool) -> None:
        # ``Request.__init__(self, tenant, prompt, lane, cap or 0, 0, arrived)``, inline (a unit
        # test holds the two equal).
        self.tenant, self.prompt_tokens, self.lane = tenant, prompt, lane
        self.max_output_tokens, self.cached_prompt_tokens, self.arrival = cap or 0, 0, arrived
        self.id, self.resumes, self.program = "", False, 0
        self.seq, self.generated, self.estimated_output, self.charged = -1, 0, 0, 0.0
        self.state = "new"
        self.output, self.stream, self.cap = output, stream, cap
        self.reservation, self.demoted = reservation, demoted
        self.dispatched = -1.0
        self.started = 0.0
        """Its endpoint's virtual clock when it was dispatched."""
        self.first = 0.0
        self.endpoint: _Endpoint | None = None
        self.out_charged = 0
        """Output tokens charged to the fair queue so far (a non-stream: its estimate)."""
        self.parked = False
        self.done = False


class _Endpoint:
    """One engine as a batch whose every request decodes a token a step, on a virtual clock
    ``v`` (tokens each request has decoded since the clock's start).

    The engine holds ``h = a + n × v`` tokens (``n`` requests; ``a``: their prompts and half a
    block each, less the clock at each one's dispatch). While ``h`` is within the KV cache ``kv``
    the clock runs at one token a step; past it the engine cannot hold every request's next
    token and preempts some (vLLM recomputes them later), which is modelled as the whole batch
    slowing to ``kv / h`` of a token a step: then ``h² `` grows linearly in time
    (``dh/dt = n × kv / (h × step)``). A request of ``n`` output tokens finishes when the clock
    has advanced ``n`` past its start, so the batch's finish order is fixed at dispatch (a heap
    of clock targets) and only the next finish's time is revised when the batch changes.

    What the gate counts there is its own: ``g_fixed`` (prompts, a non-stream's estimate) plus
    its streams' tokens so far, ``g_streams × v − g_started``."""

    __slots__ = ("a", "busy_s", "busy_since", "finishing", "g_fixed", "g_started", "g_streams",
                 "kv", "n", "next_at", "pad", "step", "t", "v", "version")

    def __init__(self, kv: float, step: float, block_size: int) -> None:
        self.kv, self.step, self.pad = kv, step, block_size / 2
        self.t = self.v = 0.0
        self.n = 0.0
        """Requests in the batch: a whole number, held as a float, as ``g_streams`` is: both
        multiply floats at every clock read, where float by float is a specialised bytecode
        and int by float a generic call (the same products)."""
        self.a = 0.0
        self.g_fixed = self.g_started = 0.0
        self.g_streams = 0.0
        self.finishing: list[tuple[float, int, _Flow]] = []
        self.version = 0
        self.next_at = math.inf
        """When the finish event queued for it is due (inf: none queued)."""
        self.busy_since = self.busy_s = 0.0

    def at(self, t: float) -> float:
        """The clock at ``t`` (not before the last time asked), advanced to it."""
        dt = t - self.t
        if dt <= 0.0:
            return self.v
        self.t = t
        n = self.n
        if not n:
            return self.v
        v, a, kv = self.v, self.a, self.kv
        h = a + n * v
        if h < kv:
            full = (kv - a) / n  # the clock where the cache fills
            moved = dt / self.step
            if v + moved <= full:
                v = self.v = v + moved
                return v
            dt -= (full - v) * self.step
            v, h = full, kv
        v = self.v = v + (math.sqrt(h * h + 2.0 * n * kv * dt / self.step) - h) / n
        return v

    def time_to(self, target: float) -> float:
        """When the clock reaches ``target`` if the batch stays as it is."""
        v, n = self.v, self.n
        if target <= v or not n:
            return self.t
        a, kv, step = self.a, self.kv, self.step
        h = a + n * v
        t = self.t
        if h < kv:
            full = (kv - a) / n
            if target <= full:
                return t + (target - v) * step
            t += (full - v) * step
            h = kv
        end = a + n * target
        return t + (end * end - h * h) * step / (2.0 * n * kv)


def _unbounded(rules: TenantRules) -> bool:
    """Whether ``Admission`` admits every request under ``rules`` as it comes, reserving
    nothing that decides anything: no budget, queue or concurrency cap, no size limit."""
    return not rules.budgets and rules.max_queued is None and rules.max_concurrent is None \
        and rules.max_input_tokens is None and rules.max_output_tokens is None


def unmodelled(config: PickerConfig) -> list[str]:
    """The rules ``config`` turns on that the fast mode does not model (empty: none)."""
    rules = gate_rules(config)
    capacity = rules.capacity
    found = []
    if not rules.holding:
        found.append("pass-through scheduling (fcfs): modelled as holding")
    if capacity.growth_room:
        found.append("capacity.growthRoom")
    if capacity.max_prefill_tokens:
        found.append("capacity.maxPrefillTokens")
    if capacity.engine_queue:
        found.append("capacity.engineQueue")
    if rules.idle_tenant_reserve:
        found.append("the idle-tenant reserve")
    if rules.engine_policy == "priority":
        found.append("priority engines and preemption")
    if rules.affinity is not None:
        found.append("prefix affinity")
    if rules.sessions is not None:
        found.append("sessions")
    return found


def build_gate(config: PickerConfig, spec: PoolSpec) -> Gate:
    """The gate as the pool simulator builds it (``picker.sim.pool._Pool._gate``): its
    scheduler, admission and estimates are what the fast replay drives."""
    scheduler = Scheduler([LaneSpec(lane.name, lane.min_share) for lane in config.lanes],
                          policy=config.scheduling.policy, cost=cost_function(config))
    for tenant in config.tenants:
        scheduler.set_weight(tenant.id, tenant.weight)
    gate = Gate(gate_rules(config), scheduler, Admission(*admission_rules(config)), now=0.0)
    gate.set_endpoints({address: spec.kv_budget_tokens for address in spec.addresses()})
    return gate


MAX_ATTRIBUTES = 30
"""Attributes a ``FastReplay`` may have: past 30, CPython 3.11 no longer shares its instances'
attribute names (a class's "shared keys" hold 30), and every ``self.x`` of the replay becomes a
dictionary lookup (31 attributes cost 2.7 % more instructions a record; a unit test holds the
count)."""


class FastReplay:
    """The fast replay's state: the gate's core parts, the endpoints, the events (no more than
    ``MAX_ATTRIBUTES`` attributes)."""

    def __init__(self, config: PickerConfig, spec: PoolSpec, result: ReplayResult, *,
                 client_timeout_s: float, chunks: int = DEFAULT_CHUNKS) -> None:
        if chunks < 1:
            raise ValueError("chunks must be at least 1")
        self.gate = gate = build_gate(config, spec)
        self.scheduler, self.admission = gate.scheduler, gate.admission
        self.result = result
        self.step_s = spec.step_s
        self.budget = float(spec.kv_budget_tokens)
        # The engine's cache in whole blocks, as the simulator's engine has it.
        kv = spec.kv_budget_tokens // spec.block_size * spec.block_size
        self.endpoints = [_Endpoint(float(kv), spec.step_s, spec.block_size)
                          for _ in range(spec.endpoints)]
        self.client_timeout_s = client_timeout_s
        self.max_wait = config.queue.max_wait
        self.max_queued = gate.rules.max_queued
        self.newest_after = gate.rules.newest_first_after
        self.default_output = config.capacity.default_output_tokens
        self.known = frozenset(t.id for t in config.tenants)
        self.chunks = chunks
        self.caps = {t: rules.max_concurrent for t, rules in admission_rules(config)[0].items()
                     if rules.max_concurrent is not None}
        self.default_cap = admission_rules(config)[1].max_concurrent
        self.capped = bool(self.caps) or self.default_cap is not None
        """Whether any tenant has a concurrency cap (else ``_may_queue`` asks only if it is
        parked)."""
        self.lanes_of: dict[str, str] = {}
        """Per tenant, its lane (``Gate.lane_of``), for a request that asks for none."""
        self.free: dict[str, bool] = {}
        """Per tenant, whether its admission rules set nothing (no budget, cap or limit): its
        requests skip ``Admission``, which would only count them."""
        self.in_queue: dict[tuple[str, str], deque[_Flow]] = {}
        """Per (tenant, lane), its queued flows, oldest first (the adaptive LIFO's newest)."""
        self.tenant_queued: dict[str, int] = {}
        self.single: dict[str, _Flow] = {}
        """Tenants with exactly one request queued and none parked: the light ones."""
        self.parked: dict[str, deque[_Flow]] = {}
        self.running: dict[str, int] = {}
        self.events: list[tuple[float, int, int, Any, int]] = []
        """(when, order, kind, payload, version): each endpoint's next finish (the endpoint,
        and its ``version`` then), a stream's charges and a client's deadline (the flow, 0)."""
        self.order = 0
        self.deadlines: deque[tuple[float, _Flow]] = deque()
        """Queued requests by when ``queue.maxWait`` drops them (arrival order is their order)."""
        self.queued = 0
        self.last_end = 0.0
        """When the latest request ended (finished, dropped): the replay's span."""

    # -- arrivals --

    def send(self, arrival: tuple[Any, ...], now: float) -> None:
        """``arrival`` (an ``Arrival``, or a plain tuple of its fields: ``Spool.rows``) reaches
        the picker at ``now`` (seconds after the replay's start)."""
        _, _, tenant, _, lane_asked, prompt, output, max_tokens, stream, _ = arrival
        gate = self.gate
        if output is not None and tenant in self.known:  # ``arrival_demand``'s common case
            prompt = prompt or 1
        else:
            prompt, output = arrival_demand(Arrival._make(arrival), self.known, self.result,
                                            self.default_output)
        if lane_asked is None:  # its tenant's lane (``choose_lane``'s answer), looked up once
            lane = self.lanes_of.get(tenant)
            if lane is None:
                lane = self.lanes_of[tenant] = gate.lane_of(tenant)
        else:
            lane = gate.choose_lane(tenant, lane_asked)
            if lane is None:
                self._record(tenant, lane_asked or "", now, prompt, output, stream,
                             LANE_NOT_ALLOWED, now)
                return
        free = self.free.get(tenant)
        if free is None:
            free = self.free[tenant] = _unbounded(self.admission.rules_for(tenant))
        reservation: Reservation | None = None
        demoted = False
        clamped = max_tokens
        if not free:
            expected = gate.expected_output(tenant, max_tokens, stream, now)
            decision = self.admission.admit(tenant, lane, prompt, max_tokens, expected, now,
                                            cap_prompt_tokens=prompt)
            if isinstance(decision, Refused):
                self._record(tenant, lane, now, prompt, output, stream, decision.reason, now)
                return
            reservation, lane, demoted = decision.reservation, decision.lane, decision.demoted
            clamped = decision.max_output_tokens
        parked = self.parked  # the queued and the parked together against ``max_queued``
        if self.queued + (sum(map(len, parked.values())) if parked else 0) >= self.max_queued:
            if reservation is not None:
                self.admission.finish(reservation, 0, now)
            self._record(tenant, lane, now, prompt, output, stream, QUEUE_FULL, now)
            return
        if clamped is not None and output > clamped:
            output = clamped  # the engine stops at the cap admission sent
        flow = _Flow(tenant, lane, now, prompt, output, stream, clamped, reservation, demoted)
        if (not parked or tenant not in parked) and (not self.capped or self._may_queue(tenant)):
            # (``_may_queue``, its common answers inline)
            if not self.queued:
                # The queue is empty: where it fits now, it goes at once (``pump`` would choose
                # it), without the queue's round trip.
                endpoint = self._room(prompt, now)
                if endpoint is not None and self.scheduler.dispatch_alone(flow, now):
                    self._start(flow, endpoint, now)
                    return
            self._enqueue(flow, now)
            self.pump(now)
            if flow.dispatched < 0:  # it waits: queue.maxWait drops it unless it goes first
                self.deadlines.append((now + self.max_wait, flow))
        else:
            self.deadlines.append((now + self.max_wait, flow))
            flow.parked = True
            self.parked.setdefault(tenant, deque()).append(flow)
            self.single.pop(tenant, None)

    def _cap(self, tenant: str) -> int | None:
        return self.caps.get(tenant, self.default_cap) if tenant in self.known \
            else self.default_cap

    def _may_queue(self, tenant: str) -> bool:
        if tenant in self.parked:
            return False
        if not self.capped:
            return True
        cap = self._cap(tenant)
        return cap is None or self.tenant_queued.get(tenant, 0) + self.running.get(tenant, 0) \
            < cap

    def _enqueue(self, flow: _Flow, now: float) -> None:
        flow.parked = False
        self.scheduler.enqueue(flow, now)
        key = (flow.tenant, flow.lane)
        queue = self.in_queue.get(key)
        if queue is None:
            queue = self.in_queue[key] = deque()
        queue.append(flow)
        self.queued += 1
        count = self.tenant_queued[flow.tenant] = self.tenant_queued.get(flow.tenant, 0) + 1
        if count == 1 and flow.tenant not in self.parked:
            self.single[flow.tenant] = flow
        else:
            self.single.pop(flow.tenant, None)

    def _unqueue(self, flow: _Flow) -> None:
        key = (flow.tenant, flow.lane)
        queue = self.in_queue[key]
        if queue[0] is flow:
            queue.popleft()
        elif queue[-1] is flow:
            queue.pop()
        else:
            queue.remove(flow)
        if not queue:
            del self.in_queue[key]
        self.queued -= 1
        tenant = flow.tenant
        count = self.tenant_queued[tenant] - 1
        if count:
            self.tenant_queued[tenant] = count
            if count == 1 and tenant not in self.parked:
                self.single[tenant] = next(
                    f for (t, _), q in self.in_queue.items() if t == tenant for f in q)
        else:
            del self.tenant_queued[tenant]
            self.single.pop(tenant, None)

    def _unpark(self, tenant: str, now: float) -> None:
        parked = self.parked.pop(tenant, None)
        while parked and self._may_queue(tenant):
            self._enqueue(parked.popleft(), now)
        if parked:
            self.parked[tenant] = parked
            self.single.pop(tenant, None)

    # -- dispatching --

    def _room(self, prompt: int, now: float) -> _Endpoint | None:
        """The least loaded endpoint where ``prompt`` fits now (``fits``), or None."""
        best, best_used, budget = None, _INF, self.budget
        for endpoint in self.endpoints:
            # What the gate counts on this endpoint at ``now`` (inline: this runs per request).
            v = endpoint.at(now) if now > endpoint.t else endpoint.v
            used = endpoint.g_fixed + endpoint.g_streams * v - endpoint.g_started
            if used >= budget or (endpoint.n and used + prompt > budget):
                continue
            if used < best_used:
                best, best_used = endpoint, used
        return best

    def pump(self, now: float) -> None:
        """Dispatch while the fair queue's next request has room, or a light tenant's does."""
        scheduler = self.scheduler
        while self.queued:
            head = scheduler.peek(now)
            if head is None:
                return
            flow: _Flow = head  # type: ignore[assignment]  # the replay queues only flows
            if self.newest_after and now - flow.arrival >= self.newest_after:
                flow = self.in_queue[(flow.tenant, flow.lane)][-1]
            endpoint = self._room(flow.prompt_tokens, now)
            if endpoint is None:
                light = self._light(flow, now)
                if light is None:
                    return
                flow, endpoint = light
            self._dispatch(flow, endpoint, now)

    def _light(self, head: _Flow, now: float) -> tuple[_Flow, _Endpoint] | None:
        """A light tenant's queued request, in the head's lane or a higher one, that fits."""
        if not self.single:
            return None
        rank = self.gate._lane_rank
        head_rank = rank.get(head.lane, 0)
        for flow in self.single.values():
            if flow is head or rank.get(flow.lane, 0) > head_rank:
                continue
            endpoint = self._room(flow.prompt_tokens, now)
            if endpoint is not None:
                return flow, endpoint
        return None

    def _dispatch(self, flow: _Flow, endpoint: _Endpoint, now: float) -> None:
        self.scheduler.dispatch(flow, now)
        self._unqueue(flow)
        self._start(flow, endpoint, now)

    def _start(self, flow: _Flow, endpoint: _Endpoint, now: float) -> None:
        """``flow``, taken from the fair queue (and charged its prompt), starts on
        ``endpoint``."""
        if flow.reservation is not None:
            self.admission.start(flow.reservation)
        tenant = flow.tenant
        running = self.running
        running[tenant] = running.get(tenant, 0) + 1
        v = endpoint.at(now) if now > endpoint.t else endpoint.v
        flow.dispatched, flow.endpoint, flow.started = now, endpoint, v
        if not endpoint.n:
            endpoint.busy_since = now
        endpoint.n += 1.0
        prompt = flow.prompt_tokens
        endpoint.a += prompt + endpoint.pad - v
        if flow.stream:
            endpoint.g_fixed += prompt
            endpoint.g_streams += 1.0
            endpoint.g_started += v
        else:
            estimate = self.gate.expected_output(tenant, flow.cap, False, now)
            self.scheduler.charge_estimate(flow, estimate)
            flow.out_charged = estimate
            endpoint.g_fixed += prompt + estimate
        output = flow.output
        steps = output if output > 1 else 1
        self.order += 1
        _heappush(endpoint.finishing, (v + steps, self.order, flow))
        flow.first = endpoint.time_to(v + 1.0)
        self._reschedule(endpoint)
        limit = flow.arrival + self.client_timeout_s
        events, step_s, order = self.events, self.step_s, self.order
        if limit < now + 4.0 * (steps * step_s):  # it may outlast its client: a cancel
            order += 1                              # to check then
            _heappush(events, (limit if limit > now else now, order, _CANCEL, flow, 0))
        chunks = self.chunks
        if flow.stream and chunks > 1 and output > 1:
            # The stream's first chunks, each charged about when its last token is out.
            part = output / chunks
            if chunks == 2:  # the default: one, without the loop (``part * 1`` is ``part``)
                order += 1
                _heappush(events, (now + _ceil(part) * step_s, order, _CHARGE, flow, 0))
            else:
                for index in range(1, chunks):
                    order += 1
                    _heappush(events, (now + _ceil(part * index) * step_s, order, _CHARGE,
                                       flow, 0))
        self.order = order

    def _reschedule(self, endpoint: _Endpoint) -> None:
        """The endpoint's next finish, as its batch now stands (earlier ones are void). A batch
        within its cache keeps its pace, so a request joining it mostly leaves the next finish
        where it was: then the event already queued stands."""
        finishing = endpoint.finishing
        while finishing and finishing[0][2].done:
            _heappop(finishing)
        if not finishing:
            endpoint.version += 1
            endpoint.next_at = math.inf
            return
        at = endpoint.time_to(finishing[0][0])
        moved = at - endpoint.next_at
        if moved <= 1e-9 and moved >= -1e-9:  # (not chained: two specialised comparisons)
            return
        version = endpoint.version = endpoint.version + 1
        endpoint.next_at = at
        self.order += 1
        _heappush(self.events, (at, self.order, _FINISH, endpoint, version))

    # -- events --

    def _finished(self, endpoint: _Endpoint, now: float) -> None:
        """The endpoint's batch reached its next finish (an event of its current ``version``):
        every request done by now ends."""
        endpoint.next_at = math.inf
        v = endpoint.at(now) + SETTLED
        finishing = endpoint.finishing
        while finishing and finishing[0][0] <= v:
            flow = _heappop(finishing)[2]
            if not flow.done:
                self._finish(flow, now, flow.output)
        self._reschedule(endpoint)

    def _cancel(self, flow: _Flow, now: float) -> None:
        """Its client gave up: the engine aborts it, the gate settles what it got."""
        endpoint = flow.endpoint
        if flow.done or endpoint is None:
            return
        generated = min(flow.output, int(endpoint.at(now) - flow.started + SETTLED))
        self._finish(flow, now, generated)
        self._reschedule(endpoint)

    def _finish(self, flow: _Flow, now: float, generated: int) -> None:
        flow.done = True
        self.last_end = now
        endpoint = flow.endpoint
        assert endpoint is not None
        endpoint.n -= 1.0
        prompt = flow.prompt_tokens
        endpoint.a -= prompt + endpoint.pad - flow.started
        if flow.stream:
            endpoint.g_fixed -= prompt
            endpoint.g_streams -= 1.0
            endpoint.g_started -= flow.started
        else:
            endpoint.g_fixed -= prompt + flow.out_charged
        if not endpoint.n:
            endpoint.busy_s += now - endpoint.busy_since
            # Float drift of the running sums: an idle endpoint holds nothing.
            endpoint.a = endpoint.g_fixed = endpoint.g_started = 0.0
        tenant = flow.tenant
        running = self.running[tenant] - 1
        if running:
            self.running[tenant] = running
        else:
            del self.running[tenant]
        self.scheduler.finish_tokens(flow, prompt, generated)
        if flow.reservation is not None:
            self.admission.finish(flow.reservation, prompt + generated, now)
        outcome = "ok" if generated >= flow.output else "cancelled"
        cap = flow.cap
        if flow.stream and cap != 0:
            self.gate.estimates.learn_output(
                tenant, generated, now, stream=True,
                complete=outcome == "ok" and (cap is None or generated < cap))
        elif outcome == "ok" and cap != 0:
            self.gate.estimates.learn_output(tenant, generated, now)
        self.result.output_tokens += generated
        first = flow.first if generated and flow.first <= now else None
        self.result.add_fields(tenant, flow.lane, outcome, flow.demoted, flow.arrival,
                               flow.dispatched, first, now, prompt, generated)
        if self.parked and tenant in self.parked:
            self._unpark(tenant, now)
        if self.queued:
            self.pump(now)

    def _expire(self, now: float) -> None:
        """Queued requests past ``queue.maxWait`` are dropped (``queue_timeout``)."""
        deadlines = self.deadlines
        while deadlines and deadlines[0][0] <= now:
            _, flow = deadlines.popleft()
            if flow.dispatched >= 0 or flow.done:
                continue
            flow.done = True
            self.last_end = now
            if flow.parked:
                parked = self.parked[flow.tenant]
                parked.remove(flow)
                if not parked:
                    del self.parked[flow.tenant]
                    if self.tenant_queued.get(flow.tenant) == 1:
                        self.single[flow.tenant] = next(
                            f for (t, _), q in self.in_queue.items() if t == flow.tenant
                            for f in q)
            else:
                self.scheduler.cancel(flow)
                self._unqueue(flow)
            if flow.reservation is not None:
                self.admission.finish(flow.reservation, 0, now)
            self._record(flow.tenant, flow.lane, flow.arrival, flow.prompt_tokens, flow.output,
                         flow.stream, "queue_timeout", now, demoted=flow.demoted)
            if flow.tenant in self.parked:
                self._unpark(flow.tenant, now)

    def _record(self, tenant: str, lane: str, arrived: float, prompt: int, output: int,
                stream: bool, outcome: str, now: float, demoted: bool = False) -> None:
        self.result.add(ReplayRecord(tenant, "replay", arrived, prompt, output, stream,
                                     outcome=outcome, end_s=now, lane=lane, demoted=demoted))

    def advance(self, until: float) -> None:
        """Every event due at or before ``until``, in time order (queue timeouts first at a
        tie, as the exact replay drops before it pumps)."""
        events, deadlines, pop = self.events, self.deadlines, _heappop
        charge_output = self.scheduler.charge_output
        while True:
            if deadlines:
                deadline = deadlines[0][0]
                if deadline <= until and (not events or deadline <= events[0][0]):
                    self._expire(deadline)
                    continue
            if not events or events[0][0] > until:
                return
            at, _, kind, payload, version = pop(events)
            if kind == _CHARGE:
                # A stream's charge: its output so far, on its endpoint's clock, less what was
                # charged (here, not in a method of its own: one event a stream).
                endpoint = payload.endpoint
                if payload.done or endpoint is None:
                    continue
                v = endpoint.at(at) if at > endpoint.t else endpoint.v
                tokens = int(v - payload.started + SETTLED)
                if tokens > payload.output:
                    tokens = payload.output
                if tokens > payload.out_charged:
                    charge_output(payload, tokens - payload.out_charged)
                    payload.out_charged = tokens
            elif kind == _FINISH:
                if version == payload.version:  # else a finish since revised
                    self._finished(payload, at)
            else:
                self._cancel(payload, at)

    def prune(self, now: float) -> None:
        """Forget idle tenants' state as the gate does every ``PRUNE_INTERVAL`` (``Gate.
        forget_idle``: nothing a decision reads changes), so that a log of endless tenant ids
        holds only the active ones."""
        gate = self.gate
        self.admission.prune(now)
        gate.estimates.prune(now)
        active = set(self.tenant_queued) | set(self.running) | set(self.parked)
        self.scheduler.forget_idle(active, gate.rules.configured_tenants)
        if len(self.free) > 4096 or len(self.lanes_of) > 4096:
            self.free, self.lanes_of = {}, {}  # caches of the rules: read again when needed

    def pending(self) -> bool:
        return bool(self.events or self.queued or self.parked)

    def busy_s(self, now: float) -> float:
        return sum(e.busy_s + (now - e.busy_since if e.n else 0.0)
                   for e in self.endpoints)


def _enqueued(flow: _Flow) -> int:
    """The order a queued flow was queued in (the scheduler's ``seq``)."""
    return flow.seq


def replay_fast(config: PickerConfig, spec: PoolSpec,
                arrivals: Iterable[Arrival] | Iterable[tuple[Any, ...]] | Spool, *,
                start: float, client_timeout_s: float = 120.0, drain_s: float | None = None,
                bucket_s: float = 60.0, chunks: int = DEFAULT_CHUNKS,
                expired: Callable[[], bool] | None = None) -> ReplayResult:
    """Replay ``arrivals`` (in arrival order; ``start``: the unix time of the replay's 0) under
    ``config`` on ``spec``'s pool, event by event (see the module's docstring). The result has
    the exact replay's form; its ``ticks`` are ``spec.step_s`` steps of the replay's span.
    ``arrivals``: ``Arrival``s, plain tuples of their fields, or a ``Spool`` (read as such:
    ``Spool.rows``)."""
    result = ReplayResult(bucket_s=bucket_s, engines=spec.endpoints, step_s=spec.step_s)
    pool = FastReplay(config, spec, result, client_timeout_s=client_timeout_s, chunks=chunks)
    drain = client_timeout_s + config.queue.max_wait if drain_s is None else drain_s
    last = 0.0
    # A spool's chunks as they are read back (a loop over lists, not a generator resumed
    # each arrival); anything else an arrival at a time.
    chunked: Iterable[list[Any]] = arrivals.chunks() if isinstance(arrivals, Spool) \
        else ([arrival] for arrival in arrivals)
    next_prune = PRUNE_INTERVAL
    events, deadlines, send = pool.events, pool.deadlines, pool.send
    count = 0
    for chunk in chunked:
        for arrival in chunk:
            now = arrival[1] - start  # ``arrived``
            if now < last:
                now = last
            if (events and events[0][0] <= now) or (deadlines and deadlines[0][0] <= now):
                pool.advance(now)
            last = now
            if now >= next_prune:
                pool.prune(now)
                next_prune = now + PRUNE_INTERVAL
            send(arrival, now)
            if expired is not None:
                count += 1
                if count % EXPIRY_CHECK_STEPS == 0 and expired():
                    raise TimeoutError(f"the replay ran out of time after {now:,.0f} "
                                       "simulated seconds")
    pool.advance(last + drain)
    end = max(last, pool.last_end)
    queued = sorted((f for q in pool.in_queue.values() for f in q), key=_enqueued)
    for flow in queued + [f for q in pool.parked.values() for f in q] + [
            entry[2] for endpoint in pool.endpoints for entry in endpoint.finishing]:
        if not flow.done:
            flow.done = True
            result.unfinished += 1
            pool._record(flow.tenant, flow.lane, flow.arrival, flow.prompt_tokens, flow.output,
                         flow.stream, "unfinished", end, demoted=flow.demoted)
    result.ticks = max(1, math.ceil(end / spec.step_s - 1e-9))
    result.busy_engine_ticks = round(pool.busy_s(end) / spec.step_s)
    return result


__all__ = ["DEFAULT_CHUNKS", "FastReplay", "build_gate", "replay_fast",
           "unmodelled"]
