"""A simulated vLLM model server: what does a gateway in front of one engine see?

``python -m picker.sim.server --port P`` serves an OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, ``/v1/embeddings``, and the Anthropic-shaped
``/v1/messages``; JSON and SSE streaming), ``/v1/models``, ``/health`` and a vLLM-named
Prometheus ``/metrics``, backed by ``picker.sim.vllm.VllmScheduler``: vLLM V1's scheduler over a
block KV cache (chunked prefill within a per-step token budget, preemption by recompute, no
waiting admission in a step that preempted; its docstring states every rule). An asyncio task
steps it while work exists and sleeps while idle; each step emits one token for every request
whose computation caught up.

Step time: a step takes ``--step-ms`` plus ``--prefill-ms-per-1k-tokens`` for each 1,000 prompt
tokens it computes (prefill chunks and the recompute of preempted requests alike; default 0, a
fixed step), as a GPU iteration grows with the prompt tokens in its batch. A step is scheduled
when it starts (the work that arrived before it, at once when the engine was idle) and its
tokens, completions and metrics are released when its time has elapsed; the next step starts
then. A request that arrives during a step waits for the next one, as in vLLM. A client that
disconnects during a step is removed from the engine at once; that step's token for it is
dropped. With the default, a lone request's first token comes one ``--step-ms`` after it
arrives, as before.

Prompt tokens, output lengths and the response shapes are defined in ``picker.sim.openai_fmt``
(its docstring states the rules): prompts are token ids of ``picker.sim.tokenizer`` (English about
4 characters a token, CJK one a character, emoji by UTF-8 bytes; the same text the same ids), chat
adds 4 template tokens per message and 3 for the reply, an image part ``--image-tokens`` (576) and
``tools`` their JSON text. ``n`` samples and a list of completions prompts are one engine request
per choice, answered together (one choice per prompt and sample, usage summed).

Prefix caching (``--enable-prefix-caching``, on by default as in vLLM V1;
``--no-enable-prefix-caching``): the engine is ``picker.sim.vllm``'s model of vLLM V1's automatic
prefix caching (its docstring states every rule: chained block hashes, a hit of the leading cached
blocks computed by no step, blocks shared by reference, LRU eviction from the free queue). A
request's hit is reported as ``usage.prompt_tokens_details.cached_tokens`` (Responses:
``input_tokens_details``), and a step's time counts only the tokens it computed, so a hit costs
no prefill time.

Engine details, vLLM-like:

* ``--kv-budget-tokens`` is the KV cache: ``kv_budget_tokens // block_size`` blocks of
  ``--block-size`` (16) tokens. ``--max-num-seqs`` caps the running requests,
  ``--max-num-batched-tokens`` (default 2048, vLLM's for its OpenAI server) the tokens one step
  computes. A request whose prompt alone exceeds the cache is refused with 400; one whose
  output would outgrow it runs alone past the cache (``picker.sim.vllm`` says why).
* ``--max-model-len`` is the context a request must fit, prompt plus ``max_tokens`` (default
  32768, the simulated model's own context, as vLLM defaults to the model's).
  A request beyond it gets vLLM's 400 in vLLM's words: a prompt alone too long, or ``'max_tokens'
  or 'max_completion_tokens' is too large``; one without ``max_tokens`` has its default cut to
  what the context leaves. (vLLM also refuses to start when its KV cache cannot hold one request
  of the whole context; the simulator does not, so a tiny ``--kv-budget-tokens`` can model a
  busy engine.)
* ``--scheduling-policy priority`` honours the body field ``priority`` (int, lower first, default
  0, FCFS among equals): waiting requests are ordered by ``(priority, arrival)`` and a preemption
  takes the running request with the largest one. Under ``fcfs`` (the default) a non-zero
  ``priority`` is refused as vLLM refuses it: 400, ``Got priority N but Priority scheduling is
  not enabled.``, ``param`` null, streaming or not, on completions, chat, responses and
  embeddings. ``/v1/messages`` ignores the field in either mode: vLLM's Anthropic request has
  none.
* A client that disconnects (streaming or not, queued or running) has its request removed from the
  engine at once, freeing its KV blocks; it is counted as ``finished_reason="abort"``.
* An embeddings request is a request with no output tokens: it finishes, and frees its blocks,
  in the step that completes its prefill.
* Metrics: ``vllm:num_requests_waiting`` / ``running``, ``vllm:kv_cache_usage_perc`` (used
  blocks over total blocks; cached blocks no request holds are free), ``vllm:num_preemptions``
  (counter), prompt and generation tokens (a prompt counted once per engine request, when its
  first token comes), successes by finish reason (per engine request), TTFT (per HTTP request),
  ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens looked up and found at
  admission, preempted requests' re-admissions not counted, as vLLM's), and
  ``vllm:cache_config_info`` with ``enable_prefix_caching``.

Programmatic use: ``SimServer(SimServerConfig(...))`` with ``await start()`` / ``await stop()``
(or ``async with``), then ``server.port`` / ``server.url``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from picker.sim.openai_fmt import (
    CHAT,
    COMPLETION,
    EMBEDDINGS,
    MESSAGES,
    RESPONSES,
    ApiError,
    MessagesStreamFormatter,
    ParsedRequest,
    ResponsesStreamFormatter,
    StreamFormatter,
    anthropic_error_body,
    embeddings_response,
    error_body,
    full_response,
    generated_ids,
    new_id,
    parse_request,
)
from picker.sim.vllm import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    POLICIES,
    SeqRequest,
    StepOutput,
    VllmConfig,
    VllmScheduler,
)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
FINISH_REASONS = ("stop", "length", "abort")
_ABORTED = 0
"""Event value telling a waiting handler that its request was aborted (server stopping)."""
_PREFILLED = -1
"""Event value telling an embeddings handler that its prompt was processed (its whole work)."""


@dataclass
class SimServerConfig:
    """Settings of one simulated model server (the CLI flags)."""

    host: str = "127.0.0.1"
    port: int = 0
    kv_budget_tokens: int = 8192
    step_ms: float = 10.0
    max_num_seqs: int = 256
    model: str = "sim-model"
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    max_model_len: int = 32768
    """The context (prompt + generated tokens) a request must fit: the simulated model's."""
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    """Tokens one engine step computes at most (vLLM's flag and its OpenAI-server default)."""
    prefill_ms_per_1k_tokens: float = 0.0
    """A step's extra time per 1,000 prompt tokens it computes (recompute included); 0: fixed."""
    enable_prefix_caching: bool = True
    """vLLM V1's automatic prefix caching (on by default, as in vLLM V1)."""
    image_tokens: int = 576
    """Prompt tokens of one image part (576: LLaVA-1.5's 24 x 24 patches)."""
    catch_up_s: float = 0.0
    """A step whose end the event loop noticed late is followed by steps that start at once,
    until the engine is back on its modelled timeline, when it is at most this late (a GPU's
    steps do not slow when its host's CPU is busy; a shared benchmark machine's event loop
    wakes late); 0: each step starts when the last one's end was noticed."""
    trace: str | None = None
    """A file to write one JSON line per engine step to (``{port}`` in it: the bound port);
    None: no trace (see ``SimEngine.trace_step``)."""

    def __post_init__(self) -> None:
        if self.kv_budget_tokens < 1:
            raise ValueError("kv_budget_tokens must be >= 1")
        if not self.step_ms > 0:
            raise ValueError("step_ms must be > 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if not self.prefill_ms_per_1k_tokens >= 0:
            raise ValueError("prefill_ms_per_1k_tokens must be >= 0")
        if self.image_tokens < 0:
            raise ValueError("image_tokens must be >= 0")
        if not self.catch_up_s >= 0:
            raise ValueError("catch_up_s must be >= 0")
        if self.kv_budget_tokens < self.block_size:
            raise ValueError("kv_budget_tokens must hold at least one block of block_size tokens")

    @property
    def total_blocks(self) -> int:
        """KV-cache blocks: ``kv_budget_tokens // block_size`` (vLLM's ``num_gpu_blocks``)."""
        return self.kv_budget_tokens // self.block_size

    def step_seconds(self, prefill_tokens: int) -> float:
        """How long a step that computes ``prefill_tokens`` prompt tokens takes."""
        return (self.step_ms + prefill_tokens * self.prefill_ms_per_1k_tokens / 1000) / 1000


class EngineMetrics:
    """vLLM's metric names on a registry of this server's own."""

    def __init__(self, model: str, block_size: int, num_gpu_blocks: int,
                 prefix_caching: bool = True) -> None:
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be "
                             "processed.", labels, registry=reg).labels(model)
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model "
                             "execution batches.", labels, registry=reg).labels(model)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                              "usage.", labels, registry=reg).labels(model)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              ["model_name", "block_size", "num_gpu_blocks", "cache_dtype",
               "enable_prefix_caching"], registry=reg,
              ).labels(model, str(block_size), str(num_gpu_blocks), "auto",
                       str(prefix_caching)).set(1)
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
            "tokens.", labels, registry=reg).labels(model)
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            labels, registry=reg).labels(model)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption "
                                   "from the engine.", labels, registry=reg).labels(model)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens "
                                     "processed.", labels, registry=reg).labels(model)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation "
                                         "tokens processed.", labels, registry=reg).labels(model)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=reg)
        self.success = {reason: success.labels(model, reason) for reason in FINISH_REASONS}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first "
                              "token in seconds.", labels, buckets=TTFT_BUCKETS,
                              registry=reg).labels(model)


@dataclass(eq=False)
class Job:
    """One HTTP request's life in the engine: one engine request per choice (``n`` samples of
    each prompt); ``events`` receives ``(choice, index)`` of each generated token."""

    requests: list[SeqRequest]
    parsed: ParsedRequest
    arrival: float
    events: asyncio.Queue[tuple[int, int]] = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    done: bool = False
    unfinished: int = 0

    @property
    def request(self) -> SeqRequest:
        return self.requests[0]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache: each prompt's first sample's hit."""
        n = self.parsed.n
        return sum(r.cached_tokens or 0 for r in self.requests[::n])


class SimEngine:
    """The stepping loop around one ``VllmScheduler``, and the bookkeeping that maps it to HTTP."""

    def __init__(self, config: SimServerConfig, metrics: EngineMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.scheduler = VllmScheduler(VllmConfig(
            total_blocks=config.total_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            enable_prefix_caching=config.enable_prefix_caching))
        self.steps = 0
        """Engine steps taken so far (it does not step while idle)."""
        self.step_time_s = 0.0
        """The modelled time of the steps taken so far (``step_seconds`` of each)."""
        self.prefill_tokens = 0
        """Prompt tokens the steps computed so far, recompute included."""
        self._jobs: dict[SeqRequest, tuple[Job, int]] = {}
        """Each engine request's job and choice."""
        self._queries_seen = self._hits_seen = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.closed = False
        self.arrived = self.finished = 0
        """Engine requests added and finished so far (the step trace's counts)."""
        self.trace: TextIO | None = None
        """Where ``trace_step`` writes (``SimServerConfig.trace``); None: nowhere."""

    # -- state --

    @property
    def waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def running(self) -> int:
        return self.scheduler.num_running

    @property
    def used_blocks(self) -> int:
        return self.scheduler.used_blocks

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv_usage

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- requests --

    def submit(self, parsed: ParsedRequest, request_id: str) -> Job:
        """Queue a request; its tokens arrive on ``job.events``."""
        loop = asyncio.get_running_loop()
        requests = []
        for choice in range(parsed.choices):
            prompt = parsed.prompts[choice // parsed.n] if parsed.prompts else None
            output = parsed.output_of(choice)
            requests.append(SeqRequest(
                id=f"{request_id}-{choice}", prompt_tokens=len(prompt) if prompt is not None
                else parsed.prompt_tokens, output_tokens=output, token_ids=prompt,
                output_ids=generated_ids(parsed.kind, output) if prompt is not None else None))
        job = Job(requests=requests, parsed=parsed, arrival=loop.time(),
                  unfinished=len(requests))
        for choice, request in enumerate(requests):
            # Added in choice order, as vLLM adds a parent's samples: the first computes the
            # prompt, the others hit its blocks in the same step.
            self.scheduler.add(request, parsed.priority, job.arrival)
            self._jobs[request] = (job, choice)
        self.arrived += len(requests)
        if self.trace is not None:
            self.trace.write(f'{{"ev":"a","t":{job.arrival:.5f},"n":{len(requests)}}}\n')
        self._wake.set()
        return job

    def cancel(self, job: Job) -> None:
        """Remove a request from the engine at once (waiting or running), freeing its blocks."""
        if job.done:
            return
        job.done = True
        for request in job.requests:
            if self._jobs.pop(request, None) is not None:
                self.scheduler.abort(request)
                self.metrics.success["abort"].inc()

    # -- the loop --

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        """Stop stepping and abort every request still in the engine."""
        self.closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for job in {job for job, _ in self._jobs.values()}:
            self.cancel(job)
            job.events.put_nowait((0, _ABORTED))
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        starts = loop.time()
        while True:
            if not self.has_work():
                self._wake.clear()
                await self._wake.wait()
                starts = loop.time()
            out = self.step(starts)
            # Planned from the step's start, not from when the sleep returned: no drift.
            ends = starts + self.config.step_seconds(out.prefill_tokens)
            delay = ends - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # catching up: the handlers still get their turn
            now = loop.time()
            self.release(out, now)
            if self.trace is not None:
                self.trace_step(out, starts, now)
            # Late by more than the catch-up allows (or not catching up): the next step starts
            # now, and the time lost is lost.
            starts = max(ends, now - self.config.catch_up_s)

    def step(self, now: float) -> StepOutput:
        """Start one engine iteration: the vLLM scheduler decides and computes it at once; its
        output waits for ``release`` at the step's end."""
        self.steps += 1
        out = self.scheduler.step(now)
        self.step_time_s += self.config.step_seconds(out.prefill_tokens)
        self.prefill_tokens += out.prefill_tokens
        return out

    def trace_step(self, out: StepOutput, started: float, now: float) -> None:
        """One JSON line for a step that ran from ``started`` to ``now`` (the event loop's
        clock, monotonic, so a picker's trace on the same host lines up with it): running and
        waiting requests and KV blocks used after it, its prompt and decode tokens, the requests
        added and finished so far, the requests it preempted (``pmt``), the prompt tokens it
        computed again after a preemption (``rec``, within ``pre``), and the prompt and output
        tokens of the requests it finished (``fp``, ``fo``). An idle engine writes nothing: a
        gap between one line's ``t`` and the next one's ``t0`` is time with nothing to run."""
        assert self.trace is not None
        scheduler = self.scheduler
        computed = sum(out.scheduled.values())
        self.trace.write(
            f'{{"t0":{started:.5f},"t":{now:.5f},"run":{scheduler.num_running},'
            f'"wait":{scheduler.num_waiting},"kv":{scheduler.used_blocks},'
            f'"kvt":{self.config.total_blocks},"pre":{out.prefill_tokens},'
            f'"dec":{computed - out.prefill_tokens},"arr":{self.arrived},'
            f'"fin":{self.finished},"pmt":{len(out.preempted)},'
            f'"rec":{out.recomputed_tokens},'
            f'"fp":{sum(r.prompt_tokens for r in out.finished)},'
            f'"fo":{sum(r.generated for r in out.finished)}}}\n')

    def release(self, out: StepOutput, now: float) -> None:
        """The step has ended: hand each emitted token to its job, finish what finished."""
        metrics, scheduler = self.metrics, self.scheduler
        metrics.preemptions.inc(len(out.preempted))
        metrics.prefix_cache_queries.inc(scheduler.prefix_cache_queries - self._queries_seen)
        metrics.prefix_cache_hits.inc(scheduler.prefix_cache_hits - self._hits_seen)
        self._queries_seen = scheduler.prefix_cache_queries
        self._hits_seen = scheduler.prefix_cache_hits
        for request, index in out.tokens.items():
            entry = self._jobs.get(request)
            if entry is None:
                continue  # cancelled during the step: its client is gone, the token unsent
            job, choice = entry
            metrics.generation_tokens.inc()
            if index == 1:
                # Counted once per engine request, as vLLM counts a prompt when its first
                # token comes.
                metrics.prompt_tokens.inc(request.prompt_tokens)
            if job.first_token_at is None:
                job.first_token_at = now
                metrics.ttft.observe(now - job.arrival)
            job.events.put_nowait((choice, index))
        for request in out.finished:
            entry = self._jobs.pop(request, None)
            if entry is None:
                continue  # cancelled during the step, and counted as aborted then
            job, choice = entry
            self.finished += 1
            job.unfinished -= 1
            job.done = job.unfinished == 0
            if request.output_tokens == 0:  # an embedding: its prompt was its whole work
                metrics.prompt_tokens.inc(request.prompt_tokens)
                metrics.success["stop"].inc()
                job.events.put_nowait((choice, _PREFILLED))
            else:
                metrics.success[job.parsed.finish_reason_of(choice)].inc()


class SimServer:
    """The simulated vLLM server: ``await start()``, then ``port``/``url``; ``await stop()``."""

    def __init__(self, config: SimServerConfig | None = None) -> None:
        self.config = config or SimServerConfig()
        self.metrics = EngineMetrics(self.config.model, self.config.block_size,
                                     self.config.total_blocks,
                                     self.config.enable_prefix_caching)
        self.engine: SimEngine | None = None
        self.runner: web.AppRunner | None = None
        self.port: int = self.config.port
        self.created = int(time.time())

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> None:
        """Start the engine loop and listen; ``port`` is the bound port afterwards."""
        self.engine = SimEngine(self.config, self.metrics)
        self.engine.start()
        # handler_cancellation: a client that disconnects while its request waits is noticed
        # at once, not at the next write.
        self.runner = web.AppRunner(self.make_app(), handler_cancellation=True,
                                    shutdown_timeout=2.0, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        if self.config.trace:
            path = self.config.trace.replace("{port}", str(self.port))
            self.engine.trace = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in stop)

    async def stop(self) -> None:
        """Abort what is in flight and stop listening."""
        if self.engine is not None:
            await self.engine.stop()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- handlers --

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        model = self.config.model
        return web.json_response({"object": "list", "data": [{
            "id": model, "object": "model", "created": self.created, "owned_by": "vllm",
            "root": model, "parent": None, "max_model_len": self.config.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        engine = self.engine
        if engine is not None:
            self.metrics.waiting.set(engine.waiting)
            self.metrics.running.set(engine.running)
            self.metrics.kv_usage.set(engine.kv_usage)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETION)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, RESPONSES)

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, EMBEDDINGS)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, MESSAGES)

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            # read() takes a chunked body as well as one with a content-length.
            body = self._decode(await request.read())
            parsed = self._parse(kind, body)
        except ApiError as e:
            return web.json_response(e.body(kind), status=e.status)
        engine = self.engine
        if engine is None or engine.closed:
            return _kind_error(kind, 503, "the engine is not running")
        response_id = new_id(kind)
        job = engine.submit(parsed, response_id)
        try:
            if parsed.stream:
                return await self._stream(request, job, response_id)
            return await self._whole(job, response_id, body)
        finally:
            engine.cancel(job)  # no-op when it finished; frees it when the client went away

    @staticmethod
    def _decode(raw: bytes) -> object:
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"JSON decode error: {e}") from None

    def _parse(self, kind: str, body: object) -> ParsedRequest:
        context = self.config.max_model_len
        parsed = parse_request(kind, body, max_model_len=context,
                               image_tokens=self.config.image_tokens)
        if parsed.model is not None and parsed.model != self.config.model:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", "model")
        longest = parsed.longest_prompt  # each prompt of several is checked alone
        if longest > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. "
                           f"However, your request has {longest} input tokens. "
                           "Please reduce the length of the input messages.",
                           _PROMPT_FIELD.get(kind, "messages"))
        budget = self.config.total_blocks * self.config.block_size
        if longest > budget:
            raise ApiError(400, f"This model's maximum context length is {context} tokens, but "
                           f"your prompt of {longest} tokens can never fit the KV "
                           f"cache ({budget} tokens).", _PROMPT_FIELD.get(kind, "messages"))
        if parsed.priority and self.config.scheduling_policy != "priority":
            # vLLM's input processor, after the server's length checks, raises a plain
            # ValueError: 400 with no ``param``.
            raise ApiError(400, f"Got priority {parsed.priority} but Priority scheduling is not "
                           "enabled.")
        return parsed

    async def _whole(self, job: Job, response_id: str, body: object) -> web.Response:
        parsed = job.parsed
        kind, left = parsed.kind, parsed.choices
        while left:
            choice, index = await job.events.get()
            if index == _ABORTED:
                return _kind_error(kind, 503, "the server is shutting down")
            if index == _PREFILLED or index >= parsed.output_of(choice):
                left -= 1
        if kind == EMBEDDINGS:
            assert isinstance(body, dict)  # parse_request checked it
            return web.json_response(embeddings_response(parsed, body, response_id,
                                                         int(time.time()), self.config.model))
        return web.json_response(full_response(parsed, response_id, int(time.time()),
                                               self.config.model, job.cached_tokens))

    async def _stream(self, request: web.Request, job: Job,
                      response_id: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await response.prepare(request)
        _ensure_nodelay(request)
        kind = job.parsed.kind
        if kind in (RESPONSES, MESSAGES):
            return await self._stream_events(response, job, response_id)
        parsed = job.parsed
        fmt = StreamFormatter(parsed, response_id, self.config.model)
        left = parsed.choices
        try:
            while left:
                choice, index = await job.events.get()
                if index == _ABORTED:
                    return response  # the server is stopping: end without [DONE]
                if index == 1 and kind == CHAT:
                    await response.write(fmt.first(choice))
                await response.write(fmt.token(index, choice))
                if index >= parsed.output_of(choice):
                    left -= 1
            if parsed.include_usage:
                await response.write(fmt.usage_chunk(job.cached_tokens))
            await response.write(fmt.done())
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away; the caller removes the request from the engine
        return response

    async def _stream_events(self, response: web.StreamResponse, job: Job,
                             response_id: str) -> web.StreamResponse:
        """A Responses API or Anthropic Messages stream: named events, no ``[DONE]``."""
        fmt: ResponsesStreamFormatter | MessagesStreamFormatter
        if job.parsed.kind == RESPONSES:
            fmt = ResponsesStreamFormatter(job.parsed, response_id, self.config.model)
        else:
            fmt = MessagesStreamFormatter(job.parsed, response_id, self.config.model)
        last = job.parsed.output_tokens
        try:
            while True:
                _, index = await job.events.get()
                if index == _ABORTED:
                    return response  # the server is stopping: end without the last events
                # The opening events go with the first token, as vLLM sends them once the
                # engine has produced something.
                await response.write(fmt.first() + fmt.token(index) if index == 1
                                     else fmt.token(index))
                if index >= last:
                    break
            await response.write(fmt.last(job.cached_tokens))
            await response.write_eof()
        except ConnectionError:
            pass
        return response


_PROMPT_FIELD = {COMPLETION: "prompt", CHAT: "messages", RESPONSES: "input",
                 EMBEDDINGS: "input", MESSAGES: "messages"}


def _kind_error(kind: str, status: int, message: str) -> web.Response:
    """An error in the shape of the API asked (Anthropic's on ``/v1/messages``)."""
    body = anthropic_error_body(status, message) if kind == MESSAGES \
        else error_body(status, message)
    return web.json_response(body, status=status)


def _ensure_nodelay(request: web.Request) -> None:
    """aiohttp sets TCP_NODELAY on accepted sockets already; make sure, chunks must not wait."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            if not sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# -- command line --


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m picker.sim.server`` argument parser."""
    d = SimServerConfig()
    p = argparse.ArgumentParser(prog="python -m picker.sim.server",
                                description="A simulated vLLM OpenAI-compatible model server.")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (default 8000)")
    p.add_argument("--kv-budget-tokens", type=int, default=d.kv_budget_tokens)
    p.add_argument("--step-ms", type=float, default=d.step_ms,
                   help="time of one engine step (one token per running request) before its "
                        "prompt tokens' cost")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--model", default=d.model)
    p.add_argument("--scheduling-policy", choices=POLICIES, default=d.scheduling_policy,
                   help="fcfs (default) refuses a non-zero request priority with 400, as vLLM "
                   "does")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context length, prompt + max_tokens (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens one engine step computes at most, prefill chunks included "
                        "(default %(default)s, vLLM's for its OpenAI server)")
    p.add_argument("--prefill-ms-per-1k-tokens", type=float, default=d.prefill_ms_per_1k_tokens,
                   help="extra step time per 1,000 prompt tokens the step computes, prefill "
                        "chunks and recompute alike (default %(default)s: every step takes "
                        "--step-ms)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="vLLM V1's automatic prefix caching (on by default, as in vLLM V1; "
                        "--no-enable-prefix-caching turns it off)")
    p.add_argument("--image-tokens", type=int, default=d.image_tokens,
                   help="prompt tokens of one image part (default %(default)s, LLaVA-1.5's)")
    p.add_argument("--catch-up-ms", type=float, default=d.catch_up_s * 1000,
                   help="steps noticed late by up to this much are followed by steps started "
                        "at once until the engine is back on its modelled timeline (default "
                        "%(default)g: none; benchmarks on a busy machine)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write one JSON line per engine step to FILE ({port} in it: the bound "
                        "port): running, waiting, KV blocks, prompt and decode tokens")
    return p


def config_from_args(args: argparse.Namespace) -> SimServerConfig:
    return SimServerConfig(host=args.host, port=args.port,
                           kv_budget_tokens=args.kv_budget_tokens, step_ms=args.step_ms,
                           max_num_seqs=args.max_num_seqs, model=args.model,
                           scheduling_policy=args.scheduling_policy, block_size=args.block_size,
                           max_model_len=args.max_model_len,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
                           enable_prefix_caching=args.enable_prefix_caching,
                           image_tokens=args.image_tokens, trace=args.trace,
                           catch_up_s=args.catch_up_ms / 1000)


async def serve(config: SimServerConfig) -> None:
    """Run until SIGTERM or SIGINT; print ``listening on URL`` once ready."""
    server = SimServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on {server.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        asyncio.run(serve(config))
    except OSError as e:  # the port is taken, the host is not ours
        print(f"error: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
