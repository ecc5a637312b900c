"""The CPython gRPC floor as an endpoint picker: what any Python picker behind the same Envoy pays
before it decides anything.

``python -m bench.floor_epp --endpoints A,B`` serves ``ExternalProcessor/Process`` over TLS
(self-signed, as fairway and upstream serve it) on grpc.aio and asyncio, as fairway does, and does
the least an endpoint picker must do on Envoy's inline response path: it holds the request's
headers until the body has come (``FULL_DUPLEX_STREAMED``), then routes it to the endpoint with
the fewest requests in flight (header and ``envoy.lb`` metadata, as fairway answers) and echoes the
body; it answers the response headers and echoes every streamed response chunk. No parse, no
queue, no metering. It prints ``ext_proc PORT`` and ``metrics PORT`` (a ``/metrics`` with nothing
of its own, so that the benchmark's sampler reads it as it reads the other pickers').

``bench.peer``'s block F runs it behind the inline Envoy: its TTFT and CPU per request on a
workload are the floor that fairway's own work stands on (the decided rule: fairway's CPU is
judged against this floor, not below it).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import start_http_server

from picker.extproc.service import _body, route
from picker.tls import self_signed

_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


class FloorServicer(pb_grpc.ExternalProcessorServicer):
    """Routes each request to the endpoint with the fewest in flight; echoes bodies."""

    def __init__(self, endpoints: list[str]) -> None:
        self.inflight = dict.fromkeys(endpoints, 0)

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        body = bytearray()
        chosen: str | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "response_body":
                    chunk = message.response_body
                    yield _body("response_body", chunk.body, chunk.end_of_stream)
                elif kind == "request_body":
                    part = message.request_body
                    body += part.body
                    if part.end_of_stream:
                        chosen = min(self.inflight, key=self.inflight.__getitem__)
                        self.inflight[chosen] += 1
                        yield route([chosen])
                        yield _body("request_body", bytes(body), True)
                elif kind == "response_headers":
                    yield _HEADERS
                elif kind == "request_trailers":
                    yield _REQUEST_TRAILERS
                elif kind == "response_trailers":
                    yield _RESPONSE_TRAILERS
        finally:
            if chosen is not None:
                self.inflight[chosen] -= 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def serve(endpoints: list[str]) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FloorServicer(endpoints), server)
    pair = self_signed()
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(pair.key_pem, pair.cert_pem)]))
    metrics = _free_port()
    start_http_server(metrics, addr="127.0.0.1")
    await server.start()
    print(f"ext_proc {port}", flush=True)
    print(f"metrics {metrics}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_epp", description=__doc__)
    parser.add_argument("--endpoints", required=True, help="host:port,host:port")
    args = parser.parse_args()
    asyncio.run(serve(args.endpoints.split(",")))


if __name__ == "__main__":
    main()
