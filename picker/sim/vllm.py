"""vLLM V1's scheduler, step by step: which request computes which tokens, and who is preempted?

A pure model (no I/O, no asyncio, time passed in) of ``vllm/v1/core/sched/scheduler.py``
(``Scheduler.schedule`` and ``_preempt_request``) with ``KVCacheManager.allocate_slots``, for a
decoder-only model without prefix caching, speculative decoding, LoRA or KV connectors. The
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
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

POLICIES = ("fcfs", "priority")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's default ``--max-num-batched-tokens`` for the OpenAI server on GPUs other than
H100-class (``EngineArgs`` defaults: 8192 on >= 70 GiB non-A100 devices)."""


@dataclass(frozen=True)
class VllmConfig:
    """The engine's scheduling limits."""

    total_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    policy: str = "fcfs"

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
    blocks: int = 0
    lost: int = 0
    """The most tokens a preemption has discarded: computing them again is recompute."""
    preemptions: int = 0
    decoding: bool = False
    """Its prefill (or recompute) is done: each step now feeds back its newest token."""
    status: str = "new"
    """``new``, ``waiting``, ``running``, ``finished`` or ``aborted``."""
    _order: int = field(default=0, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated

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


class VllmScheduler:
    """vLLM V1's scheduler over a block KV cache: ``add``, ``abort``, ``step(now)``."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.running: list[SeqRequest] = []
        self._fcfs: deque[SeqRequest] = deque()
        self._heap: list[tuple[int, float, int, SeqRequest]] = []
        self._order = itertools.count()
        self.used_blocks = 0
        self.preemptions_total = 0
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
            tokens = min(request.num_tokens - request.computed, budget)
            if not self._allocate(request, tokens, alone=not self.running):
                return  # vLLM breaks here: the requests behind it wait too
            self._pop_waiting()
            request.status = "running"
            self.running.append(request)
            out.scheduled[request] = tokens
            budget -= tokens

    def _compute(self, out: StepOutput) -> None:
        """The model runs the scheduled tokens; caught-up requests sample one token."""
        for request, tokens in out.scheduled.items():
            start = request.computed
            if not request.decoding:
                out.prefill_tokens += tokens
            recomputed = max(0, min(start + tokens, request.lost) - start)
            out.recomputed_tokens += recomputed
            request.computed += tokens
            if request.computed < request.num_tokens:
                continue  # a prefill chunk: no token yet
            if request.output_tokens > 0:
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

    def _allocate(self, request: SeqRequest, tokens: int, alone: bool) -> bool:
        needed = self.blocks_for(request.computed + tokens) - request.blocks
        if needed > self.config.total_blocks - self.used_blocks and not alone:
            return False
        if needed > 0:
            request.blocks += needed
            self.used_blocks += needed
        return True

    def _free(self, request: SeqRequest) -> None:
        self.used_blocks -= request.blocks
        request.blocks = 0

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
