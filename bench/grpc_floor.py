"""What does Python gRPC alone cost per ext_proc message, before fairway does anything?

A servicer that only reads each message's body length (grpc.aio, as the picker serves, and the
thread-pool server for comparison) receives meter-stream-like messages (an observability-mode
``ProcessingRequest`` with one 150-byte SSE chunk) from a client in another process: back to back
(dense, many messages per read, as under load) and spaced 5 ms apart on 4 streams (one wake-up per
message, as chunks of a few streams arrive), and on 40 streams 4 ms apart (10,000 messages a
second, a pool's rate). The server's CPU per message is the floor under the picker's cost per
streamed chunk: what no change inside the picker's own code can remove. Each server runs on
asyncio's own event loop and on uvloop (libuv's), and beside grpcio's C core stands grpclib, a
pure-Python gRPC over h2 that parses frames in the event loop itself: whether another transport
or loop would move the floor.

And per request, in the shape Envoy gives each routed request at 200 requests/s (open loop): the
request path's stream (headers, answered; body, answered; trailers) and the meter stream
(request headers, response headers, response body, none answered), each one RPC; and an RPC with
no message at all. The servicer answers what must be answered with an empty message.

``python -m bench.grpc_floor`` prints JSON; ``bench.profile`` runs it and reports it.
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

CHUNK = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"sim-model",'
         b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
REQUEST_RATE = 200.0
REQUEST_SECONDS = 10.0
RUNS = (("dense", 1, 20_000, 0.0), ("dense", 4, 20_000, 0.0), ("spaced 5 ms", 4, 4_000, 0.005),
        ("spaced 4 ms", 40, 40_000, 0.004))
"""(name, streams, messages in all, seconds between a stream's messages)."""


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _AioServicer(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        seen = 0
        async for message in request_iterator:
            seen += len(message.response_body.body)
        if seen < 0:
            yield pb.ProcessingResponse()


class _GrpclibServicer:
    """The same servicer on grpclib: its handler table, by the method's full name."""

    async def Process(self, stream: Any) -> None:
        seen = 0
        async for message in stream:
            seen += len(message.response_body.body)

    def __mapping__(self) -> dict[str, Any]:
        from grpclib.const import Cardinality, Handler
        return {"/envoy.service.ext_proc.v3.ExternalProcessor/Process":
                Handler(self.Process, Cardinality.STREAM_STREAM, pb.ProcessingRequest,
                        pb.ProcessingResponse)}


class _RequestServicer(pb_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        async for message in request_iterator:
            if message.observability_mode:
                continue
            if message.HasField("request_headers"):
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif message.HasField("request_body"):
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())


async def _request_client(port: int, shape: str) -> None:
    """``shape``: ``both`` (request path and meter stream), ``request`` (the first alone) or
    ``empty`` (an RPC without messages)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        body = b'{"model":"m","prompt":"hello there","max_tokens":1}'

        async def drain(call: Any) -> None:
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass

        async def one() -> None:
            call = stub.Process()
            if shape != "empty":
                await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders()))
                await call.read()
                await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
                    body=body, end_of_stream=True)))
                await call.read()
                await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
            await drain(call)
            if shape == "both":
                meter = stub.Process()
                for message in (pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
                                pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
                                pb.ProcessingRequest(response_body=pb.HttpBody(
                                    body=CHUNK, end_of_stream=True))):
                    message.observability_mode = True
                    await meter.write(message)
                await drain(meter)

        start, tasks = time.perf_counter(), []
        for i in range(int(REQUEST_RATE * REQUEST_SECONDS)):
            delay = start + i / REQUEST_RATE - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)


async def _serve_aio(servicer: pb_grpc.ExternalProcessorServicer) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _requests(loop_name: str) -> list[dict[str, Any]]:
    server, port = await _serve_aio(_RequestServicer())
    out = []
    for shape, what in (("both", "request path + meter stream (2 RPCs, 6 messages in, 2 out)"),
                        ("request", "request path alone (1 RPC, 3 in, 2 out)"),
                        ("empty", "an RPC without messages")):
        before = _cpu()
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.grpc_floor", "--request-client", str(port), shape)
        await client.wait()
        out.append({"server": f"grpc.aio, {loop_name}", "shape": what, "rate": REQUEST_RATE,
                    "ms_per_request": (_cpu() - before) / (REQUEST_RATE * REQUEST_SECONDS)
                    * 1000})
    await server.stop(0)
    return out


class _ThreadServicer(pb_grpc.ExternalProcessorServicer):
    def Process(self, request_iterator: Iterator[pb.ProcessingRequest],
                context: grpc.ServicerContext) -> Iterator[pb.ProcessingResponse]:
        seen = 0
        for message in request_iterator:
            seen += len(message.response_body.body)
        return iter(())


def _client(port: int, streams: int, count: int, spacing: float) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExternalProcessorStub(channel)

    def messages() -> Iterator[pb.ProcessingRequest]:
        for _ in range(count // streams):
            if spacing:
                time.sleep(spacing)
            yield pb.ProcessingRequest(response_body=pb.HttpBody(body=CHUNK),
                                       observability_mode=True)

    threads = [threading.Thread(target=lambda: list(stub.Process(messages())))
               for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()


def _drive(port: int, streams: int, count: int, spacing: float) -> list[str]:
    return [sys.executable, "-m", "bench.grpc_floor", "--client", str(port), str(streams),
            str(count), str(spacing)]


async def _in_loop(transport: str, loop_name: str) -> list[dict[str, Any]]:
    """``transport``: ``grpc.aio`` or ``grpclib``, served on the running loop."""
    if transport == "grpclib":
        from grpclib.server import Server
        lib = Server([_GrpclibServicer()])
        await lib.start("127.0.0.1", 0)
        port = lib._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    else:
        server, port = await _serve_aio(_AioServicer())
    out = []
    for name, streams, count, spacing in RUNS:
        before = _cpu()
        client = await asyncio.create_subprocess_exec(*_drive(port, streams, count, spacing))
        await client.wait()
        out.append({"server": f"{transport}, {loop_name}", "arrival": name, "streams": streams,
                    "messages": count, "us_per_message": (_cpu() - before) / count * 1e6})
    if transport == "grpclib":
        lib.close()
        await lib.wait_closed()
    else:
        await server.stop(0)
    return out


def _run_in(loop_name: str, coroutine: Any) -> Any:
    if loop_name == "uvloop":
        import uvloop
        return uvloop.run(coroutine)
    return asyncio.run(coroutine)


def _threads() -> list[dict[str, Any]]:
    server = grpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_ExternalProcessorServicer_to_server(_ThreadServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out = []
    for name, streams, count, spacing in RUNS:
        before = _cpu()
        subprocess.run(_drive(port, streams, count, spacing), check=True)
        out.append({"server": "grpc (thread pool)", "arrival": name, "streams": streams,
                    "messages": count, "us_per_message": (_cpu() - before) / count * 1e6})
    server.stop(0)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--request-client"]:
        asyncio.run(_request_client(int(sys.argv[2]), sys.argv[3]))
        return
    if sys.argv[1:2] == ["--requests"]:
        print(json.dumps(_run_in(sys.argv[2], _requests(sys.argv[2]))))
        return
    if sys.argv[1:2] == ["--client"]:
        port, streams, count = (int(a) for a in sys.argv[2:5])
        _client(port, streams, count, float(sys.argv[5]))
        return
    if sys.argv[1:2] == ["serve"]:
        transport, loop_name = sys.argv[2], sys.argv[3]
        print(json.dumps(_run_in(loop_name, _in_loop(transport, loop_name))))
        return
    if sys.argv[1:2] == ["threads"]:
        print(json.dumps(_threads()))
        return

    def in_own_process(*mode: str) -> Any:
        # Each server in its own process: one server's threads must not bill another's.
        return json.loads(subprocess.run([sys.executable, "-m", "bench.grpc_floor", *mode],
                                         check=True, capture_output=True, text=True).stdout)

    messages = [row for transport in ("grpc.aio", "grpclib") for loop_name in ("asyncio", "uvloop")
                for row in in_own_process("serve", transport, loop_name)]
    print(json.dumps({"messages": messages + in_own_process("threads"),
                      "requests": [row for loop_name in ("asyncio", "uvloop")
                                   for row in in_own_process("--requests", loop_name)]}))


if __name__ == "__main__":
    main()
