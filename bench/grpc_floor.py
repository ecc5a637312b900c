"""What does Python gRPC alone cost per ext_proc message, before fairway does anything?

A servicer that only reads each message's body length (grpc.aio, as the picker serves, and the
thread-pool server for comparison) receives meter-stream-like messages (an observability-mode
``ProcessingRequest`` with one 150-byte SSE chunk) from a client in another process: back to back
(dense, many messages per read, as under load) and spaced 5 ms apart on 4 streams (one wake-up per
message, as chunks of a few streams arrive). The server's CPU per message is the floor under the
picker's cost per streamed chunk: what no change inside the picker's own code can remove.

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
RUNS = (("dense", 1, 20_000, 0.0), ("dense", 4, 20_000, 0.0), ("spaced 5 ms", 4, 4_000, 0.005))
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


async def _aio() -> list[dict[str, Any]]:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(_AioServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    out = []
    for name, streams, count, spacing in RUNS:
        before = _cpu()
        client = await asyncio.create_subprocess_exec(*_drive(port, streams, count, spacing))
        await client.wait()
        out.append({"server": "grpc.aio", "arrival": name, "streams": streams,
                    "messages": count, "us_per_message": (_cpu() - before) / count * 1e6})
    await server.stop(0)
    return out


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
    if sys.argv[1:2] == ["--client"]:
        port, streams, count = (int(a) for a in sys.argv[2:5])
        _client(port, streams, count, float(sys.argv[5]))
        return
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    results: list[dict[str, Any]] = []
    if which in ("aio", "both"):
        # Each server in its own process: one server's threads must not bill the other.
        results += asyncio.run(_aio()) if which == "aio" else json.loads(subprocess.run(
            [sys.executable, "-m", "bench.grpc_floor", "aio"], check=True,
            capture_output=True, text=True).stdout)
    if which in ("threads", "both"):
        results += _threads() if which == "threads" else json.loads(subprocess.run(
            [sys.executable, "-m", "bench.grpc_floor", "threads"], check=True,
            capture_output=True, text=True).stdout)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
