"""Tenant policy through real Envoy: client → Envoy → ext_proc picker → model server.

Each rule of the tenant policy (API keys, engine priority from lanes only, the lane header,
``max_tokens`` limits, token budgets with ``Retry-After``, rate-limit headers, demotion, caps,
metering records, the tenant-label cap) is checked from the client's side of a real gateway.

Four stacks serve the module:

* ``sim_stack``: two simulated vLLM servers with a small KV budget, the picker with two lanes
  and one configured tenant per test, Envoy on the meter-stream response path, metering to a file;
* ``inline_stack``: the same picker config behind an Envoy that streams responses through the
  picker (the rate-limit headers are set by a different code path there);
* ``key_stack``: API-key tenancy;
* ``recording_stack``: the picker in front of a small OpenAI-like server started here, which
  records every body it receives, so the tests see exactly what the engine would get.

Budget arithmetic needs the picker's estimate of a request. Every request to the simulated servers
carries an ``_exact_content`` prompt, whose body estimate (by script, + 4 per message) equals
the simulated server's count (its tokenizer, + 4 per message + 3 for the reply), so the
picker's calibration of prompt estimates (per model, from the engine's reported usage) stays
exactly 1 and a request's prompt estimate is known; with ``ignore_eos`` the output is exactly
``max_tokens``. A tenant without history expects min(max_tokens, defaultOutputTokens = 256) output
tokens, and after a completed non-streaming request its average output is what that request
produced.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from picker.identity import hash_api_key
from picker.openai import parse_request
from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, metric_samples, wait_until

CHAT = "/v1/chat/completions"
EXACT_PROMPT_TOKENS = 8
DEFAULT_OUTPUT_TOKENS = 256
SERVER_KV = 1024
MAX_WAIT_S = 6
"""Long enough that a request queued behind a saturated pool is still waiting when a loaded
machine's test gets round to freeing it; the metering test waits it out once."""
API_KEY = "fw-test-0123456789abcdef0123456789abcdef"
RESET_FORMAT = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s|(\d+)ms)")

UPSTREAM_PROMPT_TOKENS = 5

Response = tuple[int, dict[str, str], bytes]

# One tenant per test (or per part of a test), so no test moves another's budget or metrics.
SIM_TENANTS: list[dict[str, Any]] = [
    {"id": "retry", "budgets": {"burst": {"tokens": 300, "per": "60s"}}},
    {"id": "quota", "budgets": {"sustained": {"tokens": 2000, "per": "24h"}}},
    {"id": "hdr", "budgets": {"burst": {"tokens": 100000, "per": "1h"}},
     "limits": {"maxConcurrent": 4}},
    {"id": "nohdr"},
    {"id": "demoter", "lane": "online", "budgets": {"burst": {"tokens": 50, "per": "1h"}},
     "overBudget": {"action": "demote", "lane": "batch"}},
    {"id": "flood"},
    {"id": "capq", "limits": {"maxQueued": 2}},
    {"id": "conc", "limits": {"maxConcurrent": 1}},
    {"id": "short", "limits": {"maxInputTokens": 20}},
    {"id": "billed"},
    {"id": "billed-late", "limits": {"maxConcurrent": 1}},
    {"id": "reasoned"},
    {"id": "refusee", "budgets": {"burst": {"tokens": 20, "per": "1h"}}},
]


# -- helpers --

def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


async def _send(session: aiohttp.ClientSession, url: str, body: bytes | Any,
                headers: dict[str, str] | None = None, path: str = CHAT) -> Response:
    async with session.post(url + path, data=body,
                            headers={"content-type": "application/json",
                                     **(headers or {})}) as response:
        return response.status, _lower(response.headers), await response.read()


def _post(url: str, body: bytes, headers: dict[str, str] | None = None,
          path: str = CHAT) -> Response:
    async def go() -> Response:
        async with aiohttp.ClientSession() as session:
            return await _send(session, url, body, headers, path)
    return asyncio.run(go())


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """``_wait_until`` inside an event loop (the predicate reads /metrics, so off the loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return True
        await asyncio.sleep(0.05)
    return await asyncio.to_thread(predicate)


def _exact_content(tokens: int) -> str:
    """A one-message chat prompt of ``tokens`` tokens by both the picker's estimate and the
    simulated server's count: w four-letter words and four line breaks. The picker counts a
    lowercase letter a quarter token, a space nothing and a line break one: w + 4, plus 4 for the
    message; the server's tokenizer a word of up to 5 letters one token and a run of up to 4
    whitespace characters one: w + 1, plus 4 for the message and 3 for the reply. Both: w + 8."""
    words = tokens - 8
    assert words >= 0
    return " ".join(["abcd"] * words) + "\n\n\n\n"


def _exact_body(max_tokens: int | None, stream: bool = False,
                prompt_tokens: int = EXACT_PROMPT_TOKENS, **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": "sim-model", "ignore_eos": True, "stream": stream,
                            "messages": [{"role": "user",
                                          "content": _exact_content(prompt_tokens)}], **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


def _error(body: bytes) -> dict[str, Any]:
    """The OpenAI-style error object of a refusal (its shape checked)."""
    error = json.loads(body)["error"]
    assert list(error) == ["message", "type", "param", "code"], error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["code"], str) and error["code"], error  # OpenAI: a string code
    return error


def _sum(samples: dict, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and wanted <= set(sample_labels))


def _inflight(stack: Stack) -> float:
    return metric(stack.metrics_url, "fairway_endpoint_inflight_tokens")


def _engines_idle(stack: Stack) -> bool:
    return _inflight(stack) == 0 and sum(
        metric(f"http://{a}/metrics", "vllm:num_requests_running")
        + metric(f"http://{a}/metrics", "vllm:num_requests_waiting")
        for a in stack.endpoint_addresses) == 0


def _seconds(duration: str) -> float:
    match = RESET_FORMAT.fullmatch(duration)
    assert match, f"not a duration: {duration!r}"
    hours, minutes, secs, millis = match.groups()
    return (int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs or 0)
            + int(millis or 0) / 1000)


def _records(path: Path, tenant: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    # Only whole lines: the picker may be writing the next one.
    lines = path.read_text().split("\n")[:-1]
    return [r for r in (json.loads(line) for line in lines if line) if r["tenant_id"] == tenant]


# -- the stacks --

def _sim_config(metering: Path | None) -> dict[str, Any]:
    return {
        "lanes": [{"name": "online"}, {"name": "batch"}],
        "queue": {"maxWait": f"{MAX_WAIT_S}s"},
        "tenants": SIM_TENANTS,
        "metering": {"output": str(metering) if metering else "none"},
    }


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("policy")
    with Stack(workdir, policy="vtc", endpoints=2,
               server_args=["--kv-budget-tokens", str(SERVER_KV), "--step-ms", "5"],
               picker_config=_sim_config(workdir / "metering.jsonl")) as running:
        yield running


@pytest.fixture(scope="module")
def metering_file(sim_stack: Stack) -> Path:
    return sim_stack.workdir / "metering.jsonl"


@pytest.fixture(scope="module")
def inline_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("policy-inline"), policy="vtc", endpoints=1,
               server_args=["--step-ms", "5"], picker_config=_sim_config(None),
               response_path="inline") as running:
        yield running


@pytest.fixture(scope="module")
def key_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {
        "tenancy": {"mode": "apiKey",
                    "apiKeys": [{"sha256": hash_api_key(API_KEY), "tenant": "keyed"}]},
        "tenants": [{"id": "keyed"}, {"id": "someone-else"}],
    }
    with Stack(tmp_path_factory.mktemp("policy-keys"), policy="vtc", endpoints=1,
               server_args=["--step-ms", "5"], picker_config=config) as running:
        yield running


class RecordingUpstream:
    """An OpenAI-like model server on 127.0.0.1 that keeps every request body it receives.

    It runs its own event loop in a thread (the Stack is synchronous). Bodies are recorded as
    received: the raw bytes, the ``Content-Length`` header and the parsed JSON (None when the
    bytes do not parse, which is answered 400). Its usage says 5 prompt tokens and, as with
    ``ignore_eos``, ``max_tokens`` completion tokens (1 without), unless the request header
    ``x-test-completion-tokens`` names another count.
    """

    def __init__(self) -> None:
        self.port = 0
        """Bound on ``start`` (port 0: the kernel's choice, read back)."""
        self.received: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> RecordingUpstream:
        self._thread.start()
        if not self._ready.wait(10) or self._failure is not None:
            raise RuntimeError(f"recording upstream did not start: {self._failure}")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported by start()
            self._failure = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        if self._runner is not None:
            self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]

    async def _chat(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.received.append({"raw": raw, "content_length": request.headers.get(
            "content-length"), "headers": _lower(request.headers), "body": body})
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "bad JSON", "type": "BadRequest",
                                                "code": 400}}, status=400)
        completion = int(request.headers.get("x-test-completion-tokens") or
                         body.get("max_completion_tokens") or body.get("max_tokens") or 1)
        return web.json_response({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": UPSTREAM_PROMPT_TOKENS, "completion_tokens": completion,
                      "total_tokens": UPSTREAM_PROMPT_TOKENS + completion}})

    def find(self, marker: str) -> list[dict[str, Any]]:
        """The recorded requests whose body carries ``"user": marker``."""
        return [r for r in self.received
                if isinstance(r["body"], dict) and r["body"].get("user") == marker]


REC_TENANTS: list[dict[str, Any]] = [
    {"id": "p-online", "lane": "online"},
    {"id": "p-plain", "lane": "plain"},
    {"id": "laner", "lane": "online", "allowedLanes": ["batch"]},
    {"id": "clamper", "limits": {"maxOutputTokens": 50, "outputLimit": "clamp"}},
    {"id": "strict", "limits": {"maxOutputTokens": 50, "outputLimit": "reject"}},
    {"id": "rec-demoter", "budgets": {"burst": {"tokens": 40, "per": "1h"}},
     "overBudget": {"action": "demote", "lane": "batch"}},
    {"id": "overdraft", "budgets": {"burst": {"tokens": 40, "per": "1h"}}},
]


@pytest.fixture(scope="module")
def recording_stack(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RecordingUpstream]]:
    upstream = RecordingUpstream().start()
    config = {
        "lanes": [{"name": "online", "enginePriority": 0},
                  {"name": "batch", "enginePriority": 10},
                  {"name": "plain"}],
        "capacity": {"kvBudgetTokens": 4096},
        "tenants": REC_TENANTS,
    }
    try:
        with Stack(tmp_path_factory.mktemp("policy-rec"), policy="vtc", endpoints=0,
                   external_endpoints=[upstream.address], picker_config=config) as running:
            yield running, upstream
    finally:
        upstream.stop()


def _rec_body(marker: str, **fields: Any) -> dict[str, Any]:
    body = {"model": "rec-model", "messages": [{"role": "user", "content": "hello there"}],
            "temperature": 0.25, "stop": ["\n\n"], "user": marker, "max_tokens": 7}
    body.update(fields)
    return {k: v for k, v in body.items() if v is not None}


def _received(upstream: RecordingUpstream, marker: str) -> dict[str, Any]:
    """The one request the upstream got for ``marker``, checked to be intact on the wire."""
    found = upstream.find(marker)
    assert len(found) == 1, f"upstream got {len(found)} requests for {marker}"
    got = found[0]
    # The body is framed right for what was sent: a Content-Length that matches the (rewritten)
    # body, or chunked encoding (what Envoy uses for a body streamed through ext_proc), and the
    # upstream parsed it.
    if got["content_length"] is not None:
        assert int(got["content_length"]) == len(got["raw"])
    else:
        assert got["headers"].get("transfer-encoding") == "chunked", got["headers"]
    assert isinstance(got["body"], dict), got["raw"]
    return got["body"]


# -- 1. API-key tenancy --

@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-key-0123456789", f"Basic {API_KEY}", "Bearer", "Bearer   ",
     f"Bearer {API_KEY} {API_KEY}", API_KEY, f"Bearer {API_KEY}x"],
    ids=["missing", "unknown-key", "basic-scheme", "no-key", "blank-key", "two-tokens",
         "no-scheme", "key-with-suffix"])
def test_api_key_mode_refuses_missing_malformed_and_unknown_keys(
        key_stack: Stack, authorization: str | None) -> None:
    # The spoofed tenant header must not stand in for a credential.
    headers = {TENANT_HEADER: "keyed"}
    if authorization is not None:
        headers["authorization"] = authorization
    status, got, body = _post(key_stack.gateway_url, chat_body(max_tokens=3), headers)
    assert status == 401, body
    assert got["content-type"].startswith("application/json")
    error = _error(body)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert API_KEY not in body.decode()  # the key is never echoed back
    # The picker keeps serving.
    ok, _, answer = _post(key_stack.gateway_url, chat_body(max_tokens=3),
                          {"authorization": f"Bearer {API_KEY}"})
    assert ok == 200, answer


def test_api_key_request_is_charged_to_the_keys_tenant_not_the_header(key_stack: Stack) -> None:
    url = key_stack.metrics_url
    # Earlier tests' requests of this tenant settle after their clients got the answer.
    assert wait_until(lambda: metric(url, "fairway_running_requests", tenant="keyed") == 0)

    def served_tokens() -> float:  # prompt and completion (kind="cached" is of the prompt)
        return sum(metric(url, "fairway_service_tokens_total", tenant="keyed", kind=kind)
                   for kind in ("prompt", "completion"))

    before = served_tokens()
    status, _, body = _post(key_stack.gateway_url, chat_body(max_tokens=6), {
        "authorization": f"Bearer {API_KEY}", TENANT_HEADER: "someone-else",
        "x-llm-d-inference-fairness-id": "someone-else"})
    assert status == 200, body
    usage = json.loads(body)["usage"]
    served = usage["prompt_tokens"] + usage["completion_tokens"]
    assert wait_until(lambda: served_tokens() - before == served)
    assert metric(url, "fairway_service_tokens_total", tenant="someone-else") == 0
    assert metric(url, "fairway_requests_total", tenant="someone-else") == 0
    assert metric(url, "fairway_requests_total", tenant="other") == 0


# -- 2. engine priority, the lane header, max_tokens --

@pytest.mark.parametrize(
    ("tenant", "client_priority", "expected"),
    [("p-online", -100, 0), ("p-online", None, 0), ("p-online", 0, 0),
     ("p-plain", -100, None), ("p-plain", 0, None), ("p-plain", None, None)],
    ids=["online-spoofed", "online-unset", "online-same", "plain-spoofed", "plain-zero",
         "plain-unset"])
def test_engine_gets_the_lanes_priority_never_the_clients(
        recording_stack: tuple[Stack, RecordingUpstream], tenant: str,
        client_priority: int | None, expected: int | None) -> None:
    stack, upstream = recording_stack
    marker = uuid.uuid4().hex
    sent = _rec_body(marker, priority=client_priority)
    status, _, answer = _post(stack.gateway_url, json.dumps(sent).encode(),
                              {TENANT_HEADER: tenant})
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["message"]["content"] == "ok"
    got = _received(upstream, marker)
    if expected is None:
        assert "priority" not in got
    else:
        assert got["priority"] == expected
    # Everything else arrives as the client sent it.
    sent.pop("priority", None)
    got = dict(got)
    got.pop("priority", None)
    assert got == sent


def test_rewritten_body_of_a_chunked_request_arrives_whole(
        recording_stack: tuple[Stack, RecordingUpstream]) -> None:
    stack, upstream = recording_stack
    marker = uuid.uuid4().hex
    sent = _rec_body(marker, priority=-100)
    raw = json.dumps(sent).encode()

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked encoding
        for i in range(0, len(raw), 40):
            yield raw[i:i + 40]

    async def go() -> Response:
        async with aiohttp.ClientSession() as session:
            return await _send(session, stack.gateway_url, chunks(), {TENANT_HEADER: "p-online"})

    status, _, answer = asyncio.run(go())
    assert status == 200, answer
    found = upstream.find(marker)
    assert len(found) == 1
    assert found[0]["body"] == {**sent, "priority": 0}


def test_lane_header_chooses_an_allowed_lane_and_its_priority(
        recording_stack: tuple[Stack, RecordingUpstream]) -> None:
    stack, upstream = recording_stack
    url = stack.metrics_url
    before = metric(url, "fairway_requests_total", tenant="laner", lane="batch")
    marker = uuid.uuid4().hex
    status, _, answer = _post(stack.gateway_url,
                              json.dumps(_rec_body(marker, priority=-5)).encode(),
                              {TENANT_HEADER: "laner", "x-fairway-lane": "batch"})
    assert status == 200, answer
    assert _received(upstream, marker)["priority"] == 10
    assert wait_until(lambda: metric(url, "fairway_requests_total", tenant="laner",
                                      lane="batch") - before == 1)
    # The tenant's own lane may be named too.
    marker = uuid.uuid4().hex
    status, _, _ = _post(stack.gateway_url, json.dumps(_rec_body(marker)).encode(),
                         {TENANT_HEADER: "laner", "x-fairway-lane": "online"})
    assert status == 200
    assert _received(upstream, marker)["priority"] == 0


@pytest.mark.parametrize(("tenant", "lane"),
                         [("laner", "plain"), ("laner", "gold"), ("p-online", "batch")],
                         ids=["not-allowed", "unknown", "no-allowed-lanes"])
def test_lane_header_for_a_lane_not_allowed_is_403(
        recording_stack: tuple[Stack, RecordingUpstream], tenant: str, lane: str) -> None:
    stack, upstream = recording_stack
    before = metric(stack.metrics_url, "fairway_rejections_total", tenant=tenant,
                    reason="lane_not_allowed")
    marker = uuid.uuid4().hex
    status, got, body = _post(stack.gateway_url, json.dumps(_rec_body(marker)).encode(),
                              {TENANT_HEADER: tenant, "x-fairway-lane": lane})
    assert status == 403, body
    assert got["content-type"].startswith("application/json")
    assert _error(body)["type"] == "permission_error"
    assert upstream.find(marker) == []
    assert metric(stack.metrics_url, "fairway_rejections_total", tenant=tenant,
                  reason="lane_not_allowed") - before == 1


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({"max_tokens": 500}, {"max_tokens": 50}),
     ({"max_tokens": None}, {"max_tokens": 50}),
     ({"max_tokens": 30}, {"max_tokens": 30}),
     ({"max_tokens": None, "max_completion_tokens": 500}, {"max_completion_tokens": 50})],
    ids=["over", "absent", "under", "max-completion-tokens"])
def test_clamp_lowers_or_sets_max_tokens(recording_stack: tuple[Stack, RecordingUpstream],
                                         fields: dict[str, Any],
                                         expected: dict[str, int]) -> None:
    stack, upstream = recording_stack
    marker = uuid.uuid4().hex
    sent = _rec_body(marker, **fields)
    status, _, answer = _post(stack.gateway_url, json.dumps(sent).encode(),
                              {TENANT_HEADER: "clamper"})
    assert status == 200, answer
    got = _received(upstream, marker)
    assert got == {**sent, **expected, "priority": 0}


def test_output_limit_reject_refuses_large_max_tokens(
        recording_stack: tuple[Stack, RecordingUpstream]) -> None:
    stack, upstream = recording_stack
    marker = uuid.uuid4().hex
    status, _, body = _post(stack.gateway_url,
                            json.dumps(_rec_body(marker, max_tokens=500)).encode(),
                            {TENANT_HEADER: "strict"})
    assert status == 400, body
    error = _error(body)
    assert (error["type"], error["code"]) == ("invalid_request_error", "max_tokens_exceeded")
    assert "50" in error["message"]
    assert upstream.find(marker) == []
    assert metric(stack.metrics_url, "fairway_rejections_total", tenant="strict",
                  reason="output_too_long") == 1
    marker = uuid.uuid4().hex
    status, _, _ = _post(stack.gateway_url,
                         json.dumps(_rec_body(marker, max_tokens=50)).encode(),
                         {TENANT_HEADER: "strict"})
    assert status == 200
    assert _received(upstream, marker)["max_tokens"] == 50


def test_demoted_request_carries_the_lower_lanes_engine_priority(
        recording_stack: tuple[Stack, RecordingUpstream]) -> None:
    stack, upstream = recording_stack
    # Budget 40; each request uses 5 + 30 tokens (the upstream's usage): the first fits, the
    # second does not and is demoted into batch.
    priorities = []
    for _ in range(2):
        marker = uuid.uuid4().hex
        status, _, body = _post(stack.gateway_url,
                                json.dumps(_rec_body(marker, max_tokens=30)).encode(),
                                {TENANT_HEADER: "rec-demoter"})
        assert status == 200, body
        priorities.append(_received(upstream, marker)["priority"])
    assert priorities == [0, 10]


def test_budget_is_settled_to_actual_use_when_the_estimate_exceeded_the_bucket(
        recording_stack: tuple[Stack, RecordingUpstream]) -> None:
    stack, _ = recording_stack
    headers = {TENANT_HEADER: "overdraft"}
    capacity = 40
    # An estimate (prompt + min(100, 256) > 100) above the bucket's capacity is admitted on a
    # full bucket; the engine then reports 5 + 10 = 15 tokens used.
    status, _, body = _post(stack.gateway_url, json.dumps(_rec_body(
        uuid.uuid4().hex, max_tokens=100)).encode(), {**headers, "x-test-completion-tokens": "10"})
    assert status == 200, body
    used = json.loads(body)["usage"]["total_tokens"]
    assert used == UPSTREAM_PROMPT_TOKENS + 10
    m = stack.metrics_url
    assert wait_until(lambda: metric(m, "fairway_requests_total", tenant="overdraft") == 1)
    # The next request reserves its body's own prompt estimate (a calibration learned down to
    # the upstream's 5 may order the queue, not lower a reservation) + min(average output 10,
    # 5). Settled to actual use, the bucket held 40 − 15 = 25 (the refill over the test is under
    # a token): 25 less that reservation remain.
    second = json.dumps(_rec_body(uuid.uuid4().hex, max_tokens=5)).encode()
    status, got, body = _post(stack.gateway_url, second, headers)
    assert status == 200, body
    expected = capacity - used - (parse_request(second).prompt_tokens + 5)
    assert expected <= int(got["x-ratelimit-remaining-tokens"]) <= expected + 1, got


# -- 3. 429 with a Retry-After that works --

def test_over_budget_gets_429_with_a_retry_after_that_works(sim_stack: Stack) -> None:
    url, headers = sim_stack.gateway_url, {TENANT_HEADER: "retry"}
    capacity, rate = 300, 300 / 60
    drain_output = 92  # each draining request is estimated (and uses) 8 + 92 = 100 tokens
    # Drain the burst bucket until less than one draining request is left.
    remaining, sent_at = capacity, 0.0
    for _ in range(6):
        sent_at = time.monotonic()
        status, got, body = _post(url, _exact_body(drain_output), headers)
        assert status == 200, body
        assert json.loads(body)["usage"]["total_tokens"] == EXACT_PROMPT_TOKENS + drain_output
        remaining = int(got["x-ratelimit-remaining-tokens"])
        if remaining < 60:
            break
    assert remaining < 60
    # A request 15 tokens bigger than the bucket can hold, even had it held remaining + 1 and
    # refilled for all the time since the previous request was sent: short by 15 to
    # 15 + 5·elapsed, so still refused should it reach the picker up to 3 s later.
    elapsed = time.monotonic() - sent_at
    estimate = remaining + 1 + math.ceil(rate * elapsed) + 15
    max_tokens = estimate - EXACT_PROMPT_TOKENS
    # Below the tenant's average output (92), so the expected output is max_tokens itself.
    assert max_tokens <= drain_output
    rejected_before = metric(sim_stack.metrics_url, "fairway_rejections_total", tenant="retry",
                             reason="over_budget")
    body_d = _exact_body(max_tokens)
    status, got, body = _post(url, body_d, headers)
    answered = time.monotonic()
    assert status == 429, body
    error = _error(body)
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert "burst" in error["message"]
    assert "x-should-retry" not in got  # a rate limit: the client may retry after the wait
    assert re.fullmatch(r"\d+", got["retry-after"]), got["retry-after"]
    retry_after = int(got["retry-after"])
    # At the refusal the bucket held between `remaining` (the previous response's header, taken
    # after its reservation) and remaining + 1 plus the refill since that request was sent; the
    # previous request used exactly its estimate, so settling refunded nothing. That excludes
    # the wrong waits: a whole window's (60 s), or 1 s whatever the shortfall.
    longest = (estimate - remaining) / rate
    shortest = (estimate - remaining - 1 - rate * (answered - sent_at)) / rate
    assert max(1, math.ceil(shortest)) <= retry_after <= max(1, math.ceil(longest)), \
        (shortest, retry_after, longest)
    assert int(got["x-ratelimit-remaining-tokens"]) < estimate
    assert metric(sim_stack.metrics_url, "fairway_rejections_total", tenant="retry",
                  reason="over_budget") - rejected_before == 1
    time.sleep(retry_after)  # what the client was told to do
    status, _, body = _post(url, body_d, headers)
    assert status == 200, body


# -- 4. rate-limit headers on both response paths --

@pytest.mark.parametrize("response_path", ["meter-stream", "inline"])
def test_rate_limit_headers_on_successful_responses(request: pytest.FixtureRequest,
                                                    response_path: str) -> None:
    stack: Stack = request.getfixturevalue("sim_stack" if response_path == "meter-stream"
                                           else "inline_stack")
    status, got, body = _post(stack.gateway_url, _exact_body(5), {TENANT_HEADER: "hdr"})
    assert status == 200, body
    capacity, estimate, rate = 100000, EXACT_PROMPT_TOKENS + 5, 100000 / 3600
    assert got["x-ratelimit-limit-tokens"] == str(capacity)
    remaining = int(got["x-ratelimit-remaining-tokens"])
    assert capacity - estimate - 1 <= remaining <= capacity - estimate + 1
    reset = _seconds(got["x-ratelimit-reset-tokens"])
    assert reset == pytest.approx((capacity - remaining) / rate, abs=0.1)
    # maxConcurrent 4, this request running.
    assert got["x-fairway-limit-concurrent-requests"] == "4"
    assert got["x-fairway-remaining-concurrent-requests"] == "3"
    # OpenAI's request headers mean requests per window, which fairway does not limit.
    assert "x-ratelimit-limit-requests" not in got
    # A tenant without budgets or caps gets none.
    status, got, body = _post(stack.gateway_url, _exact_body(5),
                              {TENANT_HEADER: "nohdr"})
    assert status == 200, body
    assert not [k for k in got if k.startswith(("x-ratelimit", "x-fairway-"))], got


# -- 5. demotion --

def test_over_budget_tenant_is_demoted_and_still_served(sim_stack: Stack) -> None:
    url, headers = sim_stack.gateway_url, {TENANT_HEADER: "demoter"}
    # Budget 50; each request is estimated 8 + 30 = 38: the first fits, the next ones do not.
    for _ in range(3):
        status, _, body = _post(url, _exact_body(30), headers)
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 30
    m = sim_stack.metrics_url
    assert wait_until(lambda: metric(m, "fairway_requests_total", tenant="demoter") == 3)
    assert metric(m, "fairway_requests_total", tenant="demoter", lane="online") == 1
    assert metric(m, "fairway_requests_total", tenant="demoter", lane="batch") == 2
    assert metric(m, "fairway_demotions_total", tenant="demoter", from_lane="online",
                  to_lane="batch") == 2
    assert metric(m, "fairway_rejections_total", tenant="demoter") == 0


# -- 6. caps --

def test_tenant_queue_cap_refuses_beyond_max_queued(sim_stack: Stack) -> None:
    m = sim_stack.metrics_url

    def saturated() -> bool:
        samples = metric_samples(m)
        return (_sum(samples, "fairway_queued_requests", tenant="flood") >= 2
                and all(_sum(samples, "fairway_endpoint_inflight_tokens", endpoint=a) >= SERVER_KV
                        for a in sim_stack.endpoint_addresses))

    async def scenario() -> tuple[list[Response], list[Response]]:
        async with aiohttp.ClientSession() as session:
            flood = [asyncio.create_task(_send(session, sim_stack.gateway_url, _exact_body(
                4000, stream=True, prompt_tokens=460), {TENANT_HEADER: "flood"}))
                for _ in range(8)]
            try:
                assert await _until(saturated), "the flood did not saturate the pool"
                held = [asyncio.create_task(_send(session, sim_stack.gateway_url,
                                                  _exact_body(4),
                                                  {TENANT_HEADER: "capq"})) for _ in range(2)]
                assert await _until(lambda: metric(m, "fairway_queued_requests",
                                                   tenant="capq") == 2)
                extra = await asyncio.gather(*[_send(
                    session, sim_stack.gateway_url, _exact_body(4),
                    {TENANT_HEADER: "capq"}) for _ in range(3)])
            finally:
                for task in flood:
                    task.cancel()
                await asyncio.gather(*flood, return_exceptions=True)
            return extra, list(await asyncio.gather(*held))

    extra, held = asyncio.run(scenario())
    for status, got, body in extra:
        assert status == 429, body
        assert (_error(body)["type"], _error(body)["code"]) == ("requests", "tenant_queue_full")
        assert "retry-after" in got
    assert metric(m, "fairway_rejections_total", tenant="capq", reason="tenant_queue_full") == 3
    assert [status for status, _, _ in held] == [200, 200]
    assert wait_until(lambda: _engines_idle(sim_stack), timeout=15)


def test_concurrency_cap_runs_one_request_at_a_time(sim_stack: Stack) -> None:
    m = sim_stack.metrics_url
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            state = metric_samples(m)
            samples.append((_sum(state, "fairway_running_requests", tenant="conc"),
                            _sum(state, "fairway_queued_requests", tenant="conc")))
            time.sleep(0.02)

    async def scenario() -> list[Response]:
        async with aiohttp.ClientSession() as session:
            return list(await asyncio.gather(*[_send(
                session, sim_stack.gateway_url, _exact_body(40, stream=True),
                {TENANT_HEADER: "conc"}) for _ in range(4)]))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        results = asyncio.run(scenario())
    finally:
        stop.set()
        sampler.join()
    for status, got, body in results:
        assert status == 200, body
        events = [e for e in body.decode().split("\n\n") if e.startswith("data: {")]
        assert sum(bool(json.loads(e[6:])["choices"][0]["delta"].get("content"))
                   for e in events) == 40
        assert got["x-fairway-limit-concurrent-requests"] == "1"
        assert got["x-fairway-remaining-concurrent-requests"] == "0"
    running = [r for r, _ in samples]
    assert samples  # how many depends on the machine's speed: the rule is what they show
    assert max(running) <= 1, samples
    # The sampling saw the cap at work: one running while others waited.
    assert any(r == 1 and q >= 1 for r, q in samples), samples


def test_prompt_over_max_input_tokens_is_400(sim_stack: Stack) -> None:
    url, headers = sim_stack.gateway_url, {TENANT_HEADER: "short"}
    status, _, body = _post(url, _exact_body(4, prompt_tokens=100), headers)
    assert status == 400, body
    error = _error(body)
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "100 tokens" in error["message"] and "20" in error["message"], error
    assert metric(sim_stack.metrics_url, "fairway_rejections_total", tenant="short",
                  reason="input_too_long") == 1
    status, _, body = _post(url, _exact_body(4, prompt_tokens=20), headers)  # at the cap: fits
    assert status == 200, body


# -- 7. budgets under concurrency --

def test_concurrent_requests_overshoot_a_budget_only_by_estimate_error(
        sim_stack: Stack) -> None:
    budget, max_tokens, n = 2000, 250, 20
    # As the picker estimates it for a tenant without history: prompt + min(max_tokens, 256).
    estimate = EXACT_PROMPT_TOKENS + min(max_tokens, DEFAULT_OUTPUT_TOKENS)
    assert n * estimate > 2 * budget  # admitting all of them would blow the budget by far

    async def scenario() -> list[Response]:
        async with aiohttp.ClientSession() as session:
            return list(await asyncio.gather(*[_send(
                session, sim_stack.gateway_url, _exact_body(max_tokens),
                {TENANT_HEADER: "quota"}) for _ in range(n)]))

    results = asyncio.run(scenario())
    admitted = [json.loads(body) for status, _, body in results if status == 200]
    refused = [body for status, _, body in results if status == 429]
    assert len(admitted) + len(refused) == n, [status for status, _, _ in results]
    assert refused, "no request was refused: the budget was never tested"
    for body in refused:
        error = _error(body)
        # The sustained budget is a quota: OpenAI's insufficient_quota, not a rate limit.
        assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
        assert "sustained" in error["message"]
    actual = [a["usage"]["prompt_tokens"] + a["usage"]["completion_tokens"] for a in admitted]
    slack = sum(max(0, used - estimate) for used in actual)
    # Refill over the test is 2000 / 86400 per second: under one token.
    assert sum(actual) <= budget + slack + 1, (actual, estimate)
    # And the budget was used: one more request would not have fit.
    assert len(admitted) == budget // estimate, (len(admitted), estimate)


# -- 8. metering records --

FIELDS = {"tenant_id", "model", "priority_lane", "prompt_tokens", "completion_tokens",
          "cached_prompt_tokens", "queue_ms", "ttft_ms", "e2e_ms", "finish_reason", "endpoint",
          "cost", "outcome"}


def test_metering_records_completed_cancelled_and_timed_out_requests(
        sim_stack: Stack, metering_file: Path) -> None:
    url = sim_stack.gateway_url
    started = time.monotonic()
    status, _, body = _post(url, _exact_body(7, prompt_tokens=30), {TENANT_HEADER: "billed"})
    assert status == 200, body
    usage = json.loads(body)["usage"]
    # On the meter-stream path the record is written at settlement, after the client's answer.
    assert wait_until(lambda: len(_records(metering_file, "billed")) == 1, timeout=15)
    recorded_ms = (time.monotonic() - started) * 1000

    async def scenario() -> tuple[int, float, Response]:
        opened = time.monotonic()
        async with aiohttp.ClientSession() as session, session.post(
                url + CHAT, data=_exact_body(4000, stream=True, prompt_tokens=30),
                headers={TENANT_HEADER: "billed-late"}) as response:
            seen = 0
            async for line in response.content:
                if line.startswith(b"data: {"):
                    seen += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
                if seen >= 20:
                    break
            # The tenant is at its concurrency cap: this one waits until maxWait, then 503.
            late = await _send(session, url, _exact_body(4),
                               {TENANT_HEADER: "billed-late"})
            response.close()
            return seen, time.monotonic() - opened, late

    seen, streamed_s, (late_status, late_headers, late_body) = asyncio.run(scenario())
    assert late_status == 503, late_body
    assert "retry-after" in late_headers
    assert wait_until(lambda: len(_records(metering_file, "billed-late")) == 2, timeout=15)

    (done,) = _records(metering_file, "billed")
    assert set(done) >= FIELDS, set(done)
    assert (done["model"], done["priority_lane"], done["outcome"]) == ("sim-model", "online",
                                                                       "ok")
    assert (done["prompt_tokens"], done["completion_tokens"]) == (usage["prompt_tokens"],
                                                                  usage["completion_tokens"])
    assert done["completion_tokens"] == 7
    # Every prompt of this module starts with the same words, so the engine may find the first
    # block cached, depending on which endpoint earlier tests' requests reached: the record
    # carries what the engine reported, whatever it was.
    reported = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert done["cached_prompt_tokens"] == reported
    assert done["endpoint"] in sim_stack.endpoint_addresses
    assert done["cost"] == done["prompt_tokens"] + 2 * done["completion_tokens"]
    # In order, and in milliseconds: no less than the engine's 7 steps of 5 ms, no more than
    # from the client's sending to the record's being read.
    assert 0 <= done["queue_ms"] <= done["ttft_ms"] <= done["e2e_ms"] <= recorded_ms
    assert done["e2e_ms"] >= 7 * 5

    by_outcome = {r["outcome"]: r for r in _records(metering_file, "billed-late")}
    assert set(by_outcome) == {"cancelled", "queue_timeout"}, by_outcome
    cancelled = by_outcome["cancelled"]
    assert set(cancelled) >= FIELDS
    assert cancelled["finish_reason"] == "cancelled"
    assert cancelled["endpoint"] in sim_stack.endpoint_addresses
    # What was delivered (the client read on while the late request waited), not 4000: at most
    # one token per 5 ms engine step while the stream was open.
    assert seen <= cancelled["completion_tokens"] <= streamed_s / 0.005 + 20 < 4000
    assert cancelled["prompt_tokens"] > 0
    assert cancelled["cost"] == cancelled["prompt_tokens"] + 2 * cancelled["completion_tokens"]
    assert cancelled["ttft_ms"] is not None and cancelled["e2e_ms"] > cancelled["ttft_ms"]
    timed_out = by_outcome["queue_timeout"]
    assert set(timed_out) >= FIELDS
    assert timed_out["endpoint"] is None and timed_out["ttft_ms"] is None
    assert (timed_out["prompt_tokens"], timed_out["completion_tokens"], timed_out["cost"]) == \
        (0, 0, 0)
    assert timed_out["queue_ms"] >= MAX_WAIT_S * 1000 * 0.95
    assert wait_until(lambda: _engines_idle(sim_stack), timeout=15)


def test_metering_record_carries_the_engines_finish_reason(
        sim_stack: Stack, metering_file: Path) -> None:
    status, _, body = _post(sim_stack.gateway_url, _exact_body(6),
                            {TENANT_HEADER: "reasoned"})
    assert status == 200, body
    reason = json.loads(body)["choices"][0]["finish_reason"]
    assert reason == "length"  # ignore_eos: the output reached max_tokens
    assert wait_until(lambda: len(_records(metering_file, "reasoned")) == 1)
    (record,) = _records(metering_file, "reasoned")
    assert record["finish_reason"] == reason, record


def test_refused_request_is_counted_not_metered(sim_stack: Stack, metering_file: Path) -> None:
    headers = {TENANT_HEADER: "refusee"}
    # Budget 20: the first request (8 + 12) takes all of it, the second is refused.
    assert _post(sim_stack.gateway_url, _exact_body(12), headers)[0] == 200
    status, _, body = _post(sim_stack.gateway_url, _exact_body(12), headers)
    assert status == 429, body
    # A refusal before the queue costs nothing: counted in metrics, no metering record (one
    # per refusal let a refused client write gigabytes of metering a day; issue 26).
    assert wait_until(lambda: metric(sim_stack.metrics_url, "fairway_rejections_total",
                                     tenant="refusee", reason="over_budget") == 1)
    assert wait_until(lambda: len(_records(metering_file, "refusee")) >= 1)
    outcomes = sorted(r["outcome"] for r in _records(metering_file, "refusee"))
    assert outcomes == ["ok"], outcomes


# -- 9. the tenant label cap through the gateway --

def test_random_tenant_ids_are_counted_as_other(sim_stack: Stack) -> None:
    m, n = sim_stack.metrics_url, 200
    before = metric(m, "fairway_requests_total", tenant="other")
    tenants = [str(uuid.uuid4()) for _ in range(n)]

    async def scenario() -> list[Response]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=50)) as session:
            return list(await asyncio.gather(*[_send(
                session, sim_stack.gateway_url, _exact_body(1),
                {TENANT_HEADER: tenant}) for tenant in tenants]))

    statuses = [status for status, _, _ in asyncio.run(scenario())]
    assert statuses == [200] * n
    assert wait_until(lambda: metric(m, "fairway_requests_total", tenant="other") - before
                       == n)
    labels = {dict(labels).get("tenant") for _, labels in metric_samples(m)} - {None}
    assert len(labels) <= len(SIM_TENANTS) + 1, labels
    assert not labels & set(tenants)


@pytest.fixture(scope="module")
def overload_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A global queue of 3 requests, lanes online and batch."""
    config = {"lanes": [{"name": "online"}, {"name": "batch"}],
              "queue": {"maxQueued": 3, "maxWait": "30s"},
              "tenants": [{"id": "hog", "lane": "online"}, {"id": "hi", "lane": "online"},
                          {"id": "lo", "lane": "batch"}]}
    with Stack(tmp_path_factory.mktemp("overload"), policy="vtc", endpoints=2,
               server_args=["--kv-budget-tokens", str(SERVER_KV), "--step-ms", "5"],
               picker_config=config) as running:
        yield running


def test_full_queue_sheds_the_lowest_lane_first(overload_stack: Stack) -> None:
    stack, m = overload_stack, overload_stack.metrics_url

    def saturated() -> bool:
        samples = metric_samples(m)
        return all(_sum(samples, "fairway_endpoint_inflight_tokens", endpoint=a) >= SERVER_KV
                   for a in stack.endpoint_addresses)

    async def scenario() -> tuple[list[Response], Response, Response]:
        async with aiohttp.ClientSession() as session:
            def send(tenant: str) -> asyncio.Task[Response]:
                return asyncio.create_task(_send(session, stack.gateway_url, _exact_body(4),
                                                 {TENANT_HEADER: tenant}))
            hog = [asyncio.create_task(_send(session, stack.gateway_url, _exact_body(
                4000, stream=True, prompt_tokens=460), {TENANT_HEADER: "hog"}))
                for _ in range(4)]
            try:
                assert await _until(saturated), "the hog did not fill the pool"
                lows = []
                for queued in (1, 2, 3):  # one at a time, so "newest" is well defined
                    lows.append(send("lo"))
                    assert await _until(lambda q=queued: metric(
                        m, "fairway_queued_requests", tenant="lo") == q)
                high = send("hi")  # the queue is full: the newest batch request makes room
                assert await _until(lambda: metric(m, "fairway_queued_requests",
                                                   tenant="hi") == 1)
                refused_low = await send("lo")  # nothing lower to shed for a batch request
            finally:
                for task in hog:
                    task.cancel()
                await asyncio.gather(*hog, return_exceptions=True)
            return list(await asyncio.gather(*lows)), await high, refused_low

    lows, high, refused_low = asyncio.run(scenario())
    assert [status for status, _, _ in lows] == [200, 200, 429]  # the newest low was shed
    assert "shed" in _error(lows[2][2])["message"]
    assert high[0] == 200
    assert refused_low[0] == 429
    assert (_error(refused_low[2])["type"], _error(refused_low[2])["code"]) == \
        ("requests", "queue_full")
    assert metric(m, "fairway_requests_total", tenant="lo", outcome="shed") == 1
    assert metric(m, "fairway_rejections_total", tenant="lo", reason="queue_full") == 2
    assert wait_until(lambda: _engines_idle(stack), timeout=15)
