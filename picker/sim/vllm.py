"""vLLM V1's scheduler, step by step: which request computes which tokens, and who is preempted?

A pure model (no I/O, no asyncio, time passed in) of ``vllm/v1/core/sched/scheduler.py``
(``Scheduler.schedule`` and ``_preempt_request``) with ``KVCacheManager`` (``get_computed_blocks``,
``allocate_slots``, ``free``) and ``BlockPool``, for a decoder-only model with automatic prefix
caching and without speculative decoding, LoRA or KV connectors. The
simulated model server (``picker.sim.server``) steps it; seed 000's ``BatchEngine`` is a
different, simpler engine and is not this.

The rules, each as vLLM V1 has them:

* **KV blocks.** The cache is ``total_blocks`` blocks of ``block_size`` tokens (vLLM:
  ``num_gpu_blocks``; 16 tokens by default). A request holds ``ceil(computed / block_size)``
  blocks, where ``computed`` is its tokens whose KV exists: prompt tokens prefilled so far plus
  generated tokens fed back. The newest sampled token has no KV until the next step feeds it, so
  a decoding request with ``g`` tokens generated holds ``ceil((prompt + g - 1) / block_size)``.
  Scheduling ``n`` new tokens needs ``ceil((computed + n) / block_size)`` blocks in all; the
  difference must be free, or the allocation fails (``allocate_slots`` returns ``None``).
* **Step budget.** A step schedules at most ``max_num_batched_tokens`` tokens (vLLM's flag;
  the OpenAI server's default on GPUs other than H100-class is 2048, our default) and at most
  ``max_num_seqs`` requests run. Each request is given ``min(num_tokens - computed, budget
  left)`` tokens, where ``num_tokens = prompt + generated``: chunked prefill, a long prompt is
  prefilled over several steps; a decoding request needs 1.
* **Running first.** RUNNING requests are scheduled first, in their order, while budget is
  left. When one cannot get its blocks the engine preempts until it can: under ``priority`` the
  running request with the largest ``(priority, arrival)`` (``max(self.running, key=...)``; if
  that one was already scheduled this step, its tokens go back to the budget), under ``fcfs``
  the last running one (``self.running.pop()``). If the victim is the request being scheduled,
  it is not scheduled and scheduling of running requests stops there (``break``).
* **Recompute.** Preemption frees all the victim's blocks and sets its computed tokens to 0;
  it goes back to the FRONT of the waiting deque (``prepend_request``; in the priority heap it
  is simply pushed again). When rescheduled, ``num_tokens - 0`` tokens, its prompt AND the
  tokens it had generated, are prefilled again and charged to the step's token budget like any
  prefill.
* **Waiting next, only if nobody was preempted this step** (``if not preempted_reqs``). The
  waiting queue is FCFS (a deque) or ordered by ``(priority, arrival)`` (a heap; lower
  priority value first). A waiting request never preempts: admission STOPS (``break``, not
  skip) at the first request that does not get its blocks, or when ``max_num_seqs`` run, or when
  the token budget is spent.
* **Tokens out.** After the step a request whose computed tokens caught up with ``num_tokens``
  samples one token: the step that finishes a prefill (or a recompute) also yields the next
  token, a decode step yields one. A request finishes when it has generated its output tokens
  (a request with 0 output tokens, an embedding, finishes when its prefill completes) and its
  blocks are freed then.

* **Automatic prefix caching** (``enable_prefix_caching``, on by default as in vLLM V1), for a
  request that carries its token ids (``token_ids``; the generated ones in ``output_ids``); one
  given only as counts takes part in none of it. A full block's hash is
  ``hash((parent's hash, its token ids))``, the first block's parent a constant: equal hashes mean
  equal prefixes. When a waiting request is scheduled (its computed tokens 0, a preempted one
  too), its leading blocks whose hashes are cached are a hit, at most ``num_tokens - 1`` tokens
  (the last token is always computed, for its logits; a whole-block hit of a block-aligned prompt
  recomputes that last block): they count as computed, cost neither budget nor compute, and are
  shared by reference (a block's ``ref_cnt``). The allocation then needs its new blocks plus the
  hit blocks nobody holds (they leave the free queue). Every full block up to ``computed + new``
  tokens is registered in the cache as it is allocated, before it is computed, so a request
  scheduled later in the same step already hits it (vLLM's ``cache_blocks``), generated tokens'
  blocks included.
* **Free queue, LRU.** Free blocks wait in a queue, at first in id order; a new block is taken
  from its head, and a cached block taken so loses its hash (evicted). A finished, aborted or
  preempted request's blocks are released in reverse order (last block first) and those no one
  else holds are appended to the tail, still cached: the tail of a sequence is evicted before its
  head, the least recently used request's blocks before another's. A hit on a free block takes
  it out of the queue. Used blocks (``kv_usage``) are the blocks not free: cached free blocks
  count as free, as in vLLM.
* **Metrics.** A request's ``cached_tokens`` is its hit the first time it is scheduled (vLLM's
  ``num_cached_tokens``, reported as ``usage.prompt_tokens_details.cached_tokens``); each
  admission from the waiting queue adds ``num_tokens`` to ``prefix_cache_queries`` and the hit
  to ``prefix_cache_hits`` (vLLM's ``PrefixCacheStats.record``, at admission), a preempted
  request's to ``preempted_prefix_cache_queries`` / ``_hits`` instead.

Not modelled: vLLM's ``long_prefill_token_threshold`` (0 by default), the recent optional
admission ``watermark`` (0 by default), async scheduling, and ``max_model_len`` clipping (the
server refuses a request beyond the context before it gets here).

One deliberate difference: vLLM refuses to start unless its cache holds one request of the
whole context, so a request alone in the engine always gets its blocks. The simulator allows a
smaller cache (a tiny ``--kv-budget-tokens`` models a busy engine), so it keeps that guarantee
directly: **a request alone in the engine is never refused blocks**, even past the cache (it
would otherwise preempt itself forever). With every request fitting the cache alone, used blocks
never exceed the total; otherwise only a lone request exceeds it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

POLICIES = ("fcfs", "priority")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's default ``--max-num-batched-tokens`` for the OpenAI server on GPUs other than
H100-class (``EngineArgs`` defaults: 8192 on >= 70 GiB non-A100 devices)."""


_ROOT_HASH = 0x5EED
"""The first block's parent hash (vLLM's ``NONE_HASH``): a constant, so hashes are the same in
every process (a tuple of ints hashes the same everywhere)."""


class _Block:
    """One KV block: who holds it, and the hash it is cached under (None: not cached)."""

    __slots__ = ("hash", "id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref_cnt = 0
        self.hash: int | None = None


class BlockPool:
    """vLLM V1's ``BlockPool``: the blocks, the free queue (LRU at its head) and the cache map."""

    def __init__(self, total_blocks: int) -> None:
        self.total = total_blocks
        self.free: OrderedDict[int, _Block] = OrderedDict(
            (i, _Block(i)) for i in range(total_blocks))
        self.cached: dict[int, dict[int, _Block]] = {}
        """Hash → the blocks cached under it (two requests may fill equal blocks)."""
        self.lent = 0
        """Blocks lent past the cache to a lone request (held as None)."""
        self.evictions = 0

    @property
    def used(self) -> int:
        return self.total - len(self.free) + self.lent

    def get_cached(self, block_hash: int) -> _Block | None:
        blocks = self.cached.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def touch(self, blocks: Iterable[_Block]) -> None:
        """Hold cached blocks found by a hit: a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free[block.id]
            block.ref_cnt += 1

    def take(self, count: int) -> list[_Block]:
        """``count`` new blocks from the free queue's head, evicting the cached ones."""
        taken = []
        for _ in range(count):
            _, block = self.free.popitem(last=False)
            if block.hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: _Block) -> None:
        assert block.hash is not None
        same = self.cached[block.hash]
        del same[block.id]
        if not same:
            del self.cached[block.hash]
        block.hash = None
        self.evictions += 1

    def release(self, blocks: Iterable[_Block | None]) -> None:
        """Drop one hold of each block, in the order given; a block no one holds goes to the
        free queue's tail, still cached."""
        for block in blocks:
            if block is None:
                self.lent -= 1
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free[block.id] = block

    def cache(self, block: _Block, block_hash: int) -> None:
        block.hash = block_hash
        self.cached.setdefault(block_hash, {})[block.id] = block


@dataclass(frozen=True)
class VllmConfig:
    """The engine's scheduling limits."""

    total_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    """vLLM V1's automatic prefix caching (on by default, as ``--enable-prefix-caching``)."""

    def __post_init__(self) -> None:
        for name in ("total_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")


@dataclass(eq=False)
class SeqRequest:
    """One request in the engine: what it asks for, and how far it has got."""

    id: Hashable
    prompt_tokens: int
    output_tokens: int
    """Tokens it will generate; 0: prefill only (an embedding)."""
    priority: int = 0
    arrival: float = 0.0
    generated: int = 0
    computed: int = 0
    """Tokens whose KV is in the cache (reset to 0 by a preemption)."""
    token_ids: Sequence[int] | None = None
    """The prompt's token ids (``prompt_tokens`` of them); None: counts only, never cached."""
    output_ids: Sequence[int] | None = None
    """The ids of the tokens it will generate, in order, for the hashes of blocks that hold
    them; None (or too short): blocks past the known tokens are not hashed."""
    cached_tokens: int | None = None
    """Its prefix-cache hit the first time it was scheduled (None: not scheduled yet)."""
    lost: int = 0
    """The most tokens a preemption has discarded: computing them again is recompute."""
    preemptions: int = 0
    decoding: bool = False
    """Its prefill (or recompute) is done: each step now feeds back its newest token."""
    status: str = "new"
    """``new``, ``waiting``, ``running``, ``finished`` or ``aborted``."""
    _order: int = field(default=0, repr=False)
    _blocks: list[_Block | None] = field(default_factory=list, repr=False)
    """Its blocks in token order; None: a block lent past the cache to a lone request."""
    _hashes: list[int] = field(default_factory=list, repr=False)
    _num_cached_blocks: int = field(default=0, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def blocks(self) -> int:
        """KV blocks it holds (shared ones included)."""
        return len(self._blocks)

    def block_hashes(self, count: int, block_size: int) -> list[int]:
        """The hashes of its first ``count`` full blocks, or fewer when its known token ids end
        sooner (none without ``token_ids``)."""
        hashes, prompt = self._hashes, self.token_ids
        if prompt is None or len(hashes) >= count:
            return hashes
        known = self.prompt_tokens + min(self.generated, len(self.output_ids or ()))
        parent = hashes[-1] if hashes else _ROOT_HASH
        while len(hashes) < count and (len(hashes) + 1) * block_size <= known:
            start = len(hashes) * block_size
            end = start + block_size
            if end <= self.prompt_tokens:
                ids = tuple(prompt[start:end])
            else:
                out = self.output_ids or ()
                ids = tuple(prompt[start:self.prompt_tokens]) + tuple(
                    out[max(0, start - self.prompt_tokens):end - self.prompt_tokens])
            parent = hash((parent, ids))
            hashes.append(parent)
        return hashes

    @property
    def done(self) -> bool:
        return self.status in ("finished", "aborted")


@dataclass
class StepOutput:
    """What one engine step did."""

    scheduled: dict[SeqRequest, int] = field(default_factory=dict)
    """Tokens computed per request this step (prefill chunk, recompute or 1 decode token)."""
    tokens: dict[SeqRequest, int] = field(default_factory=dict)
    """The index (1-based) of the token each request emitted this step."""
    finished: list[SeqRequest] = field(default_factory=list)
    preempted: list[SeqRequest] = field(default_factory=list)
    prefill_tokens: int = 0
    """Tokens computed this step that were not a decode, recompute included."""
    recomputed_tokens: int = 0
    """Tokens computed this step whose KV a preemption had discarded."""
    emitted: dict[SeqRequest, int] = field(default_factory=dict)
    """Requests that emitted more than one token this step, and how many (only an engine
    whose ``_extra`` adds tokens: ``picker.whatif.coarse``); every other in ``tokens``, one."""


class VllmScheduler:
    """vLLM V1's scheduler over a block KV cache: ``add``, ``abort``, ``step(now)``."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.running: list[SeqRequest] = []
        self._fcfs: deque[SeqRequest] = deque()
        self._heap: list[tuple[int, float, int, SeqRequest]] = []
        self._order = itertools.count()
        self.pool = BlockPool(config.total_blocks)
        self.preemptions_total = 0
        self.prefix_cache_queries = 0
        """Tokens of requests looked up in the prefix cache when admitted (not preempted)."""
        self.prefix_cache_hits = 0
        """Of those, the tokens found cached."""
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0
        self.recomputed_tokens_total = 0
        self.steps = 0

    # -- state --

    @property
    def num_waiting(self) -> int:
        return len(self._heap) if self.config.policy == "priority" else len(self._fcfs)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def used_blocks(self) -> int:
        """Blocks some request holds (a cached block no one holds is free)."""
        return self.pool.used

    @property
    def kv_usage(self) -> float:
        """Used blocks over total blocks, as vLLM's ``vllm:kv_cache_usage_perc`` (at most 1: a
        lone request past the cache reads as a full cache)."""
        return min(1.0, self.used_blocks / self.config.total_blocks)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    # -- requests --

    def add(self, request: SeqRequest, priority: int = 0, arrival: float = 0.0) -> None:
        """Queue a new request at the back of the waiting queue (or into the priority heap)."""
        if request.status != "new":
            raise ValueError("a request is added once")
        if request.prompt_tokens < 1 or request.output_tokens < 0:
            raise ValueError("a request needs a prompt and a non-negative output")
        request.priority, request.arrival = priority, arrival
        request._order = next(self._order)
        self._push_waiting(request, front=False)

    def abort(self, request: SeqRequest) -> None:
        """Remove a waiting or running request at once, freeing its blocks."""
        if request.done or request.status == "new":
            return
        if request.status == "running":
            self.running.remove(request)
            self._free(request)
        elif self.config.policy == "priority":
            self._heap = [entry for entry in self._heap if entry[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fcfs.remove(request)
        request.status = "aborted"

    # -- the step --

    def step(self, now: float) -> StepOutput:
        """One engine iteration: schedule (running, then waiting), compute, sample, finish."""
        self.steps += 1
        out = StepOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self._compute(out)
        return out

    def _schedule_running(self, out: StepOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            tokens = min(request.num_tokens - request.computed, budget)
            tokens += self._extra(request, tokens)
            while not self._allocate(request, tokens, alone=len(self.running) == 1):
                victim = self._pick_victim()
                if victim in out.scheduled:
                    # Already scheduled this step: its tokens go back to the budget and the
                    # running list shifted left past it.
                    budget += out.scheduled.pop(victim)
                    index -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget  # vLLM: cannot schedule it, stop scheduling running ones
            out.scheduled[request] = tokens
            budget -= tokens
            index += 1
        return budget

    def _pick_victim(self) -> SeqRequest:
        if self.config.policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival, r._order))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _schedule_waiting(self, out: StepOutput, budget: int) -> None:
        while budget > 0 and self.num_waiting:
            if len(self.running) >= self.config.max_num_seqs:
                return
            request = self._peek_waiting()
            hits = self._cache_hit(request)
            hit_tokens = len(hits) * self.config.block_size
            tokens = min(request.num_tokens - hit_tokens, budget)
            tokens += self._extra(request, hit_tokens + tokens - request.computed)
            if not self._allocate(request, tokens, alone=not self.running, hits=hits):
                return  # vLLM breaks here: the requests behind it wait too
            self._record_hit(request, hit_tokens)
            self._pop_waiting()
            request.status = "running"
            self.running.append(request)
            out.scheduled[request] = tokens
            budget -= tokens

    def _extra(self, request: SeqRequest, tokens: int) -> int:
        """Tokens ``request`` decodes this step beyond the one it samples, given it computes
        ``tokens`` of its own: none in vLLM (a coarse engine's long step overrides it,
        ``picker.whatif.coarse``)."""
        return 0

    def _compute(self, out: StepOutput) -> None:
        """The model runs the scheduled tokens; caught-up requests sample one token."""
        for request, scheduled in out.scheduled.items():
            start = request.computed
            # Its own tokens; anything scheduled beyond them is ``_extra``'s (0 in vLLM).
            tokens = min(scheduled, request.num_tokens - start)
            if not request.decoding:
                out.prefill_tokens += tokens
            recomputed = max(0, min(start + tokens, request.lost) - start)
            out.recomputed_tokens += recomputed
            request.computed += tokens
            if request.computed < request.num_tokens:
                continue  # a prefill chunk: no token yet
            if request.output_tokens > 0:
                if scheduled > tokens:  # decoded within the step, each fed back but the last
                    count = min(1 + scheduled - tokens,
                                request.output_tokens - request.generated)
                    request.computed += count - 1
                    request.generated += count
                    out.emitted[request] = count
                else:
                    request.generated += 1
                request.decoding = True
                out.tokens[request] = request.generated
            if request.generated >= request.output_tokens:
                self.running.remove(request)
                self._free(request)
                request.status = "finished"
                out.finished.append(request)
        self.recomputed_tokens_total += out.recomputed_tokens

    # -- KV blocks and queues --

    def _cache_hit(self, request: SeqRequest) -> list[_Block]:
        """The cached blocks of a waiting request's prefix (vLLM's ``find_longest_cache_hit``),
        at most ``num_tokens - 1`` tokens of them."""
        if not self.config.enable_prefix_caching or request.token_ids is None:
            return []
        size = self.config.block_size
        hits: list[_Block] = []
        for block_hash in request.block_hashes((request.num_tokens - 1) // size, size):
            block = self.pool.get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _record_hit(self, request: SeqRequest, hit_tokens: int) -> None:
        if request.cached_tokens is None:
            request.cached_tokens = hit_tokens
        if not self.config.enable_prefix_caching or request.token_ids is None:
            return
        if request.preemptions:
            self.preempted_prefix_cache_queries += request.num_tokens
            self.preempted_prefix_cache_hits += hit_tokens
        else:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit_tokens

    def _allocate(self, request: SeqRequest, tokens: int, alone: bool,
                  hits: Sequence[_Block] = ()) -> bool:
        """Blocks for ``tokens`` more tokens after its computed ones and the ``hits`` (cached
        blocks of a waiting request's prefix, taken by reference); False if they are not free."""
        pool = self.pool
        hit_tokens = len(hits) * self.config.block_size
        needed = self.blocks_for(request.computed + hit_tokens + tokens) - request.blocks \
            - len(hits)
        if hits:
            held_elsewhere = sum(1 for block in hits if block.ref_cnt == 0)
            if needed + held_elsewhere > len(pool.free) and not alone:
                return False
        elif needed > len(pool.free) and not alone:
            return False
        if hits:
            pool.touch(hits)
            request._blocks.extend(hits)
            request._num_cached_blocks = len(request._blocks)
            request.computed += hit_tokens
        if needed > 0:
            own = min(needed, len(pool.free))
            request._blocks.extend(pool.take(own))
            if needed > own:  # a lone request past the cache
                request._blocks.extend([None] * (needed - own))
                pool.lent += needed - own
        if self.config.enable_prefix_caching and request.token_ids is not None:
            self._cache_blocks(request, min(request.computed + tokens, request.num_tokens))
        return True

    def _cache_blocks(self, request: SeqRequest, tokens: int) -> None:
        """Register its full blocks up to ``tokens`` in the cache (vLLM's ``cache_blocks``)."""
        size = self.config.block_size
        full = tokens // size
        if full <= request._num_cached_blocks:
            return
        hashes = request.block_hashes(full, size)
        for index in range(request._num_cached_blocks, min(full, len(hashes))):
            block = request._blocks[index]
            if block is not None and block.hash is None:
                self.pool.cache(block, hashes[index])
        request._num_cached_blocks = min(full, len(hashes))

    def _free(self, request: SeqRequest) -> None:
        # vLLM frees a request's blocks last first: its tail is evicted before its head.
        self.pool.release(reversed(request._blocks))
        request._blocks = []
        request._num_cached_blocks = 0

    def _preempt(self, request: SeqRequest) -> None:
        self._free(request)
        request.lost = max(request.lost, request.computed)
        request.computed = 0
        request.decoding = False
        request.preemptions += 1
        self.preemptions_total += 1
        self._push_waiting(request, front=True)

    def _push_waiting(self, request: SeqRequest, front: bool) -> None:
        request.status = "waiting"
        if self.config.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival, request._order,
                                        request))
        elif front:
            self._fcfs.appendleft(request)
        else:
            self._fcfs.append(request)

    def _peek_waiting(self) -> SeqRequest:
        return self._heap[0][3] if self.config.policy == "priority" else self._fcfs[0]

    def _pop_waiting(self) -> SeqRequest:
        if self.config.policy == "priority":
            return heapq.heappop(self._heap)[3]
        return self._fcfs.popleft()
