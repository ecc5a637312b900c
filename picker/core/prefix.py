"""Prefix affinity: which endpoint probably holds a request's prompt prefix in its KV cache.

It answers: *of the endpoints where a request fits, how much of its prompt has each one
recently received?* The picker does not see the engines' caches. It remembers, per endpoint,
the prompt blocks (chained hashes, ``picker.openai.prefix``) of the requests it sent there, in
a least-recently-used set bounded in blocks: an approximate copy of what the engine's prefix
cache holds (the engine evicts by its own LRU, under its own memory pressure; a block the
picker remembers may be gone, one it forgot may still be there). A request's match on an
endpoint is the count of its leading blocks found there: a chained hash names its whole prefix,
so the first miss ends the match, as it ends vLLM's hit.

Affinity decides only *where*, never *who* or *whether*: the fair queue has already chosen the
request and ``selection.rank`` the endpoints where it fits; the match only reorders those
(``affinity_order``). Pure; no clock needed (recency is dispatch order).

Each picker replica learns from its own dispatches (see docs/configuration.md
``routing.prefixAffinity``): the index is a routing hint, not state whose loss costs anything
but a cache miss, and exchanging it through the shared store every sync interval would cost
more than it saves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AffinityRules:
    """How much a prefix match counts beside load (``routing.prefixAffinity``)."""

    weight: float = 1.0
    """A whole prompt found on an endpoint adds this to its score; the least-loaded scorer's
    scores run from about -max_waiting to 1 (the free fraction of the endpoint), so 1 lets a
    full match win over an endpoint up to one whole budget emptier; 0: load alone decides."""
    block_chars: int = 256
    """Bytes of prompt text per block (characters, for ASCII text)."""
    max_blocks_per_endpoint: int = 8192
    """Blocks remembered per endpoint, least recently sent forgotten first."""


class PrefixIndex:
    """Per endpoint, the prompt blocks recently sent there, bounded, least recent evicted."""

    __slots__ = ("_held", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: dict[str, OrderedDict[int, None]] = {}

    def matched(self, address: str, blocks: Sequence[int]) -> int:
        """How many of ``blocks``, from the first, the endpoint holds (stops at the first
        miss). The whole prompt is tried first: a conversation resent is the common case."""
        held = self._held.get(address)
        if not held or not blocks:
            return 0
        if blocks[-1] in held:
            return len(blocks)
        count = 0
        for block in blocks:
            if block not in held:
                break
            count += 1
        return count

    def record(self, address: str, blocks: Sequence[int]) -> None:
        """The request with these blocks was sent to ``address``: they are now its most
        recent; the least recent beyond the capacity are forgotten."""
        if not blocks:
            return
        held = self._held.get(address)
        if held is None:
            held = self._held[address] = OrderedDict()
        move = held.move_to_end
        for block in blocks:
            if block in held:
                move(block)
            else:
                held[block] = None
        excess = len(held) - self.capacity
        while excess > 0:
            held.popitem(last=False)
            excess -= 1

    def forget(self, address: str) -> None:
        """The endpoint left the pool (or restarted empty)."""
        self._held.pop(address, None)

    def size(self, address: str) -> int:
        """Blocks remembered for the endpoint."""
        held = self._held.get(address)
        return 0 if held is None else len(held)


def cached_estimate(prompt_tokens: int, matched_blocks: int, block_chars: int,
                    text_chars: int) -> int:
    """The prompt tokens expected from the engine's cache: the matched share of the text, less
    one token (vLLM always computes at least the prompt's last token)."""
    if not matched_blocks or text_chars <= 0:
        return 0
    share = min(1.0, matched_blocks * block_chars / text_chars)
    return max(0, min(prompt_tokens - 1, int(prompt_tokens * share)))
