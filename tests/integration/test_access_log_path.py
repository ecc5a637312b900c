"""The ``access-log`` response path, driven as Envoy drives it: the routing stream half-closed
once the request is routed, then Envoy's gRPC access log (``StreamAccessLogs``) reporting the
finished request with the usage its own filters read. What the picker charged is read from its
Prometheus page; the same path through a real Envoy is ``tests/e2e/test_gateway.py``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3 import address_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import struct_pb2, wrappers_pb2

from picker.extproc.accesslog import USAGE_NAMESPACE, logged_response
from picker.stack.envoy import USAGE_NAMESPACE as ENVOY_USAGE_NAMESPACE
from picker.stack.envoy import envoy_config
from tests.integration.test_extproc_contract import (
    CHAT,
    TENANT_HEADER,
    Picker,
    chat_body,
    expect_route,
    fetch,
    header_mutation,
    running_picker,
    send_request,
    sse_events,
    streamed,
)

pytestmark = pytest.mark.integration

LOGGED = (("fairway-response-path", "access-log"),)


async def route_logged(picker: Picker, body: bytes, tenant: str) -> tuple[str, str, bytes]:
    """Route on an access-log stream, which Envoy half-closes: the endpoint, the request's
    name and the body as the picker handed it on."""
    stream = picker.open(LOGGED)
    await send_request(stream, body, headers={TENANT_HEADER: tenant})
    first = await stream.reply()
    name = first.dynamic_metadata.fields["fairway"].struct_value.fields["request"].string_value
    sent, _ = streamed(await stream.reply(), "request_body")
    await stream.call.done_writing()
    assert await stream.ended()
    return header_mutation(first, "request_headers")["x-gateway-destination-endpoint"], name, sent


def log_entry(name: str | None, *, status: int = 200, usage: dict[str, int] | None = None,
              client_gone: bool = False, body_bytes: int = 100, upstream: str | None = None,
              details: str = "via_upstream") -> accesslog_pb2.HTTPAccessLogEntry:
    """An entry as Envoy's ``http_grpc`` logger writes it."""
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    if name is not None:
        fairway = struct_pb2.Struct()
        fairway.update({"request": name})
        common.metadata.filter_metadata["fairway"].CopyFrom(fairway)
    if usage is not None:
        counts = struct_pb2.Struct()
        counts.update(usage)
        common.metadata.filter_metadata[USAGE_NAMESPACE].CopyFrom(counts)
    if upstream is not None:
        host, port = upstream.rsplit(":", 1)
        common.upstream_remote_address.CopyFrom(address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address=host, port_value=int(port))))
    common.response_flags.downstream_connection_termination = client_gone
    common.time_to_first_upstream_rx_byte.FromMilliseconds(30)
    entry.response.response_code.CopyFrom(wrappers_pb2.UInt32Value(value=status))
    entry.response.response_code_details = details
    entry.response.response_body_bytes = body_bytes
    return entry


async def send_log(picker: Picker, *entries: accesslog_pb2.HTTPAccessLogEntry) -> None:
    """One batch on Envoy's access log stream (the first message carries the identifier)."""
    message = als_pb2.StreamAccessLogsMessage()
    message.identifier.log_name = "fairway"
    message.http_logs.log_entry.extend(entries)
    stub = als_pb2_grpc.AccessLogServiceStub(picker.channel)
    await stub.StreamAccessLogs(iter([message]))


async def charged(picker: Picker, tenant: str) -> tuple[float, float]:
    return (await picker.metric("fairway_service_tokens_total", tenant=tenant, kind="prompt"),
            await picker.metric("fairway_service_tokens_total", tenant=tenant,
                                kind="completion"))


def last_usage(data: bytes, events: int | None = None) -> dict[str, int]:
    """The usage of the last chunk that has one (of the first ``events`` chunks)."""
    chunks = sse_events(data)[:events]
    return [c["usage"] for c in chunks if c.get("usage")][-1]


@pytest.fixture
async def picker(tmp_path: Path) -> Any:
    async with running_picker(tmp_path, endpoints=2,
                              tenants=[{"id": "a"}, {"id": "b"}]) as running:
        yield running


def test_the_namespace_is_the_one_envoys_filters_write() -> None:
    assert USAGE_NAMESPACE == ENVOY_USAGE_NAMESPACE
    config = envoy_config(8080, 9901, 9002, response_path="access-log")
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    # One ext_proc filter (no meter stream), the usage filters, then the router.
    assert names == ["envoy.filters.http.ext_proc", "fairway.usage.sse", "fairway.usage.json",
                     "envoy.filters.http.router"]
    assert [log["name"] for log in manager["access_log"]] == ["envoy.access_loggers.http_grpc"]


async def test_a_stream_is_asked_for_usage_in_every_chunk(picker: Picker) -> None:
    _, _, sent = await route_logged(picker, chat_body(max_tokens=5, stream=True), "a")
    assert json.loads(sent)["stream_options"] == {"include_usage": True,
                                                  "continuous_usage_stats": True}
    # A body that already asks is handed on as it came.
    body = chat_body(max_tokens=5, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})
    _, _, sent = await route_logged(picker, body, "b")
    assert sent == body
    # A client that turns the counts off (to leave uncounted mid-stream) is overruled.
    refused = chat_body(max_tokens=5, stream=True, stream_options={
        "include_usage": False, "continuous_usage_stats": False})
    _, _, sent = await route_logged(picker, refused, "b")
    assert json.loads(sent)["stream_options"] == {"include_usage": True,
                                                  "continuous_usage_stats": True}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_the_entry_settles_the_request_to_the_engines_usage(picker: Picker,
                                                                  stream: bool) -> None:
    endpoint, name, sent = await route_logged(
        picker, chat_body("tell me a story", max_tokens=9, stream=stream), "a")
    await picker.eventually("fairway_running_requests", 1, tenant="a")
    upstream = await fetch(endpoint, CHAT, sent)
    usage = last_usage(upstream.data) if stream else json.loads(upstream.data)["usage"]
    # Nothing is charged for output until the entry comes: the stream's end.
    assert (await charged(picker, "a"))[1] == 0
    await send_log(picker, log_entry(name, usage={"prompt": usage["prompt_tokens"],
                                                  "completion": usage["completion_tokens"]},
                                     upstream=endpoint, body_bytes=len(upstream.data)))
    await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    assert await charged(picker, "a") == (usage["prompt_tokens"], 9)
    assert await picker.metric("fairway_endpoint_inflight_tokens") == 0
    assert await picker.metric("fairway_running_requests") == 0
    # The TTFT is recorded from the entry's first upstream byte.
    assert await picker.metric("fairway_ttft_seconds_count", tenant="a") == 1


async def test_a_client_that_left_is_charged_the_last_count_it_was_sent(picker: Picker) -> None:
    endpoint, name, sent = await route_logged(
        picker, chat_body("tell me a story", max_tokens=40, stream=True), "a")
    upstream = await fetch(endpoint, CHAT, sent)
    cut = last_usage(upstream.data, events=7)  # the client read seven chunks, then left
    assert 0 < cut["completion_tokens"] < 40
    await send_log(picker, log_entry(name, client_gone=True,
                                     usage={"prompt": cut["prompt_tokens"],
                                            "completion": cut["completion_tokens"]}))
    await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="cancelled")
    assert await charged(picker, "a") == (cut["prompt_tokens"], cut["completion_tokens"])
    assert await picker.metric("fairway_endpoint_inflight_tokens") == 0


async def test_output_without_a_count_is_charged_the_estimate_never_nothing(
        picker: Picker) -> None:
    # An engine that reports no usage, or a stream cut before its first usage chunk.
    _, name, _ = await route_logged(picker, chat_body(max_tokens=50, stream=True), "a")
    await send_log(picker, log_entry(name, client_gone=True, body_bytes=900))
    await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="unmetered")
    assert (await charged(picker, "a"))[1] > 0
    # A client gone before any byte was sent is charged no output.
    _, name, _ = await route_logged(picker, chat_body(max_tokens=50, stream=True), "b")
    await send_log(picker, log_entry(name, client_gone=True, body_bytes=0))
    await picker.eventually("fairway_requests_total", 1, tenant="b", outcome="cancelled")
    assert (await charged(picker, "b"))[1] == 0


async def test_a_messages_stream_left_early_is_charged_what_its_bytes_carried(
        picker: Picker) -> None:
    """A /v1/messages stream reports its output count only at its end (message_delta): one the
    client left early was charged its whole max_tokens (issue 26)."""
    body = json.dumps({"model": "m", "max_tokens": 2000, "stream": True,
                       "messages": [{"role": "user", "content": "tell me a long story"}]}).encode()
    stream = picker.open(LOGGED)
    await send_request(stream, body, path="/v1/messages", headers={TENANT_HEADER: "a"})
    first = await stream.reply()
    name = first.dynamic_metadata.fields["fairway"].struct_value.fields["request"].string_value
    await stream.reply()
    await stream.call.done_writing()
    assert await stream.ended()
    # message_start (~300 bytes) and 30 one-token deltas of ~120 bytes, then the client left.
    await send_log(picker, log_entry(name, usage={"prompt": 9}, client_gone=True,
                                     body_bytes=300 + 30 * 120))
    await picker.eventually("fairway_requests_total", 1, tenant="a")
    _, output = await charged(picker, "a")
    assert 30 <= output <= 40, output  # the output estimate before (256 here), up to 2000
    assert await picker.metric("fairway_requests_total", tenant="a", outcome="cancelled") == 1


async def test_failed_requests_are_not_charged_output(picker: Picker) -> None:
    endpoint, name, _ = await route_logged(picker, chat_body(max_tokens=5), "a")
    await send_log(picker, log_entry(name, status=400, usage={"prompt": 7}))
    await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="error")
    # The engine refused it (a prompt past the context, say): nothing computed, nothing
    # charged, not the prompt estimate (issue 26).
    assert await charged(picker, "a") == (0, 0)
    # Never reached an engine: settled to nothing.
    endpoint, name, _ = await route_logged(picker, chat_body(max_tokens=5), "b")
    await send_log(picker, log_entry(
        name, status=503, upstream=endpoint, body_bytes=0,
        details="upstream_reset_before_response_started{connection_failure}"))
    await picker.eventually("fairway_requests_total", 1, tenant="b", outcome="upstream_failed")
    assert await charged(picker, "b") == (0, 0)


async def test_entries_for_other_requests_are_ignored_and_a_batch_is_read_whole(
        picker: Picker) -> None:
    _, name, _ = await route_logged(picker, chat_body(max_tokens=4), "a")
    # A refusal or pass-through (no name), an unknown name, then the request: one batch.
    await send_log(picker, log_entry(None), log_entry("not-a-request"),
                   log_entry(name, usage={"prompt": 6, "completion": 4}))
    await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    assert await charged(picker, "a") == (6, 4)
    # A second entry for the same request changes nothing.
    await send_log(picker, log_entry(name, usage={"prompt": 60, "completion": 40}))
    assert await charged(picker, "a") == (6, 4)


async def test_a_request_whose_entry_never_comes_is_settled_on_its_estimate(
        tmp_path: Path) -> None:
    async with running_picker(tmp_path, log_claim_timeout=0.3,
                              tenants=[{"id": "a"}]) as picker:
        await route_logged(picker, chat_body(max_tokens=30, stream=True), "a")
        await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="unmetered")
        assert (await charged(picker, "a"))[1] > 0
        assert await picker.metric("fairway_meter_unclaimed_total") == 1
        assert await picker.metric("fairway_endpoint_inflight_tokens") == 0


def test_the_entry_is_read_as_envoy_writes_it() -> None:
    entry = log_entry("r-1", usage={"prompt": 11, "completion": 3, "cached": 8},
                      upstream="10.0.0.7:8000")
    logged = logged_response(entry)
    assert logged is not None
    assert (logged.request_id, logged.status, logged.served) == ("r-1", 200, "10.0.0.7:8000")
    assert logged.usage(prompt_only=False) is not None
    assert (logged.prompt_tokens, logged.completion_tokens, logged.cached_tokens) == (11, 3, 8)
    assert logged.first_byte == pytest.approx(0.03)
    assert logged_response(log_entry(None)) is None
    ipv6 = logged_response(log_entry("r-2", upstream="fd00::7:8000"))
    assert ipv6 is not None and ipv6.served == "[fd00::7]:8000"
    # Embeddings report a prompt count only; a chat answer needs both.
    prompt_only = logged_response(log_entry("r-3", usage={"prompt": 5}))
    assert prompt_only is not None
    assert prompt_only.usage(prompt_only=True) is not None
    assert prompt_only.usage(prompt_only=False) is None


async def test_a_read_of_the_engine_ends_the_prefill_no_first_token_will(picker: Picker) -> None:
    """No token of an access-log stream reaches the picker before its end, so its prefill ends
    when a read of the engine shows it out of the waiting queue (``Gate.scraped``); an inline
    stream's ends with its first token, however many reads come."""
    inline = picker.open()
    await send_request(inline, chat_body("tell me a story", max_tokens=9, stream=True),
                       headers={TENANT_HEADER: "a"})
    await expect_route(inline, None, end=None)
    await picker.eventually("fairway_running_requests", 1, tenant="a")
    inline_prefill = await picker.metric("fairway_endpoint_prefill_tokens")
    assert inline_prefill > 0
    await route_logged(picker, chat_body("tell me a longer story", max_tokens=9, stream=True),
                       "b")
    await picker.eventually("fairway_running_requests", 1, tenant="b")
    # The engines wait on nothing: the first read sent after the logged stream ends its prefill.
    await picker.eventually("fairway_endpoint_prefill_tokens", inline_prefill)
    await asyncio.sleep(0.3)  # six reads at 50 ms
    assert await picker.metric("fairway_endpoint_prefill_tokens") == inline_prefill
    assert await picker.metric("fairway_running_requests") == 2
