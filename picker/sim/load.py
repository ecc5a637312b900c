"""Open-loop per-tenant HTTP load on an OpenAI-compatible endpoint: what did every tenant get?

``python -m picker.sim.load TRAFFIC.yaml --target http://127.0.0.1:PORT --out DIR [--duration S]``
sends the traffic a ``picker.sim.traffic.Traffic`` describes to Envoy in front of the fairway
picker, or to a model server directly, and records each request: status, time to first token, end,
tokens, ``Retry-After`` and the error message. It writes ``DIR/requests.csv`` (one row per
request), ``DIR/summary.json`` (per tenant and in total) and prints a per-tenant table.

How the run goes:

- *Open loop.* Every Poisson and burst send time is drawn in advance from the seed; a dispatcher
  starts each request at its time whatever the server is doing. A slow server slows the sender only
  through ``max_in_flight`` (the ``aiohttp.TCPConnector`` limit): a request that must wait for a
  connection waits inside its own timeout, and that wait counts in its TTFT, because latencies are
  measured from ``start_s``, the moment the request was issued (so a saturated run shows up as
  latency, not as fewer requests).
- *Closed loop* for ``backlog`` tenants: N workers each send a request, wait for its end, and send
  the next, so N are outstanding. After a failed request a worker pauses for the response's numeric
  ``Retry-After`` (else ``BACKLOG_ERROR_PAUSE_S``) so a refusing gateway is not hammered.
- *Sessions and programs* (``chat`` and ``agent`` tenants, ``picker.sim.workloads``) are closed
  loop per unit: a unit's next call goes once the previous reply is in and its pause (think time,
  tool latency) is over, with that reply in its messages, and names its unit in the
  ``session_header``; a failed call ends its unit (nothing is retried). A backlog tenant's worker
  runs one unit after another. ``summary.json`` gives each tenant's units started and completed
  and their completion times (first call sent to last reply), and the cached tokens reported.
- *Bounded.* Nothing is sent at or after ``duration_s``; requests still running then get at most
  ``timeout_s`` more, and are cancelled (status 0, error ``cancelled ...``). Each request also has
  ``timeout_s`` as its aiohttp total timeout (status 0, error ``timeout ...``).
- One ``aiohttp.ClientSession`` with keep-alive; aiohttp sets ``TCP_NODELAY`` on every connection
  it opens (``BaseProtocol.connection_made``), so small SSE chunks and request bodies are not held
  back by Nagle's algorithm.

Each request asks for exactly its drawn output length (``max_tokens`` with ``ignore_eos: true``)
and carries a prompt of N filler words (about one token each), so its cost is known in advance.
Token counts come from the response's ``usage`` when there is one (``usage_source=usage``); a
stream without usage counts one completion token per SSE event carrying non-empty content and takes
the drawn N as the prompt (``usage_source=counted``); a JSON reply without usage counts the words
of its text.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import math
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import aiohttp

from picker.errors import ConfigError
from picker.sim.traffic import TenantTraffic, Traffic, load_traffic
from picker.sim.workloads import WORDS, Message, Unit, chat_messages

__all__ = ["WORDS"]  # re-exported: the filler vocabulary lives with the workloads

#: Pause of a backlog worker after a failed request without a numeric ``Retry-After``.
BACKLOG_ERROR_PAUSE_S = 0.1

#: ``requests.csv`` columns, in order.
CSV_COLUMNS: tuple[str, ...] = (
    "tenant", "seq", "kind", "api", "stream", "scheduled_s", "start_s", "ttft_s", "end_s",
    "e2e_s", "status", "prompt_tokens", "completion_tokens", "cached_tokens", "usage_source",
    "drawn_prompt_tokens", "max_tokens", "retry_after", "error", "session", "call",
    "calls",
)

Kind = Literal["poisson", "burst", "backlog"]


@dataclass(frozen=True)
class PlannedRequest:
    """One request as drawn from the seed, before it is sent."""

    tenant: str
    seq: int
    """Per-tenant sequence number; open-loop requests are numbered in send-time order."""
    kind: Kind
    at_s: float | None
    """Scheduled send time after the run's start (None for backlog: sent when a slot frees)."""
    prompt_tokens: int
    """Prompt length in filler words (about one token each)."""
    max_tokens: int
    """Output length asked for (with ``ignore_eos``)."""
    stream: bool
    token_ids: tuple[int, ...] | None = None
    """The prompt's token ids (``picker.sim.tokenizer``) for the pool simulator's prefix cache,
    when a workload gives them (``picker.sim.workloads``); None: counts only, never cached."""
    messages: tuple[Message, ...] | None = None
    """A workload's chat messages (``prompt_tokens`` is then their tokens); None: filler words."""
    session: str | None = None
    """The session or program it belongs to (sent in ``session_header``), for chat and agent."""
    call: int = 0
    """Its index in its unit (turn of a session, call of a program)."""
    calls: int = 1
    """Calls of its unit."""
    unit: Unit | None = field(default=None, compare=False, repr=False)
    """The unit that gives its next call once it is answered (``picker.sim.workloads``)."""


@dataclass
class RequestRecord:
    """What one request got. Times are seconds after the run's start."""

    tenant: str
    seq: int
    kind: Kind
    api: str
    stream: bool
    scheduled_s: float | None
    start_s: float
    drawn_prompt_tokens: int
    max_tokens: int
    status: int = 0
    """HTTP status, or 0 for a connection error, timeout or cancellation (see ``error``)."""
    ttft_s: float | None = None
    """From ``start_s`` to the first SSE event carrying content, or to the end for JSON."""
    end_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` when the server reports it."""
    usage_source: Literal["usage", "counted", "none"] = "none"
    retry_after: str | None = None
    error: str | None = None
    session: str | None = None
    call: int | None = None
    """Its index in its unit, a session, program or workload request (None: not part of one)."""
    calls: int | None = None
    """Calls of its unit."""
    reply: str | None = field(default=None, repr=False)
    """The reply's text, kept for a unit's next call only."""

    @property
    def ok(self) -> bool:
        """A 2xx answer that completed without an error."""
        return 200 <= self.status < 300 and self.error is None and self.end_s is not None

    @property
    def e2e_s(self) -> float | None:
        """From ``start_s`` to the end of the response."""
        return None if self.end_s is None else self.end_s - self.start_s

    def row(self) -> list[str]:
        """The record as a ``requests.csv`` row (``CSV_COLUMNS`` order)."""
        return [_cell(getattr(self, column)) for column in CSV_COLUMNS]


@dataclass(frozen=True)
class LoadResult:
    """A finished run: every request's record, the summary, and the wall time."""

    records: list[RequestRecord]
    summary: dict[str, Any]
    wall_s: float


# ---------------------------------------------------------------------------------------------
# Planning: everything drawn from the seed, nothing timing-dependent.


def _rng(seed: int, *parts: object) -> random.Random:
    return random.Random("/".join(str(p) for p in (seed, *parts)))


def draw_request(traffic: Traffic, tenant: TenantTraffic, seq: int, kind: Kind,
                 at_s: float | None) -> PlannedRequest:
    """Request ``seq`` of ``tenant``: lengths and streaming drawn from (seed, tenant, seq). For
    a workload tenant (``picker.sim.workloads``), the first call of its unit ``seq``."""
    if tenant.workload != "requests":
        return unit_request(Unit(traffic.seed, tenant, seq), kind, at_s)
    rng = _rng(traffic.seed, tenant.name, seq)
    prompt = rng.randint(*tenant.prompt_tokens)
    output = rng.randint(*tenant.output_tokens)
    stream = rng.random() < tenant.stream_fraction
    return PlannedRequest(tenant.name, seq, kind, at_s, prompt, output, stream)


def unit_request(unit: Unit, kind: Kind, at_s: float | None) -> PlannedRequest:
    """The call ``unit`` is at, as a planned request (``at_s``: the unit's start for its first
    call, None for later ones, sent once the previous reply is in and its pause is over)."""
    call = unit.call()
    session = unit.session if unit.kind in ("chat", "agent") else None
    return PlannedRequest(unit.tenant.name, unit.seq, kind, at_s, len(call.token_ids),
                          call.max_tokens, call.stream, token_ids=call.token_ids,
                          messages=call.messages, session=session, call=call.call,
                          calls=call.calls, unit=unit)


def plan_open_loop(traffic: Traffic, duration_s: float | None = None) -> list[PlannedRequest]:
    """Every Poisson and burst request of the run, sorted by send time.

    ``duration_s`` overrides the traffic's: windows are clipped to it and later bursts dropped. A
    shorter duration plans a prefix of the longer one's requests.
    """
    duration = traffic.duration_s if duration_s is None else duration_s
    planned: list[PlannedRequest] = []
    for tenant in traffic.tenants:
        times: list[tuple[float, Kind]] = []
        if tenant.rate > 0:
            rng = _rng(traffic.seed, tenant.name, "arrivals")
            stop = duration if tenant.stop_s is None else min(tenant.stop_s, duration)
            t = tenant.start_s + rng.expovariate(tenant.rate)
            while t < stop:
                times.append((t, "poisson"))
                t += rng.expovariate(tenant.rate)
        for burst in tenant.bursts:
            if burst.at_s < duration:
                times.extend((burst.at_s, "burst") for _ in range(burst.count))
        times.sort(key=lambda item: item[0])
        for seq, (at, kind) in enumerate(times):
            planned.append(draw_request(traffic, tenant, seq, kind, at))
    planned.sort(key=lambda p: (p.at_s, p.tenant, p.seq))
    return planned


def prompt_text(seed: int, tenant: str, seq: int, words: int) -> str:
    """``words`` space-separated filler words, the same for the same (seed, tenant, seq)."""
    return " ".join(_rng(seed, tenant, seq, "words").choices(WORDS, k=words))


def request_path(api: str) -> str:
    """URL path of the OpenAI endpoint for ``api`` (``chat`` or ``completions``)."""
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def request_body(traffic: Traffic, tenant: TenantTraffic, planned: PlannedRequest) -> dict:
    """The JSON body of ``planned``: model, prompt or one user message, max_tokens, ignore_eos."""
    body: dict[str, Any] = {"model": traffic.model}
    if planned.messages is not None:
        body["messages"] = chat_messages(planned.messages)
    elif tenant.api == "chat":
        text = prompt_text(traffic.seed, tenant.name, planned.seq, planned.prompt_tokens)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt_text(traffic.seed, tenant.name, planned.seq,
                                     planned.prompt_tokens)
    body["max_tokens"] = planned.max_tokens
    body["ignore_eos"] = True
    body["stream"] = planned.stream
    if planned.stream and tenant.include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def request_headers(traffic: Traffic, tenant: TenantTraffic,
                    planned: PlannedRequest | None = None) -> dict[str, str]:
    """The tenant header (unless disabled), the session header of a session's or program's
    request, and the tenant's extra headers."""
    headers = {traffic.tenant_header: tenant.name} if tenant.send_tenant_header else {}
    if planned is not None and planned.session is not None:
        headers[traffic.session_header] = planned.session
    headers.update(tenant.headers)
    return headers


# ---------------------------------------------------------------------------------------------
# Reading responses.


def error_message(text: str) -> str:
    """The message of an OpenAI-style error body, else the body's start (or a placeholder)."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(data.get("message"), str):
            return data["message"]
    text = text.strip()
    return text[:200] if text else "(empty body)"


def chunk_text(chunk: dict) -> str:
    """The generated text an OpenAI chat or completions chunk (or reply) carries."""
    parts: list[str] = []
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        for holder in (choice.get("delta"), choice.get("message")):
            if isinstance(holder, dict):
                for key in ("content", "reasoning_content"):
                    if isinstance(holder.get(key), str):
                        parts.append(holder[key])
        if isinstance(choice.get("text"), str):
            parts.append(choice["text"])
    return "".join(parts)


def _apply_usage(record: RequestRecord, usage: Any) -> bool:
    if not isinstance(usage, dict):
        return False
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return False
    record.prompt_tokens, record.completion_tokens = prompt, completion
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        record.cached_tokens = details["cached_tokens"]
    record.usage_source = "usage"
    return True


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord,
                       now: Callable[[], float], keep_text: bool = False) -> None:
    counted = 0
    usage: Any = None
    texts: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, event:/id: lines
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            continue
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            record.error = error_message(data)
            continue
        text = chunk_text(chunk)
        if text:
            counted += 1
            if keep_text:
                texts.append(text)
            if record.ttft_s is None:
                record.ttft_s = now() - record.start_s
        if chunk.get("usage"):
            usage = chunk["usage"]
    if keep_text:
        record.reply = "".join(texts)
    if not _apply_usage(record, usage):
        record.prompt_tokens, record.completion_tokens = record.drawn_prompt_tokens, counted
        record.usage_source = "counted"


async def _read_json(resp: aiohttp.ClientResponse, record: RequestRecord,
                     now: Callable[[], float], keep_text: bool = False) -> None:
    text = await resp.text(errors="replace")
    record.ttft_s = now() - record.start_s
    try:
        data = json.loads(text)
    except ValueError:
        record.error = f"reply is not JSON: {text.strip()[:200]!r}"
        return
    if not isinstance(data, dict):
        record.error = "reply is not a JSON object"
        return
    if keep_text:
        record.reply = chunk_text(data)
    if not _apply_usage(record, data.get("usage")):
        record.prompt_tokens = record.drawn_prompt_tokens
        record.completion_tokens = len(chunk_text(data).split())
        record.usage_source = "counted"


# ---------------------------------------------------------------------------------------------
# The run.


class _Run:
    def __init__(self, traffic: Traffic, target: str, session: aiohttp.ClientSession,
                 duration_s: float, plan: list[PlannedRequest]) -> None:
        self.traffic = traffic
        self.session = session
        self.duration_s = duration_s
        base = target.rstrip("/")
        self.base = base.removesuffix("/v1")
        self.tenants = {t.name: t for t in traffic.tenants}
        self.records: list[RequestRecord] = []
        self.pending: set[asyncio.Task] = set()
        self.next_seq = {t.name: 0 for t in traffic.tenants}
        for p in plan:
            self.next_seq[p.tenant] = max(self.next_seq[p.tenant], p.seq + 1)
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()

    def now(self) -> float:
        return self.loop.time() - self.t0

    async def sleep_until(self, at_s: float) -> None:
        delay = at_s - self.now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def dispatch(self, plan: Iterable[PlannedRequest]) -> None:
        for planned in plan:
            assert planned.at_s is not None
            await self.sleep_until(planned.at_s)
            task = asyncio.create_task(self.send(planned) if planned.unit is None
                                       else self.run_unit(planned, self.duration_s))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def backlog_worker(self, tenant: TenantTraffic) -> None:
        stop = self.duration_s if tenant.stop_s is None else min(tenant.stop_s, self.duration_s)
        await self.sleep_until(tenant.start_s)
        while self.now() < stop:
            seq = self.next_seq[tenant.name]
            self.next_seq[tenant.name] = seq + 1
            planned = draw_request(self.traffic, tenant, seq, "backlog", None)
            if planned.unit is None:
                record = await self.send(planned)
            else:
                record = await self.run_unit(planned, self.duration_s)
            if not record.ok:
                pause = _seconds(record.retry_after)
                pause = BACKLOG_ERROR_PAUSE_S if pause is None else pause
                await asyncio.sleep(max(0.0, min(pause, stop - self.now())))

    async def run_unit(self, planned: PlannedRequest, stop_s: float) -> RequestRecord:
        """A session or program, closed loop: each call is sent once the previous one's reply
        is in and its pause (think time, tool latency) is over, with that reply in its prompt.
        It ends after its last call, at a failed call (abandoned: nothing is retried), or when
        its next call would go at or after ``stop_s``. Returns the last call's record."""
        unit = planned.unit
        assert unit is not None
        while True:
            record = await self.send(planned)
            if not record.ok:
                return record
            delay = unit.answered(record.reply or "")
            record.reply = None  # the unit holds it now
            if delay is None or self.now() + delay >= stop_s:
                return record
            await asyncio.sleep(delay)
            planned = unit_request(unit, planned.kind, None)

    async def send(self, planned: PlannedRequest) -> RequestRecord:
        tenant = self.tenants[planned.tenant]
        record = RequestRecord(
            tenant=tenant.name, seq=planned.seq, kind=planned.kind, api=tenant.api,
            stream=planned.stream, scheduled_s=planned.at_s, start_s=self.now(),
            drawn_prompt_tokens=planned.prompt_tokens, max_tokens=planned.max_tokens,
            session=planned.session, call=None if planned.unit is None else planned.call,
            calls=None if planned.unit is None else planned.calls)
        self.records.append(record)
        url = self.base + request_path(tenant.api)
        body = request_body(self.traffic, tenant, planned)
        headers = request_headers(self.traffic, tenant, planned)
        keep = planned.call + 1 < planned.calls
        try:
            async with self.session.post(url, json=body, headers=headers) as resp:
                record.status = resp.status
                record.retry_after = resp.headers.get("Retry-After")
                if resp.status >= 400:
                    record.error = error_message(await resp.text(errors="replace"))
                elif "text/event-stream" in resp.headers.get("Content-Type", ""):
                    await _read_stream(resp, record, self.now, keep)
                else:
                    await _read_json(resp, record, self.now, keep)
        except TimeoutError:
            record.error = _after(record.status, f"timeout after {self.traffic.timeout_s:g}s")
            record.status = 0
        except (aiohttp.ClientError, OSError) as exc:
            record.error = _after(record.status, f"{type(exc).__name__}: {exc}")
            record.status = 0
        record.end_s = self.now()
        return record

    def close_unfinished(self) -> None:
        end = self.now()
        for record in self.records:
            if record.end_s is None:
                record.error = _after(record.status, "cancelled: still running timeout_s "
                                      f"({self.traffic.timeout_s:g}s) after the run's end")
                record.status = 0
                record.end_s = end


def _after(status: int, message: str) -> str:
    return f"{message} (after HTTP {status})" if status else message


def _seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


async def _wait(tasks: Iterable[asyncio.Task], deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        remaining = [t for t in tasks if not t.done()]
        timeout = deadline - loop.time()
        if not remaining or timeout <= 0:
            return
        await asyncio.wait(remaining, timeout=timeout)


def make_session(traffic: Traffic) -> aiohttp.ClientSession:
    """The run's client session: ``max_in_flight`` connections, ``timeout_s`` per request."""
    connector = aiohttp.TCPConnector(limit=traffic.max_in_flight, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=traffic.timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def run_traffic(traffic: Traffic, target: str, out: Path | None = None, *,
                      duration_s: float | None = None,
                      records: list[RequestRecord] | None = None) -> LoadResult:
    """Send ``traffic`` to ``target`` (``http://host:port``, with or without ``/v1``).

    ``duration_s`` overrides the traffic's duration. When ``out`` is given, ``requests.csv`` and
    ``summary.json`` are written there. Returns every request's record (in issue order) and the
    summary (``summarize``, plus a ``run`` section describing the run). ``records``, when given,
    receives each record as its request is sent: a caller that cancels the run keeps them.
    """
    duration = traffic.duration_s if duration_s is None else duration_s
    if duration <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration}")
    plan = plan_open_loop(traffic, duration)
    async with make_session(traffic) as session:
        run = _Run(traffic, target, session, duration, plan)
        if records is not None:
            run.records = records
        senders = [asyncio.create_task(run.dispatch(plan))]
        for tenant in traffic.tenants:
            if tenant.backlog is not None:
                senders += [asyncio.create_task(run.backlog_worker(tenant))
                            for _ in range(tenant.backlog)]
        deadline = run.t0 + duration + traffic.timeout_s
        try:
            await _wait(senders, deadline)
            await _wait(list(run.pending), deadline)
        finally:
            leftovers = [t for t in (*senders, *run.pending) if not t.done()]
            for task in leftovers:
                task.cancel()
            await asyncio.gather(*leftovers, return_exceptions=True)
        run.close_unfinished()
        wall = run.now()
    summary = summarize(run.records, wall_s=wall, tenants=[t.name for t in traffic.tenants])
    summary["run"] = {
        "target": target, "model": traffic.model, "duration_s": duration, "seed": traffic.seed,
        "max_in_flight": traffic.max_in_flight, "timeout_s": traffic.timeout_s,
        "tenant_header": traffic.tenant_header,
    }
    result = LoadResult(records=run.records, summary=summary, wall_s=wall)
    if out is not None:
        write_outputs(result, out)
    return result


# ---------------------------------------------------------------------------------------------
# Summaries and outputs.


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in (50, 95, 99)}


def _stats(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
    prompt = sum(r.prompt_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    cached = sum(r.cached_tokens or 0 for r in records)
    stats: dict[str, Any] = {
        "sent": len(records),
        "ok": len(ok),
        "errors": dict(sorted(errors.items())),
        "ttft_s": _quantiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e_s": _quantiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "service": prompt + 2 * completion,
        "output_tokens_per_s": completion / wall_s if wall_s > 0 else 0.0,
        "cached_tokens": cached,
    }
    units = unit_completions(records)
    if units:
        done = [seconds for seconds in units.values() if seconds is not None]
        stats["units"] = {"started": len(units), "completed": len(done),
                          "completion_s": _quantiles(done)}
    return stats


def unit_completions(records: Sequence[RequestRecord]) -> dict[tuple[str, int], float | None]:
    """Per unit (tenant, seq) of a workload (``picker.sim.workloads``): seconds from its first
    call's start to its last call's end when every call of it was answered, else None (a call
    failed, or the run ended first)."""
    calls: dict[tuple[str, int], list[RequestRecord]] = {}
    for r in records:
        if r.call is not None:
            calls.setdefault((r.tenant, r.seq), []).append(r)
    out: dict[tuple[str, int], float | None] = {}
    for key, unit in calls.items():
        first = min(unit, key=lambda r: r.call or 0)
        last = max(unit, key=lambda r: r.call or 0)
        whole = (first.call == 0 and last.call == (last.calls or 1) - 1
                 and len(unit) == last.calls and all(r.ok for r in unit))
        out[key] = last.end_s - first.start_s if whole and last.end_s is not None else None
    return out


def summarize(records: Sequence[RequestRecord], wall_s: float | None = None,
              tenants: Sequence[str] | None = None) -> dict[str, Any]:
    """Per tenant and in total: sent, ok, errors by status, TTFT and e2e percentiles over ok
    requests, prompt and completion tokens, service (prompt + 2 x completion), its share of the
    total, and output tokens per second of ``wall_s``.

    ``wall_s`` defaults to the span from the first start to the last end; ``tenants`` fixes the
    order (and lists tenants without records); by default, order of first appearance.
    """
    if wall_s is None:
        ends = [r.end_s for r in records if r.end_s is not None]
        wall_s = max(ends) - min(r.start_s for r in records) if ends else 0.0
    names = list(tenants) if tenants is not None else []
    for r in records:
        if r.tenant not in names:
            names.append(r.tenant)
    per = {name: _stats([r for r in records if r.tenant == name], wall_s) for name in names}
    totals = _stats(records, wall_s)
    for stats in per.values():
        stats["service_share"] = stats["service"] / totals["service"] if totals["service"] else 0.0
    totals["service_share"] = 1.0 if totals["service"] else 0.0
    return {"wall_s": wall_s, "tenants": per, "totals": totals}


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6f}"
    return str(value)


def write_outputs(result: LoadResult, out: Path) -> None:
    """Write ``requests.csv`` and ``summary.json`` for ``result`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "requests.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(record.row() for record in result.records)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")


def format_table(summary: dict[str, Any]) -> str:
    """A compact per-tenant table of a ``summarize`` result, with a totals line."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f}"

    header = (f"{'tenant':<16} {'sent':>6} {'ok':>6} {'errors':<14} {'ttft50':>7} {'ttft95':>7} "
              f"{'e2e50':>7} {'e2e95':>7} {'out tok/s':>9} {'share':>6}")
    lines = [header + "   (times in ms)"]
    rows = [*summary["tenants"].items(), ("TOTAL", summary["totals"])]
    for name, s in rows:
        errors = ",".join(f"{k}x{v}" for k, v in s["errors"].items()) or "-"
        lines.append(
            f"{name[:16]:<16} {s['sent']:>6} {s['ok']:>6} {errors[:14]:<14} "
            f"{ms(s['ttft_s']['p50']):>7} {ms(s['ttft_s']['p95']):>7} "
            f"{ms(s['e2e_s']['p50']):>7} {ms(s['e2e_s']['p95']):>7} "
            f"{s['output_tokens_per_s']:>9.1f} {s['service_share']:>6.1%}")
    lines.append(f"wall time {summary['wall_s']:.2f}s")
    return "\n".join(lines)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; returns the exit status (2 for a bad traffic file or bad arguments)."""
    parser = argparse.ArgumentParser(
        prog="python -m picker.sim.load",
        description="Send open-loop per-tenant traffic to an OpenAI-compatible endpoint and "
                    "record what every tenant got.")
    parser.add_argument("traffic", type=Path, help="traffic YAML file")
    parser.add_argument("--target", required=True,
                        help="base URL, e.g. http://127.0.0.1:8080 (Envoy or a model server)")
    parser.add_argument("--out", required=True, type=Path,
                        help="directory for requests.csv and summary.json")
    parser.add_argument("--duration", type=_positive, default=None,
                        help="seconds of sending; overrides the file's duration_s")
    args = parser.parse_args(argv)
    try:
        traffic = load_traffic(args.traffic)
    except ConfigError as exc:
        print(f"error: {args.traffic}: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        result = asyncio.run(run_traffic(traffic, args.target, args.out,
                                         duration_s=args.duration))
        print(format_table(result.summary))
        print(f"wrote {args.out / 'requests.csv'} and {args.out / 'summary.json'}")
        return 0
    return 130


if __name__ == "__main__":
    sys.exit(main())
