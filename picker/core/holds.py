"""Why an endpoint does not take the next queued request: the ``has_room`` test, named.

Pure, and decides nothing: ``picker.core.selection.has_room`` decides; this names which of its
conditions said no, for the picker's trace (``picker.dispatch.trace``) and the efficiency
benchmark (``bench.efficiency``), which compare the picker's view with the engine's own.
"""

from __future__ import annotations

from picker.core.selection import CapacityRules, EndpointState, occupancy, waiting

ROOM = "room"
"""``has_room`` says yes: nothing in the endpoint holds the request (a rule or the fair order
may)."""
OUT_OF_SERVICE = "out_of_service"
"""Draining or ejected."""
WAITING = "waiting"
"""The engine's scraped waiting queue, less the completions seen since, is at
``capacity.maxWaiting``."""
OWN_COUNT = "own_count"
"""The prompt does not fit beside the tokens in flight by the picker's own count."""
SCRAPED_KV = "scraped_kv"
"""The prompt fits by the picker's own count, not beside the scraped KV use (moved by what the
picker's count did since the scrape)."""
LEASE = "lease"
"""Beside other replicas: past this picker's lease of the budget."""


def hold_reason(endpoint: EndpointState, now: float, rules: CapacityRules,
                prompt_tokens: int) -> str:
    """Which of ``has_room``'s conditions keeps a request of ``prompt_tokens`` (without a lease
    size) off ``endpoint`` now; ``ROOM`` when none does. The KV tests come before the waiting
    queue's, as in ``has_room``."""
    if not endpoint.in_service(now):
        return OUT_OF_SERVICE
    budget = endpoint.budget(rules.fallback_budget)
    own = float(endpoint.inflight_tokens)
    used = occupancy(endpoint, now, rules)
    if used >= budget or (endpoint.inflight_requests and used + prompt_tokens > budget):
        over_own = own >= budget or own + prompt_tokens > budget
        return OWN_COUNT if over_own else SCRAPED_KV
    if endpoint.share < 1.0 and own + prompt_tokens > endpoint.share * budget:
        return LEASE
    if waiting(endpoint, now, rules) >= rules.max_waiting:
        return WAITING
    return ROOM
