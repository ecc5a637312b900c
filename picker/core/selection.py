"""Endpoint choice: which model servers have room, and which of them should take a request.

Pure: the dispatcher owns the endpoint states and passes ``now``. An endpoint has room for a
request when its prompt fits beside the tokens in flight there (an empty endpoint takes any) and
the engine's own waiting queue is under a threshold. Scraped figures count while fresh, less what
finished since the scrape. Keeping every endpoint just saturated, and no more, is what lets the
fair queue decide the order instead of the engine's own FCFS queue: a request the engine cannot
admit yet would wait in its FCFS queue, ahead of whoever the fair queue picks next. With
``CapacityRules.engine_queue`` an endpoint without room still takes that many requests into its
engine's own queue (``queue_slot``), so that the engine refills a finished request's room at its
next step rather than after a round trip through the picker: the fair queue then orders all but
those few.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from picker.core.health import EndpointHealth, available


@dataclass
class EndpointState:
    """What the picker knows about one model server."""

    address: str
    configured_budget: int | None = None
    """KV budget in tokens from config (wins over a learned one)."""
    learned_budget: int | None = None
    """KV budget from ``vllm:cache_config_info`` (num_gpu_blocks × block_size)."""
    inflight_tokens: int = 0
    """The picker's own accounting: prompt + output so far of requests it sent here."""
    inflight_requests: int = 0
    projected_tokens: int = 0
    """What the requests in flight here will hold at their end: prompt + expected output each
    (streamed output grows ``inflight_tokens`` up to about this)."""
    prefill_tokens: int = 0
    """The prompt tokens of the streamed requests sent here whose first output token has not
    come back yet: prefill the engine has still to compute, by the picker's own accounting (a
    non-streaming request's first token is never seen, so it is not counted)."""
    prefill_computed: int = 0
    """``prefill_tokens`` less what the picker expected each of those prompts to find cached
    here (with prefix affinity): the prefill the engine has to compute, for ordering a light
    tenant's request (``Gate.candidates``); the bounds count ``prefill_tokens``."""
    waiting: float | None = None
    """Scraped ``vllm:num_requests_waiting``."""
    running: float | None = None
    """Scraped ``vllm:num_requests_running``."""
    kv_usage: float | None = None
    """Scraped ``vllm:kv_cache_usage_perc`` (0..1)."""
    prefix_caching: bool | None = None
    """Whether its engine caches prefixes, as the ``enable_prefix_caching`` label of its
    ``vllm:cache_config_info`` said (None: not read yet, or not stated)."""
    scraped_at: float | None = None
    completed_since_scrape: int = 0
    """Requests of the picker's that finished here since the last scrape: each let the engine
    admit one that was waiting, so the scraped waiting count is that much too high."""
    released_since_scrape: int = 0
    """Tokens those requests held: the scraped KV use is that much too high."""
    sent_since_scrape: int = 0
    """Requests the picker sent here since the last scrape answered (``waiting``)."""
    running_limit: float | None = None
    """The most requests its engine has been read running, once a read has shown it holding
    requests back beside them (``observe``: more waiting than the picker sent since the read
    before, so some have waited a whole read): about its own limit on running requests (vLLM's
    ``max_num_seqs``), which no metric states. None: never seen holding any back."""
    inflight_at_scrape: int = 0
    """``inflight_tokens`` when the last scrape answered: what the picker has sent, seen grow and
    freed here since moves the scraped KV use by as much."""
    draining: bool = False
    """Going away: gets no new requests; its in-flight requests finish."""
    health: EndpointHealth = field(default_factory=EndpointHealth)
    """Outlier ejection (``picker.core.health``): an ejected endpoint gets no new requests."""
    share: float = 1.0
    """The fraction of the budget this picker may hold here: its lease among active-active
    replicas (``picker.core.leases``); 1 for a picker alone."""
    engine_queued: int = 0
    """Requests sent here beyond its room, into its engine's own queue
    (``CapacityRules.engine_queue``), that the engine has not started by the picker's own
    accounting: no first token back yet (or, unseen, no read of the engine showing it out of
    the waiting queue) and not ended."""

    def in_service(self, now: float) -> bool:
        """Whether it may get a new request: not draining, not ejected (a probing endpoint
        takes one request at a time)."""
        return not self.draining and available(self.health, now)

    def budget(self, fallback: int) -> int:
        return self.configured_budget or self.learned_budget or fallback

    def fresh(self, now: float, stale_after: float) -> bool:
        """Whether scraped figures are recent enough to trust."""
        return self.scraped_at is not None and now - self.scraped_at <= stale_after


def observe(endpoint: EndpointState, waiting: float | None, running: float | None,
            kv_usage: float | None, kv_budget_tokens: int | None, now: float,
            prefix_caching: bool | None = None) -> None:
    """A scrape of the endpoint's engine answered with these figures (``None``: not exposed):
    they replace the last ones, and the completions counted since then are forgotten."""
    sent = endpoint.sent_since_scrape
    endpoint.waiting = waiting
    endpoint.running = running
    endpoint.kv_usage = kv_usage
    if kv_budget_tokens:
        endpoint.learned_budget = kv_budget_tokens
    if prefix_caching is not None:
        endpoint.prefix_caching = prefix_caching
    endpoint.scraped_at = now
    endpoint.completed_since_scrape = endpoint.released_since_scrape = 0
    endpoint.sent_since_scrape = 0
    # A request waits in an engine's queue until its next step even with slots free (vLLM
    # starts waiting requests at each step's start): a read taken in between shows the ones
    # just sent waiting beside any number running. Only more waiting than were sent since the
    # read before says the engine holds some back (they waited a whole read). Taking such a
    # read for its limit pinned an endpoint read with 3 waiting beside 1 running (the first
    # requests, 4 sent) to 1 more than it ran at each read: 31 running after 10 s beside the
    # other endpoint's 83 (system-prompt workload, bench.peer).
    if running is not None and waiting is not None and (
            waiting > sent or endpoint.running_limit is not None):
        # It runs at least this many: a read of more raises the limit, never lowers it.
        endpoint.running_limit = max(endpoint.running_limit or 0.0, running)
    endpoint.inflight_at_scrape = endpoint.inflight_tokens


BINDING_MARGIN = 0.05
"""Share of an endpoint's budget by which the scraped KV use must exceed the picker's own count
before the scraped figure is said to decide the room (block rounding alone makes the engine's
count a little higher)."""


NEARLY_FULL = 0.8
"""Share of its budget (its lease's part of it) from which the picker's own count says an
endpoint is nearly full: its engine may start queueing at any moment (outputs longer than
estimated, preemption), and a read that shows it late sends requests into that queue."""


def figures_decide(endpoint: EndpointState, now: float, rules: CapacityRules) -> bool:
    """Whether the endpoint's scraped figures may decide its room before the next slow read:
    none fresh yet, it is failing (a fresh read is its probe), its engine queues, it holds more
    than the picker sent it (other clients share it, or the estimates fall short), or it is
    nearly full by the picker's own count. The scraper reads such an endpoint at the fast
    cadence; reading the others more often would change no decision."""
    if not endpoint.fresh(now, rules.stale_after) or endpoint.health.failures:
        return True
    if waiting(endpoint, now, rules) > 0:
        return True
    budget = endpoint.budget(rules.fallback_budget)
    if endpoint.inflight_tokens >= NEARLY_FULL * budget * endpoint.share:
        return True
    if endpoint.kv_usage is None:
        return False
    scraped = endpoint.kv_usage * budget - endpoint.released_since_scrape
    return scraped > endpoint.inflight_tokens + BINDING_MARGIN * budget


@dataclass(frozen=True, slots=True)
class CapacityRules:
    """When an endpoint has room (see ``picker.config.schema.Capacity``)."""

    fallback_budget: int = 8192
    max_waiting: int = 2
    stale_after: float = 1.0
    growth_room: bool = False
    """A backlogged tenant's request needs room for its expected size beside the expected
    sizes of the requests running there (``takes_backlogged``), and other requests go first
    where the least prefill is outstanding (``Gate.candidates``); False: its prompt beside what
    they hold now, the engine's own admission rule, and the scorer's order."""
    max_prefill_tokens: int = 0
    """A backlogged tenant's request goes to an endpoint only while the prefill outstanding
    there, its own prompt included, stays within this (``takes_backlogged``); 0: no bound."""
    ready_reserve: bool = False
    """A light tenant's next request must also find its room free now on an endpoint that
    computes no prompt: none outstanding there (``prefill_tokens``), and not the one a
    backlogged tenant's request is about to go to (``keeps_reserve``); False: the reserve on
    any endpoint with the room."""
    engine_queue: int = 0
    """Requests an endpoint without room may still take, into its engine's own queue, while
    fewer than this of the picker's wait there (``EndpointState.engine_queued``): a request
    the engine finishes is replaced at its next step from that queue instead of after the
    picker has seen the end and its next request has crossed the gateway. 0: none (a request
    leaves only when its prompt fits, ``fits``)."""


def occupancy(endpoint: EndpointState, now: float, rules: CapacityRules) -> float:
    """Tokens in use on the endpoint: the picker's own count, or the scraped KV use if higher
    (other clients may share the server; a response path that shows no stream's growth).

    The scraped figure is moved by what the picker's count did since the scrape (requests sent
    and grown, requests freed): held at the scrape's value instead, it would let every request
    sent until the next scrape into the same room whenever it is the higher of the two.
    """
    used = float(endpoint.inflight_tokens)
    if endpoint.kv_usage is not None and endpoint.fresh(now, rules.stale_after):
        scraped = endpoint.kv_usage * endpoint.budget(rules.fallback_budget)
        used = max(used, scraped + endpoint.inflight_tokens - endpoint.inflight_at_scrape)
    return used


def waiting(endpoint: EndpointState, now: float, rules: CapacityRules) -> float:
    """Requests waiting in the engine's own queue (0 when the scrape is stale or missing): the
    scraped count, less the completions seen since, plus the requests the picker has sent
    there since, less the room the engine had to start them at once.

    An engine can queue beside room the picker counts: its limit on running requests (vLLM's
    ``max_num_seqs``) is reached long before its KV budget when requests share their prompt
    blocks. A request sent there then joins the end of its FCFS queue, and one starts per
    completion. Counting only the completions let every one seen after the read that brought
    the count under ``max_waiting`` send whatever the tokens allowed (hundreds of short
    requests), which the next read found queued and everyone, the fair queue's head included,
    then waited out (about a second, on the system-prompt workload). So a request sent counts
    as waiting unless the read showed the engine with room to start it: no queue, and fewer
    running than its ``running_limit`` (no limit known: any number starts)."""
    if endpoint.waiting is None or not endpoint.fresh(now, rules.stale_after):
        return 0.0
    queued = endpoint.waiting - endpoint.completed_since_scrape + endpoint.sent_since_scrape
    if endpoint.waiting <= 0:
        limit = endpoint.running_limit
        if limit is None or endpoint.running is None:
            return 0.0
        queued -= max(0.0, limit - endpoint.running)
    return max(0.0, queued)


def has_room(endpoint: EndpointState, now: float, rules: CapacityRules,
             prompt_tokens: int = 0, lease_tokens: int | None = None) -> bool:
    """Whether the endpoint should take a request with this prompt now: it is in service and
    the prompt fits (``fits``), or its engine's queue has a slot for it (``queue_slot``)."""
    if not endpoint.in_service(now):
        return False
    return fits(endpoint, now, rules, prompt_tokens, lease_tokens) or queue_slot(endpoint, rules)


def queue_slot(endpoint: EndpointState, rules: CapacityRules) -> bool:
    """Whether the endpoint may take a request that does not fit, into its engine's own queue:
    fewer than ``engine_queue`` of the picker's requests wait there. Never beside other
    replicas (a lease bounds what each may hold), and never to an endpoint with nothing in
    flight (any request fits there).

    Invariant: the picker never has more than ``engine_queue`` requests sent to an endpoint
    beyond its room and not yet started there, so the fair queue still orders all but that
    many requests an endpoint; a completion is refilled at the engine's next step for as long
    as the queue lasts, which is why it needs only about one round trip's completions."""
    return endpoint.engine_queued < rules.engine_queue and endpoint.share >= 1.0 \
        and endpoint.inflight_requests > 0


def fits(endpoint: EndpointState, now: float, rules: CapacityRules,
         prompt_tokens: int = 0, lease_tokens: int | None = None) -> bool:
    """Whether a request with this prompt fits on the endpoint now (in service assumed): its
    prompt beside the tokens in use there (``occupancy``; an empty endpoint takes any), and the
    engine's own waiting queue under ``max_waiting``. ``lease_tokens``: what the request will
    hold at its end (default its prompt), judged against this picker's lease beside other
    replicas, so that together they never reserve past the budget."""
    used = occupancy(endpoint, now, rules)
    budget = endpoint.budget(rules.fallback_budget)
    if used >= budget or (endpoint.inflight_requests and used + prompt_tokens > budget):
        return False
    # Beside other replicas, strictly within the lease: the leases sum to at most the budget.
    if endpoint.share < 1.0 and endpoint.inflight_tokens + (
            prompt_tokens if lease_tokens is None else lease_tokens) > endpoint.share * budget:
        return False
    return waiting(endpoint, now, rules) < rules.max_waiting


def free_tokens(endpoint: EndpointState, now: float, rules: CapacityRules,
                projected: bool = True, growth: float | None = None) -> float:
    """Tokens the endpoint will still have free once its running requests have grown to their
    expected size (``projected=False``: free now; ``growth``: at the peak of its use as they
    grow and end, ``growth`` above its use now, ``peak_growth``); 0 when it takes nothing
    (draining, ejected, engine queue full)."""
    if not endpoint.in_service(now) or waiting(endpoint, now, rules) >= rules.max_waiting:
        return 0.0
    used = occupancy(endpoint, now, rules)
    own = float(endpoint.inflight_tokens)
    if projected:
        expected = endpoint.projected_tokens if growth is None \
            else endpoint.inflight_tokens + growth
        used = max(used, expected)
        own = max(own, expected)
    budget = endpoint.budget(rules.fallback_budget)
    return max(0.0, min(budget - used, endpoint.share * budget - own))


def peak_growth(growing: Iterable[tuple[int, int]]) -> int:
    """By how many tokens an endpoint's use rises above its use now at its peak, if nothing
    else joins: each of ``growing``, (tokens it is still expected to grow by, tokens it holds
    now that its end frees), grows by one token an engine step, as a decoding request does,
    and ends once grown, freeing what it held. Requests that neither grow nor end by the
    picker's count (non-streaming ones, streams past their expected size) are left out: what
    they hold stays. O(n log n).

    The sum of the running requests' expected sizes (``projected_tokens``) is the use if all of
    them were at their end at once; but a request ends as it reaches it, and one started
    earlier ends first. Under a flood an endpoint's requests are at every stage of their
    output, so its use peaks about now: the sum counts the unwritten output of every running
    request as held (8k pools, outputs 150-250 beside prompts 600-900: about a tenth of the
    engine), room the engine never uses."""
    return _peak_above_now(sorted(growing, reverse=True))


def peak_growth_with(growing: Iterable[tuple[int, int]],
                     joining: tuple[int, int]) -> tuple[int, int]:
    """``peak_growth(growing)`` and ``peak_growth`` of ``growing`` with ``joining`` among them,
    sorting ``growing`` once (the gate asks both of every candidate endpoint for a backlogged
    tenant's request: its peak now, and what the request adds to it)."""
    items = sorted(growing, reverse=True)
    without = _peak_above_now(items)
    # Longest first: ``joining`` goes before the first it outlasts (equal ones are alike).
    at = next((i for i, item in enumerate(items) if item < joining), len(items))
    items.insert(at, joining)
    return without, _peak_above_now(items)


def _peak_above_now(items: list[tuple[int, int]]) -> int:
    """``peak_growth`` of ``items`` sorted longest first."""
    total = sum(held for _, held in items)
    held = peak = 0
    for count, (rest, own) in enumerate(items, 1):
        held += own
        # Just before the count-th longest ends: it and the longer ones, each grown by ``rest``.
        peak = max(peak, held + count * rest)
    return max(0, peak - total)


def takes_backlogged(endpoint: EndpointState, prompt_tokens: int, projected_tokens: float,
                     now: float, rules: CapacityRules, growth: float | None = None) -> bool:
    """Whether an endpoint that has room (``has_room``) should take a backlogged tenant's
    request of this prompt, expected to grow to ``projected_tokens``. Two rules, each off by
    default, hold such a request back; a request of a tenant that is not backlogged is never
    judged here, so whoever arrives light finds what they leave.

    * ``growth_room``: it fits once every request running there, and itself, have grown to
      their expected size (``free_tokens``). Admitting on the prompt alone fills the engine's
      cache with requests that still have to grow; the engine then preempts (recompute) as they
      do, and a light tenant's request sent there finds no free blocks (a waiting request never
      preempts in vLLM V1) until the growth has used up what was left. With ``growth`` (the
      gate's way), judged at the peak of the endpoint's use as its requests grow and end: the
      endpoint's ``peak_growth`` without it, and ``projected_tokens`` what it adds to the peak.
    * ``max_prefill_tokens``: the endpoint's outstanding prefill (``prefill_tokens``) plus this
      prompt stays within the bound (an endpoint with none outstanding takes any prompt). The
      engine computes running requests' prompt chunks before a waiting request's, and a step
      lasts longer with every prompt token in it: what a light request waits out is bounded.

    An endpoint with nothing in flight takes any request under either rule.
    """
    if not endpoint.inflight_requests:
        return True
    bound = rules.max_prefill_tokens
    if bound and endpoint.prefill_tokens and endpoint.prefill_tokens + prompt_tokens > bound:
        return False
    return not rules.growth_room or \
        free_tokens(endpoint, now, rules, growth=growth) >= projected_tokens


def keeps_reserve(endpoints: list[EndpointState], chosen: EndpointState, tokens: float,
                  reserve: float, now: float, rules: CapacityRules, total: float = 0.0,
                  growth: Mapping[str, float] | None = None) -> bool:
    """Whether, with a request expected to grow to ``tokens`` on ``chosen``, some endpoint will
    still have ``reserve`` tokens free, and the pool ``total`` (``picker.core.reserve``: room
    for a light tenant's next requests, spread wherever they go).

    With ``ready_reserve`` a light tenant's next request must also find, on an endpoint other
    than ``chosen`` that computes no prompt, room for ``reserve`` now: vLLM runs a step's
    prompt chunks to the end and computes a running request's remaining prompt before a
    waiting one's, so room on an endpoint busy with a prefill (outstanding there, or the one
    ``chosen`` is about to start) is room the light request waits a prefill for. Now, not at
    the peak of that endpoint's use: the light request is admitted at the engine's next step
    on the blocks free then, and its output grows later, into the room kept at the peak
    (wherever it is: the request, of a better engine priority, takes it by preemption if its
    endpoint has none). Readiness judged at the peak as well held the flood off the ready
    endpoint whenever its streams had room left to grow into, so that one endpoint filled
    while the other drained: 2 x 8k at 1 request/s held 0.70 of the KV (0.82 without
    readiness), 0.779 of the default's tokens. Only where ``chosen`` is the sole endpoint in
    service does readiness not count: nothing readier exists, and holding the flood would
    leave the pool idle.

    ``growth``: each endpoint's ``peak_growth`` (by address), the room judged at the peak of its
    use; ``tokens`` is then what the request adds to ``chosen``'s peak. None: at the sum of
    the expected sizes (``projected_tokens``).
    """
    unready = rules.ready_reserve and any(
        e is not chosen and e.in_service(now) for e in endpoints)
    kept = False
    pooled = 0.0
    for endpoint in endpoints:
        free = free_tokens(endpoint, now, rules,
                           growth=None if growth is None else growth[endpoint.address])
        if endpoint is chosen:
            free -= tokens
        pooled += max(0.0, free)
        if unready and endpoint is not chosen and not endpoint.prefill_tokens and \
                free_tokens(endpoint, now, rules, projected=False) >= reserve:
            unready = False
        if free >= reserve:
            kept = True
        if kept and not unready and total <= reserve:
            return True
    return kept and not unready and pooled >= total


class Scorer(Protocol):
    """Among endpoints with room, how well does each suit this request? Higher is better."""

    def score(self, endpoint: EndpointState, prompt_tokens: int, now: float,
              rules: CapacityRules) -> float:
        ...


class LeastLoaded:
    """Prefer the endpoint with the shortest waiting queue, then the most free KV budget, as
    this picker may use it: beside active-active peers, within its own lease (so that what it
    holds is spread evenly and its lease is not pinned by one endpoint)."""

    def score(self, endpoint: EndpointState, prompt_tokens: int, now: float,
              rules: CapacityRules) -> float:
        budget = endpoint.budget(rules.fallback_budget)
        free = min(1.0 - occupancy(endpoint, now, rules) / budget,
                   endpoint.share - endpoint.inflight_tokens / budget)
        return free - waiting(endpoint, now, rules)


def rank(endpoints: list[EndpointState], prompt_tokens: int, now: float, rules: CapacityRules,
         scorer: Scorer, require_room: bool = True,
         lease_tokens: int | None = None,
         bonus: Callable[[EndpointState], float] | None = None,
         held: Callable[[EndpointState], int] | None = None) -> list[EndpointState]:
    """Candidates, best first: those with room (``require_room=False``: all in service, i.e.
    neither draining nor ejected). A failing endpoint looks least loaded (nothing in flight
    stays there), so skipping ejected ones is what keeps traffic off a dead server.
    ``bonus``: added to the scorer's score (prefix affinity); it reorders the candidates, it
    never adds one. ``held``: tokens of the prompt that an endpoint already holds for requests
    running there (shared prefix blocks, ``picker.core.prefix.InflightBlocks``): the request
    needs that much less room there."""
    if not require_room:
        candidates = [e for e in endpoints if e.in_service(now)]
    elif held is None:
        candidates = [e for e in endpoints
                      if has_room(e, now, rules, prompt_tokens, lease_tokens)]
    else:
        candidates = [e for e in endpoints
                      if has_room(e, now, rules, prompt_tokens - (shared := held(e)),
                                  None if lease_tokens is None else lease_tokens - shared)]
    if len(candidates) < 2:
        return candidates
    if bonus is None:
        candidates.sort(key=lambda e: scorer.score(e, prompt_tokens, now, rules), reverse=True)
    else:
        candidates.sort(key=lambda e: scorer.score(e, prompt_tokens, now, rules) + bonus(e),
                        reverse=True)
    return candidates
