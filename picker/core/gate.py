"""The gate: which queued request leaves next, to which endpoint, and what its tenant is charged.

It answers every question the picker asks about a request between its headers and its end, in
one place and without a clock or an event loop (time is passed in): may it queue (admission,
caps, a full queue, shedding a lower lane), how big is it (the tenant's own estimates), may it
enter the fair queue or must it park at its tenant's concurrency cap, which queued request goes
now and where (the fair queue's head when an endpoint has room; a light tenant's request ahead
of a head that has to wait; the idle-tenant reserve), what the engine is asked (its priority),
and how it is settled. The asyncio dispatcher (``picker.dispatch``) adds futures, timeouts and
cancellation; the pool simulator (``picker.sim.pool``) drives the very same object against
simulated engines, so what the simulator shows is what the gateway does.

An adapter observes the gate's decisions through a ``GateListener``: a request dispatched, one
that left the queue unserved, one settled. The gate never calls back into the gate from there.

Invariants (checked in ``tests/unit/test_gate.py``):

* every request in the fair queue may be dispatched: queued plus running stays within its
  tenant's concurrency cap (the others are parked, first in first out per tenant, but for
  calls of programs in progress, which go first: ``sessions.next_parked``);
* ``single`` holds exactly the tenants with one request in the fair queue and none parked;
* an endpoint's ``inflight_requests`` is the count of the requests dispatched there and not
  yet settled; its ``inflight_tokens``/``projected_tokens`` are the sums over them of
  ``reserved_tokens``/``projected_tokens`` less each one's ``prefix_tokens``, plus the tokens of
  the distinct prompt blocks they hold there (``inflight_blocks``: a block shared by several
  requests counts once, as the engine's prefix cache stores it once); all three return to 0
  when everything sent there has ended.
* an endpoint's ``engine_queued`` is the number of requests dispatched there, not yet settled,
  that are ``engine_queued``: sent where they did not fit (``fits``) and still ``prefilling``
  (a non-streaming one, whose first token is never seen, until it ends); it reaches at most
  ``capacity.engine_queue`` through dispatches (``queue_slot``).
* an endpoint's ``prefill_tokens`` is the sum of the prompts of the requests dispatched there,
  not yet settled, that are ``prefilling`` (streams whose first output token has not come back,
  or, for those whose tokens the picker does not see, that no read of the engine has shown
  out of its waiting queue: ``scraped``); its ``prefill_computed`` is the same sum less the
  part of each prompt expected cached there at dispatch (``prefill_counted``).
* ``occupancy`` holds, per lane and tenant, the sum of ``reserved_tokens`` over its requests
  dispatched and not yet settled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from picker.core.admission import Admission, Refused, Reservation
from picker.core.cost import request_cost
from picker.core.estimates import TenantEstimates
from picker.core.health import HealthRules, on_dispatch, record_failure, record_success
from picker.core.lanes import Scheduler
from picker.core.occupancy import Occupancy
from picker.core.prefix import (
    DEFAULT_BLOCK_CHARS,
    AffinityRules,
    InflightBlocks,
    PrefixIndex,
    cached_estimate,
    covered_tokens,
    freshness,
    prefix_patience,
)
from picker.core.request import Request, Usage
from picker.core.reserve import (
    Demand,
    ReserveRules,
    is_light,
    new_demand,
    pool_reserve,
    reserved_requests,
    standing_room,
    tenant_reserve,
)
from picker.core.selection import (
    CapacityRules,
    EndpointState,
    LeastLoaded,
    Scorer,
    fits,
    free_tokens,
    keeps_reserve,
    observe,
    peak_growth,
    peak_growth_with,
    rank,
    takes_backlogged,
)
from picker.core.sessions import SessionId, SessionRules, SessionTable, next_parked, prefer

PRUNE_INTERVAL = 30.0
"""Seconds between sweeps that forget tenants whose state no longer changes a decision."""

UNDER_SERVED = 0.5
"""With priority engines, a tenant holding less than this fraction of its weighted share of its
lane's running work gets the light standing whatever its queue (see ``Gate._standing``)."""

NO_ENDPOINT = "no_endpoint"
QUEUE_FULL = "queue_full"


@dataclass(frozen=True, slots=True)
class Turnaway:
    """The request may not queue for a reason of the pool, not of its tenant."""

    reason: str
    """``no_endpoint`` (nothing in service for it) or ``queue_full``."""


@dataclass(frozen=True, slots=True)
class LaneRules:
    """One lane as the gate sees it (see ``picker.config.schema.Lane``)."""

    name: str
    engine_priority: int | None = None
    """The vLLM ``priority`` its requests carry; ``None``: the lane sets none."""


@dataclass(frozen=True)
class GateRules:
    """What the gate is told (``picker.config.build.gate_rules`` maps the config)."""

    lanes: tuple[LaneRules, ...] = (LaneRules("default"),)
    """Highest first."""
    holding: bool = True
    """False in pass-through (``fcfs``) mode: requests are dispatched at once, anywhere."""
    capacity: CapacityRules = field(default_factory=CapacityRules)
    health: HealthRules = field(default_factory=HealthRules)
    max_queued: int = 10_000
    """Requests the picker holds (queued and parked) before it refuses new ones."""
    newest_first_after: float = 0.0
    """Seconds a tenant's oldest queued request may wait before the tenant's newest goes first
    (0: oldest first always; see ``_newest_if_stale``)."""
    shed_lower_lanes: bool = False
    """A full queue refuses the newest request of a lower lane instead of the new one."""
    fallback_endpoints: int = 0
    """Endpoints named after the primary, for the gateway to retry on."""
    engine_policy: str = "fcfs"
    """How the engines order their own queue: ``fcfs`` or ``priority`` (see
    ``engine_priority_for``)."""
    preempt: bool = True
    """With ``priority`` engines: a request may go to a full endpoint whose running requests of a
    worse engine priority hold at least its prompt (see ``_preemptible``)."""
    idle_tenant_reserve: float = 0.0
    """Seconds a tenant counts as recently active for the reserve (0: no reserve)."""
    reserve_quantile: float = 0.0
    """The reserve's size (``picker.core.reserve.ReserveRules.quantile``; 0: one request)."""
    reserve_max_share: float = 1.0
    """The reserves together at most this fraction of the pool's tokens."""
    default_output_tokens: int = 256
    tenant_lanes: Mapping[str, str] = field(default_factory=dict)
    """A tenant's own lane, when not the first."""
    allowed_lanes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """Lanes a tenant may ask for (its own included)."""
    configured_tenants: frozenset[str] = frozenset()
    """Tenants the config names: their service totals are kept while they idle."""
    engine_cache: bool = True
    """The engines cache prefixes (vLLM V1's default; ``capacity.engineCache``): a prompt block
    shared by requests running on one endpoint counts once in its room, as the engine stores it
    once, whether or not affinity routes by it; with affinity, a prompt is also expected cached
    at dispatch as far as the endpoint was sent it. False (engines without a prefix cache):
    neither."""
    learn_engine_cache: bool = False
    """With ``engine_cache``: each endpoint as its engine says (``capacity.engineCache:
    auto``): taken to cache once a read of it has not said otherwise
    (``EndpointState.prefix_caching`` not false, from its ``vllm:cache_config_info``; a page
    without the label counts as caching), and as without a cache before its first read, when
    nothing is known of it. False: the assumption holds for every endpoint (``true``)."""
    affinity: AffinityRules | None = None
    """Prefix affinity (``picker.core.prefix``): among endpoints where a request fits, prefer
    the one holding more of its prompt; None: load alone decides."""
    sessions: SessionRules | None = None
    """Programs and sessions (``picker.core.sessions``): a session's calls stay on its endpoint
    and go before its tenant's new programs; None: session keys are ignored."""
    charge_sent_to_budgets: bool = True
    """Budgets count the prompt tokens sent (billing's count); False: the tokens computed
    (those the engine reports cached not counted)."""

    def lane_rank(self) -> dict[str, int]:
        return {lane.name: i for i, lane in enumerate(self.lanes)}

    def block_chars(self) -> int:
        """The block size a request's prompt is cut with for ``Gate.admit`` (the affinity's,
        else ``DEFAULT_BLOCK_CHARS``); 0: its blocks would serve nothing (no engine cache
        assumed, no affinity), so none need be cut."""
        if self.affinity is not None:
            return self.affinity.block_chars
        return DEFAULT_BLOCK_CHARS if self.engine_cache else 0


@dataclass(eq=False)
class Passage:
    """One request's passage through the gate."""

    tenant: str
    lane: str
    request: Request
    arrived_at: float
    model: str
    body_prompt_tokens: int
    """The prompt's size as estimated from the body (the tenant's calibration not applied)."""
    body_max_tokens: int | None
    """``max_tokens`` as the body set it (0 for embeddings: no output)."""
    stream: bool
    subset: frozenset[str] | None = None
    request_id: str = ""
    choices: int = 1
    """Choices the engine generates for it (``max(n, best_of)``): its output is that many
    times one choice's."""
    reservation: Reservation | None = None
    """Its hold on the tenant's budgets and caps (admission)."""
    demoted: bool = False
    max_tokens: int | None = None
    """The output limit the engine must get, when admission clamped or set it."""
    destinations: list[str] = field(default_factory=list)
    endpoint: EndpointState | None = None
    dispatched_at: float | None = None
    dispatch_seq: int = 0
    """The gate's count of dispatches when this one left: the order of dispatches made at the
    same instant (``still_waiting`` breaks ties with it)."""
    first_byte_at: float | None = None
    reserved_tokens: int = 0
    """Tokens this request adds to its endpoint's in-flight count."""
    projected_tokens: int = 0
    """Tokens it is expected to hold at its end (prompt + expected output)."""
    outcome: str | None = None
    finish_reason: str | None = None
    """As the engine reported it (``stop``, ``length``), when the response said."""
    ratelimit_headers: dict[str, str] = field(default_factory=dict)
    """``x-ratelimit-*`` for the response, as admission saw the tenant's budgets."""
    parked: bool = False
    """Held outside the fair queue because its tenant is at its concurrency cap."""
    shed_for: str | None = None
    """The lane of the request it was shed from the full queue for."""
    engine_priority: int | None = None
    """The vLLM ``priority`` the engine gets (set at dispatch; ``None``: none is sent)."""
    preempting: bool = False
    """Sent to an endpoint without room, for the engine to preempt worse requests for it."""
    prefilling: bool = False
    """A stream dispatched whose first output token has not come back: its prompt counts in its
    endpoint's ``prefill_tokens``."""
    prefix_blocks: tuple[int, ...] = ()
    """The prompt's chained block hashes (``picker.openai.prefix``); empty: neither affinity
    nor an engine cache to count them for."""
    prefix_chars: int = 0
    """Length of the text those blocks were cut from."""
    prefix_tokens: int = 0
    """While dispatched: the tokens of its prompt its blocks cover (``covered_tokens``),
    counted on its endpoint through ``Gate.inflight_blocks`` (once per distinct block) rather
    than as its own."""
    prefix_block_chars: int = 0
    """The block size its blocks were cut with (``GateRules.block_chars`` at admission); 0:
    its blocks, if any, take no part in the room (``Gate.inflight_blocks``): no engine cache
    was assumed when it was admitted."""
    holds_blocks: bool = False
    """While dispatched: its blocks are counted in its endpoint's ``Gate.inflight_blocks``
    (``prefix_block_chars`` and an endpoint whose engine caches: ``Gate.caches``)."""
    session: SessionId | None = None
    """(tenant, key) of the session or program it belongs to (``rules.sessions``); None: none."""
    engine_queued: bool = False
    """Sent to an endpoint where it did not fit, into its engine's own queue
    (``CapacityRules.engine_queue``): counted in the endpoint's ``engine_queued`` until its
    prefill ends (as ``prefilling``) or it ends."""
    prefill_counted: int = 0
    """While ``prefilling``: what it counts in its endpoint's ``prefill_computed``, its prompt
    less the part expected cached there at dispatch (``Request.cached_prompt_tokens``)."""
    prefix_wait_since: float | None = None
    """When it first waited, as the fair queue's head, for the endpoint likely to hold its
    prefix (``Gate._prefix_patience``); None: it never has."""
    prefix_wait_for: str | None = None
    """That endpoint's address: it goes first among the endpoints with room once it has
    room, within the patience."""
    output_seen: bool = True
    """The picker sees the response's tokens as they stream (the meter stream, inline); False on
    the access-log response path, which reports a request only once it has ended: its prefill
    is then judged from reads of the engine (``Gate.scraped``)."""

    @property
    def output_cap(self) -> int | None:
        """The output cap the engine works to: admission's when it set one, else the body's (0,
        for embeddings, is a cap and not "none")."""
        return self.max_tokens if self.max_tokens is not None else self.body_max_tokens


P = TypeVar("P", bound=Passage)


def output_limit(max_model_len: int | None, prompt_tokens: int, body_prompt_tokens: int
                 ) -> int | None:
    """The most one choice of a request without ``max_tokens`` may produce: the model's
    context less its prompt (the smaller of the two estimates: a prompt estimated high must
    not talk the bound down), at least 1; None when the context is not known."""
    if max_model_len is None:
        return None
    return max(1, max_model_len - min(prompt_tokens, body_prompt_tokens))


def still_waiting(sent: list[P], waiting: float) -> set[P]:
    """Of the requests ``sent`` to an engine, those still in its waiting queue when it counted
    ``waiting`` there: the ones vLLM serves last (the highest ``priority`` value, then the
    latest arrival; with FCFS engines no priority is sent, so the latest).

    An engine counts every waiting request, other pickers' and clients' too, so this errs on
    the side of waiting: at most ``waiting`` of ``sent``, never fewer than the count allows."""
    count = math.ceil(waiting)
    if count <= 0:
        return set()
    if count >= len(sent):
        return set(sent)
    # Dispatches of one instant in dispatch order, whatever order ``sent`` lists them in (a
    # stream moved to the endpoint that served it is listed last there).
    order = sorted(sent, key=lambda p: (p.engine_priority or 0, p.dispatched_at or 0.0,
                                        p.dispatch_seq))
    return set(order[len(order) - count:])


class GateListener(Protocol):
    """What an adapter is told of the gate's decisions (metrics, metering, waking a waiter)."""

    def dispatched(self, passage: Any, now: float) -> None:
        """``passage`` left the queue for ``passage.endpoint``."""

    def dropped(self, passage: Any, outcome: str, now: float) -> None:
        """``passage`` left the queue unserved (``queue_timeout``, ``cancelled``, ``shed``,
        ``shutdown``); it was charged nothing."""

    def settled(self, passage: Any, usage: Usage, outcome: str, now: float,
                estimated: bool) -> None:
        """A dispatched ``passage`` ended and its tenant was charged ``usage``."""


class _Silent:
    def dispatched(self, passage: Any, now: float) -> None:
        pass

    def dropped(self, passage: Any, outcome: str, now: float) -> None:
        pass

    def settled(self, passage: Any, usage: Usage, outcome: str, now: float,
                estimated: bool) -> None:
        pass


class Gate:
    """The fair queue in front of a pool of endpoints, and the pool's ledger."""

    def __init__(self, rules: GateRules, scheduler: Scheduler, admission: Admission, *,
                 now: float, scorer: Scorer | None = None,
                 listener: GateListener | None = None) -> None:
        self.rules = rules
        self.scheduler = scheduler
        self.admission = admission
        self.scorer: Scorer = scorer if scorer is not None else LeastLoaded()
        self.listener: GateListener = listener if listener is not None else _Silent()
        self.estimates = TenantEstimates(rules.default_output_tokens)
        """Per tenant: prompt calibration and output estimates (see ``picker.core.estimates``)."""
        self.endpoints: dict[str, EndpointState] = {}
        self.passages: dict[Request, Passage] = {}
        """Every request in the gate: queued, parked or running."""
        self._parked: dict[str, list[Passage]] = {}
        """Per tenant, requests waiting for the tenant to drop under its concurrency cap."""
        self._waiting: dict[str, dict[Request, Passage]] = {}
        """Per lane, its requests not dispatched (queued or parked), oldest first (arrival
        order): where ``_shed_for`` finds the newest of the lowest lane."""
        self._in_queue: dict[str, list[Passage]] = {}
        """Per tenant, its requests in the fair queue (parked ones not counted)."""
        self._single: dict[str, Passage] = {}
        """Tenants with exactly one request in the fair queue (and none parked): the requests
        that may go ahead of a head that has to wait (see ``pump``)."""
        self._recent: dict[str, Demand] = {}
        """Per tenant: its recent arrivals, sizes and holding time, for the idle reserve."""
        self._newest: str | None = None
        """The tenant that arrived last (``_note_arrival``)."""
        self._newest_other: str | None = None
        """The tenant that arrived last of all but ``_newest``: with it, who else arrived most
        recently, whoever asks (``_standing_room``, O(1))."""
        self._reserve = ReserveRules(rules.idle_tenant_reserve, rules.reserve_quantile,
                                     rules.reserve_max_share)
        self.occupancy = Occupancy()
        """Per lane, the tokens each tenant holds in running requests (engine priority)."""
        self.capacity_share = 1.0
        """This picker's lease: the fraction of each endpoint's budget it may hold."""
        self._lane_rank = rules.lane_rank()
        self._next_prune = now + PRUNE_INTERVAL
        self._dispatches = 0
        self._running: dict[str, dict[Passage, None]] | None = \
            {} if rules.capacity.growth_room else None
        """Per endpoint, the requests dispatched there and not yet settled, in dispatch order
        (the growth room's ``peak_growth``); None without ``growth_room``, which alone reads
        it (no insert and pop a request on the default's hot path)."""
        self._unseen_prefill: dict[str, dict[Passage, None]] = {}
        """Per endpoint, the streams there whose tokens the picker does not see
        (``Passage.output_seen`` false) and that are ``prefilling``, in dispatch order."""
        self.prefix_index: PrefixIndex | None = None
        """What each endpoint was recently sent (``rules.affinity``); None without affinity."""
        self.inflight_blocks = InflightBlocks()
        """Per endpoint, the prompt blocks of the requests running there, each counted once
        in its room (``_room_held``)."""
        self._set_affinity(rules.affinity)
        self.sessions: SessionTable | None = None
        """Per (tenant, session key), the endpoint of its last call (``rules.sessions``)."""
        self._set_sessions(rules.sessions)

    # -- rules --

    def set_rules(self, rules: GateRules) -> None:
        if rules.affinity != self.rules.affinity:
            self._set_affinity(rules.affinity)
        if rules.sessions != self.rules.sessions:
            self._set_sessions(rules.sessions)
        if rules.capacity.growth_room != (self._running is not None):
            self._running = self._running_now() if rules.capacity.growth_room else None
        self.rules = rules
        self._lane_rank = rules.lane_rank()
        self.estimates.default_output = float(rules.default_output_tokens)

    def _running_now(self) -> dict[str, dict[Passage, None]]:
        """``_running`` from the requests in the gate (rules that turn ``growth_room`` on)."""
        running: dict[str, dict[Passage, None]] = {}
        dispatched = [p for p in self.passages.values()
                      if p.dispatched_at is not None and p.endpoint is not None]
        for passage in sorted(dispatched, key=lambda p: p.dispatch_seq):
            assert passage.endpoint is not None
            running.setdefault(passage.endpoint.address, {})[passage] = None
        return running

    def _set_affinity(self, affinity: AffinityRules | None) -> None:
        """A new bound keeps what is remembered (trimmed at the next dispatch); a new block
        size makes it meaningless."""
        index = self.prefix_index
        if affinity is None:
            self.prefix_index = None
        elif index is None or self.rules.affinity is None or \
                self.rules.affinity.block_chars != affinity.block_chars:
            self.prefix_index = PrefixIndex(affinity.max_blocks_per_endpoint)
        else:
            index.capacity = affinity.max_blocks_per_endpoint

    def _set_sessions(self, rules: SessionRules | None) -> None:
        """New rules keep the sessions remembered (a smaller bound trims at the next one)."""
        if rules is None:
            self.sessions = None
        elif self.sessions is None:
            self.sessions = SessionTable(rules)
        else:
            self.sessions.rules = rules

    def set_weight(self, tenant: str, weight: float) -> None:
        """Set a tenant's weight (``Scheduler.set_weight``), for its running requests too."""
        self.scheduler.set_weight(tenant, weight)
        self.occupancy.reweigh(tenant, float(weight))

    def set_endpoints(self, budgets: Mapping[str, int | None]) -> None:
        """The pool is now these endpoints (address → configured KV budget): new ones join,
        missing ones drain (their requests finish; then they are forgotten)."""
        for address, state in self.endpoints.items():
            state.draining = address not in budgets
            state.configured_budget = budgets.get(address, state.configured_budget)
        for address, budget in budgets.items():
            if address not in self.endpoints:
                self.endpoints[address] = EndpointState(address, configured_budget=budget,
                                                        share=self.capacity_share)
        self._forget_drained()

    # -- active-active replicas (``picker.core.leases``) --

    def set_capacity_share(self, share: float, now: float) -> None:
        """This picker may hold ``share`` of every endpoint's budget (its lease); a larger one
        may let queued requests go."""
        self.capacity_share = max(0.0, min(1.0, share))
        for endpoint in self.endpoints.values():
            endpoint.share = self.capacity_share
        self.pump(now)

    def demand(self, now: float) -> dict[tuple[str, str], float]:
        """Tokens wanted per (lane, tenant): what its running requests hold plus what its
        waiting requests will hold (prompt and expected output)."""
        wanted: dict[tuple[str, str], float] = {}
        for passage in self.passages.values():
            key = (passage.lane, passage.tenant)
            tokens = passage.reserved_tokens if passage.dispatched_at is not None \
                else self._projected(passage, now)
            wanted[key] = wanted.get(key, 0.0) + tokens
        return wanted

    def held_fraction(self) -> float:
        """The largest fraction of an endpoint's budget this picker holds (its lease can shrink
        no lower until requests finish)."""
        fallback = self.rules.capacity.fallback_budget
        return max((e.inflight_tokens / e.budget(fallback) for e in self.endpoints.values()),
                   default=0.0)

    def queued_share(self, now: float) -> float:
        """The share of an endpoint's budget that this picker's largest queued request needs
        (0 with nothing queued): a lease below it leaves that request nowhere to go."""
        largest = max((self._projected(p, now) for p in self.passages.values()
                       if p.dispatched_at is None), default=0)
        fallback = self.rules.capacity.fallback_budget
        budget = max((e.budget(fallback) for e in self.endpoints.values() if not e.draining),
                     default=0)
        return min(1.0, largest / budget) if largest and budget else 0.0

    def pool_capacity(self) -> int:
        """The KV budget of every endpoint in service, in tokens."""
        fallback = self.rules.capacity.fallback_budget
        return sum(e.budget(fallback) for e in self.endpoints.values() if not e.draining)

    def _forget_drained(self) -> None:
        for address in [a for a, e in self.endpoints.items()
                        if e.draining and e.inflight_requests == 0]:
            del self.endpoints[address]
            self._unseen_prefill.pop(address, None)
            if self._running is not None:
                self._running.pop(address, None)
            self.inflight_blocks.forget(address)
            if self.prefix_index is not None:
                self.prefix_index.forget(address)
            if self.sessions is not None:
                self.sessions.forget_endpoint(address)

    def lane_of(self, tenant: str) -> str:
        """The tenant's configured lane, else the first lane."""
        return self.rules.tenant_lanes.get(tenant) or self.rules.lanes[0].name

    def choose_lane(self, tenant: str, asked: str | None) -> str | None:
        """The lane a request runs in: the tenant's own, or one its policy allows it to ask
        for; ``None`` for any other lane (refused)."""
        default = self.lane_of(tenant)
        if not asked or asked == default:
            return default
        return asked if asked in self.rules.allowed_lanes.get(tenant, ()) else None

    def engine_priority(self, lane: str) -> int | None:
        """The vLLM ``priority`` the lane's requests carry (``None``: the lane sets none); with
        ``priority`` engines, that of its light tenants (see ``engine_priority_for``)."""
        rank = self._lane_rank[lane]
        configured = self.rules.lanes[rank].engine_priority
        if self.rules.engine_policy != "priority":
            return configured
        return 2 * rank if configured is None else configured

    def engine_priority_for(self, passage: Passage, now: float | None = None) -> int | None:
        """The engine priority a queued request gets when dispatched now (``now``: the time,
        which a rate-judged reserve needs; without it, its tenant's last arrival).

        With ``fcfs`` engines, its lane's (vLLM refuses any other than 0 there). With
        ``priority`` engines, the lane's base (``2 × rank``, or its configured ``enginePriority``;
        lanes are at least 2 apart) plus the tenant's standing (``_standing``): 0 for a light
        tenant, 1 for a flood. A vLLM in priority mode then runs the light tenant's request
        before a flood's and, when its cache runs short, preempts the flood's requests (largest
        priority first) rather than the light one.
        """
        base = self.engine_priority(passage.lane)
        if base is None or self.rules.engine_policy != "priority":
            return base
        return base + self._standing(passage, now)

    def _standing(self, passage: Passage, now: float | None = None) -> int:
        """0 (light) or 1 (flood), judged in this order:

        * 0 when the tenant holds less than ``UNDER_SERVED`` of its weighted share of the lane's
          running work: it is under-served, even if two of its requests arrived together;
        * 1 when it is backlogged (the fair queue is what limits it);
        * 1 when it holds at least its share (a flood whose queue has just emptied; a tenant
          alone holds exactly its share, so a newcomer outranks what it sends next);
        * 1 when its counter is more than one request ahead of the lane's floor (a tenant that
          trickles one request at a time cannot claim the light standing);
        * else 0: its requests get what they ask, and it holds no more than its share.
        """
        tenant = passage.tenant
        weight = self.scheduler.weights.get(tenant, 1.0)
        share = self.occupancy.share(passage.lane, tenant, weight)
        if share is not None and share < UNDER_SERVED:
            return 0
        if self._backlogged(tenant, now) or (share is not None and share >= 1.0):
            return 1
        policy = self.scheduler.policy(passage.lane)
        floor = getattr(policy, "min_backlogged_counter", lambda: None)()
        if floor is None:
            return 0
        # One request's slack: a light tenant's previous request may still be charging output.
        request = passage.request
        slack = request_cost(self.scheduler.cost, request.prompt_tokens,
                             request.max_output_tokens or self.rules.default_output_tokens,
                             0) / weight
        return 1 if policy.counter(tenant) > floor + slack else 0

    # -- admission --

    def admit(self, build: Callable[..., P], tenant: str, lane: str | None, *, model: str,
              prompt_tokens: int, max_tokens: int | None, stream: bool, now: float,
              subset: frozenset[str] | None = None, request_id: str = "",
              prereserved: int | None = None, output_seen: bool = True, choices: int = 1,
              max_model_len: int | None = None, prefix_blocks: tuple[int, ...] = (),
              prefix_chars: int = 0, session: str | None = None) -> P | Refused | Turnaway:
        """Admit a request and place it: dispatched at once when it may go (``dispatched_at``
        set), else queued or parked. ``build`` makes the passage (the adapter's subclass).

        ``lane``: the lane asked for (already checked with ``choose_lane``); default the
        tenant's. ``prompt_tokens``: the body's estimate. ``prereserved``: tokens already
        reserved for it in the shared store (``budget_needs``); a request not admitted gives
        them back. ``output_seen``: see ``Passage.output_seen``. ``choices``: the output
        sequences it asks for (``max(n, best_of)``); ``max_model_len``: the model's context,
        which bounds the output of a request without ``max_tokens`` (None: unknown).
        ``prefix_blocks``, ``prefix_chars``: its prompt's block hashes, cut at
        ``rules.block_chars()``, and the text's length (``picker.openai.prefix``), for the
        shared blocks' room and prefix affinity. ``session``: the session or program
        key the request carries (``picker.core.sessions.session_key``), scoped here by
        ``tenant``; ignored without ``rules.sessions``.
        """
        decision = self._admit(build, tenant, lane, model=model, prompt_tokens=prompt_tokens,
                               max_tokens=max_tokens, stream=stream, now=now, subset=subset,
                               request_id=request_id, prereserved=prereserved,
                               output_seen=output_seen, choices=choices,
                               max_model_len=max_model_len, prefix=(prefix_blocks, prefix_chars),
                               session=session)
        # Refused before anything was reserved here: the store's reservation goes back. (A full
        # queue is turned away after: settling that reservation gives it back.)
        if prereserved is not None and (isinstance(decision, Refused) or (
                isinstance(decision, Turnaway) and decision.reason == NO_ENDPOINT)):
            self.admission.return_to_store(tenant, prereserved, now)
        return decision

    def budget_needs(self, tenant: str, *, model: str, prompt_tokens: int,
                     max_tokens: int | None, stream: bool, now: float, choices: int = 1,
                     max_model_len: int | None = None) -> int:
        """What ``admit`` would reserve from the tenant's budgets for this request."""
        prompt = self.estimates.prompt_tokens(tenant, model, prompt_tokens, now)
        expected = self.expected_output(tenant, max_tokens, stream, now)
        return self.admission.budget_needs(
            tenant, self.estimates.prompt_floor(prompt_tokens, prompt), max_tokens, expected,
            choices=choices,
            output_limit=output_limit(max_model_len, prompt, prompt_tokens))

    def _admit(self, build: Callable[..., P], tenant: str, lane: str | None, *, model: str,
               prompt_tokens: int, max_tokens: int | None, stream: bool, now: float,
               subset: frozenset[str] | None, request_id: str,
               prereserved: int | None, output_seen: bool, choices: int,
               max_model_len: int | None,
               prefix: tuple[tuple[int, ...], int] = ((), 0),
               session: str | None = None) -> P | Refused | Turnaway:
        lane = lane or self.lane_of(tenant)
        # Only whether one exists: ranking them here would be work pump() does again.
        if not any(e.in_service(now) and (subset is None or e.address in subset)
                   for e in self.endpoints.values()):
            return Turnaway(NO_ENDPOINT)
        # The tenant's own calibration only: no other tenant's reports move this estimate, and
        # the cap and the budgets are judged on at least the body's own size
        # (``TenantEstimates.prompt_floor``): a calibration taught down by prompts the engine
        # counts cheaply (digits) would otherwise carry dear ones (images) past the budget.
        prompt = self.estimates.prompt_tokens(tenant, model, prompt_tokens, now)
        floor = self.estimates.prompt_floor(prompt_tokens, prompt)
        expected = self.expected_output(tenant, max_tokens, stream, now)
        self._note_arrival(tenant, prompt + expected * choices, now)
        decision = self.admission.admit(
            tenant, lane, floor, max_tokens, expected, now, cap_prompt_tokens=floor,
            prereserved=prereserved, choices=choices,
            output_limit=output_limit(max_model_len, prompt, prompt_tokens))
        if isinstance(decision, Refused):
            return decision
        if self.queued_total() >= self.rules.max_queued and not self._shed_for(decision.lane,
                                                                                now):
            self.admission.finish(decision.reservation, 0, now)
            return Turnaway(QUEUE_FULL)
        clamped = decision.max_output_tokens
        request = Request(tenant=tenant, prompt_tokens=prompt, lane=decision.lane,
                          max_output_tokens=clamped or 0, arrival=now)
        passage = build(
            tenant=tenant, lane=decision.lane, request=request, arrived_at=now, model=model,
            body_prompt_tokens=prompt_tokens, body_max_tokens=max_tokens, stream=stream,
            subset=subset, request_id=request_id, reservation=decision.reservation,
            demoted=decision.demoted, max_tokens=clamped if clamped != max_tokens else None,
            output_seen=output_seen, choices=choices)
        if prefix[0] and (self.rules.engine_cache or self.prefix_index is not None):
            passage.prefix_blocks, passage.prefix_chars = prefix
            # (blocks are cut from text: always, in practice); prefix_block_chars turns on the
            # shared blocks' room, which an engine without a prefix cache does not have, with
            # affinity or without.
            if passage.prefix_chars > 0 and self.rules.engine_cache:
                passage.prefix_block_chars = self.rules.block_chars()
        if session is not None and self.sessions is not None:
            # Scoped by the tenant the identity resolved: a key never reaches another's session.
            passage.session = (tenant, session)
            started = self.sessions.started(passage.session, now)
            if started is not None and self.sessions.rules.resume_first:
                request.resumes, request.program = True, started
        self.passages[request] = passage
        self._waiting.setdefault(passage.lane, {})[request] = passage
        self._place(passage, now)
        return passage

    def expected_output(self, tenant: str, max_tokens: int | None, stream: bool,
                        now: float) -> int:
        """The output a request is expected to produce: the tenant's estimate, capped."""
        # Streams have their own estimate, learned from the streams' counted output: a tenant's
        # short non-streaming answers cannot talk down how much room its streams are given.
        average = self.estimates.output(tenant, now, stream=stream)
        if max_tokens is None:
            return max(1, round(average))
        # A cap of 0 (embeddings) means no output at all: the estimate is 0, not 1.
        return min(max_tokens, max(1, round(min(average, max_tokens))))

    def output_estimate(self, passage: Passage, now: float) -> int:
        """Expected output of a non-streaming request: the tenant's moving average, capped,
        times its choices."""
        return self.expected_output(passage.tenant, passage.output_cap, False,
                                    now) * passage.choices

    def _note_arrival(self, tenant: str, tokens: int, now: float) -> None:
        """Remember when the tenant last sent and how big its requests are (for the reserve)."""
        if self.rules.idle_tenant_reserve:
            # Room for the tenant's large requests, not its average one (a request larger than
            # the reserve waits like any other), and its rate (``picker.core.reserve``).
            demand = self._recent.get(tenant)
            if demand is None:
                self._recent[tenant] = new_demand(tokens, now)
            else:
                demand.arrived(tokens, now, self.rules.idle_tenant_reserve)
            if tenant != self._newest:
                self._newest_other, self._newest = self._newest, tenant

    def queued_total(self) -> int:
        """Requests waiting (queued and parked)."""
        # Counted, not scanned: this runs for every request admitted.
        return self.scheduler.queued() + sum(map(len, self._parked.values()))

    def _shed_for(self, lane: str, now: float) -> bool:
        """Make room in a full queue for a request of ``lane``: refuse the newest queued request
        of the lowest lane below it (``shedLowerLanes``). False when there is none."""
        if not self.rules.shed_lower_lanes:
            return False
        # O(lanes), not O(requests): this runs for every arrival while the queue is full, which
        # is when a flood makes arrivals many (a scan of 10,000 held requests each was minutes
        # of CPU per simulated second).
        rank = self._lane_rank.get(lane, 0)
        lowest: tuple[int, str] | None = None
        for other, waiting in self._waiting.items():
            other_rank = self._lane_rank.get(other, 0)
            if waiting and other_rank > rank and (lowest is None or other_rank > lowest[0]):
                lowest = (other_rank, other)
        if lowest is None:
            return False
        victim = next(reversed(self._waiting[lowest[1]].values()))  # the newest
        victim.shed_for = lane
        self.drop(victim, "shed", now)
        self.pump(now)  # a request the victim's tenant had parked may have entered the queue
        return True

    def _unwait(self, passage: Passage) -> None:
        waiting = self._waiting.get(passage.lane)
        if waiting is not None:
            waiting.pop(passage.request, None)
            if not waiting:
                del self._waiting[passage.lane]

    # -- the fair queue and the parking lot --

    def _place(self, passage: Passage, now: float) -> None:
        """Into the fair queue (dispatched at once if it may go), or parked at the tenant's
        concurrency cap; pass-through mode dispatches it at once."""
        tenant = passage.tenant
        if self._may_queue(tenant) or not self.rules.holding:
            self._enqueue(passage, now)
        else:
            passage.parked = True
            self._parked.setdefault(tenant, []).append(passage)
            self._single.pop(tenant, None)
        if not self.rules.holding:
            self._dispatch(passage, self.candidates(passage.subset, now, require_room=False),
                           now)
        elif not passage.parked:
            self.pump(now)

    def _enqueue(self, passage: Passage, now: float) -> None:
        passage.parked = False
        self.scheduler.enqueue(passage.request, now)
        queued = self._in_queue.setdefault(passage.tenant, [])
        queued.append(passage)
        self._update_single(passage.tenant, queued)

    def _may_queue(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` may enter the fair queue: every request there may be
        dispatched, so queued plus running stays within the tenant's concurrency cap."""
        if tenant in self._parked:
            return False  # first in, first out among the tenant's own requests
        cap = self.admission.rules_for(tenant).max_concurrent
        return cap is None or \
            len(self._in_queue.get(tenant, ())) + self.admission.running(tenant) < cap

    def _queue_remove(self, passage: Passage) -> None:
        queued = self._in_queue[passage.tenant]
        queued.remove(passage)
        if not queued:
            del self._in_queue[passage.tenant]
        self._update_single(passage.tenant, queued)

    def _update_single(self, tenant: str, queued: list[Passage]) -> None:
        if len(queued) == 1 and tenant not in self._parked:
            self._single[tenant] = queued[0]
        else:
            self._single.pop(tenant, None)

    def _unpark(self, tenant: str, now: float) -> None:
        parked = self._parked.pop(tenant, None)
        while parked and self._may_queue(tenant):
            self._enqueue(parked.pop(next_parked(parked)), now)
        if parked:
            self._parked[tenant] = parked
            self._single.pop(tenant, None)

    # -- dispatching --

    def pump(self, now: float) -> None:
        """Dispatch queued requests while the fair queue's next choice has an endpoint with
        room, or a light tenant's request has room while the head waits."""
        if not self.rules.holding:
            return
        scheduler = self.scheduler
        waiting: set[str] = set()
        """Tenants whose head waits for the endpoint holding its prefix (prefix patience)."""
        kept: set[str] = set()
        """Those endpoints: the requests after it go elsewhere meanwhile."""
        while scheduler.queued():
            request = scheduler.peek_besides(now, waiting) if waiting else scheduler.peek(now)
            if request is None:
                return
            passage = self._newest_if_stale(self.passages[request], now)
            request = passage.request
            candidates = self.candidates(passage.subset, now, require_room=True,
                                         prompt_tokens=request.prompt_tokens, passage=passage)
            if candidates and self._backlogged(passage.tenant, now):
                candidates = self._for_backlogged(passage, candidates, now)
            if candidates and passage.prefix_blocks and self._patient:
                wait_for = self._prefix_patience(passage, candidates, now)
                if wait_for is not None:
                    # The fair queue's choice waits a little for the endpoint holding its
                    # prefix; the room elsewhere goes to the next in fair order.
                    waiting.add(passage.tenant)
                    kept.add(wait_for)
                    continue
            if kept:
                candidates = [c for c in candidates if c.address not in kept]
            preempting = False
            if not candidates:
                candidates = self._preemptible(passage, now)
                preempting = bool(candidates)
            if not candidates:
                # The head waits for room. A light tenant's request that fits need not wait
                # behind it: light tenants have one request queued at most, so they cannot
                # starve the head, and holding them would leave room unused.
                light = self._light_request(now, passage)
                if light is None:
                    return
                passage, candidates, preempting = light
                if kept:
                    candidates = [c for c in candidates if c.address not in kept]
                    if not candidates:
                        return
            self._dispatch(passage, candidates, now, preempting)

    @property
    def _patient(self) -> bool:
        affinity = self.rules.affinity
        return affinity is not None and affinity.patience > 0 and self.prefix_index is not None

    def _expected_cached(self, passage: Passage, endpoint: EndpointState) -> float:
        """Prompt tokens of ``passage`` the endpoint's engine is expected to find cached: the
        part the endpoint was sent within its budget (``PrefixIndex.matched``), times the
        chance it is still there (``freshness``); 0 without affinity or an engine cache."""
        index, affinity = self.prefix_index, self.rules.affinity
        if index is None or affinity is None or not passage.prefix_blocks \
                or not self.caches(endpoint):
            return 0.0
        blocks = passage.prefix_blocks
        budget = endpoint.budget(self.rules.capacity.fallback_budget)
        matched = index.matched(endpoint.address, blocks, budget)
        if not matched:
            return 0.0
        return covered_tokens(passage.request.prompt_tokens, matched, affinity.block_chars,
                              passage.prefix_chars) * freshness(
            index.age(endpoint.address, blocks, matched), budget - endpoint.inflight_tokens,
            budget)

    def _prefix_patience(self, passage: Passage, candidates: list[EndpointState],
                         now: float) -> str | None:
        """The endpoint the fair queue's head should wait for rather than go to one of
        ``candidates`` (those with room now), or None: the endpoint in service (and in its
        subset) expected to hold the most of its prompt is not among them, its prompt fits
        there once it has room (never a request where it does not fit: it waits for room, it
        is not sent past it), and it has waited less than the prefill that saves
        (``prefix_patience``). Pure: judged again at every pump; the first wait is
        remembered on the passage."""
        affinity = self.rules.affinity
        assert affinity is not None  # ``_patient``
        with_room = {c.address for c in candidates}
        best: EndpointState | None = None
        best_saved = here = 0.0
        subset = passage.subset
        for endpoint in self.endpoints.values():
            if not endpoint.in_service(now) or (subset is not None
                                                and endpoint.address not in subset):
                continue
            saved = self._expected_cached(passage, endpoint)
            if endpoint.address in with_room:
                here = max(here, saved)
            elif saved > best_saved:
                best, best_saved = endpoint, saved
        if best is None or best_saved <= here or passage.request.prompt_tokens \
                - self._room_held(passage, best) > best.budget(
                    self.rules.capacity.fallback_budget):
            return None
        since = passage.prefix_wait_since
        if since is None:
            since = passage.prefix_wait_since = now
        if now - since >= prefix_patience(best_saved - here, affinity):
            return None
        passage.prefix_wait_for = best.address
        return best.address

    def _for_backlogged(self, passage: Passage, candidates: list[EndpointState],
                        now: float) -> list[EndpointState]:
        """Of the endpoints with room, those a backlogged tenant's request may take: within the
        growth room and the prefill bound (``takes_backlogged``, when configured), and leaving
        the idle-tenant reserve somewhere."""
        capacity = self.rules.capacity
        size: int | None = None  # its expected size, only when a rule needs it (hot path)
        growth: dict[str, float] | None = None  # per endpoint, its peak_growth (growth room)
        adds: dict[str, float] = {}  # per candidate, what the request adds to its peak
        if capacity.growth_room or capacity.max_prefill_tokens:
            size = self._projected(passage, now)
            prompt = passage.request.prompt_tokens
            if capacity.growth_room:
                growth = {}
                for c in candidates:
                    own = prompt - self._room_held(passage, c)
                    peak, joined = peak_growth_with(self._growing(c.address),
                                                    (size - prompt, own))
                    growth[c.address] = peak
                    adds[c.address] = joined + own - peak
            candidates = [c for c in candidates if takes_backlogged(
                c, prompt, adds[c.address] if growth is not None
                else size - self._room_held(passage, c), now, capacity,
                None if growth is None else growth[c.address])]
        reserve, total = self._idle_reserve(now, passage.tenant) if candidates else (0.0, 0.0)
        if not reserve and candidates and self._reserve.quantile:
            # Alone, the flood still leaves one request's room for a tenant not yet seen.
            reserve = total = self._standing_room(now, passage.tenant)
        if reserve:
            # Only endpoints that leave the room kept for a light tenant's next request
            # somewhere: packing a backlogged tenant onto one endpoint keeps another free.
            pool = list(self.endpoints.values())
            if size is None:
                size = self._projected(passage, now)
            if growth is not None:
                for e in pool:
                    if e.address not in growth:
                        growth[e.address] = self._peak_growth(e.address)
            candidates = [c for c in candidates if keeps_reserve(
                pool, c, size if growth is None else adds[c.address], reserve, now, capacity,
                total, growth)]
        return candidates

    def _peak_growth(self, address: str) -> int:
        """``picker.core.selection.peak_growth`` of the requests running on ``address``
        (``_growing``)."""
        return peak_growth(self._growing(address))

    def _growing(self, address: str) -> list[tuple[int, int]]:
        """The requests running on ``address`` as ``peak_growth`` takes them: each stream whose
        tokens the picker sees grow, (what it has yet to grow by to its expected size,
        ``projected_tokens``; its own tokens, shared prompt blocks left out, that its end
        frees). Only with ``growth_room`` (``_running`` is kept for it alone)."""
        running = self._running.get(address, ()) if self._running is not None else ()
        return [(p.projected_tokens - p.reserved_tokens, p.reserved_tokens - p.prefix_tokens)
                for p in running if p.stream and p.projected_tokens > p.reserved_tokens]

    def _standing_room(self, now: float, tenant: str) -> float:
        """Room kept for a tenant not yet seen while ``tenant`` is the only one seen within the
        reserve's window (``picker.core.reserve.standing_room``).

        O(1): of the others, the one that arrived last tells (``_newest``, ``_newest_other``);
        if it is past the window, so is every other. One forgotten (``forget_idle``, or past
        the window at an ``_idle_reserve``) was past it then, and so is now."""
        demand = self._recent.get(tenant)
        if demand is None:
            return 0.0
        last = self._newest_other if self._newest == tenant else self._newest
        other = self._recent.get(last) if last is not None else None
        if other is not None and now - other.last <= self.rules.idle_tenant_reserve:
            return 0.0
        return standing_room(demand.footprint, self._pool_tokens(), self._reserve)

    def _newest_if_stale(self, head: Passage, now: float) -> Passage:
        """The request of the head's tenant (and lane) to send: its oldest, unless that one has
        waited ``newest_first_after`` or longer, then its newest (adaptive LIFO; the fair
        queue's counters and order between tenants are the same either way).

        Under a sustained overload a tenant's oldest requests are the ones whose clients are
        about to give up: sending them first spends engines on answers nobody reads and makes
        every later request as old in its turn. Sending the newest instead serves requests whose
        clients still wait, while the stale ones time out in the queue at no engine's cost.
        Which tenant goes next is the fair queue's choice either way."""
        after = self.rules.newest_first_after
        if not after or now - head.arrived_at < after:
            return head
        queued = self._in_queue.get(head.tenant, ())
        for passage in reversed(queued):
            if passage.lane == head.lane:
                return passage
        return head

    def _projected(self, passage: Passage, now: float) -> int:
        return passage.request.prompt_tokens + self.expected_output(
            passage.tenant, passage.output_cap, passage.stream, now) * passage.choices

    def _backlogged(self, tenant: str, now: float | None, fair_unit: float | None = None) -> bool:
        """More than one request of the tenant is waiting: it keeps the pool busy by itself.
        (A light tenant has at most the one that just arrived.) With ``reserve_quantile``, light
        is judged by rate (``picker.core.reserve``): a tenant whose expected demand is below its
        fair share may have as many requests waiting as its reserve is for; one at or above its
        fair share is backlogged whatever its queue. ``fair_unit``: ``_fair_unit()``, when the
        caller judges many tenants at once (it sums over every recent tenant)."""
        if tenant in self._parked:
            return True
        queued = len(self._in_queue.get(tenant, ()))
        demand = self._recent.get(tenant) if self._reserve.quantile else None
        if demand is None:
            return queued > 1
        if now is None:
            now = demand.last
        running = self.admission.running(tenant)
        if queued > reserved_requests(demand, now, self._reserve, running):
            return True
        unit = self._fair_unit() if fair_unit is None else fair_unit
        fair = unit * self.scheduler.weights.get(tenant, 1.0)
        return not is_light(demand, now, self._reserve, fair, running)

    def _pool_tokens(self) -> float:
        fallback = self.rules.capacity.fallback_budget
        return float(sum(e.budget(fallback) for e in self.endpoints.values()))

    def _fair_unit(self) -> float:
        """The pool's tokens per unit of weight among the tenants seen recently: a tenant's
        fair share of the pool is this times its weight."""
        weights = self.scheduler.weights
        total = sum(weights.get(t, 1.0) for t in self._recent) or 1.0
        return self._pool_tokens() / total

    def _held(self, tenant: str) -> float:
        """Tokens the tenant's running requests hold (all lanes)."""
        return float(sum(self.occupancy.held(lane.name, tenant) for lane in self.rules.lanes))

    def _idle_reserve(self, now: float, exclude: str) -> tuple[float, float]:
        """Tokens to keep free for recently active tenants that are not backlogged: on one
        endpoint (their next request) and in the pool (``picker.core.reserve.pool_reserve``)."""
        window = self.rules.idle_tenant_reserve
        if not window:
            return 0.0, 0.0
        rules = self._reserve
        reserves: dict[str, tuple[float, float]] = {}
        # Once a call, not once a tenant: it sums over every recent tenant.
        unit = self._fair_unit() if rules.quantile else None
        for tenant, demand in list(self._recent.items()):
            if now - demand.last > window:
                del self._recent[tenant]
            elif tenant != exclude and not self._backlogged(tenant, now, unit):
                reserves[tenant] = (demand.footprint, tenant_reserve(
                    demand, now, rules, self._held(tenant) if rules.quantile else 0.0,
                    self.admission.running(tenant) if rules.quantile else 0))
        return pool_reserve(reserves, self._pool_tokens() if rules.quantile else 0.0, rules)

    def _light_request(self, now: float,
                       head: Passage) -> tuple[Passage, list[EndpointState], bool] | None:
        """The earliest queued request of a light tenant, in the head's lane or a higher one,
        that has room (or that the engine would preempt for: the flag)."""
        free = max((free_tokens(e, now, self.rules.capacity, projected=False)
                    for e in self.endpoints.values()), default=0.0)
        preempts = self._preempts()
        if free <= 0 and not preempts:
            return None
        head_rank = self._lane_rank.get(head.lane, 0)
        for passage in self._light_heads(now):
            if passage is head or self._lane_rank.get(passage.lane, 0) > head_rank:
                continue
            candidates = [] if passage.request.prompt_tokens > free and \
                not passage.prefix_block_chars else self.candidates(
                passage.subset, now, require_room=True,
                prompt_tokens=passage.request.prompt_tokens, passage=passage)
            if candidates and passage.prefix_blocks and self._patient and \
                    self._prefix_patience(passage, candidates, now) is not None:
                continue  # it waits a little for its prefix's endpoint (``pump``)
            if candidates:
                return passage, candidates, False
            if preempts:
                candidates = self._preemptible(passage, now)
                if candidates:
                    return passage, candidates, True
        return None

    def _light_heads(self, now: float) -> Iterable[Passage]:
        """The queued requests that may go ahead of a head that waits: those of tenants with one
        request queued (about arrival order; no sort on this hot path), and, with a rate-sized
        reserve, the oldest of each tenant with more queued that is still light by its rate
        (``_backlogged``): the room kept for it is of use only if its requests may take it."""
        if not self._reserve.quantile:  # the default: no generator on this hot path
            return self._single.values()
        return self._light_heads_by_rate(now)

    def _light_heads_by_rate(self, now: float) -> Iterator[Passage]:
        yield from self._single.values()
        unit: float | None = None  # judged lazily: the caller stops at the first that fits
        for tenant, queued in list(self._in_queue.items()):
            if len(queued) > 1 and tenant in self._recent:
                unit = self._fair_unit() if unit is None else unit
                if not self._backlogged(tenant, now, unit):
                    yield queued[0]

    def _preempts(self) -> bool:
        return self.rules.preempt and self.rules.engine_policy == "priority"

    def _preemptible(self, passage: Passage, now: float) -> list[EndpointState]:
        """Endpoints without room whose engine would make room for this request by preemption:
        requests running there with a worse engine priority hold at least its prompt, less what
        earlier requests sent this way already claimed. Most preemptible first; none unless
        engines run in priority mode with ``preempt``.

        vLLM never preempts for a waiting request directly: it preempts the running request
        with the largest (priority, arrival) when a running request needs a KV block it cannot
        get, and admits waiting requests by priority once blocks are free. A request of a
        better priority placed there therefore starts within a few engine steps instead of
        waiting for a request to finish, and only requests it outranks pay for it.
        """
        if not self._preempts():
            return []
        priority = self.engine_priority_for(passage, now)
        if priority is None:
            return []
        spare: dict[str, int] = {}
        for other in self.passages.values():
            endpoint = other.endpoint
            if endpoint is None or other.dispatched_at is None:
                continue
            if other.preempting:
                spare[endpoint.address] = spare.get(endpoint.address, 0) - other.reserved_tokens
            elif other.engine_priority is not None and other.engine_priority > priority:
                spare[endpoint.address] = spare.get(endpoint.address, 0) + other.reserved_tokens
        need = passage.request.prompt_tokens
        pool = [e for e in self.endpoints.values()
                if spare.get(e.address, 0) >= need and e.in_service(now)
                and (passage.subset is None or e.address in passage.subset)]
        pool.sort(key=lambda e: spare[e.address], reverse=True)
        return pool

    def candidates(self, subset: frozenset[str] | None, now: float, *,
                   require_room: bool = False, prompt_tokens: int = 0,
                   passage: Passage | None = None) -> list[EndpointState]:
        """Endpoints that may take a request (in ``subset``, when given), best first.
        ``passage``: the request's, whose whole expected size is judged against this picker's
        lease beside other replicas. With ``growth_room``, a request of a tenant that is not
        backlogged goes first where the least prefill is outstanding (``prefill_tokens``; the
        scorer's order among equals): the engine computes running requests' prompt chunks
        first, so that is where its own prefill starts soonest."""
        pool = [e for e in self.endpoints.values() if subset is None or e.address in subset]
        lease_tokens = None if passage is None or self.capacity_share >= 1.0 \
            else self._projected(passage, now)
        bonus = None
        index, affinity = self.prefix_index, self.rules.affinity
        if index is not None and affinity is not None and passage is not None \
                and passage.prefix_blocks and affinity.weight:
            blocks = passage.prefix_blocks
            scale = affinity.weight / len(blocks)

            fallback = self.rules.capacity.fallback_budget

            def bonus(endpoint: EndpointState) -> float:
                # What a whole match is worth, times the share of the prompt matched, times
                # the chance the engine still caches it (``freshness``): of two endpoints
                # both sent the prefix, the one that allocated less since wins.
                budget = endpoint.budget(fallback)
                matched = index.matched(endpoint.address, blocks, budget)
                return scale * matched * freshness(
                    index.age(endpoint.address, blocks, matched),
                    budget - endpoint.inflight_tokens, budget) if matched else 0.0

        held = None
        if passage is not None and passage.prefix_block_chars:

            def held(endpoint: EndpointState) -> int:
                return self._room_held(passage, endpoint)

        ranked = rank(pool, prompt_tokens, now, self.rules.capacity, self.scorer,
                      require_room=require_room, lease_tokens=lease_tokens, bonus=bonus,
                      held=held)
        if passage is not None and self.rules.capacity.growth_room and len(ranked) > 1 \
                and not self._backlogged(passage.tenant, now):
            if self.prefix_index is None or not passage.prefix_blocks:
                ranked.sort(key=lambda e: e.prefill_tokens)  # stable: the scorer breaks ties
            else:
                # Its first token comes after the prefill the engine has to compute there
                # and its own: the parts of prompts expected cached are not computed.
                prompt = passage.request.prompt_tokens
                ranked.sort(key=lambda e: e.prefill_computed + prompt
                            - self._expected_cached(passage, e))
        if passage is not None and passage.prefix_wait_for is not None and len(ranked) > 1:
            prefer(ranked, passage.prefix_wait_for)
        if passage is not None and passage.session is not None and self.sessions is not None \
                and self.sessions.rules.sticky:
            # The session's context is on its last endpoint: first, when it is among these.
            prefer(ranked, self.sessions.endpoint(passage.session, now))
        return ranked

    def _dispatch(self, passage: Passage, candidates: list[EndpointState], now: float,
                  preempting: bool = False) -> None:
        request = passage.request
        passage.preempting = preempting
        # The standing is the tenant's as it waited, this request included.
        passage.engine_priority = self.engine_priority_for(passage, now)
        primary = candidates[0]
        if self.prefix_index is not None:
            self._note_prefix(passage, primary, now)
        if passage.session is not None and self.sessions is not None:
            self.sessions.dispatched(passage.session, primary.address, now)
        self.scheduler.dispatch(request, now)
        self._queue_remove(passage)
        self._unwait(passage)
        # Past its concurrency cap only in pass-through mode, which dispatches at once.
        if passage.reservation is not None and (self.rules.holding or
                                                self.admission.may_start(passage.tenant)):
            self.admission.start(passage.reservation)
        passage.ratelimit_headers = self.admission.headers(passage.tenant, now)
        passage.endpoint = primary
        passage.destinations = [e.address for e in
                                candidates[: 1 + self.rules.fallback_endpoints]]
        passage.dispatched_at = now
        self._dispatches += 1
        passage.dispatch_seq = self._dispatches
        passage.reserved_tokens = request.prompt_tokens
        if not passage.stream:
            estimate = self.output_estimate(passage, now)
            self.scheduler.charge_estimate(request, estimate)
            passage.reserved_tokens += estimate
        if self.rules.capacity.engine_queue and self.rules.holding and not preempting and \
                not fits(primary, now, self.rules.capacity,
                         request.prompt_tokens - self._room_held(passage, primary)):
            # Beyond its room (``queue_slot``): the engine queues it until a request there ends.
            passage.engine_queued = True
            primary.engine_queued += 1
        blocks = self._hold_blocks(passage, primary)
        primary.inflight_tokens += passage.reserved_tokens - passage.prefix_tokens + blocks
        primary.inflight_requests += 1
        if self._running is not None:
            self._running.setdefault(primary.address, {})[passage] = None
        primary.sent_since_scrape += 1
        if passage.stream:
            passage.prefilling = True
            # What the engine is expected to compute: the part expected cached there
            # (``_note_prefix``, with affinity) is not prefill.
            passage.prefill_counted = request.prompt_tokens - request.cached_prompt_tokens
            primary.prefill_tokens += request.prompt_tokens
            primary.prefill_computed += passage.prefill_counted
            if not passage.output_seen:
                self._unseen_prefill.setdefault(primary.address, {})[passage] = None
        self.occupancy.add(passage.lane, passage.tenant, passage.reserved_tokens,
                           self.scheduler.weights)
        on_dispatch(primary.health, now)
        passage.projected_tokens = self._projected(passage, now)
        primary.projected_tokens += passage.projected_tokens - passage.prefix_tokens + blocks
        self.listener.dispatched(passage, now)

    def _note_prefix(self, passage: Passage, endpoint: EndpointState, now: float) -> None:
        """The request goes to ``endpoint``: the part of its prompt the endpoint is expected
        to hold is its expected cached prompt (charged at dispatch as the cost function says,
        settled from the engine's report); the new KV it asks for there (the rest of its
        prompt and its expected output) ages what the endpoint was sent before
        (``PrefixIndex.sent``), and its blocks are now the endpoint's most recent."""
        index, affinity = self.prefix_index, self.rules.affinity
        if index is None or affinity is None:
            return
        blocks = passage.prefix_blocks
        request = passage.request
        budget = endpoint.budget(self.rules.capacity.fallback_budget)
        if blocks and self.caches(endpoint):  # an engine without a cache computes every token
            request.cached_prompt_tokens = cached_estimate(
                request.prompt_tokens, index.matched(endpoint.address, blocks, budget),
                affinity.block_chars, passage.prefix_chars)
        index.sent(endpoint.address, self._projected(passage, now)
                   - request.cached_prompt_tokens)
        index.record(endpoint.address, blocks)

    def _room_held(self, passage: Passage, endpoint: EndpointState) -> int:
        """Tokens of the request's prompt that requests running on ``endpoint`` already hold
        there (``InflightBlocks``): the engine shares those blocks, so the request needs that
        much less room there. Blocks the endpoint merely has cached (the prefix index) are
        not counted: the engine counts them free and a hit takes them back out of its free
        queue."""
        if not passage.prefix_block_chars or not self.caches(endpoint):
            return 0
        matched = self.inflight_blocks.held(endpoint.address, passage.prefix_blocks)
        return covered_tokens(passage.request.prompt_tokens, matched,
                              passage.prefix_block_chars, passage.prefix_chars)

    def caches(self, endpoint: EndpointState) -> bool:
        """Whether ``endpoint``'s engine is taken to cache prefixes: the rules assume it
        (``engine_cache``) and, where they learn it, a read of it has not said otherwise.
        Before its first read an endpoint counts prompts whole: a burst sent then, counted
        once on an engine that turns out not to cache, would sit in its queue for minutes."""
        rules = self.rules
        if not rules.learn_engine_cache:
            return rules.engine_cache
        return rules.engine_cache and endpoint.scraped_at is not None and \
            endpoint.prefix_caching is not False

    def _hold_blocks(self, passage: Passage, endpoint: EndpointState) -> int:
        """The request now runs on ``endpoint``: its blocks join the endpoint's in-flight
        blocks, if its engine caches; the tokens they add there (those of the blocks nobody
        there held)."""
        passage.holds_blocks = bool(passage.prefix_block_chars) and self.caches(endpoint)
        if not passage.holds_blocks:
            passage.prefix_tokens = 0
            return 0
        prompt = passage.request.prompt_tokens
        passage.prefix_tokens = covered_tokens(prompt, len(passage.prefix_blocks),
                                               passage.prefix_block_chars, passage.prefix_chars)
        return self.inflight_blocks.hold(endpoint.address, passage.prefix_blocks, prompt,
                                         passage.prefix_block_chars, passage.prefix_chars)

    # -- the request's end --

    def drop(self, passage: Passage, outcome: str, now: float) -> None:
        """Take a request that was never dispatched out of the gate (``queue_timeout``,
        ``cancelled``, ``shed``, ``shutdown``), charging nothing. Doing it again does nothing."""
        if passage.outcome is not None or passage.dispatched_at is not None:
            return
        passage.outcome = outcome
        if passage.parked:
            self._parked[passage.tenant].remove(passage)
            if not self._parked[passage.tenant]:
                del self._parked[passage.tenant]
                self._update_single(passage.tenant, self._in_queue.get(passage.tenant, []))
        else:
            self.scheduler.cancel(passage.request)
            self._queue_remove(passage)
        self._unwait(passage)
        self.passages.pop(passage.request, None)
        if passage.reservation is not None:
            self.admission.finish(passage.reservation, 0, now)  # nothing was served
        self._unpark(passage.tenant, now)
        self.listener.dropped(passage, outcome, now)

    def charge_output(self, passage: Passage, tokens: int, now: float | None = None) -> None:
        """Tokens streamed back: charge them and count them against the endpoint. The first
        ends the request's prefill (``prefill_tokens``); with ``now`` given and a prefill bound
        configured, requests that bound held may go then (else at the gate's next pump)."""
        if tokens <= 0 or passage.outcome is not None or passage.dispatched_at is None:
            return
        self.scheduler.charge_output(passage.request, tokens)
        if passage.stream and passage.endpoint is not None:
            # A streaming request's KV footprint grows with each token; a non-streaming one had
            # its whole estimate reserved at dispatch.
            passage.endpoint.inflight_tokens += tokens
            passage.reserved_tokens += tokens
            self.occupancy.add(passage.lane, passage.tenant, tokens, self.scheduler.weights)
        if passage.prefilling:
            # Its engine started it: an engine-queue slot there is free again.
            queued = passage.engine_queued
            self._prefilled(passage)
            if now is not None and (queued or self._prefill_holds()):
                self.pump(now)

    def scraped(self, endpoint: EndpointState, waiting: float | None, running: float | None,
                kv_usage: float | None, kv_budget_tokens: int | None, *, sent_at: float,
                now: float, prefix_caching: bool | None = None) -> None:
        """A read of ``endpoint``'s engine, sent at ``sent_at``, answered at ``now`` with these
        figures (``None``: not exposed); they replace the last ones (``observe``).
        ``prefix_caching``: whether the engine says it caches prefixes (``caches``).

        It also ends the prefill of streams there whose tokens the picker does not see
        (``Passage.output_seen`` false), which no first token would end before the request
        does: of those sent before the read, the engine's ``waiting`` count are taken as still
        waiting (``still_waiting``) and the rest as computed. Whatever a prefill rule held
        goes at the caller's next ``pump``."""
        observe(endpoint, waiting, running, kv_usage, kv_budget_tokens, now, prefix_caching)
        unseen = self._unseen_prefill.get(endpoint.address)
        if not unseen or waiting is None:
            return  # nothing tells: their prefill counts until they end
        sent = [p for p in unseen if p.dispatched_at is not None and p.dispatched_at < sent_at]
        waits = still_waiting(sent, waiting)
        for passage in sent:
            if passage not in waits:
                self._prefilled(passage)

    def _prefill_holds(self) -> bool:
        """Whether a rule may hold a request until some endpoint's prefill ends."""
        capacity = self.rules.capacity
        return bool(capacity.max_prefill_tokens or (
            capacity.ready_reserve and self.rules.idle_tenant_reserve))

    def _prefilled(self, passage: Passage) -> None:
        """The request's prompt is no longer outstanding prefill on its endpoint."""
        passage.prefilling = False
        endpoint = passage.endpoint
        if endpoint is not None:
            endpoint.prefill_tokens -= passage.request.prompt_tokens
            endpoint.prefill_computed -= passage.prefill_counted
            if passage.engine_queued:
                passage.engine_queued = False
                endpoint.engine_queued -= 1
            if not passage.output_seen:
                self._unseen_prefill.get(endpoint.address, {}).pop(passage, None)

    def body_read(self, passage: Passage, max_tokens: int | None, stream: bool,
                  choices: int) -> None:
        """A request routed before its body was read (Envoy's ``STREAMED`` body mode, admitted
        on its headers as one non-streaming choice without a cap): what the body says, once
        read. The engine works to the smaller of the body's own cap and admission's (the body is
        rewritten so), so a count lost later is settled on that, not on the tenant's whole
        estimate, and a stream's output is learned as a stream's."""
        passage.stream = stream
        if max_tokens is not None:
            cap = passage.max_tokens
            if cap is not None and choices > passage.choices:
                cap = max(1, cap * passage.choices // choices)  # shared as the body is rewritten
            passage.body_max_tokens = max_tokens
            passage.max_tokens = None if cap is None else min(cap, max_tokens)
        passage.choices = choices

    def complete(self, passage: Passage, usage: Usage | None, outcome: str,
                 now: float) -> None:
        """The request ended (``ok``, ``error``, ``cancelled``, ``unmetered``,
        ``upstream_failed``): settle and free its slot, then dispatch what may go.

        Without ``usage`` it settles to what was counted: the estimated prompt and the output
        tokens seen (``unmetered``, a response the gateway never showed: the output estimate).
        Calling it again does nothing.
        """
        if passage.outcome is not None or passage.dispatched_at is None:
            return
        passage.outcome = outcome
        request = passage.request
        reported = usage is not None
        if usage is None:
            output = request.generated
            if outcome == "ok" and not passage.stream:
                estimate = request.estimated_output
                cap = passage.output_cap
                if cap is not None:  # a body read after its route may cap below the estimate
                    estimate = min(estimate, cap * passage.choices)
                output = max(output, estimate)
            elif outcome == "unmetered":
                output = max(output, self.expected_output(
                    passage.tenant, passage.output_cap, passage.stream, now) * passage.choices)
            usage = Usage(request.prompt_tokens, output, request.cached_prompt_tokens)
        self.scheduler.finish(request, usage)
        demand = self._recent.get(passage.tenant)
        if demand is not None:
            demand.ended(now - passage.dispatched_at)  # how long it held its room
        del self.passages[request]
        self._release(passage, outcome == "ok", now)
        self._learn(passage, usage, outcome, reported, now)
        if passage.reservation is not None and passage.reservation.state != "done":
            prompt = usage.prompt_tokens if self.rules.charge_sent_to_budgets else \
                usage.prompt_tokens - min(usage.cached_prompt_tokens, usage.prompt_tokens)
            self.admission.finish(passage.reservation, prompt + usage.completion_tokens, now)
        self._unpark(passage.tenant, now)
        self.listener.settled(passage, usage, outcome, now, not reported)
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_INTERVAL
            self.forget_idle(now)
        self._forget_drained()
        self.pump(now)

    def _release(self, passage: Passage, answered: bool, now: float) -> None:
        """Free the request's room on its endpoint; an answer from its engine counts as a
        success for the endpoint's health."""
        endpoint = passage.endpoint
        if endpoint is None:
            return
        blocks = self.inflight_blocks.release(endpoint.address, passage.prefix_blocks) \
            if passage.holds_blocks else 0
        if self.prefix_index is not None and passage.prefix_blocks:
            self.prefix_index.released(endpoint.address, passage.prefix_blocks)
        freed = passage.reserved_tokens - passage.prefix_tokens + blocks
        endpoint.inflight_tokens -= freed
        endpoint.projected_tokens -= passage.projected_tokens - passage.prefix_tokens + blocks
        if passage.prefilling:
            self._prefilled(passage)
        elif passage.engine_queued:  # non-streaming: no first token ended it
            passage.engine_queued = False
            endpoint.engine_queued -= 1
        self.occupancy.add(passage.lane, passage.tenant, -passage.reserved_tokens,
                           self.scheduler.weights)
        endpoint.inflight_requests -= 1
        if self._running is not None:
            self._unrun(passage, endpoint.address)
        endpoint.completed_since_scrape += 1
        endpoint.released_since_scrape += freed
        if answered:
            record_success(endpoint.health, now, self.rules.health)

    def _unrun(self, passage: Passage, address: str) -> None:
        """The request no longer runs on ``address`` (``_running``, kept)."""
        assert self._running is not None
        running = self._running.get(address)
        if running is not None:
            running.pop(passage, None)
            if not running:
                del self._running[address]

    def _learn(self, passage: Passage, usage: Usage, outcome: str, reported: bool,
               now: float) -> None:
        """What the tenant's estimates learn from a settled request."""
        if reported and usage.prompt_tokens > 0:
            # How the engine's tokenizer compares with the body estimate, per tenant and model.
            self.estimates.learn_prompt(passage.tenant, passage.model,
                                        passage.body_prompt_tokens, usage.prompt_tokens, now)
        # Requests without output (embeddings) would drag the tenant's average towards 0.
        cap = passage.output_cap
        # The estimate is of one choice: a request of n choices reports n choices' output.
        output = usage.completion_tokens // passage.choices
        if passage.stream and cap != 0:
            # A stream's own counted output; one cut short (cancelled, failed, stopped at its
            # max_tokens) may only raise the estimate.
            self.estimates.learn_output(
                passage.tenant, output, now, stream=True,
                complete=outcome == "ok" and (cap is None or output < cap))
        elif outcome == "ok" and reported and cap != 0:
            self.estimates.learn_output(passage.tenant, output, now)

    # -- endpoint health (outlier ejection, ``picker.core.health``) --

    def endpoint_failed(self, address: str, reason: str, now: float) -> bool:
        """A scrape of ``address`` failed, or a request sent there never reached its engine.
        True when this ejected it."""
        endpoint = self.endpoints.get(address)
        if endpoint is None:
            return False
        # The last endpoint in service is never ejected (see picker.core.health).
        others = any(e is not endpoint and e.in_service(now) for e in self.endpoints.values())
        return record_failure(endpoint.health, now, self.rules.health, reason, may_eject=others)

    def endpoint_ok(self, address: str, now: float) -> bool:
        """``address`` answered (a scrape, or a response from its engine). True when this
        restored it (and requests that waited for it were dispatched)."""
        endpoint = self.endpoints.get(address)
        if endpoint is None or not record_success(endpoint.health, now, self.rules.health):
            return False
        self.pump(now)
        return True

    def upstream_failed(self, passage: Passage, reason: str, now: float) -> bool:
        """The gateway reports that the request never reached an engine (connect failure,
        reset before the response began): its endpoint's failure counts towards ejection and
        the request is settled to nothing (``upstream_failed``). True when that ejected it."""
        if passage.outcome is not None or passage.dispatched_at is None:
            return False
        ejected = passage.endpoint is not None and \
            self.endpoint_failed(passage.endpoint.address, reason, now)
        self.complete(passage, Usage(0, 0, 0), "upstream_failed", now)
        return ejected

    def served_by(self, passage: Passage, address: str, now: float) -> bool:
        """The gateway reports the endpoint that actually served the request (after a retry it
        may be a fallback): its load moves there, so the endpoint that failed is not charged.
        True when that ejected the primary."""
        served = self.endpoints.get(address)
        primary = passage.endpoint
        if served is None or primary is None or served is primary or passage.outcome is not None:
            return False
        # The gateway retries only when the primary failed (connect failure, reset).
        ejected = self.endpoint_failed(primary.address, "the gateway retried on a fallback", now)
        # Its blocks leave the primary's in-flight blocks and join the server's (if its engine
        # caches: the tokens its blocks cover may differ there).
        own = {primary.address: (self.inflight_blocks.release(
            primary.address, passage.prefix_blocks) if passage.holds_blocks else 0)
            - passage.prefix_tokens}
        own[served.address] = self._hold_blocks(passage, served) - passage.prefix_tokens
        for endpoint, sign in ((primary, -1), (served, 1)):
            endpoint.inflight_tokens += sign * (passage.reserved_tokens + own[endpoint.address])
            endpoint.projected_tokens += sign * (passage.projected_tokens + own[endpoint.address])
            endpoint.inflight_requests += sign
            # It joined the server's queue, not the primary's (whose count a read since the
            # dispatch may already have restarted).
            endpoint.sent_since_scrape = max(0, endpoint.sent_since_scrape + sign)
            endpoint.engine_queued += sign * passage.engine_queued
            if passage.prefilling:
                endpoint.prefill_tokens += sign * passage.request.prompt_tokens
                endpoint.prefill_computed += sign * passage.prefill_counted
        if passage.prefilling and not passage.output_seen:
            self._unseen_prefill.get(primary.address, {}).pop(passage, None)
            self._unseen_prefill.setdefault(served.address, {})[passage] = None
        if self._running is not None:
            self._unrun(passage, primary.address)
            self._running.setdefault(served.address, {})[passage] = None
        passage.endpoint = served
        if passage.prefix_blocks and self.prefix_index is not None:
            # The prompt is in the server's cache now (the primary never computed it).
            self.prefix_index.record(served.address, passage.prefix_blocks)
        if passage.session is not None and self.sessions is not None:
            self.sessions.moved(passage.session, served.address)
        self.pump(now)  # the primary's room is free again
        return ejected

    # -- memory --

    def forget_idle(self, now: float) -> None:
        """Forget per-tenant state that forgetting cannot change a decision for: admission
        buckets refilled to full, estimates past their ttl (they read as the default), VTC
        counters at or below the lift floor (re-created identically by the lift), and reserve
        entries past their window."""
        self.admission.prune(now)
        self.estimates.prune(now)
        active = {passage.tenant for passage in self.passages.values()}
        self.scheduler.forget_idle(active, self.rules.configured_tenants)
        if self.sessions is not None:
            self.sessions.prune(now)
        window = self.rules.idle_tenant_reserve
        self._recent = {t: seen for t, seen in self._recent.items() if now - seen.last <= window}

    def tenants_held(self) -> dict[str, int]:
        """How many tenants each part of the gate holds state for (memory, benchmarks)."""
        return {"admission": self.admission.tracked_tenants(),
                "estimates": len(self.estimates.tenants()),
                "scheduler": self.scheduler.tenants_held(),
                "queues": len(self._in_queue) + len(self._parked),
                "recent": len(self._recent),
                "occupancy": self.occupancy.tenants()}
