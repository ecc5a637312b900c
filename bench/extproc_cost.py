"""What does the picker's own Python cost per request and per streamed chunk on the inline
response path, beyond gRPC?

``python -m bench.extproc_cost`` drives ``ExternalProcessor.Process`` in-process (no gRPC, no
Envoy: what remains is the picker's code, above the CPython gRPC floor of
``bench.grpc_floor``) with the messages Envoy sends for one streamed chat request of the
system-prompt workload (``bench/traffic/prefix_system_prompt.yaml``: a 2,000-token system prompt
shared by a tenant's requests, a short question), full-duplex bodies, the response inline, two
endpoints with ``routing.prefixAffinity``. Each reply is serialized as gRPC would (the servicer's
``serialize_reply`` where it has one, else ``SerializeToString``). Per request: a request
answered with no chunk; per chunk: (a request with ``CHUNKS`` one-token SSE chunks − one with
none) ÷ ``CHUNKS``. CPU time (``time.process_time``), the best of ``--rounds`` interleaved rounds
of 100 requests, for ``picker/extproc/service.py`` and the response meter it uses
(``picker/openai/response.py``) as they are and as they were at ``--before`` (read with ``git
show``), each with its own dispatcher, and for ``bench.floor_epp``'s servicer (the CPython gRPC
floor as a picker: route, echo, nothing else) on the same messages. Writes
``bench/results/extproc_cost.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

import picker.extproc.service as current
from bench.floor_epp import FloorServicer
from picker.config.schema import load_config
from picker.dispatch import Dispatcher
from picker.metrics import PickerMetrics
from picker.sim.traffic import DEFAULT_TENANT_HEADER

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BEFORE = "d6e0849"
"""The last commit before the echo went out as wire bytes and decode steps were read unparsed."""
CHUNKS = 100
REQUESTS = 100
"""Requests a round."""
ENDPOINTS = ["127.0.0.1:9001", "127.0.0.1:9002"]
CONFIG = {"endpoints": [{"address": address} for address in ENDPOINTS],
          "tenants": [{"id": "heavy"}, {"id": "light-a"}], "queue": {"maxWait": "60s"},
          "capacity": {"kvBudgetTokens": 65536}, "routing": {"prefixAffinity": {}}}
_FULL = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
CHUNK = (b'data: {"id":"chatcmpl-0cc73a884c204799b3f026f2943b355b",'
         b'"object":"chat.completion.chunk","created":1796304202,"model":"sim-model","choices":[{"index":0,"delta":{"content":'
         b'" the"},"logprobs":null,"finish_reason":null}]}\n\n')
LAST = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"sim-model",'
        b'"choices":[],"usage":{"prompt_tokens":2050,"completion_tokens":100,"total_tokens":2150,'
        b'"prompt_tokens_details":{"cached_tokens":2000}}}\n\ndata: [DONE]\n\n')


def _header(key: str, value: str) -> base_pb2.HeaderValue:
    return base_pb2.HeaderValue(key=key, raw_value=value.encode())


def _bodies(count: int) -> list[bytes]:
    """Chat bodies: one 2,000-token system prompt (8,000 characters), a 40-word question."""
    rng = random.Random(28)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    system = " ".join(rng.choice(words) for _ in range(1600))
    return [json.dumps({
        "model": "sim-model", "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": CHUNKS, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i} "
             + " ".join(rng.choice(words) for _ in range(40))}]}).encode()
        for i in range(count)]


class _Context:
    def invocation_metadata(self) -> tuple[()]:
        return ()


class Driver:
    """The messages of one request, as Envoy sends them on the inline path."""

    def __init__(self) -> None:
        self.bodies = _bodies(64)
        self.response_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[_header(":status", "200"),
                                                _header("content-type", "text/event-stream")])))
        self.chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=CHUNK))
        self.last = pb.ProcessingRequest(response_body=pb.HttpBody(body=LAST,
                                                                   end_of_stream=True))

    def messages(self, i: int, chunks: int) -> list[pb.ProcessingRequest]:
        headers = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                _header(":method", "POST"), _header(":path", "/v1/chat/completions"),
                _header(":authority", "gateway"), _header("content-type", "application/json"),
                _header(DEFAULT_TENANT_HEADER, "heavy" if i % 3 else "light-a"),
                _header("x-request-id", f"r{i}")])),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=_FULL,
                                                     response_body_mode=_FULL))
        body = pb.ProcessingRequest(request_body=pb.HttpBody(
            body=self.bodies[i % len(self.bodies)], end_of_stream=True))
        return [headers, body, self.response_headers, *([self.chunk] * chunks), self.last]

    async def one(self, processor: Any, messages: list[pb.ProcessingRequest],
                  serialize: Callable[[Any], bytes] = pb.ProcessingResponse.SerializeToString,
                  ) -> None:
        async def stream() -> AsyncIterator[pb.ProcessingRequest]:
            for message in messages:
                yield message
        async for reply in processor.Process(stream(), _Context()):
            serialize(reply)  # as gRPC does with each reply


def _source(ref: str, path: str) -> str:
    return subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def _before(ref: str) -> types.ModuleType | None:
    """``picker.extproc.service`` as it was at ``ref``, with the response meter of ``ref``
    (``picker/openai/response.py``) in it (None without git)."""
    try:
        meter_source = _source(ref, "picker/openai/response.py")
        source = _source(ref, "picker/extproc/service.py")
    except (OSError, subprocess.CalledProcessError):
        return None
    meter = types.ModuleType("picker.openai.response_before")
    exec(compile(meter_source, "response_before.py", "exec"), meter.__dict__)
    module = types.ModuleType("picker.extproc.service_before")
    exec(compile(source, "service_before.py", "exec"), module.__dict__)
    module.ResponseMeter = meter.ResponseMeter  # type: ignore[attr-defined]
    module.streamed_output = meter.streamed_output  # type: ignore[attr-defined]
    return module


def _serializer(module: types.ModuleType | None) -> Callable[[Any], bytes]:
    serialize = getattr(module, "serialize_reply", None)
    return serialize if serialize is not None else pb.ProcessingResponse.SerializeToString


FLOOR = "CPython gRPC floor (bench.floor_epp)"


async def measure(modules: dict[str, types.ModuleType], rounds: int) -> dict[str, Any]:
    config = load_config(CONFIG)
    driver = Driver()
    processors: dict[str, tuple[Any, Callable[[Any], bytes]]] = {}
    for name, module in modules.items():
        dispatcher = Dispatcher(config, metrics=PickerMetrics(CollectorRegistry()))
        processors[name] = (module.ExternalProcessor(dispatcher, lambda: config),
                            _serializer(module))
    processors[FLOOR] = (FloorServicer(ENDPOINTS),
                         _serializer(None))
    for processor, serialize in processors.values():
        for i in range(50):  # warm: the prefix index, the tenants' estimates
            await driver.one(processor, driver.messages(i, 10), serialize)
    best = {(name, chunks): float("inf") for name in processors for chunks in (0, CHUNKS)}
    sent = 0
    for _ in range(rounds):
        for name, (processor, serialize) in processors.items():
            for chunks in (0, CHUNKS):
                batch = [driver.messages(sent + i, chunks) for i in range(REQUESTS)]
                sent += REQUESTS
                start = time.process_time()
                for messages in batch:
                    await driver.one(processor, messages, serialize)
                best[name, chunks] = min(best[name, chunks],
                                         (time.process_time() - start) / REQUESTS * 1e6)
    return {name: {"us_per_request": round(best[name, 0], 1),
                   "us_per_chunk": round((best[name, CHUNKS] - best[name, 0]) / CHUNKS, 2)}
            for name in processors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--before", default=BEFORE)
    args = parser.parse_args(argv)
    modules = {"after": current}
    before = _before(args.before)
    if before is not None:
        modules = {"before": before, "after": current}
    load_start = os.getloadavg()
    got = asyncio.run(measure(modules, args.rounds))
    load_end = os.getloadavg()
    print(json.dumps(got))
    RESULTS.mkdir(exist_ok=True)
    record = {"before": args.before, "rounds": args.rounds, "chunks": CHUNKS,
              "python": sys.version.split()[0], "loadavg": [load_start, load_end],
              "results": got}
    (RESULTS / "extproc_cost.json").write_text(json.dumps(record, indent=2) + "\n")
    floor = got[FLOOR]
    lines = ["# The picker's own Python on the inline response path: CPU per request and per "
             "streamed chunk", "",
             f"`python -m bench.extproc_cost` (in-process, no gRPC; a 2,000-token system prompt "
             f"and a short question, {CHUNKS} one-token chunks; each reply serialized as gRPC "
             f"would; best of {args.rounds} interleaved rounds of {REQUESTS} requests, CPU time; "
             f"before: `{args.before}`; load average {load_start[0]:.2f} → {load_end[0]:.2f} "
             "on a 2-core machine shared with other work). The floor row is "
             "`bench.floor_epp`'s servicer on the same messages (route, echo, nothing else): "
             "what is above it is fairway's own work. What gRPC itself costs before any "
             "servicer code (receiving a message) is in `grpc_floor_run1.json`.", "",
             "| servicer | µs per request (no chunk) | above the floor | µs per streamed chunk "
             "| above the floor |",
             "|---|---|---|---|---|"]
    for name, row in got.items():
        lines.append(f"| {name} | {row['us_per_request']:.1f} | "
                     f"{row['us_per_request'] - floor['us_per_request']:.1f} | "
                     f"{row['us_per_chunk']:.2f} | "
                     f"{row['us_per_chunk'] - floor['us_per_chunk']:.2f} |")
    (RESULTS / "extproc_cost.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
