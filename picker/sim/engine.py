"""The simulated engine: continuous batching over a KV budget, one decode step per iteration.

Each step: arrivals are queued; then requests are admitted in the order the scheduler chooses,
stopping at the first chosen request whose prompt does not fit the KV budget (seed 000's loop);
then every running request decodes one token; finished requests leave. A running request occupies
``prompt + generated`` tokens of the budget. The scheduler is ``picker.core.Scheduler``, the same
object the picker service drives.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from picker.core import ContextAwareCost, LaneSpec, LinearCost, Request, Scheduler
from picker.sim.scenario import Scenario, Tenant


@dataclass
class SimResult:
    """What one run produced, step by step."""

    policy: str
    tenants: list[str]
    weights: list[float]
    service: list[list[float]]
    """Per step (after it), each tenant's cumulative weighted service, not divided by weight."""
    backlogged: list[list[bool]]
    """Per step, whether each tenant still had requests queued after that step's admission."""
    output_tokens: int
    """Output tokens decoded in the whole run."""
    peak_batch_tokens: int
    """The most tokens the running batch held at once (may exceed ``kv_budget_tokens``)."""
    admission_stops: list[str]
    """Per step, why admission stopped: ``empty`` (nothing queued), ``no_fit`` (the chosen
    request's prompt does not fit the KV budget) or ``held`` (the policy chose nothing although
    requests were queued: only a non-work-conserving policy such as ``rpm`` does that)."""

    @property
    def steps(self) -> int:
        return len(self.service)

    def total_service(self) -> float:
        return sum(self.service[-1]) if self.service else 0.0

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "policy": self.policy,
            "steps": self.steps,
            "weighted_service_per_step": self.total_service() / steps,
            "output_tokens_per_step": self.output_tokens / steps,
            "service": dict(zip(self.tenants, self.service[-1], strict=True))
            if self.service else {},
            "weights": dict(zip(self.tenants, self.weights, strict=True)),
        }


class _Traffic:
    """One tenant's arrivals, from its own random stream: every policy sees the same requests."""

    def __init__(self, tenant: Tenant, seed: int, index: int) -> None:
        self.tenant = tenant
        self.random = random.Random(f"{seed}/{index}/{tenant.name}")
        self.phase = 0
        self.queued = 0

    def new_requests(self, step: int) -> int:
        phases = self.tenant.arrivals
        while self.phase < len(phases) - 1:
            until = phases[self.phase].until
            if until is None or step < until:
                break
            self.phase += 1
        phase = phases[self.phase]
        if phase.until is not None and step >= phase.until:
            return 0  # past the end of the last phase
        if phase.backlog is not None:
            return max(0, phase.backlog - self.queued)
        return _poisson(self.random, phase.rate or 0.0)

    def make_request(self, step: int, lane: str) -> Request:
        p_low, p_high = self.tenant.prompt_tokens
        o_low, o_high = self.tenant.output_tokens
        prompt = self.random.randint(p_low, p_high)
        output = self.random.randint(o_low, o_high)
        return Request(tenant=self.tenant.name, prompt_tokens=prompt, max_output_tokens=output,
                       lane=lane, arrival=step)


def _poisson(rng: random.Random, mean: float) -> int:
    if mean <= 0:
        return 0
    # Knuth's method: fine for the small per-step means of a simulation.
    limit, k, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        k += 1
        product *= rng.random()
    return k


class BatchEngine:
    """Continuous batching over a KV budget: what a model server does each iteration.

    ``scheduler`` orders the waiting requests (the picker's VTC, or the engine's own FCFS); the
    engine admits in that order while prompts fit and decodes one token for each running request.
    A request's ``max_output_tokens`` is the output it will produce.
    """

    def __init__(self, kv_budget_tokens: int, scheduler: Scheduler,
                 max_running: int | None = None) -> None:
        self.kv_budget_tokens = kv_budget_tokens
        self.scheduler = scheduler
        self.max_running = max_running
        """At most this many requests run at once (vLLM's ``max_num_seqs``); None: no cap."""
        self.running: list[Request] = []
        self.occupancy = 0
        """Tokens of the KV budget in use: prompt + generated of every running request."""
        self.peak_batch_tokens = 0
        """The most tokens the running batch has held. Admission checks only the prompt (seed
        000's loop, and vLLM without preemption), so decoding can grow a batch past the budget."""

    def admit(self, now: float) -> tuple[str, list[Request]]:
        """Admit queued requests in the scheduler's order until one does not fit.

        Returns why admission stopped (``empty``, ``no_fit`` or ``held``) and the admitted requests.
        """
        scheduler = self.scheduler
        admitted: list[Request] = []
        while True:
            if self.max_running is not None and len(self.running) >= self.max_running:
                return "no_fit", admitted
            request = scheduler.peek(now)
            if request is None:
                return ("held" if scheduler.queued() else "empty"), admitted
            if self.occupancy + request.prompt_tokens > self.kv_budget_tokens:
                return "no_fit", admitted
            scheduler.dispatch(request, now)
            self.running.append(request)
            self.occupancy += request.prompt_tokens
            admitted.append(request)

    def cancel(self, request: Request) -> None:
        """Drop a queued or running request (its client went away), freeing its KV tokens."""
        if request.state == "running":
            self.running.remove(request)
            self.occupancy -= request.prompt_tokens + request.generated
        self.scheduler.cancel(request)

    def decode(self) -> list[Request]:
        """One decode iteration: every running request produces a token; returns those finished."""
        scheduler, finished, still_running = self.scheduler, [], []
        self.peak_batch_tokens = max(self.peak_batch_tokens, self.occupancy + len(self.running))
        for request in self.running:
            scheduler.charge_output(request, 1)
            if request.generated >= request.max_output_tokens:
                scheduler.finish(request)
                self.occupancy -= request.prompt_tokens + request.generated - 1
                finished.append(request)
            else:
                still_running.append(request)
                self.occupancy += 1
        self.running = still_running
        return finished


def make_scheduler(scenario: Scenario, policy: str, rpm_limit: float | None = None) -> Scheduler:
    """The core scheduler a scenario describes, with the given fairness policy."""
    weights = scenario.cost
    cost = (ContextAwareCost(weights.prefill_weight, weights.decode_weight, weights.context_beta)
            if weights.context_beta else LinearCost(weights.prefill_weight, weights.decode_weight))
    options: dict[str, float] = {}
    if policy == "rpm":
        options = {"limit": math.inf if rpm_limit is None else rpm_limit,
                   "window": scenario.rpm_window_steps}
    return Scheduler(
        lanes=[LaneSpec(lane.name, lane.min_share) for lane in scenario.lanes],
        policy=policy,
        cost=cost,
        weights={t.name: t.weight for t in scenario.tenants},
        **options,
    )


def simulate(scenario: Scenario, policy: str = "vtc", rpm_limit: float | None = None) -> SimResult:
    """Run ``scenario`` under ``policy`` and return the step-by-step record."""
    scheduler = make_scheduler(scenario, policy, rpm_limit)
    names = [t.name for t in scenario.tenants]
    lanes = [t.lane or scenario.lanes[0].name for t in scenario.tenants]
    traffic = [_Traffic(t, scenario.seed, i) for i, t in enumerate(scenario.tenants)]
    by_name = {t.tenant.name: t for t in traffic}
    engine = BatchEngine(scenario.kv_budget_tokens, scheduler)
    output_tokens = 0
    service_rows: list[list[float]] = []
    backlog_rows: list[list[bool]] = []
    stops: list[str] = []
    service = scheduler.service

    for step in range(scenario.steps):
        for source, lane in zip(traffic, lanes, strict=True):
            for _ in range(source.new_requests(step)):
                scheduler.enqueue(source.make_request(step, lane), step)
                source.queued += 1
        stop, admitted = engine.admit(step)
        stops.append(stop)
        for request in admitted:
            by_name[request.tenant].queued -= 1
        output_tokens += len(engine.running)
        engine.decode()
        service_rows.append([service.get(name, 0.0) for name in names])
        backlog_rows.append([source.queued > 0 for source in traffic])

    return SimResult(
        policy=policy,
        tenants=names,
        weights=[t.weight for t in scenario.tenants],
        service=service_rows,
        backlogged=backlog_rows,
        output_tokens=output_tokens,
        peak_batch_tokens=engine.peak_batch_tokens,
        admission_stops=stops,
    )
