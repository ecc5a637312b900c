"""Hostile requests through real Envoy: each gets a clear, counted refusal and loses nothing.

Deeply nested JSON, tenant ids that are too long, binary or sent twice, and stalled or oversized
uploads: the client gets an OpenAI error with the right status, the refusal is counted, the
picker's buffers and gauges return to zero, and the next honest request is served.

A stalled upload's 408 carries no Retry-After: the client may send the request again at once
(RFC 9110, 15.5.9; the ``openai`` clients retry a 408 by their own backoff), there is nothing to
wait for. A 503 for the global body budget does carry it: room comes back as others finish.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from picker.stack.launcher import Stack
from tests.e2e.conftest import TENANT_HEADER, chat_body, metric, wait_until
from tests.faults.helpers import assert_openai_error, gauges_drain, usage_records

LLMD_HEADER = "x-llm-d-inference-fairness-id"
USAGE = "usage.jsonl"
BODY_IDLE_TIMEOUT = 5
"""Seconds (``limits.bodyIdleTimeout``): a stalled upload holds its buffer this long, in which
the tests see it held and send a second upload beside it (at 1 s a loaded machine could miss
that window); it is also how long the stalled upload's 408 takes."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("hostile")
    # Each stalled-upload test has a tenant of its own, so its charges are its alone.
    config = {"tenants": [{"id": "a"}, {"id": "stalled"}, {"id": "buffered"}],
              "limits": {"maxBodyBytes": 100_000, "maxBufferedBytes": 150_000,
                         "bodyIdleTimeout": f"{BODY_IDLE_TIMEOUT}s"},
              "metering": {"output": str(workdir / USAGE)}}
    with Stack(workdir, endpoints=1, picker_config=config) as running:
        yield running


def _raw(stack: Stack, head: bytes, body: bytes = b"", *, read: bool = True,
         timeout: float = 20) -> tuple[int, dict[str, str], bytes] | socket.socket:
    """One HTTP/1.1 request written byte for byte (headers as given, even repeated or binary)."""
    conn = socket.create_connection(("127.0.0.1", stack.gateway_port), timeout=timeout)
    conn.sendall(head + b"\r\n" + body)
    if not read:
        return conn
    with conn:
        return _response(conn)


def _response(conn: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, lower-cased headers and body of the one response read from ``conn``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"connection closed before a whole response: {data!r}"
        data += chunk
    header_block, _, rest = data.partition(b"\r\n\r\n")
    lines = header_block.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = conn.recv(65536)
        assert chunk, f"connection closed mid-body: {rest!r}"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest


def _post(stack: Stack, body: bytes, extra: list[bytes] | None = None,
          length: int | None = None) -> tuple[int, dict[str, str], bytes]:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"content-type: application/json\r\n"
            + b"content-length: " + str(len(body) if length is None else length).encode()
            + b"\r\n" + b"".join(line + b"\r\n" for line in (extra or [])))
    result = _raw(stack, head, body)
    assert not isinstance(result, socket.socket)
    return result


def _error(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_deeply_nested_json_is_a_counted_400(stack: Stack) -> None:
    nested = b'{"model": "sim-model", "messages": ' + b"[" * 100_00 + b"]" * 100_00 + b"}"
    status, _, body = _post(stack, nested, [TENANT_HEADER.encode() + b": a"])
    assert status == 400, body
    assert "nested too deeply" in _error(body)["message"]
    assert metric(stack.metrics_url, "fairway_rejections_total", tenant="a",
                  reason="bad_request") >= 1
    assert metric(stack.metrics_url, "fairway_faults_total") == 0
    assert _post(stack, chat_body(max_tokens=1), [TENANT_HEADER.encode() + b": a"])[0] == 200


@pytest.mark.parametrize("value", [b"x" * 8000, b"team\xff\xfe", b"team a", b"-leading-dash"],
                         ids=["8000-chars", "not-utf8", "space", "leading-dash"])
def test_a_tenant_id_outside_the_rule_is_refused_400(stack: Stack, value: bytes) -> None:
    status, _, body = _post(stack, chat_body(max_tokens=1), [LLMD_HEADER.encode() + b": " + value])
    assert status == 400, body
    assert "must be a tenant id" in _error(body)["message"]
    assert value.decode("latin-1") not in _error(body)["message"]


@pytest.mark.parametrize("header", [LLMD_HEADER, TENANT_HEADER, "x-fairway-lane"])
def test_an_identity_header_sent_twice_is_refused_400(stack: Stack, header: str) -> None:
    name = header.encode()
    status, _, body = _post(stack, chat_body(max_tokens=1),
                            [name + b": a", name + b": someone-else"])
    assert status == 400, body
    assert "more than once" in _error(body)["message"]


def _charged_nothing(stack: Stack, tenant: str, refusals: int, reason: str) -> None:
    """``tenant``'s requests were each refused for ``reason`` before reaching an engine: counted,
    not metered (a refusal before the queue costs nothing), no service charged, and the queued,
    running and in-flight gauges at 0."""
    url = stack.metrics_url
    assert wait_until(lambda: metric(url, "fairway_rejections_total", tenant=tenant,
                                     reason=reason) == refusals)
    assert metric(url, "fairway_service_tokens_total", tenant=tenant) == 0
    assert metric(url, "fairway_weighted_service_total", tenant=tenant) == 0
    assert usage_records(stack.workdir / USAGE, tenant) == []
    drained = gauges_drain(stack)
    assert not any(drained.values()), drained


def test_a_stalled_upload_gets_408_and_gives_its_buffer_back(stack: Stack) -> None:
    body = chat_body(max_tokens=1)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n" + TENANT_HEADER.encode() + b": stalled\r\n")
    conn = _raw(stack, head, body[:10], read=False)
    assert isinstance(conn, socket.socket)
    with conn:
        assert wait_until(lambda: metric(stack.metrics_url, "fairway_buffered_body_bytes") > 0)
        # An upload still arriving holds a buffer, not a place in the queue nor a slot.
        for name in ("fairway_queued_requests", "fairway_running_requests"):
            assert metric(stack.metrics_url, name, tenant="stalled") == 0, name
        status, headers, raw = _response(conn)  # the picker gives up after bodyIdleTimeout
    # No Retry-After (see the module's docstring), and no ``x-should-retry: false`` either: the
    # client may repeat the request, and should.
    assert_openai_error(status, headers, json.loads(raw), 408, "request_timeout",
                        retryable=False)
    assert json.loads(raw)["error"]["type"] == "invalid_request_error", raw
    assert "x-should-retry" not in headers, headers
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_buffered_body_bytes") == 0)
    _charged_nothing(stack, "stalled", 1, "body_timeout")


def test_bodies_past_the_global_buffer_budget_get_503_with_retry_after(stack: Stack) -> None:
    # Two stalled uploads of 80 kB each hold 160 kB against a budget of 150 kB.
    body = b'{"model": "sim-model", "messages": [{"role": "user", "content": "' + b"x" * 80_000
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"content-type: application/json\r\ncontent-length: 99000\r\n"
            + TENANT_HEADER.encode() + b": buffered\r\n")
    first = _raw(stack, head, body, read=False)
    assert isinstance(first, socket.socket)
    with first:
        assert wait_until(lambda: metric(stack.metrics_url, "fairway_buffered_body_bytes")
                          >= 80_000)
        second = _raw(stack, head, body, read=False)
        assert isinstance(second, socket.socket)
        with second:
            second.settimeout(10)
            status, headers, raw = _response(second)
        assert_openai_error(status, headers, json.loads(raw), 503, "server_overloaded",
                            retryable=True)
        assert json.loads(raw)["error"]["type"] == "server_error", raw
        assert headers["retry-after"] == "1", headers
    # The first upload, cut by its client before it stalled for long, gave its buffer back too.
    assert wait_until(lambda: metric(stack.metrics_url, "fairway_buffered_body_bytes") == 0,
                      timeout=15)
    _charged_nothing(stack, "buffered", 1, "buffers_full")
    time.sleep(0.1)
    assert _post(stack, chat_body(max_tokens=1), [TENANT_HEADER.encode() + b": a"])[0] == 200
