"""Every inference path, and every spelling of one, goes through the fair queue (real Envoy).

A path that escapes the queue escapes budgets, caps, lanes and metering: a tenant refused with
429 must not get a 200 from any other spelling of the same path. Each API the engine serves
(completions, chat, responses, embeddings, Anthropic messages) is admitted, charged and settled;
anything else is refused with an OpenAI error unless it is on the pass-through list.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import aiohttp
import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, metric, settled_metric

PROMPT = "the cat sat on the mat " * 4
BODIES = {
    "/v1/completions": {"model": "sim-model", "prompt": PROMPT, "max_tokens": 3},
    "/v1/chat/completions": {"model": "sim-model", "max_tokens": 3,
                             "messages": [{"role": "user", "content": PROMPT}]},
    "/v1/responses": {"model": "sim-model", "input": PROMPT, "max_output_tokens": 3},
    "/v1/embeddings": {"model": "sim-model", "input": PROMPT},
    "/v1/messages": {"model": "sim-model", "max_tokens": 3,
                     "messages": [{"role": "user", "content": PROMPT}]},
}
SPELLINGS = [
    "/v1/chat/%63ompletions", "//v1/chat/completions", "/v1//chat/completions",
    "/v1/./chat/completions", "/v1/x/../chat/completions", "/v1/chat/completions/",
    "/V1/Chat/Completions", "/v1/chat%2Fcompletions", "/v1%2Fchat%2Fcompletions",
    "/v1/chat/completions?x=1", "/v1/chat/completions#frag", "/v1/chat/%2563ompletions",
    "/v1/chat\\completions", "/%76%31/%63%68%61%74/%63%6f%6d%70%6c%65%74%69%6f%6e%73",
]
"""Spellings of /v1/chat/completions a model server may decode into the real path."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = {"tenants": [
        {"id": "a"},
        {"id": "speller"},
        # Over its burst budget from the first request: every attempt must be refused.
        {"id": "broke", "budgets": {"burst": {"tokens": 1, "per": "24h"}}},
    ]}
    with Stack(tmp_path_factory.mktemp("paths"), endpoints=1, server_args=["--step-ms", "2"],
               picker_config=config) as running:
        yield running


def _send(stack: Stack, tenant: str, path: str, body: dict | None, method: str = "POST",
          stream: bool = False) -> tuple[int, bytes]:
    payload = None if body is None else json.dumps({**body, "stream": stream}).encode()

    async def go() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session, session.request(
                method, stack.gateway_url + path, data=payload, allow_redirects=False,
                headers={TENANT_HEADER: tenant, "content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=20)) as response:
            return response.status, await response.read()
    # yarl would normalise the path itself: send it as written.
    return asyncio.run(go())


def _engine_requests(stack: Stack) -> float:
    url = f"http://{stack.endpoint_addresses[0]}/metrics"
    return metric(url, "vllm:request_success_total")


@pytest.mark.parametrize(("path", "stream"), [
    (path, stream) for path in BODIES for stream in (False, True)
    if not (stream and path == "/v1/embeddings")])  # embeddings have no streaming mode
def test_each_inference_api_is_admitted_charged_and_settled(stack: Stack, path: str,
                                                            stream: bool) -> None:
    before = metric(stack.metrics_url, "fairway_requests_total", tenant="a", outcome="ok")
    prompt_before = metric(stack.metrics_url, "fairway_service_tokens_total", tenant="a",
                           kind="prompt")
    status, body = _send(stack, "a", path, BODIES[path], stream=stream)
    assert status == 200, body
    assert settled_metric(stack.metrics_url, "fairway_requests_total", before + 1,
                          tenant="a", outcome="ok") == before + 1
    assert metric(stack.metrics_url, "fairway_service_tokens_total", tenant="a",
                  kind="prompt") > prompt_before


def test_no_spelling_lets_a_refused_tenant_reach_the_engine(stack: Stack) -> None:
    # A budget never refuses a tenant's first request outright (it could never pass): spend it.
    statuses = [_send(stack, "broke", "/v1/chat/completions", BODIES["/v1/chat/completions"])[0]
                for _ in range(3)]
    assert statuses[-1] == 429, statuses
    served = _engine_requests(stack)
    for path in [*SPELLINGS, *BODIES]:
        status, body = _send(stack, "broke", path, BODIES["/v1/chat/completions"])
        assert status != 200 and status < 500, (path, status, body)
    assert _engine_requests(stack) == served


def test_each_spelling_is_queued_and_charged_like_the_plain_path(stack: Stack) -> None:
    statuses = {path: _send(stack, "speller", path, BODIES["/v1/chat/completions"])[0]
                for path in SPELLINGS}
    # Every spelling went through the fair queue, was charged, and was served: the engine is
    # sent the path the picker judged (an odd spelling went to it as is and got a 404 that was
    # charged; issue 26).
    settled = settled_metric(stack.metrics_url, "fairway_requests_total", len(SPELLINGS),
                             tenant="speller", outcome="ok")
    assert settled == len(SPELLINGS), statuses
    assert all(status == 200 for status in statuses.values()), statuses
    assert metric(stack.metrics_url, "fairway_rejections_total", tenant="speller") == 0


def test_other_paths_are_refused_or_passed_only_from_the_list(stack: Stack) -> None:
    status, body = _send(stack, "a", "/v1/models", None, method="GET")
    assert status == 200, body
    status, body = _send(stack, "a", "/tokenize", {"model": "sim-model", "prompt": "x"})
    assert status == 404
    assert json.loads(body)["error"]["code"] == "unknown_url"
    status, body = _send(stack, "a", "/v1/chat/completions", None, method="GET")
    assert status == 405
    assert json.loads(body)["error"]["code"] == "method_not_allowed"
