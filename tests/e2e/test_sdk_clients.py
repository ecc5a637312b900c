"""The official ``anthropic`` client, and the ``openai`` clients in their OpenAI and Azure forms,
through real Envoy and the picker in API-key mode, each sending its key where its API puts it:
Anthropic's ``x-api-key``, Azure OpenAI's ``api-key``, OpenAI's ``Authorization: Bearer``.

Each SDK authenticates with its own header, streams, reads fairway's refusals as its API's own
errors (Anthropic's error shape on ``/v1/messages``), and retries a spent burst budget's 429 after
``Retry-After`` with its own retry logic. A tenant header the client adds beside its key names no
tenant (the stack's Envoy passes it through here, ``trusted-client``, so this is the picker's own
guarantee; tests/faults/test_forged_identity.py has it behind the shipped Envoy, and checks that
no key reaches the model server). Outcomes are asserted on the picker's counts (requests by
tenant, rejections), and each attempt the client made is recorded by an ``httpx`` hook.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import openai
import pytest

from picker.identity import hash_api_key
from picker.stack.launcher import Stack
from tests.e2e.conftest import metric, settled_metric

TENANT_HEADER = "x-llm-d-inference-fairness-id"
SPOOF = {TENANT_HEADER: "victim", "x-gateway-inference-fairness-id": "victim"}
KEYS = {tenant: f"fw-{tenant}-0123456789abcdef0123456789abcdef"
        for tenant in ("claude", "azure", "openai", "retry")}
BURST = {"tokens": 100, "per": "10s"}
"""10 tokens a second: after one request of about 60 tokens the next is short by several seconds
of refill, more than the SDKs' own first backoffs (0.5 s to 1 s): only ``Retry-After`` gets a
retry through."""
TENANTS: list[dict[str, Any]] = [{"id": "claude"}, {"id": "azure"}, {"id": "openai"},
                                 {"id": "victim"}, {"id": "retry", "budgets": {"burst": BURST}}]
AZURE_API_VERSION = "2025-04-01-preview"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {
        "tenancy": {"mode": "apiKey",
                    "apiKeys": [{"sha256": hash_api_key(key), "tenant": tenant}
                                for tenant, key in KEYS.items()]},
        "tenants": TENANTS,
    }
    with Stack(tmp_path_factory.mktemp("sdk-clients"), policy="vtc", endpoints=1,
               server_args=["--step-ms", "2"], picker_config=config) as running:
        yield running


@dataclass
class Attempts:
    """Every HTTP response a client received: its status and headers."""

    seen: list[tuple[int, dict[str, str], float]] = field(default_factory=list)

    def hook(self, response: Any) -> None:
        self.seen.append((response.status_code,
                          {k.lower(): v for k, v in response.headers.items()}, time.monotonic()))

    @property
    def statuses(self) -> list[int]:
        return [status for status, _, _ in self.seen]


def _anthropic(stack: Stack, key: str, attempts: Attempts, max_retries: int = 0,
               **options: Any) -> anthropic.Anthropic:
    http = anthropic.DefaultHttpxClient(trust_env=False, event_hooks={"response": [attempts.hook]})
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key=key, max_retries=max_retries,
                               timeout=60.0, http_client=http, **options)


def _azure(stack: Stack, key: str, attempts: Attempts, **options: Any) -> openai.AzureOpenAI:
    http = openai.DefaultHttpxClient(trust_env=False, event_hooks={"response": [attempts.hook]})
    # The Responses API is not a deployment path: the client calls <base_url>/responses.
    return openai.AzureOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key,
                              api_version=AZURE_API_VERSION, max_retries=0, timeout=60.0,
                              http_client=http, **options)


def _message(client: anthropic.Anthropic, max_tokens: int = 5, **extra: Any) -> Any:
    return client.messages.create(
        model="sim-model", max_tokens=max_tokens,
        messages=[{"role": "user", "content": "hello there"}],
        extra_body={"ignore_eos": True}, **extra)


def _requests(stack: Stack, tenant: str) -> float:
    return metric(stack.metrics_url, "fairway_requests_total", tenant=tenant)


def _charged_once_to(stack: Stack, tenant: str, before: float) -> None:
    assert settled_metric(stack.metrics_url, "fairway_requests_total", before + 1,
                          tenant=tenant) == before + 1
    assert _requests(stack, "victim") == 0


# -- Anthropic: x-api-key on /v1/messages --

def test_anthropic_sdk_authenticates_with_x_api_key_a_spoofed_tenant_ignored(
        stack: Stack) -> None:
    attempts = Attempts()
    client = _anthropic(stack, KEYS["claude"], attempts, default_headers=SPOOF)
    before = _requests(stack, "claude")
    message = _message(client)
    assert message.type == "message" and message.content[0].type == "text"
    assert message.usage.output_tokens == 5
    assert attempts.statuses == [200]
    _charged_once_to(stack, "claude", before)


def test_anthropic_sdk_streams(stack: Stack) -> None:
    client = _anthropic(stack, KEYS["claude"], Attempts())
    before = _requests(stack, "claude")
    with client.messages.stream(model="sim-model", max_tokens=7,
                                messages=[{"role": "user", "content": "hello there"}],
                                extra_body={"ignore_eos": True}) as stream:
        deltas = [event for event in stream
                  if event.type == "content_block_delta" and event.delta.type == "text_delta"]
        final = stream.get_final_message()
    assert len(deltas) == 7
    assert final.usage.output_tokens == 7
    _charged_once_to(stack, "claude", before)


def test_anthropic_sdk_reads_an_unknown_key_as_its_authentication_error(stack: Stack) -> None:
    attempts = Attempts()
    client = _anthropic(stack, "fw-unknown-0123456789abcdef", attempts, max_retries=2)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _message(client)
    error = caught.value
    assert error.status_code == 401
    assert isinstance(error.body, dict) and error.body["type"] == "error"
    assert error.body["error"]["type"] == "authentication_error"
    assert "fw-unknown" not in str(error.body)
    assert attempts.statuses == [401]  # not retried


def test_anthropic_sdk_with_two_different_keys_is_refused(stack: Stack) -> None:
    """Another API's key header (``api-key``, as a proxy or a shared header config adds it)
    beside the SDK's ``x-api-key``: two keys of two tenants in one request is refused, charged
    to neither. (The SDK itself sends one credential: given an ``Authorization`` header it drops
    its ``x-api-key``.)"""
    attempts = Attempts()
    client = _anthropic(stack, KEYS["claude"], attempts,
                        default_headers={"api-key": KEYS["azure"]})
    before = (_requests(stack, "claude"), _requests(stack, "azure"))
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _message(client)
    assert "two different API keys" in caught.value.body["error"]["message"]
    assert attempts.statuses == [401]
    # The same key in both is one key.
    same = _anthropic(stack, KEYS["claude"], Attempts(),
                      default_headers={"api-key": KEYS["claude"]})
    assert _message(same).usage.output_tokens == 5
    assert settled_metric(stack.metrics_url, "fairway_requests_total", before[0] + 1,
                          tenant="claude") == before[0] + 1
    assert _requests(stack, "azure") == before[1]


def test_anthropic_sdk_retries_a_spent_burst_after_retry_after(stack: Stack) -> None:
    """The first attempt is refused 429 with Retry-After (several seconds of refill), the SDK
    waits what it was told and its one retry passes. Its own backoff (0.5 s, then 1 s) would
    have come too early for both retries: exactly one retry, passed, shows the header ruled."""
    draining = _anthropic(stack, KEYS["retry"], Attempts())
    attempts = Attempts()
    retrying = _anthropic(stack, KEYS["retry"], attempts, max_retries=2)
    refused_before = metric(stack.metrics_url, "fairway_rejections_total", tenant="retry",
                            reason="over_budget")
    served_before = _requests(stack, "retry")
    _message(draining, max_tokens=50)
    message = _message(retrying, max_tokens=50)
    assert message.usage.output_tokens == 50
    assert attempts.statuses == [429, 200]
    first, second = attempts.seen
    told = int(first[1]["retry-after"])
    assert told >= 2
    assert second[2] - first[2] >= told  # never earlier than told (a lower bound only)
    # The picker's own count: one refusal, two served.
    assert settled_metric(stack.metrics_url, "fairway_rejections_total", refused_before + 1,
                          tenant="retry", reason="over_budget") == refused_before + 1
    assert settled_metric(stack.metrics_url, "fairway_requests_total", served_before + 2,
                          tenant="retry") == served_before + 2


# -- Azure OpenAI: api-key --

def test_azure_sdk_authenticates_with_api_key_a_spoofed_tenant_ignored(stack: Stack) -> None:
    attempts = Attempts()
    client = _azure(stack, KEYS["azure"], attempts, default_headers=SPOOF)
    before = _requests(stack, "azure")
    response = client.responses.create(model="sim-model", input="hello there",
                                       max_output_tokens=4)
    assert response.output_text
    assert attempts.statuses == [200]
    _charged_once_to(stack, "azure", before)


def test_azure_sdk_reads_an_unknown_key_as_its_authentication_error(stack: Stack) -> None:
    attempts = Attempts()
    client = _azure(stack, "fw-unknown-0123456789abcdef", attempts)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.responses.create(model="sim-model", input="hello", max_output_tokens=4)
    assert (caught.value.code, caught.value.status_code) == ("invalid_api_key", 401)
    assert attempts.statuses == [401]


# -- OpenAI: Authorization: Bearer --

def test_openai_sdk_with_a_spoofed_tenant_header_is_charged_to_its_key(stack: Stack) -> None:
    attempts = Attempts()
    http = openai.DefaultHttpxClient(trust_env=False, event_hooks={"response": [attempts.hook]})
    client = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=KEYS["openai"],
                           max_retries=0, http_client=http, default_headers=SPOOF)
    before = _requests(stack, "openai")
    chunks = list(client.chat.completions.create(
        model="sim-model", max_tokens=3, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hello there"}], extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 3
    _charged_once_to(stack, "openai", before)
