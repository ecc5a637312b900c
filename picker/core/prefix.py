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

The room is another matter (``InflightBlocks``): an engine that caches prefixes stores a block
that requests running on it share once, whoever routed them there, so the blocks in flight are
counted once whenever the engines are known to cache (``capacity.engineCache``), affinity or
not; affinity only adds the preference for where a prompt was sent before.
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
    patience: float = 0.0
    """Seconds at most the fair queue's head may wait for the endpoint likely to hold its
    prefix when only others have room (``prefix_patience``); 0: never."""
    prefill_s_per_token: float = 0.0001
    """The engines' prefill time per prompt token: what a hit saves, in seconds."""


DEFAULT_BLOCK_CHARS = 256
"""The block size prompts are cut with when no affinity rules give one: the engines' shared
blocks are counted once in the room (``InflightBlocks``) with or without affinity."""


class PrefixIndex:
    """Per endpoint, the prompt blocks recently sent there, bounded, least recent evicted.

    Each block keeps the endpoint's *sent* count when it was last sent there: the tokens of new
    KV the requests sent to that endpoint have asked for (``sent``), each request's prompt not
    expected cached plus its expected output. The engine's prefix cache keeps a block no
    request holds in its free queue, least recently used first, and every new block it
    allocates takes the queue's head: a block is evicted once the endpoint has allocated as
    many new tokens as were free behind it, and never survives a whole KV budget of them.
    ``age`` is how many it has allocated since a match was sent there (``freshness``).
    Chained hashes keep the stamps of a prompt's blocks non-increasing along the chain (a
    block is recorded only with every block before it), so the last matched block is the
    stalest one."""

    __slots__ = ("_held", "_sent", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: dict[str, OrderedDict[int, int]] = {}
        """Per endpoint, block hash to the endpoint's ``sent`` count when it was last sent."""
        self._sent: dict[str, int] = {}

    def matched(self, address: str, blocks: Sequence[int], within: int | None = None) -> int:
        """How many of ``blocks``, from the first, the endpoint holds (stops at the first
        miss). The whole prompt is tried first: a conversation resent is the common case.
        ``within``: only blocks sent there less than this many tokens of new KV ago (``age``)
        count; None: any remembered."""
        held = self._held.get(address)
        if not held or not blocks:
            return 0
        oldest = -1 if within is None else self._sent.get(address, 0) - within
        last = held.get(blocks[-1])
        if last is not None and last > oldest:
            return len(blocks)
        count = 0
        for block in blocks:
            stamp = held.get(block)
            if stamp is None or stamp <= oldest:
                break
            count += 1
        return count

    def age(self, address: str, blocks: Sequence[int], count: int) -> int:
        """Tokens of new KV sent to ``address`` since the first ``count`` of ``blocks`` were
        last sent there (those of its last, the stalest); 0 when ``count`` is 0."""
        if count <= 0:
            return 0
        held = self._held.get(address)
        stamp = None if held is None else held.get(blocks[count - 1])
        return 0 if stamp is None else self._sent.get(address, 0) - stamp

    def sent(self, address: str, tokens: int) -> None:
        """A request asking ``tokens`` of new KV there went to ``address`` (with its blocks,
        ``record`` after this)."""
        if tokens > 0:
            self._sent[address] = self._sent.get(address, 0) + tokens

    def record(self, address: str, blocks: Sequence[int]) -> None:
        """The request with these blocks was sent to ``address``: they are now its most
        recent; the least recent beyond the capacity are forgotten."""
        if not blocks:
            return
        held = self._held.get(address)
        if held is None:
            held = self._held[address] = OrderedDict()
        stamp = self._sent.get(address, 0)
        move = held.move_to_end
        for block in blocks:
            if block in held:
                move(block)
            held[block] = stamp
        excess = len(held) - self.capacity
        while excess > 0:
            held.popitem(last=False)
            excess -= 1

    def released(self, address: str, blocks: Sequence[int]) -> None:
        """A request with these blocks ended on ``address``: the engine holds a block while a
        request uses it and puts it in its free queue (where ``age`` starts to count) at the
        end, so those still remembered age from now. None is added; the order of forgetting
        (by sending) is kept."""
        held = self._held.get(address)
        if not held or not blocks:
            return
        stamp = self._sent.get(address, 0)
        for block in blocks:
            if block in held:
                held[block] = stamp

    def forget(self, address: str) -> None:
        """The endpoint left the pool (or restarted empty)."""
        self._held.pop(address, None)
        self._sent.pop(address, None)

    def size(self, address: str) -> int:
        """Blocks remembered for the endpoint."""
        held = self._held.get(address)
        return 0 if held is None else len(held)


def freshness(age: int, free: float, budget: int) -> float:
    """The chance a block still sits in an engine's prefix cache after the endpoint allocated
    ``age`` tokens of new KV since it was last sent there, ``free`` of its ``budget`` tokens
    free now (held by no request: the picker's count). The engine keeps a block no request
    holds in its free queue, least recently used first, and takes every new block from the
    queue's head: a block is evicted once the endpoint has allocated about as many as were
    free behind it, and never survives a whole budget of them. So: 1 up to ``free``, falling
    evenly to 0 at ``budget``."""
    if age <= free:
        return 1.0
    if age >= budget:
        return 0.0
    return (budget - age) / (budget - free)


def prefix_patience(saved_tokens: float, rules: AffinityRules) -> float:
    """How long a request may wait for the endpoint likely to hold its prefix: the prefill
    the hit is expected to save there over the best endpoint with room now (``saved_tokens``:
    its cached tokens expected there, ``freshness`` included, less those expected on the
    other), at ``prefill_s_per_token``, at most ``patience``. Waiting longer than that costs
    the request more than computing its prompt elsewhere."""
    if saved_tokens <= 0 or rules.patience <= 0:
        return 0.0
    return min(rules.patience, saved_tokens * rules.prefill_s_per_token)


def cached_estimate(prompt_tokens: int, matched_blocks: int, block_chars: int,
                    text_chars: int) -> int:
    """The prompt tokens expected from the engine's cache: the matched share of the text, less
    one token (vLLM always computes at least the prompt's last token)."""
    if not matched_blocks or text_chars <= 0:
        return 0
    share = min(1.0, matched_blocks * block_chars / text_chars)
    return max(0, min(prompt_tokens - 1, int(prompt_tokens * share)))


def covered_tokens(prompt_tokens: int, blocks: int, block_chars: int, text_chars: int) -> int:
    """The prompt tokens that its first ``blocks`` blocks cover: their share of the text, at
    most all but the prompt's last token (vLLM always computes that one, in a block of its own
    when the prompt ends on a block boundary). Integer arithmetic: ``InflightBlocks.hold``
    counts block by block what this gives for a run, to the token."""
    if blocks <= 0 or text_chars <= 0:
        return 0
    return max(0, min(prompt_tokens - 1, prompt_tokens * blocks * block_chars // text_chars))


class InflightBlocks:
    """Per endpoint, the prompt blocks of the requests in flight there, each counted once.

    It answers: *of a request's prompt, how many tokens does an endpoint already hold in KV
    for requests still running there?* vLLM's prefix cache shares a cached block by reference
    (``ref_cnt``): a request whose leading blocks a running request holds allocates only the
    blocks after them. A block cached but held by no running request sits in the engine's free
    queue, which the picker counts as free room (the engine's ``kv_cache_usage_perc`` too):
    a request that hits it takes it out of that queue, so it costs room like a computed block.
    So only blocks held in flight are counted once here; the prefix index's memory of what an
    endpoint received before (``PrefixIndex``) decides where a request goes, not how much room
    it takes.

    Each block keeps the tokens it was counted with when it entered (the first holder's
    estimate), and leaves with them when its last holder ends, so an endpoint's count returns
    to exactly 0 when everything there has ended, whatever the holders' estimates were.
    Chained hashes make a request's held blocks a leading run (a block is held only with every
    block before it), so ``held`` bisects. Memory: one entry per distinct block in flight.
    """

    __slots__ = ("_ledgers",)

    def __init__(self) -> None:
        self._ledgers: dict[str, dict[int, list[int]]] = {}
        """Per endpoint, block hash to [holders, tokens counted for it]."""

    def held(self, address: str, blocks: Sequence[int]) -> int:
        """How many of ``blocks``, from the first, are held by requests in flight on
        ``address``."""
        ledger = self._ledgers.get(address)
        if not ledger or not blocks:
            return 0
        if blocks[-1] in ledger:
            return len(blocks)
        if blocks[0] not in ledger:
            return 0
        low, high = 1, len(blocks) - 1  # blocks[low - 1] held, blocks[high] not
        while low < high:
            middle = (low + high) // 2
            if blocks[middle] in ledger:
                low = middle + 1
            else:
                high = middle
        return low

    def hold(self, address: str, blocks: Sequence[int], prompt_tokens: int, block_chars: int,
             text_chars: int) -> int:
        """A request with these blocks runs on ``address`` now: the tokens its blocks add
        there (those of the blocks nobody there held, by this request's estimate)."""
        if not blocks or text_chars <= 0:
            return 0
        ledger = self._ledgers.setdefault(address, {})
        get = ledger.get
        # The blocks held already are a leading run: a reference more on each; then the rest,
        # each with the tokens it adds to the run (``covered_tokens``, inline: per block).
        held = self.held(address, blocks)
        for block in blocks[:held]:
            entry = get(block)
            if entry is None:  # only if hashes collide and break the run: counted as nothing
                ledger[block] = [1, 0]
            else:
                entry[0] += 1
        last = max(0, prompt_tokens - 1)
        step = prompt_tokens * block_chars
        before = min(last, step * held // text_chars)
        added = 0
        for count in range(held + 1, len(blocks) + 1):
            upto = step * count // text_chars
            if upto > last:
                upto = last
            block = blocks[count - 1]
            entry = get(block)
            if entry is None:
                ledger[block] = [1, upto - before]
                added += upto - before
            else:  # (a collision again: never overwrite another request's entry)
                entry[0] += 1
            before = upto
        return added

    def release(self, address: str, blocks: Sequence[int]) -> int:
        """A request with these blocks ended on ``address`` (or moved away): the tokens of
        the blocks it was the last to hold, no longer counted there."""
        ledger = self._ledgers.get(address)
        if ledger is None or not blocks:
            return 0
        freed = 0
        for block in blocks:
            entry = ledger.get(block)
            if entry is None:
                continue  # not recorded (cannot happen unless hashes collide): nothing to free
            entry[0] -= 1
            if entry[0] == 0:
                freed += entry[1]
                del ledger[block]
        # An empty ledger stays (``forget`` drops it with its endpoint): refilling a dict that
        # kept its size costs less than growing a new one, request after request.
        return freed

    def tokens(self, address: str) -> int:
        """Tokens counted for the blocks in flight on ``address``."""
        return sum(entry[1] for entry in self._ledgers.get(address, {}).values())

    def blocks(self, address: str) -> int:
        """Distinct blocks in flight on ``address`` (memory accounting)."""
        return len(self._ledgers.get(address, {}))

    def forget(self, address: str) -> None:
        self._ledgers.pop(address, None)
