"""API-key mode through the picker's ext_proc service: the key header of each API's SDK
authenticates, two different keys are refused in the error shape of the request's API, and the
routing answer removes every key header, so no tenant's key reaches a model server whatever
gateway is in front (the picker's own header mutation, in each body mode).

The picker runs in-process over a simulated server and the test plays the gateway, as in
``test_epp_protocol``; the same through real Envoy and the official SDKs is in
tests/e2e/test_sdk_clients.py and tests/faults/test_forged_identity.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from picker.identity import KEY_HEADERS, hash_api_key
from tests.integration.test_extproc_contract import (
    CHAT,
    DESTINATION,
    TENANT_HEADER,
    Picker,
    chat_body,
    fetch,
    header_mutation,
    refusal,
    relay_response,
    request_body,
    request_headers,
    running_picker,
)

pytestmark = pytest.mark.integration

MODE = processing_mode_pb2.ProcessingMode
ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef"
MESSAGES = "/v1/messages"


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[Picker]:
    async with running_picker(
            tmp_path,
            tenancy={"mode": "apiKey", "apiKeys": [
                {"sha256": hash_api_key(ALICE), "tenant": "alice"},
                {"sha256": hash_api_key(BOB), "tenant": "bob"}]},
            tenants=[{"id": "alice"}, {"id": "bob"}, {"id": "victim"}]) as picker:
        yield picker


def _key(name: str, key: str) -> tuple[str, str]:
    return (name, f"Bearer {key}" if name == "authorization" else key)


def _headers(path: str, pairs: list[tuple[str, str]],
             mode: int = MODE.FULL_DUPLEX_STREAMED) -> pb.ProcessingRequest:
    """Request headers carrying ``pairs`` in order, repeated names kept (a dict would merge
    them), and a forged tenant header."""
    message = request_headers(path, headers={TENANT_HEADER: "victim"})
    message.request_headers.headers.headers.extend(
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs)
    message.protocol_config.request_body_mode = mode
    return message


def _messages_body() -> bytes:
    return json.dumps({"model": "sim-model", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hello"}]}).encode()


def _removed(reply: pb.ProcessingResponse, phase: str) -> set[str]:
    return set(getattr(reply, phase).response.header_mutation.remove_headers)


async def _served(picker: Picker, pairs: list[tuple[str, str]], tenant: str,
                  mode: int = MODE.FULL_DUPLEX_STREAMED) -> None:
    """One chat request with ``pairs`` is routed, with every key header removed toward the
    engine, and charged to ``tenant``."""
    before = await picker.metric("fairway_requests_total", tenant=tenant)
    stream = picker.open()
    body = chat_body(max_tokens=1)
    await stream.send(_headers(CHAT, pairs, mode))
    if mode == MODE.BUFFERED:
        assert (await stream.reply()).WhichOneof("response") == "request_headers"
    await stream.send(request_body(body, True))
    reply = await stream.reply()
    phase = reply.WhichOneof("response")
    assert phase == ("request_body" if mode == MODE.BUFFERED else "request_headers"), reply
    assert set(KEY_HEADERS) <= _removed(reply, phase)
    destination = header_mutation(reply, phase)[DESTINATION]
    if phase == "request_headers":
        reply = await stream.reply()  # the body, handed on
        sent = reply.request_body.response.body_mutation.streamed_response.body
    else:
        sent = reply.request_body.response.body_mutation.body or body
    upstream = await fetch(destination, CHAT, sent)
    await relay_response(stream, 200, upstream.content_type, [upstream.data])
    await picker.eventually("fairway_requests_total", before + 1, tenant=tenant)
    assert await picker.metric("fairway_requests_total", tenant="victim") == 0


@pytest.mark.parametrize("name", KEY_HEADERS)
async def test_each_key_header_authenticates_and_none_reaches_the_engine(
        keyed: Picker, name: str) -> None:
    await _served(keyed, [_key(name, BOB)], "bob")


async def test_buffered_mode_removes_the_key_headers_from_the_body_answer(keyed: Picker) -> None:
    await _served(keyed, [_key("x-api-key", ALICE)], "alice", MODE.BUFFERED)


@pytest.mark.parametrize("pairs", [
    [_key("x-api-key", ALICE), _key("x-api-key", ALICE)],
    [_key("authorization", ALICE), _key("x-api-key", ALICE), _key("api-key", ALICE)],
], ids=["repeated-identical", "three-headers-one-key"])
async def test_the_same_key_twice_is_one_key(keyed: Picker, pairs: list[tuple[str, str]]) -> None:
    await _served(keyed, pairs, "alice")


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("pairs", [
    [_key("authorization", ALICE), _key("x-api-key", BOB)],
    [_key("x-api-key", ALICE), _key("api-key", BOB)],
    [_key("x-api-key", ALICE), _key("x-api-key", BOB)],
], ids=["bearer-vs-x-api-key", "x-api-key-vs-api-key", "x-api-key-repeated-with-another"])
async def test_two_different_keys_are_refused_401_in_the_api_s_error_shape(
        keyed: Picker, path: str, pairs: list[tuple[str, str]]) -> None:
    stream = keyed.open()
    await stream.send(_headers(path, pairs))
    reply = await stream.reply()
    refused = refusal(reply)
    assert refused.status == 401
    raw = json.loads(reply.immediate_response.body)
    if path == MESSAGES:
        assert raw["type"] == "error"
        assert refused.error["type"] == "authentication_error"
    else:
        assert (refused.error["type"], refused.error["code"]) == ("invalid_request_error",
                                                                  "invalid_api_key")
    assert "different" in refused.error["message"]
    assert ALICE not in reply.immediate_response.body.decode()
    assert BOB not in reply.immediate_response.body.decode()
    await stream.close()


async def test_anthropic_s_header_on_messages_is_served(keyed: Picker) -> None:
    before = await keyed.metric("fairway_requests_total", tenant="bob")
    stream = keyed.open()
    body = _messages_body()
    await stream.send(_headers(MESSAGES, [_key("x-api-key", BOB)]))
    await stream.send(request_body(body, True))
    reply = await stream.reply()
    assert set(KEY_HEADERS) <= _removed(reply, "request_headers")
    destination = header_mutation(reply, "request_headers")[DESTINATION]
    sent = (await stream.reply()).request_body.response.body_mutation.streamed_response.body
    upstream = await fetch(destination, MESSAGES, sent)
    await relay_response(stream, 200, upstream.content_type, [upstream.data])
    await keyed.eventually("fairway_requests_total", before + 1, tenant="bob")


async def test_header_mode_leaves_the_key_headers_to_the_gateway(tmp_path: Path) -> None:
    """In header mode the gateway in front owns the credentials (an engine run with --api-key
    may need the client's): the picker removes nothing."""
    async with running_picker(tmp_path, tenants=[{"id": "a"}]) as picker:
        stream = picker.open()
        message = request_headers(CHAT, headers={TENANT_HEADER: "a", "x-api-key": ALICE})
        await stream.send(message)
        await stream.send(request_body(chat_body(max_tokens=1), True))
        reply = await stream.reply()
        assert not set(KEY_HEADERS) & _removed(reply, "request_headers")
        await stream.close()
