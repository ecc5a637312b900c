"""The pool simulator: the picker's own gate in front of simulated vLLM engines, in discrete time.

It answers: *what does the picker do with this traffic on this pool, and what does each tenant
get?* without a network, a process or a wall clock. The gate is the one the server runs
(``picker.core.gate.Gate``, built from a ``PickerConfig`` by ``picker.config.build``); each
endpoint is vLLM V1's scheduler (``picker.sim.vllm``); the traffic is a load-generator file
(``picker.sim.traffic``) drawn with the same seeds as ``picker.sim.load`` sends it through a real
gateway. Each engine step (``step_s``) the simulator, in this order: delivers arrivals to the gate
(which admits, queues or dispatches them), drops requests past the queue timeout, cancels requests
whose client gave up (``timeout_s`` after it sent them, as the load client does: the engine aborts
them and the gate settles them to what they delivered), reads each engine's figures every
``scrape_interval_s`` (as the scraper does), steps every engine that is free, and reports the
tokens and completions of every step that ends then back to the gate (streamed output charged per
token, as the meter stream does). Nothing else differs from the server: same decisions, same
ledger.

Step time: a step that computes prompt tokens (prefill chunks, and the recompute of preempted
requests alike) keeps its engine busy for ``step_s + prefill_tokens × prefill_s_per_token``,
as a GPU iteration grows with the prompt tokens in its batch. The step is decided at its first
tick; its tokens and completions reach the gate stamped with the first tick at or after its end,
and the engine takes its next step at that tick, its own clock still where the step ended (as
the server's ``--catch-up-ms``): a step's part of a tick is not lost. Other engines, arrivals and
scrapes go on every tick meanwhile (a scrape during a step reads the engine as the step leaves
it). With ``prefill_s_per_token`` 0 (the default) every step is one tick, as before.

Sessions and programs (``picker.sim.workloads``: chat turns, agent calls) are closed loop per
unit: when a call of one ends answered, its reply (the simulated server's text for the tokens it
generated) joins the unit's context and the next call arrives after the unit's pause (think time,
tool latency), unless that is at or after ``duration_s``; a call that fails ends its unit. A
backlog tenant's next unit starts when the previous unit ends. Requests drawn as counts (every
workload without ``system_prompt_tokens``, ``chat``, ``rag`` or ``agent``) run exactly as before.

Network and Envoy latency: ``dispatch_latency_s`` delays each dispatch's arrival at its engine
and ``completion_lag_s`` the gate's seeing a finished request end (both 0 by default; the
efficiency benchmark, ``bench.efficiency``, measures them through Envoy).

What it does not model: the body parsing and tokenizer estimate
(the prompt estimate is the engine's count), and retries.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from picker.config.build import (
    admission_rules,
    cost_function,
    endpoint_budgets,
    gate_rules,
)
from picker.config.schema import PickerConfig
from picker.core import LaneSpec, Scheduler, Usage
from picker.core.admission import Admission, Refused
from picker.core.gate import Gate, Passage, Turnaway
from picker.core.selection import figures_decide
from picker.core.shared import Replica, StoreModel, StoreReply
from picker.openai.prefix import token_blocks
from picker.sim.load import (
    BACKLOG_ERROR_PAUSE_S,
    PlannedRequest,
    draw_request,
    plan_open_loop,
    unit_request,
)
from picker.sim.openai_fmt import CHAT, generated_ids, generated_text
from picker.sim.traffic import Traffic
from picker.sim.vllm import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SeqRequest,
    StepOutput,
    VllmConfig,
    VllmScheduler,
)


@dataclass(frozen=True)
class PoolSpec:
    """The simulated pool: how many engines, and how each is configured."""

    endpoints: int = 2
    kv_budget_tokens: int = 8192
    """Each engine's KV cache (``num_gpu_blocks × block_size``)."""
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    engine_policy: str = "fcfs"
    """The engines' ``--scheduling-policy``: ``fcfs`` or ``priority``."""
    enable_prefix_caching: bool = True
    """The engines' automatic prefix caching (``picker.sim.vllm``; on by default, as in vLLM
    V1). A request drawn as counts gets token ids of its own, as the server's tokenizer gives
    the load client's filler words: no other request hits its blocks, but when it is preempted
    it finds them still cached and recomputes only the evicted ones, as vLLM does."""
    step_s: float = 0.01
    """Seconds per engine step (the simulated server's ``--step-ms``)."""
    scrape_interval_s: float = 0.05
    slow_scrape_interval_s: float | None = None
    """As ``capacity.slowScrapeInterval``: an endpoint whose figures do not decide its room
    (``figures_decide``) is read this often; None: every endpoint every ``scrape_interval_s``."""
    prefill_s_per_token: float = 0.0
    """A step's extra seconds per prompt token it computes, recompute included (the server's
    ``--prefill-ms-per-1k-tokens`` / 1e6); 0: every step takes ``step_s``."""
    output_seen_at_end: bool = False
    """The gateway's access-log response path (manifests/gateway/envoy-access-log.yaml): the
    picker sees a request's output only once it has ended, so no first token ends a prefill
    and no stream grows between scrapes; False: the meter stream shows every token."""
    dispatch_latency_s: float = 0.0
    """Seconds from the gate's dispatch to the engine's adding the request (through Envoy and
    the server's HTTP stack), rounded to whole ticks of ``step_s``; 0: at once, as before."""
    completion_lag_s: float = 0.0
    """Seconds from the step a request finished in to the gate's seeing it end (the response's
    end through Envoy and the meter stream), rounded to whole ticks of ``step_s``; its room is
    the gate's again only then. 0: at that step's end, as before."""

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError("step_s must be > 0")
        if not self.prefill_s_per_token >= 0:
            raise ValueError("prefill_s_per_token must be >= 0")
        if not (self.dispatch_latency_s >= 0 and self.completion_lag_s >= 0):
            raise ValueError("dispatch_latency_s and completion_lag_s must be >= 0")

    def step_ticks(self, prefill_tokens: int) -> int:
        """Ticks of ``step_s`` a step computing ``prefill_tokens`` prompt tokens keeps its engine
        busy: ``step_s + prefill_tokens × prefill_s_per_token``, rounded up."""
        extra = prefill_tokens * self.prefill_s_per_token / self.step_s
        # The tolerance keeps float noise (0.1 / 0.01 = 10.000000000000002) from adding a tick.
        return 1 + max(0, math.ceil(extra - 1e-9))

    def addresses(self) -> list[str]:
        return [f"10.0.0.{i + 1}:8000" for i in range(self.endpoints)]

    def ticks(self, seconds: float) -> int:
        """Whole ticks of ``step_s`` nearest to ``seconds``."""
        return round(seconds / self.step_s)


@dataclass
class PoolRecord:
    """What one request got. Times are seconds after the run's start."""

    tenant: str
    kind: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    stream: bool
    outcome: str = ""
    """``ok``, a refusal's reason, ``queue_timeout`` or ``unfinished`` (still in at the end)."""
    dispatched_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    completion_tokens: int = 0
    endpoint: str | None = None
    engine_priority: int | None = None
    preemptions: int = 0
    engine_started_s: float | None = None
    """When its engine first computed any of its tokens (the start of that step)."""
    seq: int = 0
    """Its tenant's request (or unit) number."""
    session: str | None = None
    """The session or program it belongs to (``PlannedRequest.session``)."""
    call: int | None = None
    """Its index in its unit of a workload (``picker.sim.workloads``); None: not part of one."""
    calls: int = 1
    """Calls of its unit."""
    cached_tokens: int = 0
    """Its prompt tokens its engine found in its prefix cache."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class StepRecord:
    """One engine step: when it started and ended, and the prompt tokens it computed."""

    start_s: float
    end_s: float
    prefill_tokens: int


@dataclass(frozen=True)
class TtftParts:
    """Where a request's time to its first token went (``ttft_parts``), in seconds."""

    queued_s: float
    """In the picker: arrival to dispatch."""
    in_flight_s: float
    """The rest of the step its engine was running when it arrived there."""
    engine_wait_s: float
    """Dispatch to the start of the first step that computed its tokens (``in_flight_s``
    included): the engine had no blocks, no budget or a better request for it."""
    steps_waited: int
    """Steps of its engine that started after its dispatch and before its first one."""
    longest_step_waited_s: float
    """The longest step it waited out (the one in flight at dispatch included)."""
    prefill_s: float
    """The start of its first step to its first token: its prefill steps."""
    prefill_steps: int
    """Steps that computed its prompt (more than one: chunked, or sharing the budget)."""


@dataclass(eq=False)
class SimPassage(Passage):
    """A passage with what the simulator needs to serve it."""

    planned: PlannedRequest = field(kw_only=True)
    record: PoolRecord = field(kw_only=True)
    seq: SeqRequest | None = None
    picker: int = 0
    """The picker (gate) that holds it."""


@dataclass(frozen=True)
class Sharing:
    """Active-active pickers sharing state through a store (``picker.core.shared``), each with
    its own gate over the same engines."""

    pickers: int = 2
    sync_interval_s: float = 0.1
    latency_s: float = 0.001
    """Round trip of an exchange: its answer reaches the picker this much after it sent."""
    lease_expiry_s: float = 2.0
    arrival: dict[str, tuple[float, ...]] | None = None
    """Per tenant, the fraction of its requests that reaches each picker (default: evenly)."""


@dataclass
class SharingStats:
    """What the exchange did over a run."""

    exchanges: int = 0
    view_age_s: list[float] = field(default_factory=list)
    """Per picker and tick, how old the view it decides on is (since its last answer was
    produced)."""
    grants_max: float = 0.0
    """The largest sum of the pickers' grants at any moment (at most 1)."""
    held_max: float = 0.0
    """The largest share of one endpoint's budget the pickers together held at dispatch."""


@dataclass
class PoolRun:
    """A finished simulation."""

    records: list[PoolRecord]
    duration_s: float
    output_tokens_in_window: int
    """Output tokens the engines produced between ``warmup_s`` and ``duration_s``."""
    window_s: float
    preemptions: int
    recomputed_tokens: int
    computed_tokens: int
    """Every token the engines computed (prefill, recompute and decode)."""
    steps: int
    gate: Gate = field(repr=False, compare=False)
    """The gate as the run left it (its ledger and the tenants' service totals)."""
    sharing: SharingStats | None = None
    scrapes: int = 0
    """Reads of an endpoint's figures by a picker (each endpoint by each picker)."""
    step_log: dict[str, list[StepRecord]] = field(default_factory=dict, repr=False,
                                                  compare=False)
    """Per endpoint, every step its engine took, in order (``ttft_parts``)."""
    prefix_cache_queries: int = 0
    """Prompt tokens the engines looked up in their prefix caches (vLLM's counter, summed)."""
    prefix_cache_hits: int = 0
    """Of those, the tokens found cached: the engines' hit rate is hits / queries."""

    def tokens_per_s(self) -> float:
        return self.output_tokens_in_window / self.window_s if self.window_s > 0 else 0.0

    def ttft_parts(self, record: PoolRecord) -> TtftParts | None:
        """Where ``record``'s time to its first token went; None without a first token."""
        if record.first_token_s is None or record.dispatched_s is None \
                or record.engine_started_s is None or record.endpoint is None:
            return None
        steps = self.step_log.get(record.endpoint, [])
        sent, started = record.dispatched_s, record.engine_started_s
        starts = [step.start_s for step in steps]
        first = bisect.bisect_left(starts, sent)
        # Steps that ended after its dispatch and started before its first one.
        waited = [step for step in steps[max(0, first - 1):bisect.bisect_left(starts, started)]
                  if step.end_s > sent]
        in_flight = [step for step in waited if step.start_s < sent]  # running at dispatch
        prefill = steps[bisect.bisect_left(starts, started):
                        bisect.bisect_left(starts, record.first_token_s)]
        return TtftParts(
            queued_s=sent - record.arrival_s,
            in_flight_s=max(0.0, in_flight[0].end_s - sent) if in_flight else 0.0,
            engine_wait_s=started - sent,
            steps_waited=len(waited) - len(in_flight),
            longest_step_waited_s=max((s.end_s - s.start_s for s in waited), default=0.0),
            prefill_s=record.first_token_s - started,
            prefill_steps=sum(1 for s in prefill if s.prefill_tokens))


class _Pool:
    """One run's state: the gate, the engines, and the traffic still to send."""

    def __init__(self, config: PickerConfig, traffic: Traffic, spec: PoolSpec,
                 duration_s: float, sharing: Sharing | None = None) -> None:
        self.config, self.traffic, self.spec, self.duration_s = config, traffic, spec, duration_s
        model = config.model(traffic.model)
        self.max_model_len = None if model is None else model.max_model_len
        """The served model's context (``models[].maxModelLen``), as the dispatcher passes it:
        it bounds the budget reservation of a request without ``max_tokens``."""
        addresses = spec.addresses()
        budgets = endpoint_budgets(config)
        self.gates = [self._gate(config, {a: budgets.get(a) or spec.kv_budget_tokens
                                          for a in addresses})
                      for _ in range(1 if sharing is None else sharing.pickers)]
        self.gate = self.gates[0]
        self.scrapes = 0
        self.next_scrape: dict[tuple[int, str], float] = {}
        """(picker, address) → when it is next read (``PoolSpec.slow_scrape_interval_s``)."""
        self.sharing = sharing
        if sharing is not None:
            self.store = StoreModel(lease_expiry=sharing.lease_expiry_s)
            self.replicas = [Replica(gate, sharing.sync_interval_s) for gate in self.gates]
            self.batches = [0] * sharing.pickers
            self.answers: list[tuple[float, int, int, StoreReply]] = []
            """(when it arrives, order, picker, answer), a heap."""
            self.answered_at = [0.0] * sharing.pickers
            self.stats = SharingStats()
            self.route = random.Random(traffic.seed)
        engine = VllmConfig(total_blocks=spec.kv_budget_tokens // spec.block_size,
                            block_size=spec.block_size, max_num_seqs=spec.max_num_seqs,
                            max_num_batched_tokens=spec.max_num_batched_tokens,
                            policy=spec.engine_policy,
                            enable_prefix_caching=spec.enable_prefix_caching)
        self.engines = {a: VllmScheduler(engine) for a in addresses}
        self.in_flight: dict[str, tuple[StepOutput, int]] = {}
        """Each busy engine's step: its output, and the ticks left until it ends."""
        self.clock: dict[str, float] = {}
        """Each engine's own time: when its last step ended, exactly (``_ticks``)."""
        self.step_log: dict[str, list[StepRecord]] = {a: [] for a in addresses}
        self.records: list[PoolRecord] = []
        self.open_loop = plan_open_loop(traffic, duration_s)
        self.next_open = 0
        self.backlog_due: list[tuple[float, str]] = []
        """(when, tenant), a heap: a closed-loop tenant's next request."""
        self.follow_ups: list[tuple[float, int, PlannedRequest]] = []
        """(when, order, request), a heap: a session's or program's next call, planned when its
        previous call completed (dependent arrivals)."""
        self.follow_order = itertools.count()
        self.next_seq = {t.name: 0 for t in traffic.tenants}
        self.queued: list[SimPassage] = []
        self.deadlines: list[tuple[float, int, SimPassage]] = []
        """(when its client gives up, dispatch order, passage), a heap of dispatched requests."""
        self.dispatches = itertools.count()
        self.refused: list[SimPassage] = []
        """Dispatched to an engine that refused them (settled after the gate's turn)."""
        self.to_engine: list[tuple[float, int, SimPassage]] = []
        """(when it reaches its engine, order, passage), a heap (``dispatch_latency_s``)."""
        self.to_gate: list[tuple[float, int, SimPassage, Usage]] = []
        """(when the gate sees it end, order, passage, usage), a heap (``completion_lag_s``)."""
        self.lag_order = itertools.count()
        self.own_ids = itertools.count(1)
        """Numbers a request drawn as counts its token ids by (``dispatched``)."""
        self.now = 0.0

    def _gate(self, config: PickerConfig, budgets: dict[str, int]) -> Gate:
        scheduler = Scheduler([LaneSpec(lane.name, lane.min_share) for lane in config.lanes],
                              policy=config.scheduling.policy, cost=cost_function(config))
        for tenant in config.tenants:
            scheduler.set_weight(tenant.id, tenant.weight)
        gate = Gate(gate_rules(config), scheduler, Admission(*admission_rules(config)),
                    now=0.0, listener=self)
        gate.set_endpoints(dict(budgets))
        return gate

    # -- active-active pickers --

    def exchange(self) -> None:
        """Every picker sends its changes; each answer arrives ``latency_s`` later."""
        assert self.sharing is not None
        for i, replica in enumerate(self.replicas):
            self.batches[i] += 1
            ask = replica.lease_request(f"p{i}", self.now)
            answer = self.store.exchange(
                f"p{i}", self.batches[i], replica.changes(self.now), self.now,
                target=ask.target, held=ask.held, demand=ask.demand, floors=ask.floors)
            self.stats.exchanges += 1
            heapq.heappush(self.answers, (self.now + self.sharing.latency_s,
                                          self.stats.exchanges, i, answer))
        grants = sum(granted for _, granted, _ in self.store.leases.values())
        self.stats.grants_max = max(self.stats.grants_max, grants)

    def start_sharing(self, exchanges: int = 30) -> None:
        """Exchanges answered before any request: pickers start before the traffic does, each
        loading its view before it serves, and their leases settle meanwhile (each asks for an
        even part of an idle pool)."""
        for _ in range(exchanges):
            self.exchange()
            while self.answers:
                _, _, i, answer = heapq.heappop(self.answers)
                self.replicas[i].receive(answer, self.now)
        self.stats.grants_max = 0.0

    def receive(self) -> None:
        answers = self.answers
        while answers and answers[0][0] <= self.now:
            sent_at, _, i, answer = heapq.heappop(answers)
            self.replicas[i].receive(answer, self.now)
            self.answered_at[i] = sent_at - self.sharing.latency_s if self.sharing else 0.0
        self.stats.view_age_s.extend(self.now - at for at in self.answered_at)

    def note_held(self) -> None:
        """The largest share of one endpoint the pickers together hold now."""
        for address in self.engines:
            held = 0.0
            for gate in self.gates:
                endpoint = gate.endpoints.get(address)
                if endpoint is not None:
                    held += endpoint.inflight_tokens / endpoint.budget(
                        gate.rules.capacity.fallback_budget)
            self.stats.held_max = max(self.stats.held_max, held)

    def _picker_for(self, tenant: str) -> int:
        if self.sharing is None:
            return 0
        weights = (self.sharing.arrival or {}).get(tenant)
        if weights is None:
            return self.route.randrange(self.sharing.pickers)
        return self.route.choices(range(self.sharing.pickers), weights)[0]

    # -- what the gate decided (``GateListener``) --

    def dispatched(self, passage: SimPassage, now: float) -> None:
        record, endpoint = passage.record, passage.endpoint
        assert endpoint is not None  # the gate dispatches to an endpoint
        record.dispatched_s, record.endpoint = now, endpoint.address
        record.engine_priority = passage.engine_priority
        if passage.engine_priority and self.spec.engine_policy != "priority":
            # vLLM refuses a non-zero priority unless it runs --scheduling-policy priority
            # (400); the gateway settles such a request to nothing.
            self.refused.append(passage)
            return
        planned = passage.planned
        # A workload's reply is the simulated server's text, its blocks hashed as the server's.
        output_ids: Sequence[int] | None = None if planned.messages is None \
            else generated_ids(CHAT, planned.max_tokens)
        token_ids: Sequence[int] | None = planned.token_ids
        if token_ids is None:
            # Drawn as counts: the load client sends that many random filler words, which the
            # server's tokenizer makes as many ids, no block of them equal to another request's.
            # Ids of its own (a range: nothing stored), so that vLLM's prefix cache acts as on
            # the server: a preempted request finds its blocks still cached when rescheduled
            # and recomputes only what was evicted meanwhile (``own_ids``).
            base = next(self.own_ids) << 32
            end = base + planned.prompt_tokens
            token_ids, output_ids = range(base, end), range(end, end + planned.max_tokens)
        seq = SeqRequest(id=passage, prompt_tokens=planned.prompt_tokens,
                         output_tokens=planned.max_tokens, token_ids=token_ids,
                         output_ids=output_ids)
        passage.seq = seq
        latency = self.spec.ticks(self.spec.dispatch_latency_s) * self.spec.step_s
        if latency:
            heapq.heappush(self.to_engine, (now + latency, next(self.lag_order), passage))
        else:
            self.engines[endpoint.address].add(seq, passage.engine_priority or 0, now)
        heapq.heappush(self.deadlines, (passage.arrived_at + self.traffic.timeout_s,
                                        next(self.dispatches), passage))

    def dropped(self, passage: SimPassage, outcome: str, now: float) -> None:
        self._end(passage.record, outcome, now, passage.planned)

    def settled(self, passage: SimPassage, usage: Usage, outcome: str, now: float,
                estimated: bool) -> None:
        record = passage.record
        record.completion_tokens = usage.completion_tokens
        record.preemptions = passage.seq.preemptions if passage.seq is not None else 0
        if passage.seq is not None:
            record.cached_tokens = passage.seq.cached_tokens or 0
        self._end(record, outcome, now, passage.planned)

    def _end(self, record: PoolRecord, outcome: str, now: float,
             planned: PlannedRequest | None = None) -> None:
        record.outcome, record.end_s = outcome, now
        unit = None if planned is None else planned.unit
        if unit is not None and outcome == "ok":
            assert planned is not None  # it holds the unit
            delay = unit.answered(generated_text(CHAT, record.completion_tokens))
            if delay is not None and now + delay < self.duration_s:
                heapq.heappush(self.follow_ups, (now + delay, next(self.follow_order),
                                                 unit_request(unit, planned.kind, None)))
                return  # the unit goes on
        if record.kind == "backlog":
            pause = 0.0 if outcome == "ok" else BACKLOG_ERROR_PAUSE_S
            self._next_backlog(record.tenant, now + pause)

    # -- traffic --

    def _next_backlog(self, tenant: str, at: float) -> None:
        spec = self.traffic.tenant(tenant)
        stop = self.duration_s if spec.stop_s is None else min(spec.stop_s, self.duration_s)
        if at < stop:
            heapq.heappush(self.backlog_due, (max(at, spec.start_s), tenant))

    def _send(self, planned: PlannedRequest) -> None:
        record = PoolRecord(planned.tenant, planned.kind, self.now, planned.prompt_tokens,
                            planned.max_tokens, planned.stream, seq=planned.seq,
                            session=planned.session,
                            call=None if planned.unit is None else planned.call,
                            calls=planned.calls)
        self.records.append(record)
        build = functools.partial(SimPassage, planned=planned, record=record)
        picker = self._picker_for(planned.tenant)
        build = functools.partial(build, picker=picker)
        gate = self.gates[picker]
        # The token ids are hashed as the dispatcher hashes a body's text (for the shared
        # blocks' room and prefix affinity): blocks of about blockChars / 4 tokens (four
        # characters a token), chained the same way.
        block_chars = gate.rules.block_chars()
        blocks, size = ((), 0) if not block_chars or planned.token_ids is None else \
            token_blocks(self.traffic.model, planned.token_ids, max(1, block_chars // 4))
        passage = gate.admit(
            build, planned.tenant, None, model=self.traffic.model,
            prompt_tokens=planned.prompt_tokens, max_tokens=planned.max_tokens,
            stream=planned.stream, now=self.now,
            output_seen=not self.spec.output_seen_at_end, max_model_len=self.max_model_len,
            prefix_blocks=blocks, prefix_chars=size, session=planned.session)
        if isinstance(passage, (Refused, Turnaway)):
            self._end(record, passage.reason, self.now, planned)
            return
        if record.dispatched_s is None:
            self.queued.append(passage)

    def arrivals(self) -> None:
        plan, now = self.open_loop, self.now
        while self.next_open < len(plan) and (plan[self.next_open].at_s or 0.0) <= now:
            self._send(plan[self.next_open])
            self.next_open += 1
        due = self.backlog_due
        while due and due[0][0] <= now:
            _, tenant = heapq.heappop(due)
            seq = self.next_seq[tenant]
            self.next_seq[tenant] = seq + 1
            self._send(draw_request(self.traffic, self.traffic.tenant(tenant), seq,
                                    "backlog", None))
        follow_ups = self.follow_ups
        while follow_ups and follow_ups[0][0] <= now:
            self._send(heapq.heappop(follow_ups)[2])

    def in_transit(self) -> None:
        """Dispatches that reach their engine now, and completions the gate sees now; a request
        its client gave up on meanwhile is left out (the gate has settled it)."""
        due = self.now + 1e-9
        while self.to_engine and self.to_engine[0][0] <= due:
            passage = heapq.heappop(self.to_engine)[2]
            if passage.outcome is None and passage.seq is not None \
                    and passage.endpoint is not None:
                self.engines[passage.endpoint.address].add(
                    passage.seq, passage.engine_priority or 0, self.now)
        while self.to_gate and self.to_gate[0][0] <= due:
            _, _, passage, usage = heapq.heappop(self.to_gate)
            self.gates[passage.picker].complete(passage, usage, "ok", self.now)

    def engine_refusals(self) -> None:
        refused, self.refused = self.refused, []
        for passage in refused:
            self.gates[passage.picker].complete(passage, Usage(0, 0, 0), "engine_refused",
                                                self.now)

    def timeouts(self) -> None:
        limit = self.config.queue.max_wait
        queued = self.queued
        # In arrival order: none is past the limit while the first is not, so the list (and the
        # dispatched ones it still holds) is swept only then, not every tick.
        if queued and self.now - queued[0].arrived_at >= limit:
            self._sweep(limit)
        self._deadlines()

    def _sweep(self, limit: float) -> None:
        waiting = []
        for passage in self.queued:
            if passage.dispatched_at is not None or passage.outcome is not None:
                continue
            if self.now - passage.arrived_at >= limit:
                self.gates[passage.picker].drop(passage, "queue_timeout", self.now)
            else:
                waiting.append(passage)
        self.queued = waiting

    def _deadlines(self) -> None:
        deadlines = self.deadlines
        while deadlines and deadlines[0][0] <= self.now:
            passage = heapq.heappop(deadlines)[2]
            if passage.outcome is None and passage.seq is not None \
                    and passage.endpoint is not None:
                # The client gave up: Envoy resets the stream and the engine aborts the request.
                self.engines[passage.endpoint.address].abort(passage.seq)
                self.gates[passage.picker].complete(passage, None, "cancelled", self.now)

    # -- the engines --

    def scrape(self) -> None:
        slow = self.spec.slow_scrape_interval_s
        for address, engine in self.engines.items():
            for picker, gate in enumerate(self.gates):
                endpoint = gate.endpoints.get(address)
                if endpoint is None:
                    continue
                due = self.next_scrape.get((picker, address), 0.0)
                if slow is not None and due > self.now + 1e-9:
                    continue
                # As vLLM's ``vllm:cache_config_info`` states it (``capacity.engineCache: auto``).
                gate.scraped(endpoint, engine.num_waiting, engine.num_running, engine.kv_usage,
                             None, sent_at=self.now, now=self.now,
                             prefix_caching=self.spec.enable_prefix_caching)
                self.scrapes += 1
                if slow is not None:
                    fast = figures_decide(endpoint, self.now, gate.rules.capacity)
                    self.next_scrape[(picker, address)] = self.now + (
                        self.spec.scrape_interval_s if fast else slow)

    def step_engines(self, counting: bool) -> tuple[int, int]:
        """Step every free engine and report every step that ends at the next tick; returns
        output tokens reported and tokens computed."""
        produced = computed = 0
        for address, engine in self.engines.items():
            if address in self.in_flight:
                out, ticks = self.in_flight[address]
            else:
                out = engine.step(self.now)
                computed += sum(out.scheduled.values())
                ticks = self._ticks(address, out.prefill_tokens)
                self.step_log[address].append(StepRecord(
                    self.now, self.now + ticks * self.spec.step_s, out.prefill_tokens))
                for seq in out.scheduled:
                    record = cast(SimPassage, seq.id).record
                    if record.engine_started_s is None:
                        record.engine_started_s = self.now
            if ticks > 1:
                self.in_flight[address] = (out, ticks - 1)
                continue
            self.in_flight.pop(address, None)
            produced += self.report(out)
        return (produced if counting else 0), computed

    def _ticks(self, address: str, prefill_tokens: int) -> int:
        """Ticks a step that starts now keeps its engine busy. The engine keeps its own exact
        clock, as the server's ``--catch-up-ms`` keeps its modelled pace: a step starts where
        the last one ended (now, after an idle tick) and lasts ``step_s`` plus its prompt
        tokens' cost; it is reported at the first tick at or after its end. (Each step rounded
        up to whole ticks instead lost half a tick a prefill step: 2-4 % of an engine's time at
        8k.)"""
        spec, now = self.spec, self.now
        start = self.clock.get(address, now)
        if not now - spec.step_s < start <= now + 1e-9:
            start = now
        end = start + spec.step_s + prefill_tokens * spec.prefill_s_per_token
        self.clock[address] = end
        # The tolerance keeps float noise from adding a tick.
        return max(1, math.ceil((end - now) / spec.step_s - 1e-9))

    def report(self, out: StepOutput) -> int:
        """A step ends at the next tick: its tokens and completions reach the gate then; returns
        the output tokens delivered (none to a request its client has given up on)."""
        gates, now = self.gates, self.now + self.spec.step_s
        delivered = 0
        for seq in out.tokens:
            passage: Any = seq.id  # the SimPassage ``dispatched`` gave the engine
            if passage.outcome is not None:
                continue  # cancelled by its client while the step ran
            delivered += 1
            if passage.record.first_token_s is None:
                passage.record.first_token_s = now
            if passage.stream and not self.spec.output_seen_at_end:
                gates[passage.picker].charge_output(passage, 1, now)
        lag = self.spec.ticks(self.spec.completion_lag_s) * self.spec.step_s
        for seq in out.finished:
            finished = cast(SimPassage, seq.id)
            # The engine's own cached count, as the server reports it in usage.
            usage = Usage(seq.prompt_tokens, seq.generated, seq.cached_tokens or 0)
            if lag:
                heapq.heappush(self.to_gate, (now + lag, next(self.lag_order), finished, usage))
            else:
                gates[finished.picker].complete(finished, usage, "ok", now)
        return delivered


def simulate(config: PickerConfig, traffic: Traffic, spec: PoolSpec, *,
             duration_s: float | None = None, warmup_s: float = 0.0,
             drain_s: float = 0.0, sharing: Sharing | None = None) -> PoolRun:
    """Run ``traffic`` through the gate onto ``spec``'s engines for ``duration_s`` (default the
    traffic's), then up to ``drain_s`` more for requests in flight. Output tokens are counted
    between ``warmup_s`` and ``duration_s``. ``sharing``: several pickers, each its own gate,
    sharing state through a ``StoreModel`` (``PoolRun.gate`` is the first)."""
    duration = traffic.duration_s if duration_s is None else duration_s
    pool = _Pool(config, traffic, spec, duration, sharing)
    sync_every = 0 if sharing is None else max(1, round(sharing.sync_interval_s / spec.step_s))
    if sharing is not None:
        pool.start_sharing()
    for tenant in traffic.tenants:
        if tenant.backlog is not None:
            for _ in range(tenant.backlog):
                pool._next_backlog(tenant.name, tenant.start_s)
    scrape_every = max(1, round(spec.scrape_interval_s / spec.step_s))
    step, produced, computed = 0, 0, 0
    end = duration + drain_s
    while True:
        pool.now = step * spec.step_s
        if pool.now >= end or (pool.now >= duration
                               and not any(gate.passages for gate in pool.gates)):
            break
        if sync_every:
            if step % sync_every == 0:
                pool.exchange()
            pool.receive()
        pool.arrivals()
        pool.in_transit()
        pool.timeouts()
        if step % scrape_every == 0:
            pool.scrape()
        for gate in pool.gates:
            gate.pump(pool.now)
        if sync_every:
            pool.note_held()
        pool.engine_refusals()
        tokens, work = pool.step_engines(warmup_s <= pool.now < duration)
        produced += tokens
        computed += work
        step += 1
    for record in pool.records:
        if not record.outcome:
            record.outcome = "unfinished"
    engines = pool.engines.values()
    return PoolRun(records=pool.records, duration_s=duration,
                   output_tokens_in_window=produced, window_s=max(0.0, duration - warmup_s),
                   preemptions=sum(e.preemptions_total for e in engines),
                   recomputed_tokens=sum(e.recomputed_tokens_total for e in engines),
                   computed_tokens=computed, steps=step, gate=pool.gate,
                   sharing=pool.stats if sharing is not None else None, scrapes=pool.scrapes,
                   step_log=pool.step_log,
                   prefix_cache_queries=sum(e.prefix_cache_queries for e in engines),
                   prefix_cache_hits=sum(e.prefix_cache_hits for e in engines))
