"""Envoy's ext_proc stream for one HTTP request, speaking the GIE Endpoint Picker contract.

It answers: *what does the picker say to Envoy, and when?* Envoy streams the request headers and
body (``FULL_DUPLEX_STREAMED``); the picker holds its answer to the headers until the whole body has
arrived and the fair queue has dispatched the request, then sets ``x-gateway-destination-endpoint``
(primary first, fallbacks after; also as ``envoy.lb`` dynamic metadata), clears the route cache and
streams the body back. Refusals are ``ImmediateResponse``s with an OpenAI-style error body.

The response comes back one of two ways, and the tenant is charged as tokens stream either way:

* **inline** (the GIE contract; what a Gateway API implementation sends): the same stream carries
  the response headers and body, and the picker echoes every chunk back, so each chunk waits for
  a round trip through the picker.
* **meter stream**: the gateway marks the picker's stream with the gRPC metadata
  ``fairway-response-path: meter-stream`` and sends the response on a second ext_proc filter in
  ``observability_mode`` (Envoy does not wait for answers). The picker names the request in its
  ``fairway`` dynamic metadata; the second filter forwards that namespace, which is how its
  stream finds the request. Metering then leaves the response's critical path.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from picker.config.schema import PickerConfig
from picker.dispatch import Dispatcher, Ticket
from picker.errors import BadRequest, BodyTooLarge, NoEndpoint, RequestError
from picker.openai import ResponseMeter, error_body, parse_request

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
INFERENCE_PATHS = ("/v1/completions", "/v1/chat/completions")
METER_NAMESPACE = "fairway"
METER_KEY = "request"
RESPONSE_PATH_METADATA = "fairway-response-path"
METER_STREAM = "meter-stream"


def _header_value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): _header_value(h) for h in message.headers.headers}


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key,
                                                                  raw_value=value.encode()))


def _subset(message: pb.ProcessingRequest) -> frozenset[str] | None:
    namespaces = message.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    value = namespaces[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(a.strip() for a in value.string_value.split(",") if a.strip())


def immediate(error: RequestError,
              extra_headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """An ``ImmediateResponse`` carrying the error's status and an OpenAI-style body."""
    headers = [_set_header("content-type", "application/json")]
    if error.retry_after is not None:
        # Rounded up: a client that waits exactly this long must pass.
        headers.append(_set_header("retry-after", str(max(1, math.ceil(error.retry_after)))))
    headers.extend(_set_header(k, v) for k, v in (extra_headers or {}).items())
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.http_status),
        headers=pb.HeaderMutation(set_headers=headers),
        body=error_body(error.message, error.error_type, error.http_status),
        details=f"fairway_{error.metric_label}",
    ))


def route(destinations: list[str], meter_id: str | None = None,
          response_headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """The answer to the request headers: where Envoy sends the request.

    The header names the primary only: Envoy's ``ORIGINAL_DST`` cluster routes on it and refuses
    a list (503, "no original_dst", seen with Envoy 1.40). The ``envoy.lb`` metadata carries the
    primary and the fallbacks, comma-separated, which Envoy's ``override_host`` load-balancing
    policy reads for retries. ``meter_id`` names the request for its meter stream;
    ``response_headers`` go into the ``fairway`` metadata, from which a meter-stream gateway adds
    them to the response.
    """
    metadata = struct_pb2.Struct()
    fairway: dict[str, str] = dict(response_headers or {})
    if meter_id is not None:
        fairway[METER_KEY] = meter_id
    namespaces: dict[str, dict[str, str]] = {
        LB_NAMESPACE: {DESTINATION_HEADER: ",".join(destinations)}}
    if fairway:
        namespaces[METER_NAMESPACE] = fairway
    metadata.update(namespaces)
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[_set_header(DESTINATION_HEADER,
                                                                       destinations[0])]),
            clear_route_cache=True,
        )),
        dynamic_metadata=metadata,
    )


def rewrite_body(body: dict, engine_priority: int | None, max_tokens: int | None) -> bool:
    """Make the body say what policy decided; True when it changed.

    The engine's ``priority`` comes from the lane only: a client's own is replaced, or removed
    when the lane sets none (it would otherwise jump the engine's queue). ``max_tokens`` is set
    when admission clamped it.
    """
    changed = False
    if engine_priority is None:
        changed = body.pop("priority", None) is not None
    elif body.get("priority") != engine_priority:
        body["priority"] = engine_priority
        changed = True
    if max_tokens is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if body.get(key) != max_tokens:
            body[key] = max_tokens
            changed = True
    return changed


def _meter_id(message: pb.ProcessingRequest) -> str | None:
    namespace = message.metadata_context.filter_metadata.get(METER_NAMESPACE)
    if namespace is None:
        return None
    value = namespace.fields.get(METER_KEY)
    return value.string_value if value is not None and value.string_value else None


def _body(field: str, chunk: bytes, end: bool) -> pb.ProcessingResponse:
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk,
                                                                         end_of_stream=end))
    return pb.ProcessingResponse(**{field: pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=mutation))})


class _Exchange:
    """One HTTP request's ext_proc conversation."""

    def __init__(self, dispatcher: Dispatcher, config: PickerConfig,
                 meter_id: str | None = None) -> None:
        self.dispatcher = dispatcher
        self.config = config
        self.meter_id = meter_id
        """Set when the response comes on a separate meter stream (named by this id)."""
        self.headers: dict[str, str] = {}
        self.model: str | None = None
        self.tenant = config.tenancy.default_tenant
        self.lane: str | None = None
        self.body = bytearray()
        self.subset: frozenset[str] | None = None
        self.ticket: Ticket | None = None
        self.meter: ResponseMeter | None = None
        self.response_failed = False
        self.answered = False
        """The request headers have been answered (routed or refused)."""
        self.done = False

    @property
    def request_id(self) -> str:
        """The name metering records carry: the meter stream's, else Envoy's ``x-request-id``."""
        return self.meter_id or self.headers.get("x-request-id", "")

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _headers(message.request_headers)
            self.subset = _subset(message)
            try:
                # Who and which lane are known from the headers: refuse before the body comes.
                self.tenant = self.dispatcher.identity.tenant(self.headers)
                self.lane = self.dispatcher.choose_lane(
                    self.tenant, self.headers.get(self.config.tenancy.lane_header.lower()))
            except RequestError as error:
                self.done = self.answered = True
                return [self._refuse(error)]
            if message.request_headers.end_of_stream:
                return self._route_without_body()
            return []
        if kind == "request_body":
            return await self._on_request_body(message.request_body)
        if kind == "request_trailers":
            # Trailers end a request whose last body chunk did not say end_of_stream.
            replies = [] if self.answered else await self._dispatch()
            return [*replies, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            self.observe_response(message)
            limits = self.ticket.ratelimit_headers if self.ticket is not None else {}
            if not limits:
                return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
            mutation = pb.HeaderMutation(set_headers=[_set_header(k, v)
                                                      for k, v in limits.items()])
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=mutation)))]
        if kind == "response_body":
            self.observe_response(message)
            body = message.response_body
            return [_body("response_body", body.body, body.end_of_stream)]
        if kind == "response_trailers":
            self.observe_response(message)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def observe_response(self, message: pb.ProcessingRequest) -> None:
        """Meter one response message (inline or from the meter stream); answers nothing."""
        kind = message.WhichOneof("request")
        if kind == "response_headers":
            self._on_response_headers(message.response_headers)
        elif kind == "response_body":
            self._on_response_body(message.response_body)
        elif kind == "response_trailers":
            self._finish()

    def _route_without_body(self) -> list[pb.ProcessingResponse]:
        # A GET such as /v1/models: no body, nothing to queue or charge; least-loaded endpoint.
        self.answered = True
        candidates = self.dispatcher.candidates(self.subset)
        if not candidates:
            self.done = True
            return [self._refuse(NoEndpoint("no endpoint is available"))]
        return [route([candidates[0].address])]

    async def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        self.body += body.body
        if len(self.body) > self.config.limits.max_body_bytes:
            self.done = self.answered = True
            return [self._refuse(BodyTooLarge(
                f"request body exceeds {self.config.limits.max_body_bytes} bytes"))]
        if not body.end_of_stream:
            return []
        return await self._dispatch()

    async def _dispatch(self) -> list[pb.ProcessingResponse]:
        self.answered = True
        path = self.headers.get(":path", "").split("?", 1)[0]
        try:
            if path not in INFERENCE_PATHS:
                candidates = self.dispatcher.candidates(self.subset)
                if not candidates:
                    raise NoEndpoint("no endpoint is available")
                return [route([candidates[0].address]), _body("request_body", bytes(self.body),
                                                              True)]
            if not self.body:
                raise BadRequest("request body is empty")
            inference = parse_request(bytes(self.body))
            self.model = inference.model
            self.ticket = await self.dispatcher.admit(
                self.tenant, inference, self.subset, self.lane, self.request_id)
        except RequestError as error:
            self.done = True
            return [self._refuse(error)]
        ticket = self.ticket
        body = bytes(self.body)
        if rewrite_body(inference.body, self.dispatcher.engine_priority(ticket.lane),
                        ticket.max_tokens):
            # No content-length to fix: with a streamed body Envoy drops it and sends the
            # upstream request chunked.
            body = json.dumps(inference.body, separators=(",", ":")).encode()
        return [route(ticket.destinations, self.meter_id, ticket.ratelimit_headers),
                _body("request_body", body, True)]

    def _refuse(self, error: RequestError) -> pb.ProcessingResponse:
        self.dispatcher.reject(self.tenant, error, model=self.model, lane=self.lane,
                               request_id=self.request_id)
        log.info("refused tenant=%s status=%d reason=%s: %s", self.tenant, error.http_status,
                 error.metric_label, error.message)
        limits = self.dispatcher.ratelimit_headers(self.tenant) if error.http_status == 429 \
            else None
        return immediate(error, limits)

    def _on_response_headers(self, message: pb.HttpHeaders) -> None:
        headers = _headers(message)
        status = headers.get(":status", "200")
        self.response_failed = not status.startswith("2")
        self.meter = ResponseMeter("text/event-stream" in headers.get("content-type", ""))
        if message.end_of_stream:
            self._finish()

    def _on_response_body(self, body: pb.HttpBody) -> None:
        ticket = self.ticket
        if ticket is not None and ticket.outcome is None:
            if body.body:
                self.dispatcher.on_first_byte(ticket)
            if self.meter is not None and not self.response_failed:
                self.dispatcher.on_output_tokens(ticket, self.meter.feed(body.body))
        if body.end_of_stream:
            self._finish()

    def _finish(self) -> None:
        self.done = True
        ticket = self.ticket
        if ticket is None or ticket.outcome is not None:
            return
        usage = self.meter.finish() if self.meter is not None and not self.response_failed \
            else None
        if self.meter is not None:
            ticket.finish_reason = self.meter.finish_reason
        self.dispatcher.complete(ticket, usage, "error" if self.response_failed else "ok")

    def abandon(self) -> None:
        """The stream ended early (client gone, Envoy reset): settle to what was delivered."""
        ticket = self.ticket
        if ticket is not None and ticket.outcome is None:
            self.dispatcher.complete(ticket, None, "cancelled")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` backed by the fair dispatcher."""

    def __init__(self, dispatcher: Dispatcher, config: Callable[[], PickerConfig],
                 meter_claim_timeout: float = 10.0) -> None:
        self.dispatcher = dispatcher
        self._config = config
        self.meter_claim_timeout = meter_claim_timeout
        """Seconds a routed request waits for its meter stream before it is settled as gone."""
        # A restarted picker must not take an old request's meter stream for a new request.
        self._id_prefix = os.urandom(4).hex()
        self._ids = itertools.count(1)
        self._awaiting_meter: dict[str, tuple[_Exchange, asyncio.TimerHandle]] = {}

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        metered = any(key == RESPONSE_PATH_METADATA and value == METER_STREAM
                      for key, value in context.invocation_metadata() or ())
        meter_id = f"{self._id_prefix}-{next(self._ids)}" if metered else None
        exchange = _Exchange(self.dispatcher, self._config(), meter_id)
        handed_over = False
        try:
            async for message in request_iterator:
                if message.observability_mode:
                    await self._meter(message, request_iterator)
                    return
                replies = await exchange.handle(message)
                if meter_id is not None and exchange.ticket is not None and not handed_over:
                    # Before the route goes out: the meter stream can open as soon as it has.
                    self._await_meter(meter_id, exchange)
                    handed_over = True
                for reply in replies:
                    yield reply
                if exchange.done and exchange.ticket is None:
                    return
        finally:
            if not handed_over:
                exchange.abandon()

    def _await_meter(self, meter_id: str, exchange: _Exchange) -> None:
        """The request is routed; its response will come on a meter stream named ``meter_id``."""
        timer = asyncio.get_running_loop().call_later(self.meter_claim_timeout, self._unclaimed,
                                                      meter_id)
        self._awaiting_meter[meter_id] = (exchange, timer)

    def _unclaimed(self, meter_id: str) -> None:
        exchange, _ = self._awaiting_meter.pop(meter_id, (None, None))
        if exchange is not None and not exchange.done:
            log.warning("no meter stream for request %s within %gs: is the gateway's metering "
                        "filter missing? settled as gone", meter_id, self.meter_claim_timeout)
            exchange.abandon()

    async def _meter(self, first: pb.ProcessingRequest,
                     messages: AsyncIterator[pb.ProcessingRequest]) -> None:
        """A meter stream (``observability_mode``): Envoy waits for no answer, so none is sent."""
        meter_id = _meter_id(first)
        exchange, timer = self._awaiting_meter.pop(meter_id, (None, None)) if meter_id \
            else (None, None)
        if timer is not None:
            timer.cancel()
        try:
            if exchange is not None:
                exchange.observe_response(first)
            async for message in messages:
                if exchange is not None:
                    exchange.observe_response(message)
        finally:
            if exchange is not None:
                exchange.abandon()  # the stream ended before the response did: client gone


def add_to_server(processor: ExternalProcessor, server: grpc.aio.Server) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
