"""Envoy's gRPC access log as a response path: what did a finished request cost, by the
gateway's own count?

With ``fairway-response-path: access-log`` no ext_proc stream carries the response. Envoy's own
filters read the engine's ``usage`` as it passes (``sse_to_metadata`` on a stream, whose every
chunk carries it once the picker has asked for ``continuous_usage_stats``; ``json_to_metadata``
on a whole answer) into ``fairway.usage`` metadata, and Envoy's access log (``http_grpc``,
entries batched for ``buffer_flush_interval``) sends it when the request has ended, with the
``fairway`` metadata naming the request. The picker then settles the request as a meter stream's
end would: the usage, the status, whether the client left, which endpoint served.

What this path gives up, for no picker message per streamed token: a stream's output is charged
when it ends, not as it streams (a tenant's counter lags by what its running streams have
produced so far), the picker does not see a stream grow (only its engine's scraped KV use
does: a light tenant is served worse under a flood, ``bench/results/overhead.md``), its first
token is seen only then (TTFT is recorded late; the prefill rules, ``capacity.maxPrefillTokens``
and ``readyReserve``, see a prefill end when a read of the engine shows the request out of its
waiting queue: ``Gate.scraped``), and a finished request's room is freed up to one flush
interval late.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from picker.extproc.routed import (
    METER_KEY,
    METER_NAMESPACE,
    UPSTREAM_FAILURE_DETAILS,
    LoggedResponse,
)
from picker.extproc.service import ExternalProcessor

USAGE_NAMESPACE = "fairway.usage"
"""The metadata namespace Envoy's usage filters write (``picker.stack.envoy.usage_filters``)."""


def _count(fields: dict | None, key: str) -> int | None:
    if fields is None:
        return None
    value = fields.get(key)
    return None if value is None else max(0, int(value.number_value))


def _address(entry: accesslog_pb2.AccessLogCommon) -> str | None:
    socket = entry.upstream_remote_address.socket_address
    if not socket.address:
        return None
    host = f"[{socket.address}]" if ":" in socket.address else socket.address
    return f"{host}:{socket.port_value}"


def logged_response(entry: accesslog_pb2.HTTPAccessLogEntry) -> LoggedResponse | None:
    """The request ``entry`` reports, or None for a request the picker did not route (a
    refusal, a pass-through path, another gateway's)."""
    common = entry.common_properties
    namespaces = common.metadata.filter_metadata
    fairway = namespaces.get(METER_NAMESPACE)
    if fairway is None:
        return None
    name = fairway.fields.get(METER_KEY)
    if name is None or not name.string_value:
        return None
    usage = namespaces.get(USAGE_NAMESPACE)
    fields = usage.fields if usage is not None else None
    response = entry.response
    details = response.response_code_details
    return LoggedResponse(
        request_id=name.string_value,
        status=response.response_code.value,
        prompt_tokens=_count(fields, "prompt"),
        completion_tokens=_count(fields, "completion"),
        cached_tokens=_count(fields, "cached") or 0,
        client_gone=common.response_flags.downstream_connection_termination,
        body_bytes=response.response_body_bytes,
        served=_address(common),
        failure=details if details.startswith(UPSTREAM_FAILURE_DETAILS) else None,
        first_byte=common.time_to_first_upstream_rx_byte.ToNanoseconds() / 1e9
        if common.HasField("time_to_first_upstream_rx_byte") else None,
    )


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """``envoy.service.accesslog.v3.AccessLogService``: settles the requests whose log entries
    come (an entry for a request the picker does not hold is ignored)."""

    def __init__(self, processor: ExternalProcessor) -> None:
        self.processor = processor

    async def StreamAccessLogs(self,
                               request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
                               context: grpc.aio.ServicerContext
                               ) -> als_pb2.StreamAccessLogsResponse:
        # A forged log entry could settle (charge) a routed request: the same peers as ext_proc.
        if self.processor.client_auth is not None:
            await self.processor.authorize(context)
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                try:
                    logged = logged_response(entry)
                    if logged is not None:
                        self.processor.settle_logged(logged)
                except Exception as error:  # one bad entry must not drop the rest of the batch
                    self.processor.count_fault(error)
        return als_pb2.StreamAccessLogsResponse()


def add_to_server(receiver: AccessLogReceiver, server: grpc.aio.Server) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(receiver, server)
