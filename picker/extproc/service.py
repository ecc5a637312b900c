"""Envoy's ext_proc stream for one HTTP request, speaking the GIE Endpoint Picker contract.

It answers: *what does the picker say to Envoy, and when?* Envoy streams the request headers and
body (``FULL_DUPLEX_STREAMED``); the picker holds its answer to the headers until the whole body has
arrived and the fair queue has dispatched the request, then sets ``x-gateway-destination-endpoint``
(primary first, fallbacks after; also as ``envoy.lb`` dynamic metadata), clears the route cache and
streams the body back. Response chunks are echoed back while they are metered, so the tenant is
charged as tokens stream. Refusals are ``ImmediateResponse``s with an OpenAI-style error body.
"""

from __future__ import annotations

import logging
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


def immediate(error: RequestError) -> pb.ProcessingResponse:
    """An ``ImmediateResponse`` carrying the error's status and an OpenAI-style body."""
    headers = [_set_header("content-type", "application/json")]
    if error.retry_after is not None:
        headers.append(_set_header("retry-after", str(max(1, round(error.retry_after)))))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.http_status),
        headers=pb.HeaderMutation(set_headers=headers),
        body=error_body(error.message, error.error_type, error.http_status),
        details=f"fairway_{error.metric_label}",
    ))


def route(destinations: list[str]) -> pb.ProcessingResponse:
    """The answer to the request headers: where Envoy sends the request.

    The header names the primary only: Envoy's ``ORIGINAL_DST`` cluster routes on it and refuses
    a list (503, "no original_dst", seen with Envoy 1.40). The ``envoy.lb`` metadata carries the
    primary and the fallbacks, comma-separated, which Envoy's ``override_host`` load-balancing
    policy reads for retries.
    """
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: ",".join(destinations)}})
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[_set_header(DESTINATION_HEADER,
                                                                       destinations[0])]),
            clear_route_cache=True,
        )),
        dynamic_metadata=metadata,
    )


def _body(field: str, chunk: bytes, end: bool) -> pb.ProcessingResponse:
    mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=chunk,
                                                                         end_of_stream=end))
    return pb.ProcessingResponse(**{field: pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=mutation))})


class _Exchange:
    """One HTTP request's ext_proc conversation."""

    def __init__(self, dispatcher: Dispatcher, config: PickerConfig) -> None:
        self.dispatcher = dispatcher
        self.config = config
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.subset: frozenset[str] | None = None
        self.ticket: Ticket | None = None
        self.meter: ResponseMeter | None = None
        self.response_failed = False
        self.answered = False
        """The request headers have been answered (routed or refused)."""
        self.done = False

    @property
    def tenant(self) -> str:
        tenancy = self.config.tenancy
        for name in (tenancy.header, *tenancy.also_accept):
            value = self.headers.get(name.lower(), "").strip()
            if value:
                return value
        return tenancy.default_tenant

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _headers(message.request_headers)
            self.subset = _subset(message)
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
            return self._on_response_headers(message.response_headers)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "response_trailers":
            self._finish()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

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
            self.ticket = await self.dispatcher.admit(self.tenant, inference, self.subset)
        except RequestError as error:
            self.done = True
            return [self._refuse(error)]
        return [route(self.ticket.destinations), _body("request_body", bytes(self.body), True)]

    def _refuse(self, error: RequestError) -> pb.ProcessingResponse:
        self.dispatcher.reject(self.tenant, error)
        log.info("refused tenant=%s status=%d reason=%s: %s", self.tenant, error.http_status,
                 error.metric_label, error.message)
        return immediate(error)

    def _on_response_headers(self, message: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        headers = _headers(message)
        status = headers.get(":status", "200")
        self.response_failed = not status.startswith("2")
        self.meter = ResponseMeter("text/event-stream" in headers.get("content-type", ""))
        if message.end_of_stream:
            self._finish()
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _on_response_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        ticket = self.ticket
        if ticket is not None and ticket.outcome is None:
            if body.body:
                self.dispatcher.on_first_byte(ticket)
            if self.meter is not None and not self.response_failed:
                self.dispatcher.on_output_tokens(ticket, self.meter.feed(body.body))
        if body.end_of_stream:
            self._finish()
        return [_body("response_body", body.body, body.end_of_stream)]

    def _finish(self) -> None:
        self.done = True
        ticket = self.ticket
        if ticket is None or ticket.outcome is not None:
            return
        usage = self.meter.finish() if self.meter is not None and not self.response_failed \
            else None
        self.dispatcher.complete(ticket, usage, "error" if self.response_failed else "ok")

    def abandon(self) -> None:
        """The stream ended early (client gone, Envoy reset): settle to what was delivered."""
        ticket = self.ticket
        if ticket is not None and ticket.outcome is None:
            self.dispatcher.complete(ticket, None, "cancelled")


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` backed by the fair dispatcher."""

    def __init__(self, dispatcher: Dispatcher, config: Callable[[], PickerConfig]) -> None:
        self.dispatcher = dispatcher
        self._config = config

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = _Exchange(self.dispatcher, self._config())
        try:
            async for message in request_iterator:
                for reply in await exchange.handle(message):
                    yield reply
                if exchange.done and exchange.ticket is None:
                    return
        finally:
            exchange.abandon()


def add_to_server(processor: ExternalProcessor, server: grpc.aio.Server) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
