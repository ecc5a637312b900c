"""The picker dies under a fail-closed gateway: clients get a retryable 503 with an OpenAI-style
body (Envoy's ``status_on_error`` and a local reply), never an empty 500; the picker's own
refusals keep their bodies."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(tmp_path_factory.mktemp("unreachable"), endpoints=1,
               picker_config={"tenants": [{"id": "a"}]}) as running:
        yield running


def _post(stack: Stack, body: bytes, path: str = "/v1/chat/completions"
          ) -> tuple[int, dict[str, str], dict]:
    request = urllib.request.Request(stack.gateway_url + path, data=body, headers={
        TENANT_HEADER: "a", "content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, \
            json.loads(error.read() or b"{}")


def test_a_dead_picker_is_a_retryable_503_with_an_openai_body(stack: Stack) -> None:
    status, headers, answer = _post(stack, b"{not json")  # the picker's own refusal
    assert status == 400
    assert answer["error"]["code"] == "invalid_request"
    status, _, _ = _post(stack, chat_body(max_tokens=1))
    assert status == 200
    picker = next(p for p in stack.processes if "picker" in p.args and "serve" in p.args)
    os.killpg(picker.pid, signal.SIGKILL)
    picker.wait(10)
    status, headers, answer = _post(stack, chat_body(max_tokens=1))
    assert status == 503
    assert headers.get("content-type") == "application/json", (headers, answer)
    assert headers["retry-after"] == "1"
    assert answer["error"]["code"] == "picker_unavailable"
    assert answer["error"]["type"] == "server_error"
