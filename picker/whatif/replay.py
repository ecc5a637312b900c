"""A log's arrivals replayed through the pool simulator under one config, summed as they end.

It answers: *under this config, on this pool, what would each tenant and lane have got from the
traffic the log recorded?* The gate is the picker's own (``picker.sim.pool`` builds it from the
config with ``picker.config.build``, as the server does); each endpoint is the simulator's vLLM
scheduler. Each request of the log arrives again at its recorded time (relative to the first),
asks for the lane and ``max_tokens`` it asked for, and its engine produces again the tokens the
real engine produced for it (a request that never reached an engine produces its
``max_tokens``, else the config's ``capacity.defaultOutputTokens``). A client gives up
``client_timeout_s`` after it sent, as the load client does.

Memory is bounded: a request's figures are added to its tenant's and lane's sums when it ends
and the request is dropped (quantiles in log-spaced bins 1 % wide), and the engines' step log,
which the simulator keeps for ``PoolRun.ttft_parts``, is not kept (``ReplayPool.step_engines``).
Stretches where the pool is idle and nothing arrives are skipped in one jump, not stepped
through. ``coarse`` > 1 is the fast mode (``picker.whatif.coarse``).

What it does not replay: requests the picker refused before its queue (401, 404, 429 at
admission...) are not in the metering log (``picker.metering``), so a config that would admit
them cannot be credited with them; and whatever the simulator does not model (``picker.sim.pool``:
network, Envoy, the body's token estimate).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from picker.config.schema import PickerConfig
from picker.core.admission import INSUFFICIENT_QUOTA, OVER_BUDGET, Refused
from picker.core.gate import Turnaway
from picker.core.request import Usage
from picker.errors import RequestError
from picker.sim.load import PlannedRequest
from picker.sim.pool import PoolRecord, PoolSpec, SimPassage, _Pool
from picker.sim.traffic import TenantTraffic, Traffic
from picker.sim.vllm import StepOutput
from picker.whatif.coarse import CoarseScheduler
from picker.whatif.log import Arrival

LANE_NOT_ALLOWED = "lane_not_allowed"
OVER_BUDGET_REASONS = frozenset((OVER_BUDGET, INSUFFICIENT_QUOTA))
EXPIRY_CHECK_STEPS = 1024
"""Steps between two questions to a replay's ``expired`` (each costs about one step)."""


def _statuses() -> dict[str, int]:
    """Each refusal's HTTP status by its reason (the errors' metric labels are the reasons)."""
    statuses: dict[str, int] = {}
    pending: list[type[RequestError]] = [RequestError]
    while pending:
        kind = pending.pop()
        statuses.setdefault(kind.metric_label, kind.http_status)
        pending.extend(kind.__subclasses__())
    return statuses


STATUS = _statuses()


_LOG_RATIO = math.log(1.01)
"""The ratio of one ``Quantiles`` bin's upper bound to its lower, as a log."""
_floor, _log = math.floor, math.log


class Quantiles:
    """p50/p95 of a stream of durations (seconds) in bounded memory: counts in log-spaced bins
    1 % wide, so a quantile is exact to within 1 % (values under 1 µs count as 0)."""

    def __init__(self) -> None:
        self.bins: dict[int, int] = {}
        self.zeros = 0
        self.count = 0

    def add(self, value: float) -> None:
        # ``ReplayResult.add_fields`` does this inline: a change here goes there too.
        self.count += 1
        if value < 1e-6:
            self.zeros += 1
            return
        key = _floor(_log(value) / _LOG_RATIO)
        bins = self.bins
        bins[key] = bins.get(key, 0) + 1

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank), the middle of its bin; None without values."""
        if not self.count:
            return None
        rank = max(1, math.ceil(q * self.count))
        if rank <= self.zeros:
            return 0.0
        seen = self.zeros
        for key in sorted(self.bins):
            seen += self.bins[key]
            if seen >= rank:
                return math.exp((key + 0.5) * _LOG_RATIO)
        raise AssertionError("unreachable: the bins hold every value")


@dataclass
class LaneStats:
    """What one tenant got in one lane (the lane it ran in, or was refused from)."""

    sent: int = 0
    ok: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of requests served (completed, or given up on after their first token)."""
    completion_tokens: int = 0
    """Output tokens delivered."""
    refused: dict[str, int] = field(default_factory=dict)
    """Requests refused or dropped, by reason (``over_budget``, ``queue_timeout``, ...)."""
    demoted: int = 0
    """Requests that ran in this lane because their tenant's budget demoted them."""
    queue_wait: Quantiles = field(default_factory=Quantiles)
    """Arrival to dispatch, of requests dispatched."""
    ttft: Quantiles = field(default_factory=Quantiles)
    """Arrival to first token, of requests that got one."""

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def status_count(self, status: int) -> int:
        """Requests answered with HTTP ``status`` (429: budgets, caps and full queues)."""
        return sum(n for reason, n in self.refused.items() if STATUS.get(reason) == status)


@dataclass
class ReplayRecord(PoolRecord):
    """A pool record with the lane the request ran in and whether it was demoted there."""

    lane: str = ""
    demoted: bool = False


@dataclass
class ReplayResult:
    """One config's replay, summed."""

    bucket_s: float
    """Width of the service-over-time buckets."""
    lanes: dict[tuple[str, str], LaneStats] = field(default_factory=dict)
    budget_out_s: dict[str, float] = field(default_factory=dict)
    """Per tenant, when (seconds after the first arrival) its budget first ran out: its first
    request refused over budget or demoted."""
    series: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per tenant, tokens served (prompt + output) in each bucket of ``bucket_s``, by end."""
    unknown_tenants: dict[str, list[int]] = field(default_factory=dict)
    """Tenants the config does not name: [first line, requests]. They run under
    ``tenantDefaults``, as the picker would run them."""
    output_tokens: int = 0
    """Output tokens the engines produced."""
    ticks: int = 0
    """Steps of ``step_s`` from the first arrival to the last request's end (idle ones too)."""
    busy_engine_ticks: int = 0
    engines: int = 0
    step_s: float = 0.0
    unfinished: int = 0
    """Requests still in when the replay stopped (``drain_s`` after the last arrival)."""
    _quotient: float = field(default=math.nan, repr=False, compare=False)
    _bucket: int = field(default=0, repr=False, compare=False)
    """The last request's end ÷ ``bucket_s`` (floored) and its bucket (``int`` of it, called
    only when it changes)."""

    @property
    def duration_s(self) -> float:
        return self.ticks * self.step_s

    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def utilisation(self) -> float:
        """Share of engine-steps an engine had a request running."""
        total = self.ticks * self.engines
        return self.busy_engine_ticks / total if total else 0.0

    def total_tokens(self) -> int:
        return sum(stats.tokens for stats in self.lanes.values())

    def share(self, key: tuple[str, str]) -> float:
        """The share of all tokens served that went to ``key`` (tenant, lane)."""
        total = self.total_tokens()
        return self.lanes[key].tokens / total if total else 0.0

    def add(self, record: ReplayRecord) -> None:
        """A request ended: add its figures."""
        self.add_fields(record.tenant, record.lane, record.outcome, record.demoted,
                        record.arrival_s, record.dispatched_s, record.first_token_s,
                        record.end_s, record.prompt_tokens, record.completion_tokens)

    def add_fields(self, tenant: str, lane: str, outcome: str, demoted: bool, arrival_s: float,
                   dispatched_s: float | None, first_token_s: float | None,
                   end_s: float | None, prompt_tokens: int, completion_tokens: int) -> None:
        """``add`` without a record (the fast replay's per-request path builds none)."""
        stats = self.lanes.get((tenant, lane))
        if stats is None:
            stats = self.lanes[(tenant, lane)] = LaneStats()
        stats.sent += 1
        if outcome == "ok":
            stats.ok += 1
        else:
            stats.refused[outcome] = stats.refused.get(outcome, 0) + 1
        if demoted:
            stats.demoted += 1
        if demoted or (outcome != "ok" and outcome in OVER_BUDGET_REASONS):
            self.budget_out_s.setdefault(tenant, arrival_s)
        # ``Quantiles.add``, inline (this runs for every request of the log and of a replay).
        if dispatched_s is not None:
            quantiles = stats.queue_wait
            value = dispatched_s - arrival_s
            quantiles.count += 1
            if value < 1e-6:
                quantiles.zeros += 1
            else:
                bins, key = quantiles.bins, _floor(_log(value) / _LOG_RATIO)
                bins[key] = bins.get(key, 0) + 1
        served = completion_tokens
        if first_token_s is not None:
            quantiles = stats.ttft
            value = first_token_s - arrival_s
            quantiles.count += 1
            if value < 1e-6:
                quantiles.zeros += 1
            else:
                bins, key = quantiles.bins, _floor(_log(value) / _LOG_RATIO)
                bins[key] = bins.get(key, 0) + 1
            served += prompt_tokens
        elif outcome == "ok":
            served += prompt_tokens  # an embedding: its prompt is its service
        if served:
            stats.prompt_tokens += served - completion_tokens
            stats.completion_tokens += completion_tokens
            quotient = (end_s or arrival_s) // self.bucket_s
            if quotient == self._quotient:  # the bucket of the last request, mostly
                bucket = self._bucket
            else:
                bucket = self._bucket = int(quotient)
                self._quotient = quotient
            series = self.series.get(tenant)
            if series is None:
                series = self.series[tenant] = {}
            series[bucket] = series.get(bucket, 0) + served

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenants": [{
                "tenant": tenant, "lane": lane, "share": self.share((tenant, lane)),
                "sent": s.sent, "ok": s.ok, "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "queue_wait_s": {"p50": s.queue_wait.quantile(0.5),
                                 "p95": s.queue_wait.quantile(0.95)},
                "ttft_s": {"p50": s.ttft.quantile(0.5), "p95": s.ttft.quantile(0.95)},
                "refused_429": s.status_count(429), "demoted": s.demoted,
                "refused": dict(sorted(s.refused.items())),
                "budget_out_s": self.budget_out_s.get(tenant),
            } for (tenant, lane), s in sorted(self.lanes.items())],
            "pool": {"tokens_per_s": self.tokens_per_s(), "utilisation": self.utilisation(),
                     "output_tokens": self.output_tokens, "duration_s": self.duration_s,
                     "unfinished": self.unfinished},
            "unknown_tenants": {t: {"first_line": v[0], "requests": v[1]}
                                for t, v in sorted(self.unknown_tenants.items())},
        }


def arrival_demand(arrival: Arrival, known: Container[str], result: ReplayResult,
                   default_output: int) -> tuple[int, int]:
    """The prompt and output tokens a replay sends for ``arrival`` (the output it made, else the
    cap it asked, else ``default_output``), counting a tenant the config does not know. Shared
    by the exact and the fast replay."""
    if arrival.tenant not in known:
        seen = result.unknown_tenants.setdefault(arrival.tenant, [arrival.line, 0])
        seen[1] += 1
    output = arrival.output_tokens
    if output is None:
        output = arrival.max_tokens if arrival.max_tokens is not None else default_output
    # An engine takes no empty prompt (a record metered at 0 tokens that reached one).
    return arrival.prompt_tokens or 1, output


class ReplayPool(_Pool):
    """The pool simulator fed from a log instead of a traffic file: ``send`` one arrival at a
    time; each request, when it ends, goes to ``result`` and is dropped."""

    def __init__(self, config: PickerConfig, spec: PoolSpec, result: ReplayResult, *,
                 client_timeout_s: float, coarse: int = 1, fine_step_s: float | None = None
                 ) -> None:
        # The simulator draws traffic from a Traffic; the replay's comes from the log, so this
        # one only carries the client timeout (its tenant sends nothing: a backlog never started).
        traffic = Traffic(duration_s=1.0, tenants=(TenantTraffic("~replay", backlog=1),),
                          timeout_s=client_timeout_s)
        super().__init__(config, traffic, spec, 0.0)
        self.result = result
        self.default_output = config.capacity.default_output_tokens
        self.known = frozenset(t.id for t in config.tenants)
        self.coarse = coarse
        self.fine_step_s = spec.step_s if fine_step_s is None else fine_step_s
        if coarse > 1:  # the fast mode (``picker.whatif.coarse``); ``spec``'s step is k fine
            self.engines = {address: CoarseScheduler(engine.config, coarse)
                            for address, engine in self.engines.items()}

    def send(self, arrival: Arrival) -> None:
        """``arrival`` reaches the picker now."""
        tenant, gate = arrival.tenant, self.gate
        prompt, output = arrival_demand(arrival, self.known, self.result, self.default_output)
        planned = PlannedRequest(tenant, arrival.line, "poisson", self.now, prompt, output,
                                 arrival.stream)
        record = ReplayRecord(tenant, "replay", self.now, prompt, output, arrival.stream)
        lane = gate.choose_lane(tenant, arrival.lane_asked)
        if lane is None:  # the picker answers 403 to a lane the tenant may not ask for
            record.lane = arrival.lane_asked or ""
            self._end(record, LANE_NOT_ALLOWED, self.now)
            return
        passage = gate.admit(
            functools.partial(SimPassage, planned=planned, record=record), tenant, lane,
            model=arrival.model, prompt_tokens=prompt,
            max_tokens=arrival.max_tokens, stream=arrival.stream, now=self.now,
            output_seen=not self.spec.output_seen_at_end)
        if isinstance(passage, (Refused, Turnaway)):
            record.lane = lane
            self._end(record, passage.reason, self.now)
            return
        record.lane, record.demoted = passage.lane, passage.demoted
        if record.dispatched_s is None:
            self.queued.append(passage)

    def _end(self, record: PoolRecord, outcome: str, now: float,
             planned: PlannedRequest | None = None) -> None:
        # ``planned`` is the simulator's (a session's next turn); a log's requests have none.
        record.outcome, record.end_s = outcome, now
        assert isinstance(record, ReplayRecord)
        self.result.add(record)

    def step_engines(self, counting: bool) -> tuple[int, int]:
        """The simulator's ``step_engines`` without what only ``PoolRun.ttft_parts`` reads (the
        step log, each request's first engine step: work per token a replay never uses); it
        also counts the engines busy this tick. Returns output tokens reported and engines
        busy."""
        produced = busy = 0
        in_flight, spec = self.in_flight, self.spec
        for address, engine in self.engines.items():
            flight = in_flight.get(address)
            if flight is not None:
                out, ticks = flight
                busy += 1
            else:
                if engine.running or engine.num_waiting:
                    busy += 1
                out = engine.step(self.now)
                ticks = spec.step_ticks(out.prefill_tokens) if out.prefill_tokens else 1
            if ticks > 1:
                in_flight[address] = (out, ticks - 1)
                continue
            if flight is not None:
                del in_flight[address]
            if out.tokens or out.finished:
                produced += self.report(out)
        return produced, busy

    def report(self, out: StepOutput) -> int:
        """As the simulator's, but in the fast mode each request's tokens of the step at once,
        its first one stamped a fine step after the step's start."""
        if self.coarse == 1:
            return super().report(out)
        gate, end, first = self.gate, self.now + self.spec.step_s, self.now + self.fine_step_s
        emitted = out.emitted
        charge = not self.spec.output_seen_at_end
        delivered = 0
        for seq in out.tokens:
            passage: Any = seq.id
            if passage.outcome is not None:
                continue  # cancelled by its client while the step ran
            count = emitted.get(seq, 1)
            delivered += count
            if passage.record.first_token_s is None:
                passage.record.first_token_s = first
            if passage.stream and charge:
                gate.charge_output(passage, count, end)
        for seq in out.finished:
            finished = cast(SimPassage, seq.id)
            gate.complete(finished, Usage(seq.prompt_tokens, seq.generated,
                                          seq.cached_tokens or 0), "ok", end)
        return delivered

    def idle(self) -> bool:
        """Nothing held, running or due: time may jump to the next arrival."""
        return not self.gate.passages and not self.in_flight and not self.refused and all(
            engine.num_running == 0 and engine.num_waiting == 0
            for engine in self.engines.values())


def replay(config: PickerConfig, spec: PoolSpec, arrivals: Iterable[Arrival], *, start: float,
           client_timeout_s: float = 120.0, drain_s: float | None = None,
           bucket_s: float = 60.0, coarse: int = 1, coarse_scale: float = 1.0,
           expired: Callable[[], bool] | None = None) -> ReplayResult:
    """Replay ``arrivals`` (in arrival order; ``start``: the unix time of the replay's 0) under
    ``config`` on ``spec``'s pool. After the last arrival the replay runs until every request has
    ended, or ``drain_s`` more (default: the client timeout plus the queue's ``maxWait``).

    ``expired`` is asked every ``EXPIRY_CHECK_STEPS`` steps; once it answers True the replay
    stops with TimeoutError (the operator bounds a dry run's time; no clock is read here).

    ``coarse``: 1, exact; k > 1, the fast mode (``picker.whatif.coarse``): steps of k ×
    ``spec.step_s`` (times ``coarse_scale``: ``picker.whatif.coarse.step_scale``) in which a
    request emits up to k tokens."""
    fine_step_s = spec.step_s
    if coarse > 1:
        spec = dataclasses.replace(spec, step_s=spec.step_s * coarse * coarse_scale,
                                   max_num_batched_tokens=spec.max_num_batched_tokens * coarse)
    result = ReplayResult(bucket_s=bucket_s, engines=spec.endpoints, step_s=spec.step_s)
    pool = ReplayPool(config, spec, result, client_timeout_s=client_timeout_s, coarse=coarse,
                      fine_step_s=fine_step_s)
    drain = client_timeout_s + config.queue.max_wait if drain_s is None else drain_s
    step_s = spec.step_s
    scrape_every = max(1, round(spec.scrape_interval_s / step_s))
    source: Iterator[Arrival] = iter(arrivals)
    upcoming = next(source, None)
    last_arrival = 0.0
    step = 0
    while True:
        if pool.idle():
            if upcoming is None:
                break
            due = max(step, math.floor((upcoming.arrived - start) / step_s + 1e-9))
            if due > step:  # nothing to step through: jump, and read the (idle) engines there
                step = due
                pool.now = step * step_s
                pool.scrape()
        pool.now = now = step * step_s
        if upcoming is None and now > last_arrival + drain:
            break
        while upcoming is not None and upcoming.arrived - start <= now + 1e-9:
            pool.send(upcoming)
            last_arrival = upcoming.arrived - start
            upcoming = next(source, None)
        pool.timeouts()
        if step % scrape_every == 0:
            pool.scrape()
        pool.gate.pump(now)
        pool.engine_refusals()
        produced, busy = pool.step_engines(True)
        result.output_tokens += produced
        result.busy_engine_ticks += busy
        step += 1
        if expired is not None and step % EXPIRY_CHECK_STEPS == 0 and expired():
            raise TimeoutError(f"the replay ran out of time after {step * step_s:,.0f} "
                               "simulated seconds")
    for passage in list(pool.gate.passages.values()):
        record = cast(SimPassage, passage).record
        if not record.outcome:
            result.unfinished += 1
            pool._end(record, "unfinished", pool.now)
    result.ticks = step
    return result
