"""Envoy's ext_proc stream for one HTTP request, speaking the GIE Endpoint Picker contract.

It answers: *what does the picker say to Envoy, and when?* The answer routes the request: it sets
``x-gateway-destination-endpoint`` and the ``envoy.lb`` dynamic metadata key of the same name to the
same value (the protocol forbids them to differ) and clears the route cache. Refusals are
``ImmediateResponse``s with an OpenAI-style error body.

When the route can be given depends on the request body mode the gateway configured (Envoy names
it in the stream's first message, ``protocol_config``):

* ``FULL_DUPLEX_STREAMED`` (current gateways), or ``STREAMED`` with
  ``send_body_without_waiting_for_header_response``: the body arrives while the headers wait, so
  the picker holds its answer to the headers until the whole body is in and the fair queue has
  dispatched the request, then answers the headers and streams the (possibly rewritten) body back.
* ``BUFFERED`` (older kgateway, an Envoy AI Gateway option): Envoy sends the body only after the
  headers are answered, so the headers are answered at once, unrouted, and the route (header
  mutation, route-cache clear, metadata) goes out with the answer to the buffered body.
* ``STREAMED`` (waiting for the headers answer) and ``NONE``: the upstream is chosen when the
  headers are answered, before the body is seen, so the request is admitted and queued on an
  estimate from ``content-length`` (the body's size bounds its tokens); the body is then collected
  and handed on whole, rewritten, as the last chunk (earlier chunks are cleared).

The response comes back one of two ways, and the tenant is charged as tokens stream either way:

* **inline** (the GIE contract; what a Gateway API implementation sends): the same stream carries
  the response headers and body, and the picker echoes every chunk back, so each chunk waits for
  a round trip through the picker.
* **meter stream**: the gateway marks the picker's stream with the gRPC metadata
  ``fairway-response-path: meter-stream`` and sends the response on a second ext_proc filter in
  ``observability_mode`` (Envoy does not wait for answers). The picker names the request in its
  ``fairway`` dynamic metadata; the second filter forwards that namespace, which is how its
  stream finds the request. Metering then leaves the response's critical path.
* **access log** (``fairway-response-path: access-log``): no response stream. Envoy reads the
  engine's ``usage`` itself and its gRPC access log brings it, with the request's name, when
  the request has ended (``picker.extproc.accesslog``): a stream's output is charged at its end,
  and streamed chunks cost the picker nothing.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from typing import TypeAlias

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from picker.config.schema import PickerConfig
from picker.core.request import Usage
from picker.dispatch import Dispatcher, Ticket
from picker.errors import (
    BadRequest,
    BodyBuffersFull,
    BodyTimeout,
    BodyTooLarge,
    InternalError,
    MeterBacklog,
    NoEndpoint,
    RequestError,
    Unauthorized,
)
from picker.extproc.routed import (
    METER_KEY,
    METER_NAMESPACE,
    UPSTREAM_FAILURE_DETAILS,
    LoggedResponse,
)
from picker.identity import KEY_HEADERS, OBJECTIVE_HEADER
from picker.openai import ResponseMeter, error_body, parse_request
from picker.openai.paths import ApiKind, classify, forward_path
from picker.openai.request import CHARS_PER_TOKEN, InferenceRequest, anthropic_error_body
from picker.openai.response import streamed_output
from picker.tls import UNAUTHENTICATED_HEADER_MODE, ClientAuth

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SERVED_KEY = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"
MODEL_HEADER = "x-gateway-model-name"
"""Set by GIE gateways from the body's model: the model of a request routed before its body."""
RESPONSE_PATH_METADATA = "fairway-response-path"
METER_STREAM = "meter-stream"
ACCESS_LOG = "access-log"

_MODE = processing_mode_pb2.ProcessingMode


class BodyPlan(enum.Enum):
    """When the route can be given, from the request body mode the gateway configured."""

    HOLD = "hold"
    """The body comes while the headers wait: answer the headers once the request is dispatched."""
    BUFFERED = "buffered"
    """Envoy sends the body only after the headers are answered: route from the body answer."""
    AT_HEADERS = "at_headers"
    """The upstream is chosen when the headers are answered: route on an estimate, before the
    body."""


def body_plan(message: pb.ProcessingRequest) -> tuple[BodyPlan, bool]:
    """The plan for a stream, from its first message's ``protocol_config``, and whether each
    body chunk gets an answer of its own (``STREAMED``; ``FULL_DUPLEX_STREAMED`` answers with a
    stream of its own instead).

    An Envoy too old to send ``protocol_config`` is taken to stream full duplex (the GIE
    default), as before the field existed.
    """
    if not message.HasField("protocol_config"):
        return BodyPlan.HOLD, False
    config = message.protocol_config
    mode = config.request_body_mode
    if mode in (_MODE.BUFFERED, _MODE.BUFFERED_PARTIAL):
        return BodyPlan.BUFFERED, False
    if mode == _MODE.FULL_DUPLEX_STREAMED:
        return BodyPlan.HOLD, False
    if mode == _MODE.STREAMED and config.send_body_without_waiting_for_header_response:
        return BodyPlan.HOLD, True
    return BodyPlan.AT_HEADERS, mode == _MODE.STREAMED


def _header_value(header: base_pb2.HeaderValue) -> str:
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): _header_value(h) for h in message.headers.headers}


_KEY_HEADERS = frozenset(KEY_HEADERS)


def _request_headers(message: pb.HttpHeaders,
                     watched: frozenset[str]) -> tuple[dict[str, str], str | None]:
    """The headers (lower-cased names), and the first of ``watched`` sent more than once: one
    pass over the headers, on the per-request path. An API key header repeated with the same
    value is no repeat (a client library and a proxy may both set it); with another, it is."""
    headers: dict[str, str] = {}
    repeated = None
    for header in message.headers.headers:
        key = header.key.lower()
        value = _header_value(header)
        if repeated is None and key in headers and key in watched and not (
                key in _KEY_HEADERS and headers[key] == value):
            repeated = key
        headers[key] = value
    return headers, repeated


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


def served_endpoint(message: pb.ProcessingRequest) -> str | None:
    """The endpoint that actually served the request, as the gateway reports it.

    The protocol's form is the ``envoy.lb`` metadata key ``x-gateway-destination-endpoint-served``;
    a plain Envoy can instead send its ``upstream.address`` attribute (``response_attributes``).
    """
    lb = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is not None:
        value = lb.fields.get(SERVED_KEY)
        if value is not None and value.string_value:
            return value.string_value.split(",", 1)[0].strip()
    for attributes in message.attributes.values():
        value = attributes.fields.get(UPSTREAM_ADDRESS_ATTRIBUTE)
        if value is not None and value.string_value:
            return value.string_value
    return None


def upstream_failure(message: pb.ProcessingRequest) -> str | None:
    """Why the gateway answered without an engine (its ``response.code_details`` attribute, in
    ``response_attributes``), or None when an engine answered or the gateway does not say."""
    for attributes in message.attributes.values():
        value = attributes.fields.get("response.code_details")
        if value is not None and value.string_value.startswith(UPSTREAM_FAILURE_DETAILS):
            return value.string_value
    return None


def immediate(error: RequestError, extra_headers: dict[str, str] | None = None,
              anthropic: bool = False) -> pb.ProcessingResponse:
    """An ``ImmediateResponse`` carrying the error's status and an OpenAI-style body (Anthropic's
    shape for a ``/v1/messages`` request, whose clients parse that)."""
    headers = [_set_header("content-type", "application/json")]
    if error.retry_after is not None:
        # Rounded up: a client that waits exactly this long must pass.
        headers.append(_set_header("retry-after", str(max(1, math.ceil(error.retry_after)))))
    if not error.should_retry:
        # The official OpenAI clients read this before their own status rules.
        headers.append(_set_header("x-should-retry", "false"))
    headers.extend(_set_header(k, v) for k, v in (extra_headers or {}).items())
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.http_status),
        headers=pb.HeaderMutation(set_headers=headers),
        body=anthropic_error_body(error.message, error.http_status) if anthropic
        else error_body(error.message, error.error_type, error.code),
        details=f"fairway_{error.metric_label}",
    ))


def _route_common(destinations: list[str], extra: list[base_pb2.HeaderValueOption] | None = None,
                  remove: list[str] | None = None,
                  body: bytes | None = None) -> pb.CommonResponse:
    # Header and metadata carry the same value, as the protocol requires: the primary, then any
    # fallbacks. Envoy's ORIGINAL_DST cluster takes a single address only (503 "no original_dst"
    # on a list, seen with Envoy 1.40) while override_host takes a single one or a list, so one
    # address (``routing.fallbackEndpoints: 0``, the default) is the form every gateway accepts.
    value = ",".join(destinations)
    mutation = pb.HeaderMutation(set_headers=[_set_header(DESTINATION_HEADER, value),
                                              *(extra or ())],
                                 remove_headers=remove or [])
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    if body is not None:
        common.body_mutation.body = body
    return common


def _route_metadata(destinations: list[str], meter_id: str | None,
                    response_headers: dict[str, str] | None) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    fairway: dict[str, str] = dict(response_headers or {})
    if meter_id is not None:
        fairway[METER_KEY] = meter_id
    namespaces: dict[str, dict[str, str]] = {
        LB_NAMESPACE: {DESTINATION_HEADER: ",".join(destinations)}}
    if fairway:
        namespaces[METER_NAMESPACE] = fairway
    metadata.update(namespaces)
    return metadata


def route(destinations: list[str], meter_id: str | None = None,
          response_headers: dict[str, str] | None = None,
          remove_headers: list[str] | None = None,
          strip: tuple[str, ...] = ()) -> pb.ProcessingResponse:
    """The answer to the request headers: where Envoy sends the request.

    ``meter_id`` names the request for its meter stream; ``response_headers`` go into the
    ``fairway`` metadata, from which a meter-stream gateway adds them to the response.
    ``strip``: headers the engine must not get (``Identity.credential_headers``).
    """
    remove = [*(remove_headers or ()), *strip]
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=_route_common(destinations,
                                                                  remove=remove)),
        dynamic_metadata=_route_metadata(destinations, meter_id, response_headers),
    )


def route_with_body(destinations: list[str], body: bytes | None, meter_id: str | None = None,
                    response_headers: dict[str, str] | None = None,
                    strip: tuple[str, ...] = ()) -> pb.ProcessingResponse:
    """The answer to a buffered request body: the route travels with it (``BUFFERED`` mode).

    ``body``, when given, replaces the buffered body; its ``content-length`` is set to match.
    ``strip``: headers the engine must not get (the headers are still held in this mode).
    """
    extra = None if body is None else [_set_header("content-length", str(len(body)))]
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=_route_common(destinations, extra,
                                                            remove=list(strip), body=body)),
        dynamic_metadata=_route_metadata(destinations, meter_id, response_headers),
    )


def rewrite_body(body: dict, engine_priority: int | None, max_tokens: int | None,
                 cap_key: str | None = "max_tokens") -> bool:
    """Make the body say what policy decided; True when it changed.

    The engine's ``priority`` comes from the picker only (the lane's, and with engines in
    priority mode the tenant's standing): a client's own is replaced, or removed when none is
    set (it would otherwise jump the engine's queue). The output cap (``cap_key``:
    ``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``) is set when admission
    clamped it, and only ever lowered: a body routed before it was read (``AT_HEADERS``) keeps
    a smaller cap of its own.
    """
    changed = False
    if engine_priority is None:
        changed = body.pop("priority", None) is not None
    elif body.get("priority") != engine_priority:
        body["priority"] = engine_priority
        changed = True
    if max_tokens is not None and cap_key is not None:
        key = "max_completion_tokens" if cap_key == "max_tokens" \
            and "max_completion_tokens" in body else cap_key
        own = body.get(key)
        if not (isinstance(own, int) and 0 < own <= max_tokens):
            body[key] = max_tokens
            changed = True
    return changed


USAGE_OPTION_KINDS = frozenset({ApiKind.COMPLETIONS, ApiKind.CHAT})
"""The APIs whose streams take ``stream_options`` (OpenAI's, and vLLM's continuous usage)."""


def ask_continuous_usage(body: dict) -> bool:
    """Ask a stream for its usage in every chunk (vLLM's ``continuous_usage_stats``, with
    ``include_usage``); True when the body changed. The client then sees ``usage`` on its chunks
    and a last usage chunk, as with vLLM's ``--enable-force-include-usage``."""
    options = body.get("stream_options")
    if not isinstance(options, dict):
        options = {}
    if options.get("include_usage") is True and options.get("continuous_usage_stats") is True:
        return False
    body["stream_options"] = {**options, "include_usage": True, "continuous_usage_stats": True}
    return True


def _meter_id(message: pb.ProcessingRequest) -> str | None:
    namespace = message.metadata_context.filter_metadata.get(METER_NAMESPACE)
    if namespace is None:
        return None
    value = namespace.fields.get(METER_KEY)
    return value.string_value if value is not None and value.string_value else None


def _body(field: str, chunk: bytes, end: bool) -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse()
    # Set through the parents' attributes: upb builds the nested messages in place, a quarter
    # of the CPU of building four messages by keyword and copying each into its parent (2 µs a
    # streamed chunk against 9 on the inline response path, where every chunk comes here).
    streamed = getattr(reply, field).response.body_mutation.streamed_response
    streamed.body = chunk
    if end:
        streamed.end_of_stream = True
    return reply


_VARINT_BYTES = tuple(bytes((n,)) for n in range(0x80))


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    if value < 0x80:
        return _VARINT_BYTES[value]
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _echo_head(size: int, end: bool) -> bytes:
    """The wire bytes of ``_body("response_body", chunk, end)`` before a chunk of ``size`` bytes
    (after it: ``end_of_stream``, when set). Each message there has one field set, written as
    upb writes it: tag, length, value; the lengths are those of what each message holds."""
    streamed = (1 + len(_varint(size)) + size if size else 0) + (2 if end else 0)
    mutation = 1 + len(_varint(streamed)) + streamed  # BodyMutation.streamed_response
    common = 1 + len(_varint(mutation)) + mutation  # CommonResponse.body_mutation
    response = 1 + len(_varint(common)) + common  # BodyResponse.response
    return (b"\x22" + _varint(response)  # ProcessingResponse.response_body (field 4)
            + b"\x0a" + _varint(common)  # BodyResponse.response (1)
            + b"\x1a" + _varint(mutation)  # CommonResponse.body_mutation (3)
            + b"\x1a" + _varint(streamed)  # BodyMutation.streamed_response (3)
            + (b"\x0a" + _varint(size) if size else b""))  # StreamedBodyResponse.body (1)


_END_OF_STREAM = b"\x10\x01"
"""``StreamedBodyResponse.end_of_stream`` (field 2) set, on the wire."""
ECHO_HEADS_KEPT = 4096
"""Chunk sizes whose echo heads are kept (an SSE stream's chunks come in a few sizes)."""
_echo_heads: dict[int, bytes] = {}


def echo_reply(chunk: bytes, end: bool) -> bytes:
    """The inline response path's answer to a streamed chunk (the chunk echoed), as the bytes
    gRPC sends for ``_body("response_body", chunk, end)``: a head kept per chunk size, then the
    chunk. A tenth of the CPU of building the message and serializing it, on every chunk."""
    key = len(chunk) << 1 | end
    head = _echo_heads.get(key)
    if head is None:
        if len(_echo_heads) >= ECHO_HEADS_KEPT:
            return _body("response_body", chunk, end).SerializeToString()
        head = _echo_heads[key] = _echo_head(len(chunk), end)
    return head + chunk + _END_OF_STREAM if end else head + chunk


Reply: TypeAlias = "pb.ProcessingResponse | bytes"
"""What ``Process`` yields: a message, or a message's wire bytes (``echo_reply``,
``_RESPONSE_BODY_CONTINUE``)."""


def serialize_reply(reply: Reply) -> bytes:
    """``Process``'s response serializer: a reply made as its wire bytes goes as it is, a message
    is serialized."""
    if isinstance(reply, bytes):
        return reply
    return reply.SerializeToString()


def _body_replaced(chunk: bytes | None) -> pb.ProcessingResponse:
    """A ``STREAMED`` chunk's answer: cleared (``None``) or replaced by ``chunk``."""
    mutation = pb.BodyMutation(clear_body=True) if chunk is None else pb.BodyMutation(body=chunk)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=mutation)))


NOTHING_COMPUTED = Usage(0, 0, 0)
"""What an engine's error answer (a status other than 2xx) reports it computed."""

_HEADERS_CONTINUE = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_BODY_CONTINUE = pb.ProcessingResponse(request_body=pb.BodyResponse())
_RESPONSE_BODY_CONTINUE = \
    pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString()
"""A response chunk let pass unchanged (modes other than full duplex), on the wire: the same
every chunk, serialized once."""


class BodyBudget:
    """Request body bytes held at once by all streams together (``limits.maxBufferedBytes``)."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = 0


class _Exchange:
    """One HTTP request's ext_proc conversation."""

    def __init__(self, dispatcher: Dispatcher, config: PickerConfig,
                 meter_id: str | None = None, bodies: BodyBudget | None = None,
                 logged: bool = False) -> None:
        self.dispatcher = dispatcher
        self.config = config
        self.bodies = bodies if bodies is not None else BodyBudget()
        self.held = 0
        """Bytes of this request's body counted in ``bodies``."""
        self.body_complete = False
        self.meter_id = meter_id
        """Set when the response comes on a separate meter stream or in the access log (named by
        this id)."""
        self.logged = logged
        """The response is metered from the gateway's access log: a stream is asked for usage
        in every chunk (``stream_options``), the one count a cut stream leaves there."""
        self.headers: dict[str, str] = {}
        self.plan = BodyPlan.HOLD
        self.per_chunk = False
        """Each request body chunk is answered on its own (``STREAMED``)."""
        self.chunks = 0
        """Request body chunks received."""
        self.echo_response = True
        """Response chunks are answered by echoing them (``FULL_DUPLEX_STREAMED``); in the other
        modes an answer without a mutation lets a chunk (or the buffered body) pass."""
        self.response_unseen = False
        """The gateway sends this stream no response body (``response_body_mode: NONE``) and
        no meter stream is coming: output cannot be counted, so it is settled on the estimate."""
        self.kind: ApiKind | None = None
        """The inference API of the path; None for a pass-through path."""
        self.forward_path: str | None = None
        """The canonical path to send upstream, when the request's own spelling differs (a
        trailing slash, upper case, escapes): the engine is sent the path the picker judged."""
        self.model: str | None = None
        self.tenant = config.tenancy.default_tenant
        self.lane: str | None = None
        self.lane_asked: str | None = None
        """The lane header (or objective) as the request sent it; None: it asked for none, so
        the metering record says so (a replay under another config gives it that config's lane
        for its tenant, not this one's)."""
        self.body = bytearray()
        self.subset: frozenset[str] | None = None
        self.ticket: Ticket | None = None
        self.meter: ResponseMeter | None = None
        self.response_failed = False
        self.routed = False
        self.done = False
        self.routed_at = 0.0
        """When the route went out (the event loop's clock), for a meter-stream request."""
        self.shed: Callable[[str], bool] | None = None
        """Set while the picker is behind on its meter streams: whether a tenant's inference
        request is refused (503, ``MeterBacklog``) rather than routed to a response whose meter
        could be lost."""

    @property
    def request_id(self) -> str:
        """The name metering records carry: the meter stream's, else Envoy's ``x-request-id``."""
        return self.meter_id or self.headers.get("x-request-id", "")

    async def handle(self, message: pb.ProcessingRequest) -> list[Reply]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._on_request_headers(message)
        if kind == "request_body":
            return await self._on_request_body(message.request_body)
        if kind == "request_trailers":
            # Trailers end a request whose last body chunk did not say end_of_stream.
            self.body_complete = True
            replies = [] if self.routed or self.done \
                else self._with_path(await self._body_complete())
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
            return [self.answer_response_body(message.response_body)]
        if kind == "response_trailers":
            self.observe_response(message)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    @property
    def receiving_body(self) -> bool:
        """Headers came, the body has not finished: a stall here holds a buffer (and, when routed
        at the headers, an endpoint's room)."""
        return bool(self.headers) and not self.body_complete and not self.done

    def release_body(self) -> None:
        """The body has been handed on (or the request ended): its bytes leave the budget."""
        if self.held:
            self.bodies.used -= self.held
            self.held = 0
            self.body = bytearray()

    def stalled(self) -> pb.ProcessingResponse:
        """The body stopped arriving for ``bodyIdleTimeout``."""
        seconds = self.config.limits.body_idle_timeout
        return self._refuse_mid_request(BodyTimeout(
            f"no request body data for {seconds:g}s"))[0]

    def fault(self, error: Exception) -> list[pb.ProcessingResponse]:
        """A bug met while handling a message: a clear 500, the request settled, nothing lost."""
        if self.done and self.ticket is None:
            return []
        return self._refuse_mid_request(InternalError(
            f"the endpoint picker failed on this request ({type(error).__name__})"))

    def observe_response(self, message: pb.ProcessingRequest) -> None:
        """Meter one response message (inline or from the meter stream); answers nothing."""
        kind = message.WhichOneof("request")
        if kind == "response_headers":
            served = served_endpoint(message)
            if served is not None and self.ticket is not None:
                self.dispatcher.served_by(self.ticket, served)
            failure = upstream_failure(message)
            if failure is not None and self.ticket is not None:
                # Never reached an engine: settled to nothing, counted against the endpoint.
                self.dispatcher.upstream_failed(self.ticket, failure)
            self._on_response_headers(message.response_headers)
        elif kind == "response_body":
            self._on_response_body(message.response_body)
        elif kind == "response_trailers":
            self._finish()

    async def _on_request_headers(self, message: pb.ProcessingRequest
                                  ) -> list[pb.ProcessingResponse]:
        self.headers, repeated = _request_headers(message.request_headers,
                                                  self.dispatcher.identity_headers)
        self.subset = _subset(message)
        self.plan, self.per_chunk = body_plan(message)
        if message.HasField("protocol_config"):
            response_mode = message.protocol_config.response_body_mode
            self.echo_response = response_mode == _MODE.FULL_DUPLEX_STREAMED
            self.response_unseen = response_mode == _MODE.NONE and self.meter_id is None
        try:
            # Who, which lane and which API are known from the headers: refuse before the body
            # (the API first, so that a refusal comes in its error shape).
            self.kind = classify(self.headers.get(":method", ""), self.headers.get(":path", ""),
                                 self.config.routing.pass_through_set)
            if self.kind is not None:
                self.forward_path = forward_path(self.headers.get(":path", ""))
            if repeated in _KEY_HEADERS:  # watched in API-key mode only
                # Two different keys: whose tenant to charge is not ours to guess.
                raise Unauthorized(f"header {repeated!r} is sent more than once with different "
                                   "values; send one API key")
            if repeated is not None:
                # Proxies disagree on which copy counts (Envoy logs the first, a dict keeps the
                # last): a request naming two tenants or lanes is refused, not guessed at.
                raise BadRequest(f"header {repeated!r} is sent more than once")
            self.tenant = self.dispatcher.identity.tenant(self.headers)
            self.lane_asked = self._lane_asked()
            self.lane = self.dispatcher.choose_lane(self.tenant, self.lane_asked)
            if self.shed is not None and self.kind is not None and self.shed(self.tenant):
                raise MeterBacklog("the endpoint picker is behind metering responses; retry "
                                   "shortly")
            if self.kind is not None and message.request_headers.end_of_stream:
                raise BadRequest("request body is empty")
        except RequestError as error:
            self.done = True
            return [self._refuse(error)]
        if message.request_headers.end_of_stream:
            return self._pass_through(None)
        if self.plan is BodyPlan.BUFFERED:
            return [_HEADERS_CONTINUE]
        if self.plan is BodyPlan.AT_HEADERS:
            return self._with_path(await self._route_before_body())
        return []

    def _lane_asked(self) -> str | None:
        """The lane the request asks for: the lane header, else the lane its InferenceObjective
        maps to (objectives the config does not name are the gateway's business, not ours)."""
        asked = self.headers.get(self.config.tenancy.lane_header.lower())
        if asked:
            return asked
        objective = self.headers.get(OBJECTIVE_HEADER)
        if objective:
            for lane in self.config.lanes:
                if objective in lane.objectives:
                    return lane.name
        return None

    def _pass_through(self, body: bytes | None) -> list[pb.ProcessingResponse]:
        """A listed non-inference path (``GET /v1/models``): nothing to queue or charge; routed
        to the least-loaded endpoint."""
        self.routed = True
        candidates = self.dispatcher.candidates(self.subset)
        if not candidates:
            self.done = True
            return [self._refuse(NoEndpoint("no endpoint is available"))]
        destinations = [candidates[0].address]
        strip = self.dispatcher.identity.credential_headers
        if body is None:
            return [route(destinations, strip=strip)]
        if self.plan is BodyPlan.BUFFERED:
            return [route_with_body(destinations, None, strip=strip)]
        if self.per_chunk:
            return [route(destinations, strip=strip), *[_BODY_CONTINUE] * self.chunks]
        return [route(destinations, strip=strip), _body("request_body", body, True)]

    async def _on_request_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.done:
            return []
        if body.end_of_stream:
            self.body_complete = True
        size = len(body.body)
        limits = self.config.limits
        if size and self.bodies.used + size > limits.max_buffered_bytes:
            return self._refuse_mid_request(BodyBuffersFull(
                "the gateway's picker is holding too many request bodies; retry shortly"))
        self.bodies.used += size
        self.held += size
        self.body += body.body
        self.chunks += 1
        if len(self.body) > limits.max_body_bytes:
            return self._refuse_mid_request(BodyTooLarge(
                f"request body exceeds {self.config.limits.max_body_bytes} bytes"))
        if self.plan is BodyPlan.AT_HEADERS:
            if self.ticket is None:
                return [_BODY_CONTINUE]  # a pass-through path: the body goes on as it is
            # Already routed: the body goes on whole, rewritten, as the last chunk.
            if not body.end_of_stream:
                return [_body_replaced(None)]
            return self._finish_routed_body()
        if self.plan is BodyPlan.BUFFERED and not body.end_of_stream:
            # BUFFERED_PARTIAL sends what fits in Envoy's buffer: the body is larger than that.
            return self._refuse_mid_request(BodyTooLarge(
                "request body exceeds the gateway's buffer"))
        if not body.end_of_stream:
            return []
        return self._with_path(await self._body_complete())

    async def _body_complete(self) -> list[pb.ProcessingResponse]:
        """The whole body is in (HOLD or BUFFERED): admit, queue, and route."""
        if self.plan is BodyPlan.AT_HEADERS:
            return self._finish_routed_body() if self.ticket is not None else []
        if self.kind is None:
            return self._pass_through(bytes(self.body))
        try:
            if not self.body:
                raise BadRequest("request body is empty")
            inference = parse_request(bytes(self.body), self.kind, self.config.part_costs)
            ticket = await self._admit(inference)
        except RequestError as error:
            self.done = True
            return [self._refuse(error)]
        rewritten = self._rewritten(inference, ticket)
        destinations = ticket.destinations
        strip = self.dispatcher.identity.credential_headers
        if self.plan is BodyPlan.BUFFERED:
            return [route_with_body(destinations, rewritten, self.meter_id,
                                    ticket.ratelimit_headers, strip=strip)]
        if self.per_chunk:
            # STREAMED, the chunks held: each is answered, the last carries the whole body.
            whole = bytes(self.body) if rewritten is None else rewritten
            return [route(destinations, self.meter_id, ticket.ratelimit_headers,
                          remove_headers=["content-length"], strip=strip),
                    *[_body_replaced(None)] * (self.chunks - 1), _body_replaced(whole)]
        # No content-length to fix: with a streamed body Envoy drops it and sends the upstream
        # request chunked.
        body = bytes(self.body) if rewritten is None else rewritten
        return [route(destinations, self.meter_id, ticket.ratelimit_headers, strip=strip),
                _body("request_body", body, True)]

    async def _route_before_body(self) -> list[pb.ProcessingResponse]:
        """AT_HEADERS: admit on what the headers say, since the upstream is chosen now."""
        if self.kind is None:
            return self._pass_through(None)
        try:
            ticket = await self._admit(self._inference_from_headers())
        except RequestError as error:
            self.done = True
            return [self._refuse(error)]
        # The body is replaced whole at its end, so its length is not known yet.
        return [route(ticket.destinations, self.meter_id, ticket.ratelimit_headers,
                      remove_headers=["content-length"],
                      strip=self.dispatcher.identity.credential_headers)]

    async def _admit(self, inference: InferenceRequest) -> Ticket:
        """Admit and queue; returns once the request is dispatched (RequestError if refused)."""
        self.model = inference.model
        sessions = self.config.routing.sessions
        self.ticket = await self.dispatcher.admit(
            self.tenant, inference, self.subset, self.lane_asked, self.request_id,
            output_seen=not (self.logged or self.response_unseen),
            # The session header is a hint scoped by the tenant resolved above; it goes on to
            # the engine unchanged (the application may read it there).
            session=None if sessions is None else self.headers.get(sessions.header))
        self.routed = True
        return self.ticket

    def _inference_from_headers(self) -> InferenceRequest:
        length = self.headers.get("content-length", "")
        size = int(length) if length.isdigit() else self.config.limits.max_body_bytes
        if size > self.config.limits.max_body_bytes:
            raise BodyTooLarge(f"request body exceeds {self.config.limits.max_body_bytes} bytes")
        assert self.kind is not None
        # The body's size bounds its prompt: no tenant can make it look smaller than it is.
        return InferenceRequest(model=self.headers.get(MODEL_HEADER, ""),
                                prompt_tokens=max(1, size // CHARS_PER_TOKEN), max_tokens=None,
                                stream=False, include_usage=False, body={}, kind=self.kind,
                                output_cap_key=None)

    def _finish_routed_body(self) -> list[pb.ProcessingResponse]:
        """AT_HEADERS: the whole body is in; check it and hand it on, rewritten."""
        ticket = self.ticket
        assert ticket is not None and self.kind is not None
        try:
            inference = parse_request(bytes(self.body), self.kind, self.config.part_costs)
        except RequestError as error:
            # Nothing reached the engine: the body was held back. Settle to nothing.
            self.dispatcher.complete(ticket, Usage(0, 0, 0), "error")
            self.done = True
            return [self._refuse(error)]
        self.model = inference.model
        rewritten = self._rewritten(inference, ticket)
        self.dispatcher.body_read(ticket, inference)  # its cap, stream and choices, now known
        return [_body_replaced(bytes(self.body) if rewritten is None else rewritten)]

    def _with_path(self, replies: list[pb.ProcessingResponse]) -> list[pb.ProcessingResponse]:
        """``replies`` with the route (the one that clears the route cache) also setting
        ``:path`` to ``forward_path``, when the request spelled its path otherwise: Envoy would
        forward ``/V1/chat/completions`` or ``/v1/chat/completions/`` unchanged, the engine
        answer 404, and the request be charged for nothing served. (Envoy's default mutation
        rules let ext_proc set ``:path``; a gateway that forbids it sends the spelling as is,
        and a refusal from the engine is charged nothing.)"""
        if self.forward_path is None:
            return replies
        for reply in replies:
            which = reply.WhichOneof("response")
            if which in ("request_headers", "request_body"):
                common = getattr(reply, which).response
                if common.clear_route_cache:
                    common.header_mutation.set_headers.append(
                        _set_header(":path", self.forward_path))
                    break
        return replies

    def _rewritten(self, inference: InferenceRequest, ticket: Ticket) -> bytes | None:
        """The body as policy wants it, or None when it needs no change."""
        cap = ticket.max_tokens
        if cap is not None and inference.choices > ticket.choices:
            # Routed before its body was read (AT_HEADERS), as one choice: the n it asks for
            # share the output admission reserved, so none can cost more than it was bounded to.
            cap = max(1, cap * ticket.choices // inference.choices)
        changed = rewrite_body(inference.body, ticket.engine_priority, cap,
                               inference.output_cap_key)
        if self.logged and inference.stream and inference.kind in USAGE_OPTION_KINDS:
            changed = ask_continuous_usage(inference.body) or changed
        if not changed:
            return None
        return json.dumps(inference.body, separators=(",", ":")).encode()

    def _refuse_mid_request(self, error: RequestError) -> list[pb.ProcessingResponse]:
        self.done = True
        self.release_body()
        if self.ticket is not None and self.ticket.outcome is None:
            if self.body_complete and self.routed and self.plan is not BodyPlan.AT_HEADERS:
                self.dispatcher.complete(self.ticket, None, "error")  # it reached the engine
            else:
                self.dispatcher.complete(self.ticket, Usage(0, 0, 0), "error")
        return [self._refuse(error)]

    def _refuse(self, error: RequestError) -> pb.ProcessingResponse:
        # Counted, and logged within the dispatcher's log budget: never metered.
        self.dispatcher.reject(self.tenant, error, model=self.model, lane=self.lane,
                               request_id=self.request_id)
        limits = self.dispatcher.ratelimit_headers(self.tenant) if error.http_status == 429 \
            else None
        return immediate(error, limits, anthropic=self.kind is ApiKind.MESSAGES)

    def _on_response_headers(self, message: pb.HttpHeaders) -> None:
        headers = _headers(message)
        status = headers.get(":status", "200")
        self.response_failed = not status.startswith("2")
        kind = self.kind if self.kind is not None else ApiKind.CHAT
        self.meter = ResponseMeter("text/event-stream" in headers.get("content-type", ""), kind)
        if message.end_of_stream:
            self._finish()

    def answer_response_body(self, body: pb.HttpBody) -> bytes:
        """A streamed response chunk of the inline path, metered, and the reply Envoy waits for
        (the chunk echoed in full-duplex mode), as its wire bytes (``serialize_reply``). Every
        chunk comes here: observe_response's work for a body, without asking the message its
        kind again, and reading the chunk once (each read of a bytes field copies it)."""
        chunk, end = body.body, body.end_of_stream
        self._on_response_chunk(chunk, end)
        if self.echo_response:
            return echo_reply(chunk, end)
        return _RESPONSE_BODY_CONTINUE

    def _on_response_body(self, body: pb.HttpBody) -> None:
        self._on_response_chunk(body.body, body.end_of_stream)

    def _on_response_chunk(self, chunk: bytes, end: bool) -> None:
        ticket = self.ticket
        if ticket is not None and ticket.outcome is None:
            if chunk and ticket.first_byte_at is None:
                self.dispatcher.on_first_byte(ticket)
            meter = self.meter
            if meter is not None and not self.response_failed:
                tokens = meter.feed(chunk)
                if tokens:  # an event without text (a role, usage, [DONE]) charges nothing
                    self.dispatcher.on_output_tokens(ticket, tokens)
        if end:
            self._finish()

    def _finish(self) -> None:
        self.done = True
        ticket = self.ticket
        if ticket is None or ticket.outcome is not None:
            return
        self._settle(ticket, self._usage(), "error" if self.response_failed else "ok")

    def _usage(self) -> Usage | None:
        """The engine's usage as the response reported it (None: not reported). An engine that
        answered with an error status (400 for a prompt past the context, 404) computed
        nothing and is charged nothing, not the prompt estimate."""
        if self.meter is None:
            return None
        return NOTHING_COMPUTED if self.response_failed else self.meter.finish()

    def _settle(self, ticket: Ticket, usage: Usage | None, outcome: str) -> None:
        if self.meter is not None:
            ticket.finish_reason = self.meter.finish_reason
        self.dispatcher.complete(ticket, usage, outcome)

    def settle_logged(self, logged: LoggedResponse) -> None:
        """Settle from the gateway's access log entry (the ``access-log`` response path)."""
        self.done = True
        ticket = self.ticket
        if ticket is None or ticket.outcome is not None:
            return
        dispatcher = self.dispatcher
        if logged.served is not None:
            dispatcher.served_by(ticket, logged.served)
        if logged.failure is not None:
            # Never reached an engine: settled to nothing, counted against the endpoint.
            dispatcher.upstream_failed(ticket, logged.failure)
            return
        if logged.first_byte is not None and logged.body_bytes:
            dispatcher.on_first_byte(ticket, at=ticket.arrived_at + logged.first_byte)
        if logged.failed:
            # An engine's error answer computed nothing (a request the client left before
            # any answer, status 0, stays on its estimate).
            dispatcher.complete(ticket, NOTHING_COMPUTED if logged.status >= 400 else None,
                                "error")
            return
        outcome = "cancelled" if logged.client_gone else "ok"
        usage = logged.usage(prompt_only=self.kind is ApiKind.EMBEDDINGS)
        if usage is not None:
            dispatcher.complete(ticket, usage, outcome)
        elif logged.completion_tokens is not None:
            # Output counted but no prompt count: the prompt stays at its estimate.
            dispatcher.on_output_tokens(ticket, logged.completion_tokens)
            dispatcher.complete(ticket, None, outcome)
        elif logged.client_gone and not logged.body_bytes:
            dispatcher.complete(ticket, None, "cancelled")
        elif logged.client_gone and ticket.stream and self.kind is not None \
                and (delivered := streamed_output(self.kind, logged.body_bytes)) is not None:
            # A /v1/messages or Responses stream left before its count came: what its bytes can
            # have carried (capped), not the whole max_tokens.
            cap = ticket.output_cap
            dispatcher.on_output_tokens(ticket, delivered if cap is None else min(cap, delivered))
            dispatcher.complete(ticket, None, "cancelled")
        else:
            # Output went out uncounted (an engine that reports no usage, or a stream cut
            # before its usage): the output estimate, never nothing.
            dispatcher.metrics.settlements_estimated.labels("no_usage").inc()
            dispatcher.complete(ticket, None, "unmetered")

    def abandon(self) -> None:
        """The stream ended early (client gone, Envoy reset): settle to what was delivered.

        A gateway that sends no response body ends the stream without one as a matter of
        course: the request is settled on its estimate, not for free.
        """
        ticket = self.ticket
        if ticket is None or ticket.outcome is not None:
            return
        # Envoy can end the stream before its last, empty end_of_stream message: the client
        # had the whole body by its length and closed the connection. A response whose usage
        # was read whole was delivered whole.
        usage = self._usage()
        if usage is not None:
            self._settle(ticket, usage, "error" if self.response_failed else "ok")
            return
        # A response the picker was never to see (no body sent; or the access log's entry, lost):
        # its output went uncounted, so it is charged the estimate.
        if (self.response_unseen or self.logged) and self.meter is None:
            self.settle_estimated("response_unseen" if self.response_unseen else "log_unclaimed")
            return
        self.dispatcher.complete(ticket, None, "cancelled")

    def settle_estimated(self, reason: str) -> None:
        """The response went out but its count was lost (``reason``, a label of
        ``fairway_settlements_estimated_total``): settled ``unmetered``, on the output counted
        so far or the tenant's expected output, whichever is more; never as a client that left,
        which would charge only what the picker happened to read."""
        ticket = self.ticket
        if ticket is None or ticket.outcome is not None:
            return
        usage = self._usage()
        if usage is not None:  # read whole after all
            self._settle(ticket, usage, "error" if self.response_failed else "ok")
            return
        self.dispatcher.metrics.settlements_estimated.labels(reason).inc()
        if self.meter is not None:
            ticket.finish_reason = self.meter.finish_reason
        self.dispatcher.complete(ticket, None, "unmetered")


UNCLAIMED_LOG_INTERVAL = 60.0
"""Seconds between warnings about requests whose meter stream never came."""

METER_BACKLOG_SHED = 0.5
"""Seconds a routed request may wait for its meter stream to be read before the picker refuses
new requests (503 ``meter_backlog``, ``Retry-After``) until it has caught up. Unloaded, the
meter stream is read a few milliseconds after the route; a picker that falls further behind
than Envoy's ``deferred_close_timeout`` (5 s in the shipped configs) loses meters, since Envoy
resets the stream and discards what the picker had not read. A tenth of that leaves room for
the requests already routed, which fall further behind as they stream (1.5 s lost 60 meters of
883 whole streams where 0.5 s lost none: bench/results/meter_overload.md)."""

METER_CUT_IDLE = 1.0
"""A meter stream that ends before its response did, less than this many seconds after the
picker read its last message, was cut while data was still coming: the picker was behind and
Envoy reset the stream (``deferred_close_timeout`` after the HTTP stream ended), so what the
response carried after that is unknown and it is settled on its estimate. A picker that keeps
up reads a client's departure (the last message) a whole ``deferred_close_timeout`` before the
reset, which must therefore exceed this (5 s in the shipped configs)."""


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` backed by the fair dispatcher."""

    def __init__(self, dispatcher: Dispatcher, config: Callable[[], PickerConfig],
                 meter_claim_timeout: float = 10.0, log_claim_timeout: float = 330.0,
                 client_auth: ClientAuth | None = None) -> None:
        self.dispatcher = dispatcher
        self._config = config
        self.client_auth = client_auth
        """Who may speak ext_proc on this port (``picker.tls.ClientAuth``); None: anyone (the
        in-process tests that drive the servicer directly)."""
        self._refusals_logged_at = -math.inf
        self.meter_claim_timeout = meter_claim_timeout
        """Seconds a routed request waits for its meter stream before it is settled as gone."""
        self.log_claim_timeout = log_claim_timeout
        """Seconds a request routed by an access-log gateway waits for its log entry (which
        comes when it ends) before it is settled on its estimate."""
        # A restarted picker must not take an old request's meter stream for a new request.
        self._id_prefix = os.urandom(4).hex()
        self._ids = itertools.count(1)
        self._awaiting_meter: dict[str, tuple[_Exchange, asyncio.TimerHandle]] = {}
        self._routed: collections.deque[tuple[float, str]] = collections.deque()
        """(when, meter id) of meter-stream requests routed, oldest first; the front is popped
        once claimed, or once a request routed after it was (``meter_backlog``)."""
        self._claimed_through = -math.inf
        """When the latest-routed request whose meter stream was claimed was routed."""
        self._claim_lag = 0.0
        """How long the latest meter stream claimed had waited since its route."""
        self.meter_backlog_shed = METER_BACKLOG_SHED
        self._metering: collections.Counter[str] = collections.Counter()
        """Meter-stream requests routed and not yet metered, by tenant (``_shed``)."""
        self.bodies = BodyBudget()
        dispatcher.metrics.buffered_body_bytes.set_function(lambda: self.bodies.used)
        self._faults_logged: set[str] = set()
        self._unclaimed_since_log = 0
        self._unclaimed_logged_at = -math.inf

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Reply]:
        config = self._config()
        if self.client_auth is not None:
            await self.authorize(context, config)
        path = next((value for key, value in context.invocation_metadata() or ()
                     if key == RESPONSE_PATH_METADATA), None)
        metered = path in (METER_STREAM, ACCESS_LOG)
        meter_id = f"{self._id_prefix}-{next(self._ids)}" if metered else None
        exchange = _Exchange(self.dispatcher, config, meter_id, self.bodies,
                             logged=path == ACCESS_LOG)
        if path == METER_STREAM and self.meter_backlog() > self.meter_backlog_shed:
            exchange.shed = self._shed
        handed_over = False
        messages = aiter(request_iterator)
        try:
            while True:
                try:
                    if exchange.receiving_body:
                        async with asyncio.timeout(config.limits.body_idle_timeout):
                            message = await anext(messages)
                    else:
                        message = await anext(messages)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    yield exchange.stalled()
                    return
                if message.observability_mode:
                    await self._meter(message, messages)
                    return
                chunk_reply: bytes | None = None
                try:
                    if message.WhichOneof("request") == "response_body":
                        # Every streamed chunk of the inline response path: metered and
                        # answered here, without a coroutine or a list per chunk.
                        chunk_reply = exchange.answer_response_body(message.response_body)
                    else:
                        replies = await exchange.handle(message)
                except Exception as error:  # the one guard: a bug must not fail the stream bare
                    self.count_fault(error)
                    replies = exchange.fault(error)
                    chunk_reply = None
                if chunk_reply is not None:
                    yield chunk_reply
                    if exchange.done and exchange.ticket is None:
                        return
                    continue
                if exchange.routed and exchange.body_complete:
                    exchange.release_body()
                if meter_id is not None and exchange.ticket is not None and not handed_over:
                    # Before the route goes out: the meter stream can open as soon as it has.
                    self._await_meter(meter_id, exchange)
                    handed_over = True
                for reply in replies:
                    yield reply
                if exchange.done and exchange.ticket is None:
                    return
        finally:
            exchange.release_body()
            if not handed_over:
                exchange.abandon()

    async def authorize(self, context: grpc.aio.ServicerContext,
                        config: PickerConfig | None = None) -> None:
        """Refuse the stream (PERMISSION_DENIED, before any message is read: nothing routed,
        charged or metered) unless its peer may speak ext_proc (``client_auth``)."""
        assert self.client_auth is not None
        config = config or self._config()
        reason = self.client_auth.refusal(context, config.tenancy.mode == "header")
        if reason is None:
            return
        kind = "unauthenticated" if reason == UNAUTHENTICATED_HEADER_MODE else "name"
        self.dispatcher.metrics.peers_refused.labels(kind).inc()
        now = asyncio.get_running_loop().time()
        # At most one line a minute: an impostor (or a misconfigured gateway) must not flood it.
        if now - self._refusals_logged_at >= UNCLAIMED_LOG_INTERVAL:
            self._refusals_logged_at = now
            log.warning("ext_proc stream from %s refused: %s (counted in "
                        "fairway_ext_proc_peers_refused_total)", context.peer(), reason)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

    def count_fault(self, error: Exception) -> None:
        """A bug met while handling a message or a log entry: counted, logged once per kind."""
        kind = type(error).__name__
        self.dispatcher.metrics.faults.labels(kind).inc()
        if kind not in self._faults_logged:  # once per kind: a flood must not flood the log
            self._faults_logged.add(kind)
            log.exception("fault while handling a request (logged once per kind; counted in "
                          "fairway_faults_total)", exc_info=error)

    def _await_meter(self, meter_id: str, exchange: _Exchange) -> None:
        """The request is routed; its response will come on a meter stream named ``meter_id``,
        or in the access log when it has ended."""
        timeout = self.log_claim_timeout if exchange.logged else self.meter_claim_timeout
        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout, self._unclaimed, meter_id)
        self._awaiting_meter[meter_id] = (exchange, timer)
        if not exchange.logged:
            exchange.routed_at = loop.time()
            self._routed.append((exchange.routed_at, meter_id))
            self._metering[exchange.tenant] += 1

    def _metered(self, exchange: _Exchange) -> None:
        """A meter-stream request's meter stream is over (or never came)."""
        metering = self._metering
        metering[exchange.tenant] -= 1
        if metering[exchange.tenant] <= 0:
            del metering[exchange.tenant]

    def _shed(self, tenant: str) -> bool:
        """While behind on meter streams: refuse ``tenant``'s new request unless it has fewer
        than an equal share of the requests being metered, so that the refusals fall on the
        tenants that make the backlog, and a light one still gets in."""
        metering = self._metering
        return metering[tenant] * len(metering) >= metering.total()

    def meter_backlog(self) -> float:
        """How far behind the picker is reading meter streams, in seconds: 0 while none is
        awaited, else how long the latest one claimed had waited since its route, or how long
        the oldest routed after that one has waited so far, whichever is more. A meter stream
        opens as soon as Envoy has the route, so a picker that keeps up claims it within
        milliseconds; one routed before a claimed one and still unclaimed is not coming (a route
        without the metering filter), which is no backlog."""
        routed, awaiting, claimed = self._routed, self._awaiting_meter, self._claimed_through
        while routed and (routed[0][0] <= claimed or routed[0][1] not in awaiting):
            routed.popleft()
        if not routed:
            return 0.0
        return max(asyncio.get_running_loop().time() - routed[0][0], self._claim_lag)

    def _unclaimed(self, meter_id: str) -> None:
        exchange, _ = self._awaiting_meter.pop(meter_id, (None, None))
        if exchange is not None and not exchange.done:
            self.dispatcher.metrics.meter_unclaimed.inc()
            self._unclaimed_since_log += 1
            now = asyncio.get_running_loop().time()
            # One line a minute at most: a gateway without its metering filter would otherwise
            # log every request (each is counted in fairway_requests_total all the same).
            if now - self._unclaimed_logged_at >= UNCLAIMED_LOG_INTERVAL:
                log.warning("no meter stream or access log entry in time for %d request(s) (the "
                            "latest %s): is the gateway's metering filter or access log "
                            "missing? settled on its estimate (counted in "
                            "fairway_meter_unclaimed_total)", self._unclaimed_since_log, meter_id)
                self._unclaimed_logged_at, self._unclaimed_since_log = now, 0
            exchange.settle_estimated("log_unclaimed" if exchange.logged else "meter_unclaimed")
        if exchange is not None and not exchange.logged:
            self._metered(exchange)

    def settle_logged(self, logged: LoggedResponse) -> None:
        """The gateway's access log reports that a request routed for that path has ended."""
        exchange, timer = self._awaiting_meter.pop(logged.request_id, (None, None))
        if exchange is None:
            return
        if timer is not None:
            timer.cancel()
        exchange.settle_logged(logged)

    async def _meter(self, first: pb.ProcessingRequest,
                     messages: AsyncIterator[pb.ProcessingRequest]) -> None:
        """A meter stream (``observability_mode``): Envoy waits for no answer, so none is sent.

        It returns as soon as the response is settled, ending the stream from this side rather
        than waiting for Envoy's ``deferred_close_timeout`` (``picker.stack.envoy``'s
        ``METER_DEFERRED_CLOSE`` says what that timeout bounds)."""
        meter_id = _meter_id(first)
        exchange, timer = self._awaiting_meter.pop(meter_id, (None, None)) if meter_id \
            else (None, None)
        if exchange is None:
            # Nothing to meter (a request refused, a pass-through path, or one already settled):
            # ended at once, so that a flood of refusals costs the picker no reading.
            return
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        read_at = loop.time()
        if not exchange.logged:
            self._claim_lag = read_at - exchange.routed_at
            self._claimed_through = max(self._claimed_through, exchange.routed_at)
        try:
            exchange.observe_response(first)
            if exchange.done:
                return
            async for message in messages:
                read_at = loop.time()
                exchange.observe_response(message)
                if exchange.done:
                    return
        finally:
            if not exchange.logged:
                self._metered(exchange)
            if not exchange.done:
                # The stream ended before the response did. Read up to date, the picker sees a
                # client that left (Envoy ends the stream a deferred_close_timeout after that);
                # ended while the picker was still reading, it is the picker's backlog that
                # Envoy's reset discarded. (gRPC shows a reset as a plain end as often as not.)
                if loop.time() - read_at < METER_CUT_IDLE:
                    exchange.settle_estimated("meter_cut")
                else:
                    exchange.abandon()


SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def add_to_server(processor: ExternalProcessor, server: grpc.aio.Server) -> None:
    """Serve ``processor`` on ``server``: the generated registration
    (``add_ExternalProcessorServicer_to_server``), with ``serialize_reply`` as the response
    serializer, so that replies made as wire bytes go out as they are."""
    handlers = {"Process": grpc.stream_stream_rpc_method_handler(
        processor.Process, request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=serialize_reply)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
