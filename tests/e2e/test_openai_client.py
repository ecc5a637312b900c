"""The official ``openai`` Python client through real Envoy and the picker.

Clients written for OpenAI act on a refusal by its status, its body's string ``code`` and its
headers: they raise ``RateLimitError``, ``AuthenticationError``, ``BadRequestError``; they retry a
429 after ``Retry-After`` unless ``x-should-retry: false`` says not to. This module checks that
fairway's refusals drive that logic as OpenAI's own would: a burst budget is a rate limit the
client waits out and then passes, a spent sustained budget is ``insufficient_quota`` and is not
retried, an unknown key is ``invalid_api_key``, a prompt over ``maxInputTokens`` is
``context_length_exceeded``.

Every request the client makes is recorded by an ``httpx`` response hook, so a test sees each
attempt (status and headers), not only the final outcome. Budget arithmetic uses prompts whose
estimate equals the simulated server's count (see ``_exact_prompt``): with ``ignore_eos`` a request
of ``PROMPT`` prompt tokens and ``max_tokens`` output uses exactly their sum, which is also what the
picker reserves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from picker.identity import hash_api_key
from picker.stack.launcher import Stack
from tests.e2e.conftest import metric, settled_metric

PROMPT = 20
"""Prompt tokens of every request here (by the picker's estimate and the server's count)."""
OUTPUT = 50
ESTIMATE = PROMPT + OUTPUT

KEYS = {tenant: f"fw-{tenant}-0123456789abcdef0123456789abcdef"
        for tenant in ("plain", "burst", "retry", "quota", "short")}
BURST = {"tokens": 100, "per": "10s"}
"""10 tokens a second: after one request (70) a second is 40 short, 4 s of refill. The client's
own backoff (0.5 s, then 1 s) would retry long before that; only ``Retry-After`` gets it through."""
SUSTAINED = {"tokens": 100, "per": "60s"}
"""The same shortfall takes 24 s here: a ``Retry-After`` under the client's 2-minute ceiling, so
only ``x-should-retry: false`` keeps the client from retrying."""

TENANTS: list[dict[str, Any]] = [
    {"id": "plain", "limits": {"maxConcurrent": 4}},
    {"id": "burst", "budgets": {"burst": BURST}},
    {"id": "retry", "budgets": {"burst": BURST}},
    {"id": "quota", "budgets": {"sustained": SUSTAINED}},
    {"id": "short", "limits": {"maxInputTokens": PROMPT}},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {
        "tenancy": {"mode": "apiKey",
                    "apiKeys": [{"sha256": hash_api_key(key), "tenant": tenant}
                                for tenant, key in KEYS.items()]},
        "tenants": TENANTS,
    }
    with Stack(tmp_path_factory.mktemp("openai-client"), policy="vtc", endpoints=1,
               server_args=["--step-ms", "2"], picker_config=config) as running:
        yield running


@dataclass
class Attempt:
    status: int
    headers: dict[str, str]
    at: float


@dataclass
class Client:
    """An ``openai.OpenAI`` client and every HTTP response it received."""

    api: openai.OpenAI
    attempts: list[Attempt] = field(default_factory=list)


def _client(stack: Stack, key: str, max_retries: int) -> Client:
    attempts: list[Attempt] = []

    def record(response: Any) -> None:
        attempts.append(Attempt(response.status_code,
                                {k.lower(): v for k, v in response.headers.items()},
                                time.monotonic()))

    http = openai.DefaultHttpxClient(trust_env=False, event_hooks={"response": [record]})
    api = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key,
                        max_retries=max_retries, timeout=60.0, http_client=http)
    return Client(api, attempts)


def _exact_prompt(tokens: int) -> str:
    """A one-message chat prompt of ``tokens`` tokens by both the picker's estimate and the
    simulated server's count: w four-letter words and four line breaks. The picker counts a
    lowercase letter a quarter token, a space nothing and a line break one: w + 4, plus 4 for the
    message; the server's tokenizer a word of up to 5 letters one token and a run of up to 4
    whitespace characters one: w + 1, plus 4 for the message and 3 for the reply. Both: w + 8."""
    words = tokens - 8
    assert words >= 0
    return " ".join(["abcd"] * words) + "\n\n\n\n"


def _chat(client: Client, prompt_tokens: int = PROMPT, max_tokens: int = OUTPUT,
          **extra: Any) -> Any:
    return client.api.chat.completions.create(
        model="sim-model", max_tokens=max_tokens,
        messages=[{"role": "user", "content": _exact_prompt(prompt_tokens)}],
        extra_body={"ignore_eos": True}, **extra)


def _rejections(stack: Stack, tenant: str, reason: str) -> float:
    return metric(stack.metrics_url, "fairway_rejections_total", tenant=tenant, reason=reason)


def _error_object(error: openai.APIStatusError) -> dict[str, Any]:
    body = error.body
    assert isinstance(body, dict), body
    assert list(body) == ["message", "type", "param", "code"], body
    return body


# -- success --

def test_chat_completion_through_the_client(stack: Stack) -> None:
    client = _client(stack, KEYS["plain"], max_retries=0)
    raw = client.api.chat.completions.with_raw_response.create(
        model="sim-model", max_tokens=5,
        messages=[{"role": "user", "content": _exact_prompt(PROMPT)}],
        extra_body={"ignore_eos": True})
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (PROMPT, 5)
    # The concurrency cap is not a request rate: it is reported under fairway's own names.
    assert raw.headers["x-fairway-limit-concurrent-requests"] == "4"
    assert raw.headers["x-fairway-remaining-concurrent-requests"] == "3"  # this one running
    assert "x-ratelimit-limit-requests" not in raw.headers
    assert [a.status for a in client.attempts] == [200]


def test_streamed_chat_completion_through_the_client(stack: Stack) -> None:
    client = _client(stack, KEYS["plain"], max_retries=0)
    chunks = list(_chat(client, max_tokens=7, stream=True,
                        stream_options={"include_usage": True}))
    text = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text) == 7
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (PROMPT, 7)


# -- a burst budget is a rate limit: retried after Retry-After --

def test_burst_budget_is_a_rate_limit_the_client_waits_out(stack: Stack) -> None:
    client = _client(stack, KEYS["burst"], max_retries=0)
    _chat(client)  # 70 of the 100 tokens; the next request is 40 short (4 s of refill)
    before = _rejections(stack, "burst", "over_budget")
    with pytest.raises(openai.RateLimitError) as caught:
        _chat(client)
    error = caught.value
    assert error.status_code == 429
    assert (error.code, error.type) == ("rate_limit_exceeded", "tokens")
    assert "burst" in _error_object(error)["message"]
    headers = error.response.headers
    retry_after = int(headers["retry-after"])
    assert 1 <= retry_after <= 4
    assert "x-should-retry" not in headers
    assert headers["x-ratelimit-limit-tokens"] == str(BURST["tokens"])
    assert settled_metric(stack.metrics_url, "fairway_rejections_total", before + 1,
                          tenant="burst", reason="over_budget") == before + 1

    # The same with retries, on a tenant of its own whose bucket is full, so that its shortfall
    # does not hang on how long the above took: after one request, the first attempt (sent
    # right after it, by a client made beforehand) is refused, the client waits the
    # Retry-After it was given, and the retry passes because the bucket has refilled by then.
    # Had it used its own backoff (0.5 s, 1 s) both retries would have come too early.
    draining = _client(stack, KEYS["retry"], max_retries=0)
    retrying = _client(stack, KEYS["retry"], max_retries=2)
    before = _rejections(stack, "retry", "over_budget")
    _chat(draining)
    completion = _chat(retrying)
    assert completion.usage is not None and completion.usage.completion_tokens == OUTPUT
    first, second = retrying.attempts  # exactly one retry
    assert (first.status, second.status) == (429, 200)
    told = int(first.headers["retry-after"])
    assert told >= 2  # 40 short at 10 tokens a second, less what refilled in between
    # A lower bound only: the client sleeps at least what it was told, never less.
    assert second.at - first.at >= told
    assert settled_metric(stack.metrics_url, "fairway_rejections_total", before + 1,
                          tenant="retry", reason="over_budget") == before + 1


# -- a spent sustained budget is insufficient_quota: not retried --

def test_sustained_budget_is_insufficient_quota_and_not_retried(stack: Stack) -> None:
    client = _client(stack, KEYS["quota"], max_retries=2)
    _chat(client)  # 70 of the 100 tokens; the next request is 40 short (24 s of refill)
    before = _rejections(stack, "quota", "insufficient_quota")
    client.attempts.clear()
    with pytest.raises(openai.RateLimitError) as caught:
        _chat(client)
    error = caught.value
    assert (error.code, error.type) == ("insufficient_quota", "insufficient_quota")
    assert "sustained" in _error_object(error)["message"]
    assert error.response.headers["x-should-retry"] == "false"
    # Within the client's 2-minute ceiling: without x-should-retry it would have retried.
    assert 1 <= int(error.response.headers["retry-after"]) <= 120
    assert [a.status for a in client.attempts] == [429]  # max_retries=2, no retry made
    assert settled_metric(stack.metrics_url, "fairway_rejections_total", before + 1,
                          tenant="quota", reason="insufficient_quota") == before + 1
    assert _rejections(stack, "quota", "over_budget") == 0


# -- refusals that are the request's fault --

def test_unknown_api_key_is_an_authentication_error(stack: Stack) -> None:
    client = _client(stack, "fw-unknown-0123456789abcdef0123456789abcdef", max_retries=2)
    with pytest.raises(openai.AuthenticationError) as caught:
        _chat(client)
    error = caught.value
    assert error.status_code == 401
    assert (error.code, error.type) == ("invalid_api_key", "invalid_request_error")
    assert "fw-unknown" not in _error_object(error)["message"]  # the key is not echoed back
    assert [a.status for a in client.attempts] == [401]


def test_prompt_over_max_input_tokens_is_context_length_exceeded(stack: Stack) -> None:
    client = _client(stack, KEYS["short"], max_retries=2)
    before = _rejections(stack, "short", "input_too_long")
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, prompt_tokens=100, max_tokens=4)
    error = caught.value
    assert (error.code, error.type) == ("context_length_exceeded", "invalid_request_error")
    assert "100 tokens" in _error_object(error)["message"]
    assert [a.status for a in client.attempts] == [400]
    assert settled_metric(stack.metrics_url, "fairway_rejections_total", before + 1,
                          tenant="short", reason="input_too_long") == before + 1
    # At the cap it passes.
    assert _chat(client, prompt_tokens=PROMPT, max_tokens=4).choices[0].message.content
