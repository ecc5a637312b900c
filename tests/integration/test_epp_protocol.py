"""The Endpoint Picker protocol, point by point, against the picker's ext_proc service.

The protocol document (gateway-api-inference-extension, ``004-endpoint-picker-protocol``) is
walked in its own order; each test names the point it checks. The picker runs in-process
(``picker.server.serve``) over simulated vLLM servers, and the test plays the gateway message by
message with the helpers of ``test_extproc_contract``. The same points through a real Envoy, as
each gateway configures it, are in ``tests/e2e``.

1. ext_proc, streaming both ways (``FULL_DUPLEX_STREAMED``); also the body modes gateways still
   configure: ``BUFFERED``, ``BUFFERED_PARTIAL``, ``STREAMED`` (with and without
   ``send_body_without_waiting_for_header_response``).
2. Endpoint subset: ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` is
   obeyed; a subset with no eligible endpoint is refused 503.
3. Destination endpoint: ``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata
   carry one or more ``ip:port``, primary first, and never differ; no endpoint: 503; a request
   to drop: 429.
4. Destination endpoint served: ``x-gateway-destination-endpoint-served`` in the response's
   ``envoy.lb`` metadata moves the request's accounting to the endpoint that served it.
5. Health: the gRPC health services ``liveness``, ``readiness`` and
   ``envoy.service.ext_proc.v3.ExternalProcessor`` (on the ext_proc port here; the dedicated
   health port, readiness on leader and pool sync, and liveness on standbys are in
   ``tests/unit/test_health.py`` and ``tests/integration/test_picker_tls.py``).
6. Fairness id: ``x-llm-d-inference-fairness-id``, and its deprecated alias
   ``x-gateway-inference-fairness-id``; the new name wins when both are sent.
7. InferenceObjective: ``x-gateway-inference-objective`` names a lane only within the tenant's
   allowed lanes (a client never picks its own priority).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.test_extproc_contract import (
    CHAT,
    DESTINATION,
    LLMD_HEADER,
    TENANT_HEADER,
    TIMEOUT,
    Picker,
    Stream,
    chat_body,
    fetch,
    header_mutation,
    lb_metadata,
    pool,
    refusal,
    relay_response,
    request_body,
    request_headers,
    response_body,
    response_headers,
    route,
    running_picker,
    send_request,
    split,
    tiny_pool,
)

pytestmark = pytest.mark.integration
__all__ = ["pool"]  # the fixture, imported for the tests below

MODE = processing_mode_pb2.ProcessingMode
ENDPOINT = re.compile(r"^127\.0\.0\.1:\d+$")


def headers_in_mode(mode: int, *, eager: bool = False, tenant: str = "a",
                    content_length: int | None = None,
                    response_mode: int = MODE.FULL_DUPLEX_STREAMED) -> pb.ProcessingRequest:
    message = request_headers(headers={TENANT_HEADER: tenant,
                                       **({} if content_length is None
                                          else {"content-length": str(content_length)})})
    message.protocol_config.CopyFrom(pb.ProtocolConfiguration(
        request_body_mode=mode, response_body_mode=response_mode,
        send_body_without_waiting_for_header_response=eager))
    return message


def served(address: str) -> pb.ProcessingRequest:
    """Response headers as a gateway sends them after a retry: the endpoint that served."""
    message = response_headers(200, "text/event-stream")
    lb = struct_pb2.Struct()
    lb.update({"x-gateway-destination-endpoint-served": address})
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


# -- 1. body modes --


async def test_buffered_mode_answers_headers_at_once_and_routes_from_the_body(
        pool: Picker) -> None:
    stream = pool.open()
    await stream.send(headers_in_mode(MODE.BUFFERED))
    answer = await stream.reply()
    # Envoy sends a BUFFERED body only once the headers are answered: holding them deadlocks.
    assert answer.WhichOneof("response") == "request_headers"
    assert DESTINATION not in header_mutation(answer, "request_headers")
    body = chat_body(max_tokens=3, priority=-5)  # a client's own priority is removed
    await stream.send(request_body(body, True))
    answer = await stream.reply()
    assert answer.WhichOneof("response") == "request_body"
    common = answer.request_body.response
    assert common.clear_route_cache
    headers = header_mutation(answer, "request_body")
    assert headers[DESTINATION] in pool.endpoints
    assert lb_metadata(answer) == [headers[DESTINATION]]
    rewritten = common.body_mutation.body
    assert "priority" not in json.loads(rewritten)
    assert headers["content-length"] == str(len(rewritten))
    upstream = await fetch(headers[DESTINATION], CHAT, rewritten)
    await relay_response(stream, 200, upstream.content_type, [upstream.data])
    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    assert await pool.metric("fairway_service_tokens_total", tenant="a", kind="completion") == 3


async def test_buffered_partial_body_cut_by_the_gateway_buffer_is_refused_413(
        pool: Picker) -> None:
    stream = pool.open()
    await stream.send(headers_in_mode(MODE.BUFFERED_PARTIAL))
    await stream.reply()
    await stream.send(request_body(chat_body()[:20], False))
    assert refusal(await stream.reply()).status == 413


async def test_buffered_mode_refusal_comes_from_the_body(tmp_path: Path) -> None:
    async with running_picker(tmp_path, tenants=[{"id": "a", "limits": {"maxInputTokens": 5}}]) \
            as picker:
        stream = picker.open()
        await stream.send(headers_in_mode(MODE.BUFFERED))
        await stream.reply()
        await stream.send(request_body(chat_body("word " * 40), True))
        refused = refusal(await stream.reply())
        assert refused.status == 400
        assert await stream.ended()


@pytest.mark.parametrize("parts", [1, 3])
async def test_streamed_mode_routes_at_the_headers_on_the_body_size(pool: Picker,
                                                                    parts: int) -> None:
    body = chat_body(max_tokens=2, priority=3)
    stream = pool.open()
    # STREAMED without send_body_without_waiting_for_header_response: the upstream is chosen when
    # the headers are answered, so the picker routes before it has seen the body.
    await stream.send(headers_in_mode(MODE.STREAMED, content_length=len(body)))
    answer = await stream.reply()
    assert answer.WhichOneof("response") == "request_headers"
    headers = header_mutation(answer, "request_headers")
    assert headers[DESTINATION] in pool.endpoints
    assert lb_metadata(answer) == [headers[DESTINATION]]
    # The body is handed on whole, rewritten, at its end: its length changes.
    assert "content-length" in answer.request_headers.response.header_mutation.remove_headers
    chunks = split(body, parts)
    handed_on = b""
    for i, chunk in enumerate(chunks):
        await stream.send(request_body(chunk, i == len(chunks) - 1))
        mutation = (await stream.reply()).request_body.response.body_mutation
        if i < len(chunks) - 1:
            assert mutation.clear_body
        else:
            handed_on = mutation.body
    assert "priority" not in json.loads(handed_on)
    upstream = await fetch(headers[DESTINATION], CHAT, handed_on)
    await relay_response(stream, 200, upstream.content_type, [upstream.data])
    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    # Charged the engine's count, not the size estimate it was queued on.
    usage = json.loads(upstream.data)["usage"]
    assert await pool.metric("fairway_service_tokens_total", tenant="a",
                             kind="prompt") == usage["prompt_tokens"]


async def test_streamed_mode_malformed_body_after_routing_is_refused_and_costs_nothing(
        pool: Picker) -> None:
    stream = pool.open()
    await stream.send(headers_in_mode(MODE.STREAMED, content_length=9))
    await stream.reply()
    await stream.send(request_body(b"{not json", True))
    assert refusal(await stream.reply()).status == 400
    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="error")
    assert await pool.metric("fairway_service_tokens_total", tenant="a") == 0
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0


async def test_streamed_mode_sending_the_body_early_is_held_like_full_duplex(
        pool: Picker) -> None:
    body = chat_body(max_tokens=2)
    chunks = split(body, 2)
    stream = pool.open()
    await stream.send(headers_in_mode(MODE.STREAMED, eager=True))
    await stream.send(request_body(chunks[0], False))
    await stream.quiet_for(0.2)
    await stream.send(request_body(chunks[1], True))
    answer = await stream.reply()
    assert header_mutation(answer, "request_headers")[DESTINATION] in pool.endpoints
    assert (await stream.reply()).request_body.response.body_mutation.clear_body
    assert (await stream.reply()).request_body.response.body_mutation.body == body


@pytest.mark.parametrize("response_mode", [MODE.STREAMED, MODE.BUFFERED])
async def test_response_chunks_pass_unchanged_outside_full_duplex(pool: Picker,
                                                                  response_mode: int) -> None:
    # Only FULL_DUPLEX_STREAMED takes a streamed_response echo; elsewhere Envoy would fail the
    # stream on one, so a chunk is answered without a mutation.
    stream = pool.open()
    await stream.send(headers_in_mode(MODE.BUFFERED, response_mode=response_mode))
    await stream.reply()
    body = chat_body(max_tokens=2)
    await stream.send(request_body(body, True))
    routed = header_mutation(await stream.reply(), "request_body")[DESTINATION]
    upstream = await fetch(routed, CHAT, body)
    await stream.send(response_headers(200, upstream.content_type))
    await stream.reply()
    await stream.send(response_body(upstream.data, True))
    answer = await stream.reply()
    assert answer.WhichOneof("response") == "response_body"
    assert not answer.response_body.response.HasField("body_mutation")
    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    assert await pool.metric("fairway_service_tokens_total", tenant="a", kind="completion") == 2


# -- 2. endpoint subset --


async def test_subset_is_obeyed_and_an_empty_one_refused_503(pool: Picker) -> None:
    second = pool.endpoints[1]
    for _ in range(3):
        assert (await route(pool.open(), chat_body(), subset=[second])).destinations == [second]
    stream = pool.open()
    await send_request(stream, chat_body(), subset=[])
    assert refusal(await stream.reply()).status == 503


# -- 3. destination endpoint --


async def test_header_and_metadata_carry_the_same_endpoints(pool: Picker) -> None:
    routed = await route(pool.open(), chat_body(), headers={TENANT_HEADER: "a"})
    assert routed.destinations == [routed.header]
    assert ENDPOINT.match(routed.header)


async def test_fallbacks_travel_in_header_and_metadata_alike(tmp_path: Path) -> None:
    async with running_picker(tmp_path, endpoints=2,
                              routing={"fallbackEndpoints": 1}) as picker:
        stream = picker.open()
        await send_request(stream, chat_body())
        answer = await stream.reply()
        header = header_mutation(answer, "request_headers")[DESTINATION]
        assert header.split(",") == lb_metadata(answer)
        assert sorted(header.split(",")) == sorted(picker.endpoints)


async def test_no_ready_endpoint_is_503_and_a_request_to_drop_429(tmp_path: Path) -> None:
    async with tiny_pool(tmp_path, queue={"maxQueued": 1}) as (picker, _):
        await send_request(picker.open(), chat_body(), headers={TENANT_HEADER: "a"})
        await picker.eventually("fairway_queued_requests", 1, tenant="a")
        stream = picker.open()  # the queue is full: this one is dropped
        await send_request(stream, chat_body(), headers={TENANT_HEADER: "a"})
        assert refusal(await stream.reply()).status == 429
        stream = picker.open()
        await send_request(stream, chat_body(), subset=["10.0.0.1:8000"])
        assert refusal(await stream.reply()).status == 503


# -- 4. destination endpoint served --


async def test_served_endpoint_takes_the_request_accounting(pool: Picker) -> None:
    stream = pool.open()
    routed = await route(stream, chat_body(max_tokens=4, stream=True),
                         headers={TENANT_HEADER: "a"})
    primary = routed.header
    other = next(e for e in pool.endpoints if e != primary)
    await stream.send(served(other))
    await stream.reply()
    assert await pool.metric("fairway_endpoint_inflight_tokens", endpoint=primary) == 0
    assert await pool.metric("fairway_endpoint_inflight_tokens", endpoint=other) > 0
    await stream.send(response_body(b"data: [DONE]\n\n", True))
    await stream.reply()
    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0


# -- 5. health --


async def test_health_services_of_the_protocol_answer(pool: Picker) -> None:
    health = health_pb2_grpc.HealthStub(pool.channel)
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=TIMEOUT)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service


# -- 6. fairness id --


@pytest.mark.parametrize(("headers", "tenant"), [
    ({LLMD_HEADER: "a"}, "a"),
    ({TENANT_HEADER: "b"}, "b"),
    ({LLMD_HEADER: "a", TENANT_HEADER: "b"}, "a"),
], ids=["current", "deprecated-alias", "current-wins"])
async def test_fairness_id_from_either_header_name(pool: Picker, headers: dict[str, str],
                                                   tenant: str) -> None:
    stream: Stream = pool.open()
    body = chat_body(max_tokens=1)
    routed = await route(stream, body, headers=headers)
    upstream = await fetch(routed.header, CHAT, body)
    await relay_response(stream, 200, upstream.content_type, [upstream.data])
    await pool.eventually("fairway_requests_total", 1, tenant=tenant, outcome="ok")


# -- 7. InferenceObjective --


async def test_inference_objective_picks_a_lane_only_within_the_tenants_allowed_lanes(
        tmp_path: Path) -> None:
    lanes = [{"name": "online", "objectives": ["chat-premium"]},
             {"name": "batch", "objectives": ["nightly"]}]
    tenants = [{"id": "a", "lane": "online", "allowedLanes": ["batch"]},
               {"id": "b", "lane": "batch"}]
    async with running_picker(tmp_path, lanes=lanes, tenants=tenants) as picker:
        body = chat_body(max_tokens=1)
        stream = picker.open()
        routed = await route(stream, body, headers={
            TENANT_HEADER: "a", "x-gateway-inference-objective": "nightly"})
        upstream = await fetch(routed.header, CHAT, body)
        await relay_response(stream, 200, upstream.content_type, [upstream.data])
        await picker.eventually("fairway_requests_total", 1, tenant="a", lane="batch")
        # b may not use the online lane: an objective cannot lift it there.
        stream = picker.open()
        await send_request(stream, body, headers={
            TENANT_HEADER: "b", "x-gateway-inference-objective": "chat-premium"})
        assert refusal(await stream.reply()).status == 403
        # An objective the config does not name leaves the tenant in its own lane.
        stream = picker.open()
        routed = await route(stream, body, headers={
            TENANT_HEADER: "b", "x-gateway-inference-objective": "unknown-objective"})
        upstream = await fetch(routed.header, CHAT, body)
        await relay_response(stream, 200, upstream.content_type, [upstream.data])
        await picker.eventually("fairway_requests_total", 1, tenant="b", lane="batch")


async def test_messages_refusals_use_anthropics_error_shape(tmp_path: Path) -> None:
    async with running_picker(tmp_path, tenants=[{"id": "a", "limits": {"maxInputTokens": 5}}]) \
            as picker:
        stream = picker.open()
        body = json.dumps({"model": "sim-model", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "word " * 40}]}).encode()
        await send_request(stream, body, path="/v1/messages", headers={TENANT_HEADER: "a"})
        answer = await stream.reply()
        assert answer.immediate_response.status.code == 400
        error = json.loads(answer.immediate_response.body)
        assert error["type"] == "error"
        assert error["error"]["type"] == "invalid_request_error"
        assert "more than the 5 allowed" in error["error"]["message"]
