"""The picker's configuration: what the operator writes and the picker reads.

Keys mirror the ``TenantPolicy`` spec (camelCase, as Kubernetes does). Process settings (ports,
paths) are flags, not config. ``python -m picker.config check FILE`` validates a file with this
same code.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal, cast

from picker.config.strict import load, load_yaml_file, require_known, require_unique
from picker.errors import BadRequest, ConfigError
from picker.openai.media import DEFAULT_COSTS, PartCosts
from picker.openai.paths import INFERENCE_PATHS, normalise_method, normalise_path

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_METHOD = re.compile(r"^[A-Z][A-Z0-9_-]*$")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


def _camel(name: str, **rules: object) -> dict:
    parts = name.split("_")
    return {"key": parts[0] + "".join(p.title() for p in parts[1:]), **rules}


@dataclass(frozen=True)
class ApiKey:
    """One API key, by its SHA-256 (``python -m picker.config hash-key``); never the key."""

    sha256: str
    """Lowercase hex SHA-256 of the key as sent after ``Bearer``."""
    tenant: str = field(metadata={"min_length": 1})
    """The tenant the key belongs to."""

    def __post_init__(self) -> None:
        if not _SHA256.match(self.sha256):
            raise ConfigError("sha256", "must be 64 lowercase hex characters (the key's SHA-256, "
                                        "from `python -m picker.config hash-key`)")


@dataclass(frozen=True)
class Tenancy:
    """How a request's tenant is found."""

    mode: Literal["header", "apiKey"] = "header"
    """``header``: a trusted header the gateway set after authenticating the caller. ``apiKey``:
    the key of ``Authorization: Bearer <key>``, ``x-api-key`` or ``api-key`` (in that precedence;
    two different keys are refused) looked up in ``apiKeys`` (401 when unknown); client-sent
    tenant headers are then ignored, and the key headers are removed before the model server. A
    reload from ``apiKey`` to ``header`` is refused: switching takes a restart."""
    header: str = "x-llm-d-inference-fairness-id"
    """Trusted header the gateway sets to the caller's tenant id (upstream's current name)."""
    also_accept: tuple[str, ...] = field(default=("x-gateway-inference-fairness-id",),
                                         metadata=_camel("also_accept"))
    """Further trusted headers, tried in order when ``header`` is absent (by default the
    deprecated upstream name)."""
    default_tenant: str = field(default="anonymous", metadata=_camel("default_tenant"))
    """Tenant of requests that carry none of the headers (header mode)."""
    api_keys: tuple[ApiKey, ...] = field(default=(), metadata=_camel("api_keys"))
    """The keys of API-key mode. With the operator, the keys of TenantPolicies
    (``apiKeySecretRef``) are added to the base config's; only the base config sets ``mode``."""
    lane_header: str = field(default="x-fairway-lane", metadata=_camel("lane_header"))
    """Application header choosing a lane among the tenant's ``allowedLanes``."""

    def __post_init__(self) -> None:
        require_unique([k.sha256 for k in self.api_keys], "apiKeys[{}].sha256", "key")
        if self.mode == "apiKey" and not self.api_keys:
            raise ConfigError("apiKeys", "apiKey mode needs at least one key")


@dataclass(frozen=True)
class Cost:
    """Weighted service: what a tenant is charged for its tokens."""

    prefill_weight: float = field(default=1.0, metadata=_camel("prefill_weight", ge=0))
    """``w_p``: per prompt token, charged at dispatch."""
    decode_weight: float = field(default=2.0, metadata=_camel("decode_weight", ge=0))
    """``w_q``: per output token, charged as it streams back."""
    context_beta: float = field(default=0.0, metadata=_camel("context_beta", ge=0))
    """``β``: extra charge per output token per token of context (0: linear cost)."""
    charge_cached_prompt: bool = field(default=True, metadata=_camel("charge_cached_prompt"))
    """False: the prompt is charged as computed: tokens the engine reports served from its
    prefix cache (``usage.prompt_tokens_details.cached_tokens``, Anthropic's
    ``cache_read_input_tokens``) cost ``cachedPromptWeight`` each instead of one. At dispatch
    the prompt is charged on the picker's own expectation (with ``routing.prefixAffinity``,
    the part of the prompt the chosen endpoint was recently sent), settled from ``usage``."""
    cached_prompt_weight: float = field(default=0.0, metadata=_camel("cached_prompt_weight",
                                                                     ge=0, le=1))
    """With ``chargeCachedPrompt: false``: what a cached prompt token costs beside a computed
    one (0: nothing)."""
    budget_tokens: Literal["sent", "computed"] = field(default="sent",
                                                       metadata=_camel("budget_tokens"))
    """What tenants' token budgets count of a prompt: ``sent`` (every prompt token, as billing
    usually counts) or ``computed`` (those the engine reported cached not counted). Budgets
    reserve on the sent prompt either way; the difference is given back at settlement."""


@dataclass(frozen=True)
class Lane:
    """A priority lane; the list order is the priority order, highest first."""

    name: str = field(metadata={"min_length": 1})
    min_share: float = field(default=0.0, metadata=_camel("min_share", ge=0, lt=1))
    """Fraction of service the lane gets at least while backlogged (0: strict priority)."""
    engine_priority: int | None = field(default=None, metadata=_camel("engine_priority"))
    """vLLM request ``priority`` for this lane's requests (lower runs first); unset: untouched.
    The engines must run ``--scheduling-policy priority`` (vLLM refuses a non-zero priority
    otherwise)."""
    objectives: tuple[str, ...] = ()
    """InferenceObjective names (the gateway's ``x-gateway-inference-objective`` header) that
    ask for this lane; honoured only within the tenant's allowed lanes, like the lane header."""


@dataclass(frozen=True)
class Scheduling:
    """Which fairness policy orders the queue."""

    policy: Literal["vtc", "lcf", "fcfs"] = "vtc"
    """``vtc``: fair queueing, requests held until an endpoint has room. ``lcf``: VTC without the
    lift (for comparison). ``fcfs``: pass-through, every request dispatched at once (what a gateway
    without fairness does)."""
    engine_policy: Literal["fcfs", "priority"] = field(default="fcfs",
                                                        metadata=_camel("engine_policy"))
    """How the pool's engines schedule their own queue (vLLM's ``--scheduling-policy``; vLLM
    refuses a request with a ``priority`` other than 0 unless it runs ``priority``). With
    ``priority`` the picker writes an engine priority into every request that reflects its
    tenant's standing: ``2 × lane rank`` (or the lane's ``enginePriority``), plus 1 when the
    tenant is a flood (backlogged in the picker, or holding at least its weighted share of the
    lane's running work; one holding less than half its share is light whatever its queue), so
    a light tenant's request runs before a flood's in the engine and the engine, not the
    picker, makes room for it (see ``preempt``)."""
    preempt: bool = field(default=None,  # type: ignore[assignment]
                          metadata=_camel("preempt", profile=True))
    """With ``enginePolicy: priority``: when no endpoint has room, a request may still go to an
    endpoint whose running requests of a worse engine priority hold at least its prompt (the
    engine preempts them for it, as vLLM's priority scheduler does), instead of waiting for a
    request to finish. The bound is what the engine can preempt: requests already sent this way
    count against it. ``false``: requests wait for room. vLLM never preempts for a waiting
    request: the request sent so is admitted once a running flood request, short of a block
    for its next token, is preempted (the newest of the worst priority), and it takes the
    victim's freed blocks, cached ones included, so the victim, queued behind it at its worse
    priority, recomputes its whole prompt and output when it runs again (where the pool's own
    order readmits it first, its blocks still cached). Measured (``bench.efficiency``, 64k of KV,
    priority engines, open loop, seed 29, 4 endpoints, through Envoy): recomputed tokens 39.9k
    against pass-through's 13.0k in the 15 s window, prompt tokens a step 89 against 82, tokens
    0.936 of pass-through. In the pool simulator on the goal matrix's priority-engine cells
    (8k and 64k, 2 and 4 endpoints, open and closed loop, seeds 27-29): the default's
    recompute 1.6 to 4.4 times pass-through's in open loop with it, 0.8 to 2.0 without; tokens
    0.969 to 1.034 of pass-through with it, 0.977 to 1.029 without (64k open loop: 0.969 to
    1.034 with, 0.996 to 1.010 without); the light tenant's p95 0.3 to 1.8 times its p95 with
    it (median 0.86: better at 8k, mixed at 64k). Unset: the profile's (``throughput``:
    ``false``, ``isolation``: ``true``; before the profile decided it, always ``true``)."""


@dataclass(frozen=True)
class Queue:
    """Limits of the fair queue."""

    max_queued: int = field(default=10000, metadata=_camel("max_queued", ge=1))
    """Requests held at once, all tenants; beyond it new requests get 429."""
    max_wait: float = field(default=60.0, metadata=_camel("max_wait", gt=0, duration=True))
    """Longest a request may wait for its turn; then 503 with Retry-After."""
    newest_first_after: float = field(default=5.0, metadata=_camel("newest_first_after", ge=0,
                                                                   duration=True))
    """Once a tenant's oldest queued request has waited this long, the tenant's turns go to its
    newest request first (adaptive LIFO; ``0s``: always oldest first). Under a sustained overload
    a tenant's oldest requests are those whose clients are about to give up: sending them first
    spends the engines on answers nobody reads, and every later request grows as old in its
    turn. The fair queue still decides which tenant goes next."""
    overload: Literal["shedLowerLanes", "refuseNew"] = "shedLowerLanes"
    """When ``maxQueued`` is reached: ``shedLowerLanes`` refuses the lowest lane first (an
    arrival in a higher lane takes the place of the newest queued request of the lowest lane that
    has one, which gets 429); ``refuseNew`` refuses every arrival alike."""


CAPACITY_PROFILES: dict[str, dict[str, float | bool | int]] = {
    "throughput": {"idle_tenant_reserve": 0.0, "growth_room": False, "max_prefill_tokens": 0,
                   "ready_reserve": False, "reserve_quantile": 0.0, "reserve_max_share": 1.0},
    "isolation": {"idle_tenant_reserve": 10.0, "growth_room": True, "max_prefill_tokens": 4096,
                  "ready_reserve": True, "reserve_quantile": 0.9, "reserve_max_share": 0.15},
}
"""What ``capacity.profile`` sets, by field: the values of the settings a key left unset
takes. ``isolation``'s are those measured together in ``bench/isolation_together.py`` (its
*ready* profile) and through Envoy in ``bench/isolation_envoy.py``."""
PREEMPT_BY_PROFILE: dict[str, bool] = {"throughput": False, "isolation": True}
"""``scheduling.preempt`` left unset, by ``capacity.profile`` (``Scheduling.preempt`` says why
the work-conserving profile leaves it off)."""


@dataclass(frozen=True)
class Capacity:
    """When an endpoint has room for another request."""

    kv_budget_tokens: int | Literal["auto"] = field(default="auto",
                                                   metadata=_camel("kv_budget_tokens"))
    """Tokens an endpoint may hold in flight. ``auto``: learned from the endpoint's
    ``vllm:cache_config_info`` (num_gpu_blocks × block_size), else ``fallbackKvBudgetTokens``."""
    fallback_kv_budget_tokens: int = field(default=8192,
                                           metadata=_camel("fallback_kv_budget_tokens", ge=1))
    """Budget used with ``auto`` until (or unless) the endpoint reports its own."""
    max_waiting: int = field(default=2, metadata=_camel("max_waiting", ge=1))
    """An endpoint whose scraped ``vllm:num_requests_waiting`` is at or above this has no room."""
    engine_queue: int = field(default=0, metadata=_camel("engine_queue", ge=0, le=64))
    """Requests the picker keeps queued in each engine beyond its room. An endpoint where a
    request's prompt does not fit beside the tokens in flight still takes it while fewer than
    this many of the picker's requests sent so wait in its engine's queue (by the picker's own
    count: sent beyond the room, no first token back yet). When a request there ends, the
    engine starts the next one at its next step instead of idling that room until the picker has
    seen the end and its next request has crossed the gateway. The fair queue still orders
    everything else: at most this many requests an endpoint leave out of its order; a light
    tenant's request waits behind them on ``fcfs`` engines and overtakes them on ``priority``
    engines (its ``priority`` is better). Not beside other replicas (a lease bounds what each
    holds). Measured through real Envoy (``bench/efficiency_default.py``: two endpoints, a flood
    at 30 requests/s and a light tenant at 3, 8k and 64k tokens of KV, one 30 s run a variant):
    decode tokens per modelled step time 0.98 to 1.04 of FCFS pass-through at ``0``, 0.97 to
    1.02 at ``1`` or ``2``, no gain above a run's noise; at 8k on ``fcfs`` engines the light
    tenant's p95 TTFT rose by a fifth to two fifths at ``2``. ``0`` (default): a request leaves
    only when its prompt fits."""
    scrape_interval: float = field(default=0.05, metadata=_camel("scrape_interval", gt=0,
                                                                 duration=True))
    """How often an endpoint's ``/metrics`` is read while its figures decide its room: the last
    read showed its engine queueing, or holding more than the picker's own accounting (other
    clients share it), or it failed; and until the first read."""
    slow_scrape_interval: float = field(default=0.5, metadata=_camel("slow_scrape_interval",
                                                                     gt=0, duration=True))
    """How often otherwise: while the picker's own accounting of what it sent decides the room,
    a fresher read would change no decision (reading a real vLLM page costs about 0.33 ms of
    CPU). Never shorter than ``scrapeInterval``, nor longer than half of ``metricsStaleAfter``
    (figures must not go stale between reads): ``slow_scrape_cadence``."""
    metrics_stale_after: float = field(default=1.0, metadata=_camel("metrics_stale_after", gt=0,
                                                                    duration=True))
    """Scraped figures older than this are ignored (the picker's own accounting is used)."""
    default_output_tokens: int = field(default=256,
                                       metadata=_camel("default_output_tokens", ge=1))
    """Output estimate for a non-streaming request before the tenant has a history."""
    engine_cache: bool | Literal["auto"] | None = field(default=None,
                                                        metadata=_camel("engine_cache"))
    """Whether the engines cache prefixes (vLLM V1's automatic prefix caching, on unless
    started with ``--no-enable-prefix-caching``). Where they do, a prompt block that requests
    running on one endpoint share counts once in its room, as the engine stores it once,
    whether or not ``routing.prefixAffinity`` routes by it (with affinity, a prompt is also
    charged at dispatch as cached as far as the endpoint was sent it); where they do not, each
    request's whole prompt counts and is charged as computed. ``auto``: per endpoint, as the
    ``enable_prefix_caching`` label of its ``vllm:cache_config_info`` says (a page without the
    label counts as caching), prompts counted whole until its first read; ``true`` /
    ``false``: for every endpoint, whatever it says. Unset (default): ``auto`` with
    ``routing.prefixAffinity``, ``false`` without it, as before this setting; ``auto`` without
    affinity is opt-in until it keeps the weights where the engine's ``max_num_seqs``, not its
    KV, binds (identical prompts from every tenant let the picker send past the engine's
    running limit and the engine's own queue decide the order: the fault tests' 1:2:3 split
    read 0.28 / 0.35 / 0.37 with it). The picker cuts each prompt's
    text into chained blocks for it (``routing.prefixAffinity.blockChars``, 256 characters
    without affinity): 25 us of CPU a request at a 2k-token prompt, 41 at 4k, hashing included
    (bench/results/prefix_scorer.md). Measured in the pool simulator (bench/results/prefix.md)
    without affinity, a tenant's 2,000-token system prompt on every request: pool tokens/s
    5,588 -> 6,646 (pass-through's), TTFT p50 1,220 -> 20 ms, p95 35 s -> 30 ms, against
    counting every prompt whole. Wrong, it costs fairness: engines without a prefix cache
    behind ``true`` are sent past what they hold and their own queues decide the order
    (weights 1:2:3 on shared system prompts served 100 / 0 / 0 % without affinity, 74 / 26 / 0
    with it; ``auto`` and ``false`` 16.7 / 33.4 / 49.9, bench/results/prefix.md, "fairness
    with prefix caching"); engines with one behind ``false`` are held below their room."""
    profile: Literal["throughput", "isolation"] = "throughput"
    """The latency-isolation settings as one switch (``CAPACITY_PROFILES``). ``throughput``
    (default): work-conserving, no request is held while an endpoint has room
    (``idleTenantReserve: 0s``, ``growthRoom: false``, ``maxPrefillTokens: 0``,
    ``readyReserve: false``, ``reserveQuantile: 0``). ``isolation``: a light tenant's first
    token under a flood as if it were nearly alone, at a cost in the pool's tokens
    (``idleTenantReserve: 10s``, ``growthRoom: true``, ``maxPrefillTokens: 4096``,
    ``readyReserve: true``, ``reserveQuantile: 0.9``, ``reserveMaxShare: 0.15``); meant with
    ``scheduling.enginePolicy: priority`` (vLLM's ``--scheduling-policy priority``), which the
    profile cannot set since the engines' flag decides it. Any of these keys written out
    wins over the profile's value, and these fields hold what is in force: ``/metrics`` says it
    (``fairway_capacity_profile{profile="isolation"} 1``, and each setting's own
    gauge, e.g. ``fairway_capacity_max_prefill_tokens``), as does each TenantPolicy's
    ``status.capacityProfile``. Measured cost: README, "What isolation costs"."""
    idle_tenant_reserve: float = field(default=None,  # type: ignore[assignment]
                                       metadata=_camel("idle_tenant_reserve", profile=True, ge=0,
                                                       duration=True))
    """Headroom for light tenants. For this long after a tenant's last request, while it is not
    backlogged (at most one request waiting in the picker), one endpoint keeps room for its
    typical request: backlogged tenants may not take that room (a light tenant's queued request
    may, out of fair order). Room is
    judged by what running requests will hold once their output has grown. The light tenant's
    next request then starts at once instead of waiting for a long request to finish, at the cost
    of a little throughput while such tenants exist. ``0s``: strictly work-conserving, no
    request is ever held while an endpoint has room. Unset: the profile's (``throughput``: ``0s``,
    ``isolation``: ``10s``)."""

    growth_room: bool = field(default=None,  # type: ignore[assignment]
                              metadata=_camel("growth_room", profile=True))
    """Room for growth, for latency isolation under a flood. A backlogged tenant's request
    (more than one waiting in the picker, or parked) leaves only for an endpoint where it fits
    at the peak of the endpoint's use as the streams there, and itself, grow to their expected
    size (prompt + expected output) and end, each freeing its room once grown: the sum of
    their expected sizes counted every running request's unwritten output as held at once,
    room the engine never used, since one started earlier ends first (at 8k, about a tenth
    of an engine; the isolation profile's tokens on 4 x 8k 0.85-0.88 of the default's with
    the sum, see README); a request of a tenant that is not backlogged, or
    to an empty endpoint, still needs only its prompt to fit beside what is held now (vLLM's own
    admission), and goes first where the least prefill is outstanding (see
    ``maxPrefillTokens``). The engine then rarely preempts for growth, and the room its
    requests have yet to grow into is free blocks where a light tenant's request starts at
    once: vLLM never preempts for a waiting request, so by default (the prompt alone) such a
    request waits, in an engine filled by the flood, until the flood's growth has used up what
    was left. Not work-conserving: it holds a flood's request whose prompt would fit now.
    Measured in the pool simulator (``bench/isolation.py``, priority engines, two or three
    traffic seeds): tokens 0.86 to 0.88 of the default on the 1,024-token hard case (below
    FCFS pass-through's 0.97), 0.97 at 8k, 1.05 at 64k, 0.98 to 1.04 at 256k and 500k
    (preemption's recompute falls from 14 to 26 % of engine work to under 3 %); a light
    tenant's p95 TTFT under the flood goes from 2.5 to 10.6 times its p95 alone to 1.0 (1k),
    1.3 to 1.5 (8k), 2.2 to 3.6 (64k), 1.3 to 2.0 (256k, 500k). ``false``: the prompt alone.
    Unset: the profile's (``throughput``: ``false``, ``isolation``: ``true``)."""
    max_prefill_tokens: int = field(default=None,  # type: ignore[assignment]
                                    metadata=_camel("max_prefill_tokens", profile=True, ge=0))
    """Prefill pacing. A backlogged tenant's request leaves for an endpoint only while the prompt
    tokens sent there and not yet answered by a first token (streams: a non-streaming request's
    first token is not seen; on the access-log response path, where no token is seen before a stream
    ends, until a read of the engine shows it out of the waiting queue), its own included, stay
    within this; an endpoint with none outstanding takes any prompt. vLLM computes running requests'
    prompt chunks before a waiting request's and a step lasts longer with every prompt token in it,
    so this bounds the prefill a light tenant's request waits out where the engines are
    prefill-bound rather than short of cache. Set it to the engines' ``--max-num-batched-tokens``
    (one step's prompt budget: the engine could not start more before its next step anyway); lower
    is not work-conserving. Measured in the pool simulator (priority engines, three seeds, 8,192):
    alone, tokens 1.00 to 1.12 of the default at every size, a light tenant's p95 ÷ alone 2.1 to 2.2
    at 500k tokens of KV (2.7 to 3.0 without) and no better below, where the cache, not the prefill,
    is what its request waits for; with ``growthRoom``, 1.2 to 1.5 at 256k and 500k (1.3 to 2.0 with
    ``growthRoom`` alone). Held requests are judged again when a first token comes back or such a
    read ends a prefill (the server and the simulator alike). ``0``: no bound. Unset: the
    profile's (``throughput``: ``0``, ``isolation``: ``4096``)."""
    ready_reserve: bool = field(default=None,  # type: ignore[assignment]
                                metadata=_camel("ready_reserve", profile=True))
    """With ``idleTenantReserve``: keep room for a light tenant's next request where it starts
    at the engine's next step, on an endpoint computing no prompt. A step runs its prompt
    chunks to the end and vLLM finishes a running request's prompt before starting a waiting
    one's, so room on an endpoint busy with a flood's prefill is room a light request waits
    that prefill for (a step of 8,192 prompt tokens lasts longer than a light request alone
    waits for its first token). A backlogged tenant's request then leaves only while another
    endpoint in service, with no prefill outstanding, has that room free now (the request is
    admitted on the blocks free at the engine's next step; the room its output grows into is
    kept at the peak of use, on any endpoint): flood prefills take turns across the pool.
    Judged at the peak on that endpoint too, the flood was kept off it while its streams had
    room left to grow into (2 x 8k at 1 request/s: 0.779 of the default's tokens; judged
    now, 0.866, see README). Not work-conserving: prefill-bound engines lose throughput while
    one endpoint at a time stays out of prefill, less as the pool widens. Measured in the pool
    simulator (``bench/isolation_together.py``, priority engines, with ``idleTenantReserve:
    10s``, ``growthRoom`` and ``maxPrefillTokens: 4096``, three seeds a size, 8k to 500k
    tokens of KV, before the peak rules):
    a light tenant's p95 TTFT under a flood 1.00 to 1.26 times its p95 alone on two endpoints
    (1.00 to 1.87 without it), at 0.73 to 0.91 of the default's tokens (0.91 to 1.05 without);
    1.00 to 1.09 on four endpoints at 0.87 to 1.00; 1.00 on eight at 0.95 to 1.04 (8k and
    64k); through Envoy at 64k, 1.14. ``false``: the reserve counts on any endpoint with the
    room. Unset: the profile's (``throughput``: ``false``, ``isolation``: ``true``)."""

    reserve_quantile: float = field(default=None,  # type: ignore[assignment]
                                    metadata=_camel("reserve_quantile", profile=True, ge=0,
                                                    lt=1))
    """With ``idleTenantReserve``: how much room a light tenant's reserve keeps, and who is
    light. ``0``: room for one typical request of each tenant that has at most one request
    waiting in the picker (a tenant with two waiting is judged a flood). Above 0: the reserve
    follows the tenant's rate (Little's law): its requests expected in flight are its arrival
    rate (over ``idleTenantReserve``) times the time one of its requests holds its room
    (dispatch to end, as measured); with Poisson arrivals the number in flight is Poisson of
    that mean, and the reserve keeps room for this quantile of it, less what the tenant holds
    already, and at least one large request. A tenant is light while that expected demand
    (requests in flight × its mean size) is below its fair share of the pool (by weight, among
    the tenants seen within ``idleTenantReserve``); it may then have as many requests waiting as
    its reserve is for, and its oldest may go ahead of a fair-queue head that waits for room (as
    a single waiting request may): the room kept for it is of use only if it may take it. A
    tenant at or above its fair share gets no reserve and is judged backlogged, like a flood.
    A tenant flooding the pool alone (no other seen within ``idleTenantReserve``) still leaves
    room for one request as large as its own, for a tenant not yet seen to start at once.
    Needs ``idleTenantReserve`` (under a profile, ``idleTenantReserve: 0s`` turns it off).
    Unset: the profile's (``throughput``: ``0``, ``isolation``: ``0.9``)."""
    reserve_max_share: float = field(default=None,  # type: ignore[assignment]
                                     metadata=_camel("reserve_max_share", profile=True, gt=0,
                                                     le=1))
    """With ``reserveQuantile``: the reserves of all light tenants together keep at most this
    fraction of the pool's tokens free (the sum of the endpoints' budgets). Room kept free is
    room the flood does not use: past some share, the reserve costs more of the pool's tokens
    than isolation is worth (README, "What isolation costs"). Unset: the profile's
    (``throughput``: ``1``, unused there; ``isolation``: ``0.15``)."""

    def __post_init__(self) -> None:
        # A key left unset takes the profile's value; one written out wins. The fields then
        # hold what is in force, so every reader (the gate's rules, /metrics, the status) sees
        # one answer.
        unset = [name for name in CAPACITY_PROFILES[self.profile] if getattr(self, name) is None]
        for name in unset:
            object.__setattr__(self, name, CAPACITY_PROFILES[self.profile][name])
        if "ready_reserve" in unset and not self.idle_tenant_reserve:
            # idleTenantReserve: 0s written out under a profile leaves its ready reserve nothing
            # to place: off, rather than an error the profile's user did not write.
            object.__setattr__(self, "ready_reserve", False)
        if "reserve_quantile" in unset and not self.idle_tenant_reserve:
            object.__setattr__(self, "reserve_quantile", 0.0)  # likewise: no reserve to size
        if isinstance(self.kv_budget_tokens, int) and self.kv_budget_tokens < 1:
            raise ConfigError("kvBudgetTokens", "must be >= 1 or auto")
        if self.ready_reserve and not self.idle_tenant_reserve:
            raise ConfigError("readyReserve", "needs idleTenantReserve (a reserve to place)")
        if self.reserve_quantile and not self.idle_tenant_reserve:
            raise ConfigError("reserveQuantile", "needs idleTenantReserve (a reserve to size)")

    @property
    def slow_scrape_cadence(self) -> float:
        """Seconds between reads of an endpoint whose figures do not decide its room."""
        return max(self.scrape_interval, min(self.slow_scrape_interval,
                                             self.metrics_stale_after / 2))


@dataclass(frozen=True)
class Health:
    """Outlier ejection of endpoints that fail, as Envoy's outlier detection does it. Failed
    scrapes (refused, timed out, HTTP error) and requests that never reached an engine (the
    gateway's upstream connect failure or reset) count; any success resets the count. An ejected
    endpoint gets no requests; when its time is up one scrape or one request probes it: success
    restores it, failure ejects it again for longer. The last endpoint in service is never
    ejected (when every endpoint looks bad the signal is more likely wrong than the whole pool
    gone; a request to a dead last endpoint fails with a retryable 503 and costs nothing)."""

    consecutive_failures: int = field(default=3, metadata=_camel("consecutive_failures", ge=1,
                                                                 le=100))
    """Failures in a row that eject an endpoint."""
    base_ejection_time: float = field(default=1.0, metadata=_camel("base_ejection_time", gt=0,
                                                                   duration=True))
    """The first ejection's length; the n-th lasts n times this (``maxEjectionTime`` at most)."""
    max_ejection_time: float = field(default=30.0, metadata=_camel("max_ejection_time", gt=0,
                                                                   duration=True))
    """The longest ejection; also how long an endpoint must stay healthy to take one off its
    ejection count."""

    def __post_init__(self) -> None:
        if self.max_ejection_time < self.base_ejection_time:
            raise ConfigError("maxEjectionTime", "must be >= baseEjectionTime")


@dataclass(frozen=True)
class Endpoint:
    """A model server of the pool (static; InferencePool discovery comes later)."""

    address: str
    """``ip:port``."""
    kv_budget_tokens: int | None = field(default=None, metadata=_camel("kv_budget_tokens", ge=1))
    """Overrides ``capacity.kvBudgetTokens`` for this endpoint."""

    def __post_init__(self) -> None:
        match = _ADDRESS.match(self.address)
        if not match or not 1 <= int(match.group(2)) <= 65535:
            raise ConfigError("address", f"must be host:port or [ipv6]:port with a port in "
                                         f"1..65535, got {self.address!r}")


@dataclass(frozen=True)
class Model:
    """What the picker must know of a served model to estimate and bound its requests.

    ``name`` is matched against the body's ``model``; ``"*"`` is the entry for any model not
    named. Without an entry a model gets the defaults below."""

    name: str = field(metadata={"min_length": 1})
    max_model_len: int | None = field(default=None, metadata=_camel("max_model_len", ge=1))
    """The engine's context length (vLLM ``--max-model-len``): a request that sets no
    ``max_tokens`` may produce up to this less its prompt, so that is what it is reserved at.
    Unset: such a request is reserved at what its budget can pay (and its output capped there)."""
    image_tokens: int | None = field(default=None, metadata=_camel("image_tokens", ge=1))
    """Prompt tokens of every image, for a processor that resizes each to one grid (LLaVA-1.5:
    576, Gemma 3: 256). Unset: by the image's size (``imagePatchPixels``, ``imageMaxTokens``)."""
    image_patch_pixels: int = field(default=28, metadata=_camel("image_patch_pixels", ge=1))
    """Side in pixels of the square one image token covers: an image of ``w×h`` pixels costs
    ``ceil(w/p)·ceil(h/p)`` tokens (Qwen2-VL and Qwen2.5-VL: 28, Pixtral: 16). The size is read
    from a base64 image's header (PNG, JPEG, GIF, WebP)."""
    image_max_tokens: int = field(default=16384, metadata=_camel("image_max_tokens", ge=1))
    """Tokens of the largest image (Qwen2-VL: its ``max_pixels`` ÷ 28², 16,384 by default), and
    of an image whose size the picker cannot read (a remote URL): an under-estimate would let a
    tenant outrun its budget, and the engine's usage settles the charge."""
    audio_tokens_per_second: float = field(
        default=25.0, metadata=_camel("audio_tokens_per_second", gt=0, le=10000))
    """Prompt tokens a second of ``input_audio`` (Qwen2-Audio: 25); audio by URL counts as 30
    seconds."""
    file_tokens: int = field(default=4096, metadata=_camel("file_tokens", ge=1))
    """Tokens of a file part given by reference (``file_id``, a URL); a file in the body counts
    as text, a token per four bytes."""

    @functools.cached_property
    def part_costs(self) -> PartCosts:
        """What the prompt estimate charges this model's non-text parts."""
        return PartCosts(image_tokens=self.image_tokens,
                         image_patch_pixels=self.image_patch_pixels,
                         image_max_tokens=self.image_max_tokens,
                         audio_tokens_per_second=self.audio_tokens_per_second,
                         file_tokens=self.file_tokens)


@dataclass(frozen=True)
class Budget:
    """A token bucket: holds up to ``tokens``, refilled evenly over ``per``."""

    tokens: int = field(metadata={"ge": 1})
    """Capacity: prompt + output tokens."""
    per: float = field(metadata={"gt": 0, "duration": True})
    """Time to refill from empty (``60s``, ``1h``, ``24h``)."""


@dataclass(frozen=True)
class Budgets:
    """Token budgets, charged with the estimate at admission and settled to actual use."""

    burst: Budget | None = None
    """Short window (seconds to minutes): smooths bursts."""
    sustained: Budget | None = None
    """Long window (hours to a day): the tenant's quota."""
    reserve: Literal["worstCase", "expected"] = "worstCase"
    """What a request reserves until it is settled. ``worstCase``: what it may cost, prompt +
    output cap × choices (``max_tokens``, else ``models[].maxModelLen`` less the prompt, times
    ``max(n, best_of)``), the cap lowered (and sent to the engine) so that no request costs
    more than the smallest budget holds; a request waits (429 with ``Retry-After``, or is
    demoted) until its worst case fits, and a tenant never gets more than its budget, however
    many requests it sends at once. The cost: a reservation held longer than needed, so a client
    that sets no ``max_tokens`` runs fewer requests at once (docs/budgets.md, measured).
    ``expected``: prompt + expected output × choices, while the tenant's outstanding worst case
    (over its requests in flight, worst case less reserved) stays within its level: one
    request more at once, and an overshoot of at most one request's worst case, owed. Either
    way a debt is owed in full (no floor): a tenant in debt waits (debt + its next request's
    need) / refill rate, the debt being at most one request's worst case plus what the prompt
    estimate fell short by (in demote mode, what the demote lane served over the budget)."""


@dataclass(frozen=True)
class OverBudget:
    """What happens to a request its tenant's budget cannot cover."""

    action: Literal["reject", "demote"] = "reject"
    """``reject``: 429 with ``Retry-After`` from the bucket. ``demote``: admitted into ``lane``."""
    lane: str | None = None
    """The lane demoted requests go to (required for ``demote``): below the tenant's own lane
    (later in ``lanes``). In ``tenantDefaults``: below the first lane, and not above the lane
    of a tenant without an ``overBudget`` of its own."""

    def __post_init__(self) -> None:
        if self.action == "demote" and not self.lane:
            raise ConfigError("lane", "demote needs the lane to demote to")


@dataclass(frozen=True)
class TenantLimits:
    """Hard caps; unset means no cap."""

    max_queued: int | None = field(default=None, metadata=_camel("max_queued", ge=1))
    """Requests of the tenant held in the queue at once; beyond it 429."""
    max_concurrent: int | None = field(default=None, metadata=_camel("max_concurrent", ge=1))
    """Requests of the tenant running at once; more wait in the queue."""
    max_input_tokens: int | None = field(default=None, metadata=_camel("max_input_tokens", ge=1))
    """Longest prompt (estimated from the body); longer gets 400."""
    max_output_tokens: int | None = field(default=None,
                                          metadata=_camel("max_output_tokens", ge=1))
    """Largest ``max_tokens``; larger is refused or clamped (``outputLimit``)."""
    output_limit: Literal["reject", "clamp"] = field(default="reject",
                                                     metadata=_camel("output_limit"))
    """``clamp``: ``max_tokens`` is lowered to ``maxOutputTokens`` (and set when absent)."""


@dataclass(frozen=True)
class TenantPolicy:
    """Budgets, caps and the over-budget rule; per tenant, or as ``tenantDefaults``."""

    budgets: Budgets = Budgets()
    over_budget: OverBudget = field(default=OverBudget(), metadata=_camel("over_budget"))
    limits: TenantLimits = TenantLimits()


@dataclass(frozen=True)
class Tenant:
    """A tenant's share, lanes, budgets and caps."""

    id: str = field(metadata={"min_length": 1})
    weight: float = field(default=1.0, metadata={"ge": 0.001, "le": 1000})
    """Share relative to other tenants in the same lane (0.001 to 1000: a share a million times
    another's at most, and every counter stays finite)."""
    lane: str | None = None
    """Lane of the tenant's requests (default: the first lane)."""
    allowed_lanes: tuple[str, ...] = field(default=(), metadata=_camel("allowed_lanes"))
    """Further lanes the ``laneHeader`` may choose for a request."""
    budgets: Budgets | None = None
    """Unset: ``tenantDefaults.budgets``."""
    over_budget: OverBudget | None = field(default=None, metadata=_camel("over_budget"))
    """Unset: ``tenantDefaults.overBudget``."""
    limits: TenantLimits | None = None
    """Unset: ``tenantDefaults.limits``."""

    def policy(self, defaults: TenantPolicy) -> TenantPolicy:
        """This tenant's rules, each part falling back to ``defaults``."""
        return TenantPolicy(self.budgets or defaults.budgets,
                            self.over_budget or defaults.over_budget,
                            self.limits or defaults.limits)


@dataclass(frozen=True)
class Limits:
    """Request limits."""

    max_body_bytes: int = field(default=4 * 1024 * 1024, metadata=_camel("max_body_bytes", ge=1))
    """Larger request bodies get 413."""
    max_buffered_bytes: int = field(default=64 * 1024 * 1024,
                                    metadata=_camel("max_buffered_bytes", ge=1))
    """Request bodies held at once, all streams together (a body is held until its request is
    routed); a request that would go past it gets 503 with ``Retry-After``."""
    body_idle_timeout: float = field(default=30.0, metadata=_camel("body_idle_timeout", gt=0,
                                                                   duration=True))
    """A request whose body stops arriving for this long gets 408 and gives its buffer back."""


@dataclass(frozen=True)
class PassThrough:
    """A path routed to an endpoint without admission, queueing or charge (not an inference
    path)."""

    method: str
    """HTTP method in upper case (``GET``), or ``*`` for any."""
    path: str
    """Starts with ``/``; matched after the picker normalises the request's path
    (percent-decoding, case, ``.``/``..``, repeated and trailing slashes), so it is stored
    normalised."""

    def __post_init__(self) -> None:
        if self.method != "*" and not _METHOD.match(self.method):
            raise ConfigError("method", f"must be an upper-case HTTP method such as GET, or *; "
                                        f"got {self.method!r}")
        if not self.path.startswith("/"):
            raise ConfigError("path", f"must start with /, got {self.path!r}")
        if "?" in self.path or "#" in self.path:
            raise ConfigError("path", "must not hold a query or fragment (they are not matched)")
        try:
            path = normalise_path(self.path)
        except BadRequest as exc:
            raise ConfigError("path", exc.message) from None
        if path in INFERENCE_PATHS:
            raise ConfigError("path", f"{path} is an inference path: inference paths are always "
                                      "admitted and charged, never passed through")
        object.__setattr__(self, "method", normalise_method(self.method))
        object.__setattr__(self, "path", path)

    @property
    def name(self) -> str:
        """The entry as written in messages and the reference: ``GET /v1/models``."""
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class PrefixAffinity:
    """Prefix affinity: among the endpoints where a request fits, prefer the one that was recently
    sent more of its prompt (its engine's prefix cache likely holds it). The prompt's text (messages
    with their roles, system, tools, documents) is cut into blocks whose hashes chain as vLLM's do;
    each picker replica remembers, per endpoint, the blocks it sent there (least recently sent
    forgotten first). The fair queue still decides which request goes next, and capacity where it
    may go; affinity only orders the endpoints that have room (a prompt block shared by requests
    running on one endpoint counts once in its room with or without affinity:
    ``capacity.engineCache``). Each replica learns from its own
    dispatches only: with several replicas a conversation's turns keep their endpoint as long as the
    gateway sends them to the same replica, and otherwise fall back to load (a cache miss, never a
    request where it does not fit; simulated with requests spread at random over 2 replicas, chat
    sessions' hit rate 0.50 -> 0.68 instead of 0.53 -> 0.83 with one). ``engineCache``, here
    before, moved to ``capacity.engineCache``: the engines' cache decides the room whether or
    not affinity is on. A remembered block ages by the new KV sent to its endpoint since it was
    sent there (or since the request that held it ended): it counts only within the endpoint's
    budget, weighted by the chance the engine still caches it (whole within the room free now,
    none past the budget), so that of two endpoints sent a prefix the one likelier to still hold
    it wins. About 55 us of CPU per request at a 16,000-character prompt (38 of them the
    hashing and the shared-block room, which ``capacity.engineCache`` costs without affinity
    too) and 116 bytes per remembered block at most, under 1 MB an endpoint at the default bound
    (bench/results/prefix_scorer.md)."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "engineCache": "it is capacity.engineCache now (the engines' prefix cache counts in the "
                       "room with or without affinity)"}

    weight: float = field(default=1.0, metadata={"ge": 0})
    """What a whole prompt found on an endpoint adds to its score beside load (the least-loaded
    score is the endpoint's free fraction of its KV budget, less its engine's waiting
    requests): at 1 a full match outweighs an endpoint up to a whole budget emptier; 0: load
    alone decides."""
    block_chars: int = field(default=256, metadata=_camel("block_chars", ge=16, le=65536))
    """Bytes of prompt text per block (characters, for ASCII text): about 64 tokens, four of
    vLLM's 16-token blocks. Smaller blocks match shorter shared prefixes and cost more CPU. The
    blocks ``capacity.engineCache`` counts in the room are these (256 without affinity)."""
    max_blocks_per_endpoint: int = field(default=8192, metadata=_camel(
        "max_blocks_per_endpoint", ge=1, le=10_000_000))
    """Blocks remembered per endpoint (8,192 of 256 bytes: about 500k tokens of prompt)."""
    patience: float = field(default=0.0, metadata={"ge": 0, "le": 10, "duration": True})
    """The longest the fair queue's next request (or a light tenant's request that may go
    past a head waiting for room) may wait for the endpoint likely to hold its prompt's prefix
    when only other endpoints have room, while the requests after it in fair order take that
    room: the prefill the hit is expected to save there
    (``prefillMsPer1kTokens`` times the prompt tokens expected cached, each block's chance of
    still being cached counted by the tokens of new KV sent to the endpoint since, against
    its budget), at most this. It is never sent where it does not fit: it waits for room
    there, then goes first to it. A backlogged tenant whose prefix is on every endpoint
    saves nothing by waiting and never does. Needs ``vtc`` or ``lcf`` to let the next go;
    under another policy the room waits too. ``0s`` (default): never wait."""
    prefill_ms_per_1k_tokens: float = field(default=100.0, metadata={
        "key": "prefillMsPer1kTokens", "gt": 0, "le": 100_000})
    """The engines' prefill time per 1,000 prompt tokens, in milliseconds: what a prefix hit
    saves, for ``patience`` (a step of vLLM prefilling them beside its batch; about 50 to 100
    on one GPU for an 8B model)."""


_HEADER_NAME = re.compile(r"^[a-z0-9!#$%&'*+.^_`|~-]+$")


@dataclass(frozen=True)
class Sessions:
    """Programs and sessions: an optional key a request carries in ``header``, set by the
    gateway or the application, naming the session or agent program it belongs to. It never
    picks the tenant: every key is scoped by the tenant the identity resolved, so a key sent by
    one tenant neither steers nor rides another tenant's session. A session's calls go to the
    endpoint its previous call went to (its context is in that engine's prefix cache) when that
    endpoint has room, before prefix affinity and load are looked at; otherwise the normal
    choice (never an endpoint where the request does not fit). A call of a session that already
    had a call dispatched (a program in progress) goes before its tenant's new programs, the
    oldest program first: the fair queue still picks which tenant goes next, by its counters,
    so a tenant's share of tokens does not grow with its calls; only the order inside its own
    queue changes (once a tenant's oldest request has waited ``queue.newestFirstAfter``, its
    newest goes first whatever its program). The header is passed to the model server
    unchanged. Each picker replica keeps its own table. Measured in the pool simulator on agent
    programs of 1, 10 and 30 calls per task, every tenant backlogged
    (bench/results/prefix.md, "programs and sessions"): computed-token shares 34.0 / 34.3 /
    31.6 % with sessions on as off; the 10-call tenant's tasks done 81 -> 97 of 179, the
    30-call tenant's 1 -> 7 of 57; the pool's tokens/s 1,889 -> 1,820 and the 1-call tenant's
    TTFT p95 11 -> 30 s (its oldest-program-first calls carry a tenant's largest prompts to
    the head of its queue, where they wait for room)."""

    header: str = "x-session-id"
    """The request header holding the key (lower case). A value longer than 256 characters or
    holding a control character is ignored (the request has no session)."""
    max_sessions: int = field(default=65_536, metadata=_camel("max_sessions", ge=1,
                                                              le=10_000_000))
    """Sessions remembered per picker; past it the least recently used is forgotten (its next
    call is routed and ordered as a new one). About 170 bytes a session plus its key (under
    20 MB at the default with 40-character keys)."""
    idle_timeout: float = field(default=600.0, metadata=_camel("idle_timeout", gt=0,
                                                               duration=True))
    """A session is forgotten this long after its last call."""
    sticky: bool = True
    """A session's calls go to the endpoint of its previous call while it has room."""
    resume_first: bool = field(default=True, metadata=_camel("resume_first"))
    """A tenant's calls of programs in progress go before its new programs (within the tenant's
    fair share)."""

    def __post_init__(self) -> None:
        if not _HEADER_NAME.match(self.header):
            raise ConfigError("header", f"must be a lower-case HTTP header name, got "
                                        f"{self.header!r}")


@dataclass(frozen=True)
class Routing:
    """How requests are routed. The inference paths (``/v1/completions``,
    ``/v1/chat/completions``, ``/v1/responses``, ``/v1/embeddings``, ``/v1/messages``) are always
    admitted and charged; a path listed here is routed uncharged; any other path is refused with
    404 (405 for a listed path asked with a method its entries do not list)."""

    pass_through: tuple[PassThrough, ...] = field(
        default=(PassThrough("GET", "/v1/models"), PassThrough("GET", "/health")),
        metadata=_camel("pass_through"))
    """Method and path pairs routed without admission or charge."""
    prefix_affinity: PrefixAffinity | None = field(default=None,
                                                   metadata=_camel("prefix_affinity"))
    """Route a request towards the endpoint likely to hold its prompt's prefix (unset: off: load
    alone decides where; a prompt block shared by requests running on one endpoint still counts
    once in its room, as ``capacity.engineCache`` says)."""
    sessions: Sessions | None = None
    """Programs and sessions: the key a request carries in ``header`` (set by the gateway or
    the application) keeps a session's calls on the endpoint of its previous call while that
    endpoint has room (before prefix affinity and load), and sends a tenant's calls of programs
    in progress, oldest program first, before its new programs; which tenant goes next is still
    the fair queue's choice, so more calls buy no more share. Keys are scoped by the tenant the
    identity resolved and never choose it; the header reaches the model server unchanged; each
    replica keeps its own bounded table. Measured in bench/results/prefix.md ("programs and
    sessions"), costs included. Unset: session keys are ignored."""
    fallback_endpoints: int = field(default=0, metadata=_camel("fallback_endpoints", ge=0,
                                                               le=8))
    """Endpoints named after the primary, for the gateway to retry on (header and ``envoy.lb``
    metadata carry the same list, as the protocol requires). Behind a gateway that routes with
    ``override_host`` and retries (the stack of ``picker.stack``, the plain-Envoy samples
    ``manifests/gateway/envoy.yaml`` and ``envoy-jwt.yaml``, Istio, Envoy AI Gateway with a
    FailOpen pool) set 2, one per retry of their policies: each retry of a request that never
    reached an engine then takes the picker's next choice; past the list, override_host's
    fallback policy picks among the hosts not yet tried (at 0 every retry goes that way). Leave
    0 (the default) behind ``ORIGINAL_DST`` (Envoy AI Gateway FailClose, kgateway 2.0) and
    kgateway's subset routing: they take one address only and refuse a list (503); a retry
    there reaches the same host, and the picker's ejection (``health``) moves traffic off a
    dead one. docs/gateways.md, "Retries"."""

    def __post_init__(self) -> None:
        require_unique([entry.name for entry in self.pass_through], "passThrough[{}]", "entry")

    @functools.cached_property
    def pass_through_set(self) -> frozenset[tuple[str, str]]:
        """``(METHOD, normalised path)`` pairs, as ``picker.openai.paths.classify`` takes them."""
        return frozenset((entry.method, entry.path) for entry in self.pass_through)


@dataclass(frozen=True)
class Metering:
    """Where the per-request usage records go."""

    output: str = "none"
    """``stdout``, ``none``, or a file path (appended to): one JSON object per finished
    request."""


@dataclass(frozen=True)
class RedisStore:
    """The Redis that ``state.backend: redis`` shares state through."""

    url: str = "redis://127.0.0.1:6379/0"
    """``redis://host:port/db``, or ``rediss://`` for TLS. A password does not belong here:
    use ``passwordFile``."""
    password_file: str | None = field(default=None, metadata=_camel("password_file"))
    """A file holding the password (a Secret mounted into the pod), read at start."""
    ca_file: str | None = field(default=None, metadata=_camel("ca_file"))
    """CA certificates to verify a ``rediss://`` server with (default: the system's)."""
    key_prefix: str = field(default="fairway", metadata=_camel("key_prefix", min_length=1))
    """Start of every key: one per pool, so pools sharing a Redis stay apart (the chart sets
    it to the release namespace and the picker's name)."""

    def __post_init__(self) -> None:
        scheme = self.url.split("://", 1)[0] if "://" in self.url else ""
        if scheme not in ("redis", "rediss"):
            raise ConfigError("url", "must start with redis:// or rediss://")
        if "@" in self.url.split("://", 1)[1].split("/", 1)[0]:
            raise ConfigError("url", "must not carry credentials: put the password in a file "
                                     "named by passwordFile")
        if self.ca_file is not None and scheme != "rediss":
            # Silently unused otherwise: the operator believes the link is verified TLS.
            raise ConfigError("caFile", "is used only with TLS: the url must start with "
                                        "rediss://")


@dataclass(frozen=True)
class State:
    """Where tenants' fair-queue counters and budget levels live: in this process
    (``memory``), or shared through Redis by every picker replica and kept across restarts
    (``redis``)."""

    backend: Literal["memory", "redis"] = "memory"
    """``memory``: one picker's own (lost on restart). ``redis``: see ``redis``."""
    redis: RedisStore = RedisStore()
    sync_interval: float = field(default=0.1, metadata=_camel("sync_interval", gt=0,
                                                             duration=True))
    """How often a picker sends Redis its charges and reads everyone's: others' charges reach
    it this late, and a budget can be overrun by what the replicas admit in one interval."""
    max_staleness: float = field(default=2.0, metadata=_camel("max_staleness", gt=0,
                                                             duration=True))
    """A picker whose last exchange with Redis is older than this counts Redis as
    unavailable and acts as ``onUnavailable`` says."""
    on_unavailable: Literal["failSoft", "failClosed"] = field(
        default="failSoft", metadata=_camel("on_unavailable"))
    """``failSoft``: go on deciding on this picker's own view (others' charges unseen until
    Redis returns; nothing is charged twice when it does). ``failClosed``: refuse new requests
    with 503 ``state_unavailable`` until Redis answers again."""

    def __post_init__(self) -> None:
        if self.max_staleness < self.sync_interval:
            raise ConfigError("maxStaleness", "must be at least syncInterval")


@dataclass(frozen=True)
class PickerConfig:
    """The whole picker configuration."""

    endpoints: tuple[Endpoint, ...] = ()
    tenancy: Tenancy = Tenancy()
    scheduling: Scheduling = Scheduling()
    cost: Cost = Cost()
    lanes: tuple[Lane, ...] = (Lane("default"),)
    queue: Queue = Queue()
    capacity: Capacity = Capacity()
    limits: Limits = Limits()
    routing: Routing = Routing()
    health: Health = Health()
    tenants: tuple[Tenant, ...] = ()
    tenant_defaults: TenantPolicy = field(default=TenantPolicy(),
                                          metadata=_camel("tenant_defaults"))
    """Budgets, caps and over-budget rule of tenants without their own (and of unknown ones)."""
    metering: Metering = Metering()
    state: State = State()
    models: tuple[Model, ...] = ()
    """Per served model: its context length and how its prompts are estimated."""

    def __post_init__(self) -> None:
        require_unique([m.name for m in self.models], "models[{}].name", "model")
        if not self.lanes:
            raise ConfigError("lanes", "needs at least one lane")
        lane_names = [lane.name for lane in self.lanes]
        require_unique(lane_names, "lanes[{}].name", "lane")
        owner: dict[str, str] = {}
        for i, lane in enumerate(self.lanes):
            for j, objective in enumerate(lane.objectives):
                if objective in owner:
                    raise ConfigError(f"lanes[{i}].objectives[{j}]",
                                      f"objective {objective!r} already asks for lane "
                                      f"{owner[objective]!r}")
                owner[objective] = lane.name
        if cast("bool | None", self.scheduling.preempt) is None:
            # Unset: the capacity profile's (the field then holds what is in force).
            object.__setattr__(self, "scheduling", dataclasses.replace(
                self.scheduling, preempt=PREEMPT_BY_PROFILE[self.capacity.profile]))
        if self.scheduling.engine_policy == "priority":
            self._check_engine_priorities()
        require_unique([e.address for e in self.endpoints], "endpoints[{}].address", "endpoint")
        require_unique([t.id for t in self.tenants], "tenants[{}].id", "tenant")
        for i, tenant in enumerate(self.tenants):
            require_known(tenant.lane, lane_names, f"tenants[{i}].lane", "lane")
            for j, allowed in enumerate(tenant.allowed_lanes):
                require_known(allowed, lane_names, f"tenants[{i}].allowedLanes[{j}]", "lane")
            if tenant.over_budget is not None:
                require_known(tenant.over_budget.lane, lane_names,
                              f"tenants[{i}].overBudget.lane", "lane")
        require_known(self.tenant_defaults.over_budget.lane, lane_names,
                      "tenantDefaults.overBudget.lane", "lane")
        self._check_demotions(lane_names)

    def _check_demotions(self, lane_names: list[str]) -> None:
        """Demotion moves a request past its budget to a lower lane (later in ``lanes``): into a
        higher lane it would reward going over budget, into the tenant's own lane it would
        change nothing (a rule that does so is a mistake)."""
        first = lane_names[0]
        defaults = self.tenant_defaults.over_budget
        if _demotion_step(defaults, first, lane_names) == 0:  # nothing is above the first lane
            raise ConfigError("tenantDefaults.overBudget.lane", _not_lower(
                defaults, "the first lane (that of tenants naming none)", first, lane_names))
        for i, tenant in enumerate(self.tenants):
            lane = tenant.lane or first
            if tenant.over_budget is not None:
                step = _demotion_step(tenant.over_budget, lane, lane_names)
                if step is not None and step <= 0:
                    whose = "the tenant's lane" if tenant.lane else \
                        "the tenant's lane (the first lane, as it names none)"
                    raise ConfigError(f"tenants[{i}].overBudget.lane",
                                      _not_lower(tenant.over_budget, whose, lane, lane_names))
            elif (_demotion_step(defaults, lane, lane_names) or 0) < 0:
                # Into its own lane an inherited rule is harmless (the defaults serve tenants of
                # every lane); above it, it would lift the tenant when over budget.
                raise ConfigError(f"tenants[{i}].lane", (
                    f"{lane!r} is below {defaults.lane!r}, the lane tenantDefaults.overBudget "
                    f"demotes to, which this tenant follows (it has no overBudget of its own): "
                    f"give it its own overBudget; {_LOWER} ({_lane_order(lane_names)})"))

    def _check_engine_priorities(self) -> None:
        """With engines in priority mode a lane's requests take two engine priorities (light,
        backlogged): set lanes' ``enginePriority`` on all lanes or none, at least 2 apart and
        increasing down the list, so the lanes stay strictly ordered in the engine."""
        given = [lane.engine_priority for lane in self.lanes]
        if all(p is None for p in given):
            return
        for i, priority in enumerate(given):
            if priority is None:
                raise ConfigError(f"lanes[{i}].enginePriority", "must be set on every lane "
                                  "when another lane sets it (scheduling.enginePolicy: priority)")
            if i and priority < (given[i - 1] or 0) + 2:
                raise ConfigError(f"lanes[{i}].enginePriority",
                                  f"must be at least {(given[i - 1] or 0) + 2} (2 above the lane "
                                  "before it: scheduling.enginePolicy: priority)")

    def model(self, name: str) -> Model | None:
        """The entry of model ``name``, else the ``"*"`` entry, else None."""
        fallback = None
        for model in self.models:
            if model.name == name:
                return model
            if model.name == "*":
                fallback = model
        return fallback

    def part_costs(self, name: str) -> PartCosts:
        """What an image, audio or file part costs for model ``name`` (its entry, the ``"*"``
        entry, or the defaults): ``picker.openai.parse_request`` takes this."""
        entry = self.model(name)
        return DEFAULT_COSTS if entry is None else entry.part_costs

    def tenant(self, tenant_id: str) -> Tenant | None:
        """The configured entry of ``tenant_id``, if any."""
        for tenant in self.tenants:
            if tenant.id == tenant_id:
                return tenant
        return None


_LOWER = "demotion moves a request past its budget to a lower lane"


def _lane_order(lane_names: list[str]) -> str:
    return f"lanes, highest priority first: {', '.join(lane_names)}"


def _demotion_step(rule: OverBudget, lane: str, lane_names: list[str]) -> int | None:
    """How many lanes down ``rule`` moves a request of ``lane`` (negative: up); None when it
    does not demote."""
    if rule.action != "demote" or rule.lane is None:
        return None
    return lane_names.index(rule.lane) - lane_names.index(lane)


def _not_lower(rule: OverBudget, whose: str, lane: str, lane_names: list[str]) -> str:
    """Why ``rule`` may not demote a request of ``lane`` (``whose`` lane it is)."""
    where = (f"{rule.lane!r} is {whose}: demoting into it changes nothing" if rule.lane == lane
             else f"{rule.lane!r} is above {whose} {lane!r}")
    return f"{where}; {_LOWER} ({_lane_order(lane_names)})"


def load_config(source: str | Path | dict) -> PickerConfig:
    """The picker config from a YAML file path or already-parsed data."""
    if isinstance(source, dict):
        return load(PickerConfig, source)
    return load_yaml_file(PickerConfig, source)
