"""The picker's ext_proc gRPC service driven directly, message by message, as Envoy drives it.

Each test runs ``picker.server.serve`` in-process (ports 0) in front of one or two in-process
simulated vLLM servers, and plays Envoy with a ``grpc.aio`` ``ExternalProcessorStub``: it sends the
``ProcessingRequest`` messages Envoy sends in ``FULL_DUPLEX_STREAMED`` mode (request headers, body
chunks, trailers, response headers, response body chunks), forwards the request to the endpoint the
picker chose where the test needs a real response, and checks each answer against the EPP wire
contract (DESIGN.md §3). What the picker charged is read from its own Prometheus page.
The whole stack through a real Envoy is covered by ``tests/e2e``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from picker.extproc import service as extproc_service
from picker.openai.request import estimate_prompt_tokens
from picker.server import EXT_PROC_SERVICE, ServeSettings, serve
from picker.sim.server import SimServer, SimServerConfig
from tests.tls import tls_channel

pytestmark = pytest.mark.integration

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
TENANT_HEADER = "x-gateway-inference-fairness-id"
LLMD_HEADER = "x-llm-d-inference-fairness-id"
CHAT = "/v1/chat/completions"
MODEL = "sim-model"
#: For an answer, a scrape showing a settlement, a start: generous, since a CPU-starved machine
#: settles a request only when --meter-claim-timeout (10 s) runs out.
TIMEOUT = 15.0
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- what Envoy sends --


def _header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                       for k, v in headers.items()])


def request_headers(path: str = CHAT, *, method: str = "POST",
                    headers: dict[str, str] | None = None, end_of_stream: bool = False,
                    subset: list[str] | str | None = None) -> pb.ProcessingRequest:
    """The first message of a stream: request headers, with the subset hint when given."""
    fields = {":method": method, ":path": path, ":scheme": "http", ":authority": "gateway",
              "x-request-id": "4f1c6a1e-test", "user-agent": "integration-test"}
    if not end_of_stream:
        fields["content-type"] = "application/json"
    fields.update(headers or {})
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=_header_map(fields), end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX,
                                                 response_body_mode=FULL_DUPLEX))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET_KEY: subset})
        message.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return message


def request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_headers(status: int = 200, content_type: str = "application/json",
                     end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=_header_map({":status": str(status), "content-type": content_type}),
        end_of_stream=end_of_stream))


def response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk,
                                                          end_of_stream=end_of_stream))


def trailers(kind: str) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(**{kind: pb.HttpTrailers(
        trailers=_header_map({"x-checksum": "0"}))})


def split(data: bytes, parts: int) -> list[bytes]:
    """``data`` in ``parts`` pieces of about equal size (none empty)."""
    size = -(-len(data) // parts)
    return [data[i:i + size] for i in range(0, len(data), size)]


def chat_body(content: str = "the cat sat on a mat", *, max_tokens: int = 4,
              stream: bool = False, **extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                       **extra}).encode()


def estimated_prompt(content: str) -> int:
    """The picker's prompt estimate for a one-message chat (by script, plus 4 per message)."""
    return estimate_prompt_tokens({"messages": [{"role": "user", "content": content}]})


# -- what the picker answers --


def header_mutation(reply: pb.ProcessingResponse, phase: str) -> dict[str, str]:
    mutation = getattr(reply, phase).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() or h.header.value
            for h in mutation.set_headers}


def lb_metadata(reply: pb.ProcessingResponse) -> list[str]:
    value = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION]
    return value.string_value.split(",")


def streamed(reply: pb.ProcessingResponse, phase: str) -> tuple[bytes, bool]:
    assert reply.WhichOneof("response") == phase, reply
    mutation = getattr(reply, phase).response.body_mutation
    assert mutation.WhichOneof("mutation") == "streamed_response", reply
    return mutation.streamed_response.body, mutation.streamed_response.end_of_stream


@dataclass
class Refusal:
    status: int
    headers: dict[str, str]
    error: dict[str, Any]


def refusal(reply: pb.ProcessingResponse) -> Refusal:
    assert reply.WhichOneof("response") == "immediate_response", reply
    immediate = reply.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() or h.header.value
               for h in immediate.headers.set_headers}
    return Refusal(immediate.status.code, headers, json.loads(immediate.body)["error"])


# -- playing Envoy on one ext_proc stream --


class Stream:
    """One HTTP request's ext_proc stream, as Envoy holds it; replies are read in the background."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.call = stub.Process(metadata=metadata)
        self.replies: asyncio.Queue[pb.ProcessingResponse | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                reply = await self.call.read()
                if reply is grpc.aio.EOF:
                    return
                self.replies.put_nowait(reply)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            return  # CancelledError: our own close() cancelled the call
        finally:
            self.replies.put_nowait(None)

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for message in messages:
            await self.call.write(message)

    async def reply(self, timeout: float = TIMEOUT) -> pb.ProcessingResponse:
        reply = await asyncio.wait_for(self.replies.get(), timeout)
        assert reply is not None, "the picker closed the stream instead of answering"
        return reply

    async def quiet_for(self, seconds: float) -> None:
        """Assert the picker says nothing for ``seconds`` (and keeps the stream open)."""
        await asyncio.sleep(seconds)
        assert self.replies.empty(), f"unexpected answer: {self.replies.get_nowait()}"

    async def ended(self, timeout: float = TIMEOUT) -> bool:
        """Whether the picker closes the stream with nothing more to say."""
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(self.replies.get(), timeout) is None
        return False

    async def close(self) -> None:
        """Envoy's side goes away (client disconnect, stream reset)."""
        self.call.cancel()
        await self._reader


@dataclass
class Routed:
    destinations: list[str]
    """From the ``envoy.lb`` dynamic metadata: primary first."""
    header: str
    """The ``x-gateway-destination-endpoint`` header value."""


async def send_request(stream: Stream, body: bytes, *, path: str = CHAT, parts: int = 1,
                       headers: dict[str, str] | None = None,
                       subset: list[str] | str | None = None) -> None:
    await stream.send(request_headers(path, headers=headers, subset=subset))
    chunks = split(body, parts)
    for i, chunk in enumerate(chunks):
        await stream.send(request_body(chunk, i == len(chunks) - 1))


async def expect_route(stream: Stream, body: bytes | None, *, end: bool | None = True) -> Routed:
    """The routing answer to the headers, then (for a request with a body) the body echoed with
    ``end_of_stream`` = ``end`` (None: not checked)."""
    reply = await stream.reply()
    assert reply.WhichOneof("response") == "request_headers", reply
    common = reply.request_headers.response
    assert common.clear_route_cache
    header = header_mutation(reply, "request_headers")[DESTINATION]
    routed = Routed(lb_metadata(reply), header)
    assert routed.destinations[0] == header
    if body is not None:
        echoed, end_of_stream = streamed(await stream.reply(), "request_body")
        assert echoed == body
        assert end is None or end_of_stream == end
    return routed


async def route(stream: Stream, body: bytes, **kwargs: Any) -> Routed:
    await send_request(stream, body, **kwargs)
    return await expect_route(stream, body)


async def relay_response(stream: Stream, status: int, content_type: str,
                         chunks: Sequence[bytes]) -> None:
    """Feed a response through the stream as Envoy does; each chunk must come back unchanged."""
    await stream.send(response_headers(status, content_type))
    reply = await stream.reply()
    assert reply.WhichOneof("response") == "response_headers", reply
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        await stream.send(response_body(chunk, last))
        assert streamed(await stream.reply(), "response_body") == (chunk, last)


async def settled_to_usage(pool: Picker, tenant: str, usage: dict[str, int]) -> None:
    """The request ended ok, charged the engine's own prompt and completion counts, and gave
    its endpoint's room back."""
    await pool.eventually("fairway_requests_total", 1, tenant=tenant, outcome="ok")
    assert await pool.metric("fairway_service_tokens_total", tenant=tenant,
                             kind="completion") == usage["completion_tokens"]
    assert await pool.metric("fairway_service_tokens_total", tenant=tenant,
                             kind="prompt") == usage["prompt_tokens"]
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0


@dataclass
class Upstream:
    status: int
    content_type: str
    chunks: list[bytes]

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


async def fetch(address: str, path: str, body: bytes | None = None) -> Upstream:
    """Envoy's upstream leg: send the request where the picker said; the response as it came."""
    async with aiohttp.ClientSession() as session, session.request(
            "POST" if body is not None else "GET", f"http://{address}{path}", data=body,
            headers={"content-type": "application/json"}) as response:
        chunks = [chunk async for chunk in response.content.iter_any()]
        return Upstream(response.status, response.headers.get("content-type", ""), chunks)


def sse_events(data: bytes) -> list[dict[str, Any]]:
    events = [e for e in data.decode().split("\n\n") if e.startswith("data: {")]
    return [json.loads(e[len("data: "):]) for e in events]


def content_events(data: bytes) -> int:
    return sum(1 for e in sse_events(data)
               if any(c.get("delta", {}).get("content") for c in e["choices"]))


# -- the picker under test --


@dataclass
class Picker:
    grpc_port: int
    metrics_port: int
    endpoints: list[str]
    channel: grpc.aio.Channel
    streams: list[Stream] = field(default_factory=list)

    def open(self, metadata: tuple[tuple[str, str], ...] = ()) -> Stream:
        stream = Stream(pb_grpc.ExternalProcessorStub(self.channel), metadata)
        self.streams.append(stream)
        return stream

    async def samples(self) -> Samples:
        async with aiohttp.ClientSession() as session, session.get(
                f"http://127.0.0.1:{self.metrics_port}/metrics") as response:
            text = await response.text()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
        wanted = set(labels.items())
        return sum(v for (n, sample_labels), v in (await self.samples()).items()
                   if n == name and wanted <= set(sample_labels))

    async def eventually(self, name: str, expected: float, timeout: float = TIMEOUT,
                         **labels: str) -> None:
        deadline = time.monotonic() + timeout
        while (value := await self.metric(name, **labels)) != expected:
            assert time.monotonic() < deadline, f"{name}{labels} = {value}, not {expected}"
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_picker(tmp_path: Path, *, endpoints: int = 1, meter_claim_timeout: float = 10.0,
                         log_claim_timeout: float = 330.0, **config: Any) -> AsyncIterator[Picker]:
    """serve() in-process over ``endpoints`` simulated servers; ``config`` keys are merged in."""
    async with contextlib.AsyncExitStack() as stack:
        sims = [await stack.enter_async_context(SimServer(SimServerConfig(step_ms=2.0)))
                for _ in range(endpoints)]
        addresses = [f"127.0.0.1:{s.port}" for s in sims]
        document: dict[str, Any] = {"endpoints": [{"address": a} for a in addresses],
                                    "capacity": {"scrapeInterval": "50ms"}}
        for key, value in config.items():
            document[key] = {**document.get(key, {}), **value} if isinstance(value, dict) \
                else value
        path = tmp_path / "picker.yaml"
        path.write_text(json.dumps(document))  # JSON is YAML
        stop = asyncio.Event()
        ready: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        # The test's own client stands in for the gateway: tenant headers believed from it.
        settings = ServeSettings(path, grpc_port=0, grpc_health_port=0, metrics_port=0,
                                 admin_port=0, grace=1.0, client_auth="trust-network",
                                 meter_claim_timeout=meter_claim_timeout,
                                 log_claim_timeout=log_claim_timeout)
        task = asyncio.create_task(serve(settings, stop, ready))
        try:
            grpc_port, metrics_port = await asyncio.wait_for(
                asyncio.shield(ready), TIMEOUT)
            # TLS, unverified: as the gateways dial it (the picker's default).
            async with await tls_channel(grpc_port) as channel:
                picker = Picker(grpc_port, metrics_port, addresses, channel)
                try:
                    yield picker
                finally:
                    for stream in picker.streams:
                        await stream.close()
        finally:
            stop.set()
            await asyncio.wait_for(task, TIMEOUT)


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Picker]:
    """Two endpoints, three configured tenants."""
    async with running_picker(tmp_path, endpoints=2, tenants=[
            {"id": "a"}, {"id": "b"}, {"id": "anonymous"}]) as picker:
        yield picker


@contextlib.asynccontextmanager
async def tiny_pool(tmp_path: Path, **config: Any) -> AsyncIterator[tuple[Picker, Stream]]:
    """One endpoint with a 64-token budget, already filled by a streaming request that never
    finishes (the second value: its stream, routed)."""
    config = {"capacity": {"kvBudgetTokens": 64}, "tenants": [{"id": "holder"}, {"id": "a"}],
              **config}
    async with running_picker(tmp_path, **config) as picker:
        holder = picker.open()
        await route(holder, chat_body("word " * 60, max_tokens=500, stream=True),
                    headers={TENANT_HEADER: "holder"})
        await picker.eventually("fairway_running_requests", 1, tenant="holder")
        yield picker, holder


# -- the exchange --


@pytest.mark.parametrize("parts", [1, 3])
async def test_headers_are_answered_after_the_whole_body_with_the_route(
        pool: Picker, parts: int) -> None:
    body = chat_body(max_tokens=3)
    stream = pool.open()
    await stream.send(request_headers(headers={TENANT_HEADER: "a"}))
    chunks = split(body, parts)
    for chunk in chunks[:-1]:
        await stream.send(request_body(chunk, False))
    await stream.quiet_for(0.3)  # headers (and partial body) alone: no answer yet
    await stream.send(request_body(chunks[-1], True))

    routed = await expect_route(stream, body)  # body echoed whole, end_of_stream set
    assert routed.header in pool.endpoints
    # Header and metadata agree (no fallbacks unless configured: ORIGINAL_DST takes one).
    assert routed.destinations == [routed.header]
    await stream.quiet_for(0.1)


async def test_response_is_echoed_chunk_by_chunk_and_settled(pool: Picker) -> None:
    body = chat_body(max_tokens=5)
    stream = pool.open()
    routed = await route(stream, body, parts=2, headers={TENANT_HEADER: "a"})
    upstream = await fetch(routed.header, CHAT, body)
    assert upstream.status == 200
    await relay_response(stream, 200, upstream.content_type, split(upstream.data, 4))
    usage = json.loads(upstream.data)["usage"]
    assert usage["completion_tokens"] == 5

    await settled_to_usage(pool, "a", usage)


async def test_trailers_are_answered(pool: Picker) -> None:
    body = chat_body(max_tokens=2)
    stream = pool.open()
    await stream.send(request_headers(headers={TENANT_HEADER: "a"}))
    for chunk in split(body, 2):  # trailers end the request: no body chunk has end_of_stream
        await stream.send(request_body(chunk, False))
    await stream.quiet_for(0.2)
    await stream.send(trailers("request_trailers"))
    routed = await expect_route(stream, body, end=None)
    assert routed.header in pool.endpoints
    assert (await stream.reply()).WhichOneof("response") == "request_trailers"

    upstream = await fetch(routed.header, CHAT, body)
    await stream.send(response_headers(200, upstream.content_type))
    assert (await stream.reply()).WhichOneof("response") == "response_headers"
    await stream.send(response_body(upstream.data, False))
    assert streamed(await stream.reply(), "response_body") == (upstream.data, False)
    await stream.send(trailers("response_trailers"))
    assert (await stream.reply()).WhichOneof("response") == "response_trailers"
    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    assert await pool.metric("fairway_service_tokens_total", tenant="a", kind="completion") == 2


async def test_request_without_body_is_routed_at_once_and_not_queued(pool: Picker) -> None:
    stream = pool.open()
    await stream.send(request_headers("/v1/models", method="GET", end_of_stream=True))
    routed = await expect_route(stream, None)
    assert routed.header in pool.endpoints
    upstream = await fetch(routed.header, "/v1/models")
    assert upstream.status == 200
    await relay_response(stream, 200, upstream.content_type, [upstream.data])
    assert await stream.ended()
    assert await pool.metric("fairway_requests_total") == 0


async def test_unlisted_path_is_refused_404_and_not_charged(pool: Picker) -> None:
    stream = pool.open()
    # Refused at the headers: Envoy sends nothing more once the answer is an immediate
    # response (sending the body after it races the stream's end).
    await stream.send(request_headers("/tokenize"))
    refused = refusal(await stream.reply())
    assert refused.status == 404
    assert refused.error["code"] == "unknown_url"
    assert await stream.ended()
    assert await pool.metric("fairway_service_tokens_total") == 0


@pytest.mark.parametrize(("path", "sent"), [
    ("/v1/chat/completions/", "/v1/chat/completions"),
    ("/V1/Chat/Completions?x=1", "/v1/chat/completions?x=1"),
    (CHAT, None)])
async def test_the_route_sends_the_engine_the_path_the_picker_judged(
        pool: Picker, path: str, sent: str | None) -> None:
    """A spelling the picker normalises went to the engine unchanged, which answered 404 to a
    request charged as inference (issue 26): the route now sets ``:path`` too."""
    stream = pool.open()
    await send_request(stream, chat_body(), path=path)
    reply = await stream.reply()
    assert header_mutation(reply, "request_headers").get(":path") == sent


async def test_listed_pass_through_post_is_routed_with_its_body_and_not_charged(
        tmp_path: Path) -> None:
    async with running_picker(tmp_path, routing={"passThrough": [
            {"method": "POST", "path": "/tokenize"}]}) as picker:
        body = b'{"model": "sim-model", "prompt": "tokenize me"}'
        stream = picker.open()
        routed = await route(stream, body, path="/tokenize", parts=2)
        assert routed.header in picker.endpoints
        await relay_response(stream, 404, "application/json", [b'{"detail": "Not Found"}'])
        assert await stream.ended()
        assert await picker.metric("fairway_requests_total") == 0
        assert await picker.metric("fairway_service_tokens_total") == 0


# -- the subset hint --


@pytest.mark.parametrize("form", ["list", "comma-string"])
async def test_subset_hint_restricts_the_choice(pool: Picker, form: str) -> None:
    second = pool.endpoints[1]  # with both idle, the first endpoint would win the tie
    hint: list[str] | str = [second] if form == "list" else f" 10.9.9.9:8000, {second}"
    for _ in range(3):
        stream = pool.open()
        routed = await route(stream, chat_body(), subset=hint)
        assert routed.destinations == [second]
    stream = pool.open()
    await stream.send(request_headers("/v1/models", method="GET", end_of_stream=True,
                                      subset=hint))
    assert (await expect_route(stream, None)).destinations == [second]


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_subset_naming_no_known_endpoint_is_refused_503(pool: Picker, method: str) -> None:
    stream = pool.open()
    if method == "GET":
        await stream.send(request_headers("/v1/models", method="GET", end_of_stream=True,
                                          subset=["10.9.9.9:8000"]))
    else:
        await send_request(stream, chat_body(), subset=["10.9.9.9:8000"])
    refused = refusal(await stream.reply())
    assert refused.status == 503
    assert refused.headers["content-type"] == "application/json"
    assert refused.error["type"] == "server_error"
    assert await stream.ended()


# -- refusals --


@pytest.mark.parametrize(
    ("body", "fragment"),
    [(b"{not json", "not valid JSON"),
     (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
      "'model' is required")],
    ids=["bad-json", "missing-model"])
async def test_malformed_request_is_refused_400(pool: Picker, body: bytes, fragment: str) -> None:
    stream = pool.open()
    await send_request(stream, body, headers={TENANT_HEADER: "b"})
    refused = refusal(await stream.reply())
    assert refused.status == 400
    assert refused.headers["content-type"] == "application/json"
    assert "retry-after" not in refused.headers
    assert fragment in refused.error["message"]
    assert refused.error["type"] == "invalid_request_error"
    assert refused.error["code"] == "invalid_request"
    assert await stream.ended()
    assert await pool.metric("fairway_rejections_total", tenant="b", reason="bad_request") == 1


async def test_body_over_the_limit_is_refused_413_without_waiting_for_the_end(
        tmp_path: Path) -> None:
    async with running_picker(tmp_path, limits={"maxBodyBytes": 1000}) as picker:
        stream = picker.open()
        await stream.send(request_headers(), request_body(b"x" * 600, False))
        await stream.quiet_for(0.1)
        await stream.send(request_body(b"x" * 600, False))  # 1200 bytes, more to come
        refused = refusal(await stream.reply())
        assert refused.status == 413
        assert refused.headers["content-type"] == "application/json"
        assert "1000 bytes" in refused.error["message"]
        assert await stream.ended()
        assert await picker.metric("fairway_rejections_total", reason="body_too_large") == 1
        # Exactly at the limit is fine.
        body = chat_body("z" * (1000 - len(chat_body(""))))
        assert len(body) == 1000
        await route(picker.open(), body)


async def test_queued_request_is_answered_when_capacity_frees(tmp_path: Path) -> None:
    async with tiny_pool(tmp_path) as (picker, holder):
        body = chat_body()
        stream = picker.open()
        await send_request(stream, body, headers={TENANT_HEADER: "a"})
        await picker.eventually("fairway_queued_requests", 1, tenant="a")
        await stream.quiet_for(0.3)  # the pool is full: the headers stay unanswered
        await relay_response(holder, 200, "text/event-stream", [b"data: [DONE]\n\n"])
        routed = await expect_route(stream, body)
        assert routed.destinations == picker.endpoints
        await picker.eventually("fairway_requests_total", 1, tenant="holder", outcome="ok")
        assert await picker.metric("fairway_queue_wait_seconds_count", tenant="a") == 1
        assert await picker.metric("fairway_queue_wait_seconds_sum", tenant="a") >= 0.3


async def test_queue_wait_over_max_wait_is_refused_503_with_retry_after(tmp_path: Path) -> None:
    async with tiny_pool(tmp_path, queue={"maxWait": "200ms"}) as (picker, _):
        stream = picker.open()
        started = time.monotonic()
        await send_request(stream, chat_body(), headers={TENANT_HEADER: "a"})
        # Within the reply's timeout (15 s): the holder never finishes, and the default maxWait
        # is 60 s, so a maxWait not applied would never answer here.
        refused = refusal(await stream.reply())
        waited = time.monotonic() - started
        assert refused.status == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["content-type"] == "application/json"
        assert refused.error["type"] == "server_error"
        assert waited >= 0.2
        assert await stream.ended()
        assert await picker.metric("fairway_requests_total", tenant="a",
                                   outcome="queue_timeout") == 1
        assert await picker.metric("fairway_service_tokens_total", tenant="a") == 0
        assert await picker.metric("fairway_rejections_total", tenant="a",
                                   reason="queue_timeout") == 1  # counted once


async def test_full_queue_is_refused_429(tmp_path: Path) -> None:
    async with tiny_pool(tmp_path, queue={"maxQueued": 1}) as (picker, _):
        queued = picker.open()
        await send_request(queued, chat_body(), headers={TENANT_HEADER: "a"})
        await picker.eventually("fairway_queued_requests", 1, tenant="a")
        stream = picker.open()
        await send_request(stream, chat_body(), headers={TENANT_HEADER: "a"})
        refused = refusal(await stream.reply())  # queued instead, it would never be answered
        assert refused.status == 429
        assert refused.headers["retry-after"] == "1"
        assert (refused.error["type"], refused.error["code"]) == ("requests", "queue_full")
        assert await stream.ended()
        assert await picker.metric("fairway_rejections_total", tenant="a",
                                   reason="queue_full") == 1
        await queued.quiet_for(0.1)  # the one in the queue still waits its turn


# -- tenancy --


async def test_tenant_comes_from_the_trusted_headers_or_the_default(tmp_path: Path) -> None:
    tenants = [{"id": t} for t in ("team-a", "team-b", "nobody", "both")]
    async with running_picker(tmp_path, tenants=tenants, tenancy={
            "header": "X-Team", "defaultTenant": "nobody"}) as picker:
        cases: list[dict[str, str]] = [
            {"x-team": "team-a"},
            {TENANT_HEADER: "team-b"},  # alsoAccept's default: the deprecated upstream name
            {},
            {"x-team": "both", TENANT_HEADER: "team-b"},  # the configured header wins
            {"x-team": "someone-unconfigured"},
        ]
        for headers in cases:
            body = chat_body(max_tokens=2)
            stream = picker.open()
            routed = await route(stream, body, headers=headers)
            upstream = await fetch(routed.header, CHAT, body)
            await relay_response(stream, 200, upstream.content_type, [upstream.data])
        for tenant in ("team-a", "team-b", "nobody", "both", "other"):
            await picker.eventually("fairway_requests_total", 1, tenant=tenant, outcome="ok")
        assert await picker.metric("fairway_requests_total") == 5


async def test_the_metering_record_names_the_lane_asked_not_the_lane_given(
        tmp_path: Path) -> None:
    """A what-if replay (``picker.whatif``) gives a request that asked for no lane its tenant's
    lane under the candidate config: the record must say it asked for none."""
    log = tmp_path / "metering.jsonl"
    async with running_picker(tmp_path, lanes=[{"name": "online"}, {"name": "batch"}],
                              tenants=[{"id": "a", "allowedLanes": ["batch"]}],
                              metering={"output": str(log)}) as picker:
        for headers in ({TENANT_HEADER: "a"}, {TENANT_HEADER: "a", "x-fairway-lane": "batch"}):
            body = chat_body(max_tokens=2)
            stream = picker.open()
            routed = await route(stream, body, headers=headers)
            upstream = await fetch(routed.header, CHAT, body)
            await relay_response(stream, 200, upstream.content_type, [upstream.data])
        await picker.eventually("fairway_requests_total", 2, tenant="a", outcome="ok")
    records = sorted((json.loads(line) for line in log.read_text().splitlines()),
                     key=lambda r: r["arrived_at"])
    assert [(r["lane_asked"], r["priority_lane"]) for r in records] == [
        (None, "online"), ("batch", "batch")]


# -- charging --


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage-chunk"])
async def test_streamed_response_is_charged_per_content_event(pool: Picker,
                                                              include_usage: bool) -> None:
    content = "Hello, world! " * 10
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    body = chat_body(content, max_tokens=12, stream=True, **extra)
    stream = pool.open()
    routed = await route(stream, body, headers={TENANT_HEADER: "a"})
    upstream = await fetch(routed.header, CHAT, body)
    assert upstream.content_type.startswith("text/event-stream")
    # Envoy's chunking need not follow event boundaries: feed it in odd-sized pieces.
    pieces = [upstream.data[i:i + 37] for i in range(0, len(upstream.data), 37)]
    await relay_response(stream, 200, upstream.content_type, pieces)

    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="ok")
    events = content_events(upstream.data)
    assert events == 12
    assert await pool.metric("fairway_service_tokens_total", tenant="a",
                             kind="completion") == events
    prompt = await pool.metric("fairway_service_tokens_total", tenant="a", kind="prompt")
    if include_usage:
        usage = [e["usage"] for e in sse_events(upstream.data) if e.get("usage")][-1]
        assert usage["prompt_tokens"] != estimated_prompt(content)  # else the check is moot
        assert prompt == usage["prompt_tokens"]
    else:
        assert prompt == estimated_prompt(content)
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0


async def test_non_streaming_response_is_settled_to_its_usage(pool: Picker) -> None:
    content = "Hello, world! " * 10
    body = chat_body(content, max_tokens=7)
    stream = pool.open()
    routed = await route(stream, body, headers={TENANT_HEADER: "b"})
    upstream = await fetch(routed.header, CHAT, body)
    await relay_response(stream, 200, upstream.content_type, split(upstream.data, 3))
    usage = json.loads(upstream.data)["usage"]
    assert usage["prompt_tokens"] != estimated_prompt(content)

    await pool.eventually("fairway_requests_total", 1, tenant="b", outcome="ok")
    assert await pool.metric("fairway_service_tokens_total", tenant="b",
                             kind="prompt") == usage["prompt_tokens"]
    assert await pool.metric("fairway_service_tokens_total", tenant="b",
                             kind="completion") == usage["completion_tokens"] == 7
    # Weighted service with the default cost (w_p = 1, w_q = 2).
    assert await pool.metric("fairway_weighted_service_total", tenant="b") == \
        usage["prompt_tokens"] + 2 * usage["completion_tokens"]


async def test_a_whole_body_whose_end_never_came_is_settled_to_its_usage(pool: Picker) -> None:
    """Envoy may close the stream before its last, empty end_of_stream message (the client read
    the whole body by its Content-Length and left): the usage in the body is what was served,
    not nothing."""
    body = chat_body("Hello, world! " * 10, max_tokens=7)
    stream = pool.open()
    routed = await route(stream, body, headers={TENANT_HEADER: "b"})
    upstream = await fetch(routed.header, CHAT, body)
    await stream.send(response_headers(200, upstream.content_type))
    await stream.reply()
    for piece in split(upstream.data, 3):
        await stream.send(response_body(piece, False))
        await stream.reply()
    await stream.close()

    usage = json.loads(upstream.data)["usage"]
    assert usage["completion_tokens"] == 7
    await settled_to_usage(pool, "b", usage)


async def test_error_response_is_not_charged_for_output(pool: Picker) -> None:
    body = chat_body(max_tokens=4)
    stream = pool.open()
    await route(stream, body, headers={TENANT_HEADER: "b"})
    await relay_response(stream, 500, "application/json",
                         [b'{"error": {"message": "boom", "usage": {"prompt_tokens": 999, '
                          b'"completion_tokens": 999}}}'])
    await pool.eventually("fairway_requests_total", 1, tenant="b", outcome="error")
    assert await pool.metric("fairway_service_tokens_total", tenant="b", kind="completion") == 0
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0


@pytest.mark.parametrize("status", [400, 404])
async def test_a_request_the_engine_refuses_is_charged_nothing(pool: Picker, status: int) -> None:
    """Issue 26: a context-length 400 was charged its prompt estimate (17,790 tokens once)."""
    stream = pool.open()
    await route(stream, chat_body("word " * 400, max_tokens=4), headers={TENANT_HEADER: "b"})
    await relay_response(stream, status, "application/json",
                         [b'{"error": {"message": "maximum context length is 16 tokens"}}'])
    await pool.eventually("fairway_requests_total", 1, tenant="b", outcome="error")
    assert await pool.metric("fairway_service_tokens_total", tenant="b", kind="prompt") == 0
    assert await pool.metric("fairway_weighted_service_total", tenant="b") == 0
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0


# -- Envoy going away --


async def test_stream_closed_while_queued_is_cancelled_uncharged(tmp_path: Path) -> None:
    async with tiny_pool(tmp_path) as (picker, _):
        stream = picker.open()
        await send_request(stream, chat_body(), headers={TENANT_HEADER: "a"})
        await picker.eventually("fairway_queued_requests", 1, tenant="a")
        await stream.close()
        await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="cancelled")
        assert await picker.metric("fairway_queued_requests", tenant="a") == 0
        assert await picker.metric("fairway_service_tokens_total", tenant="a") == 0
        assert await picker.metric("fairway_weighted_service_total", tenant="a") == 0


async def test_stream_closed_mid_response_settles_to_what_was_delivered(pool: Picker) -> None:
    content = "tell me a long story"
    body = chat_body(content, max_tokens=40, stream=True)
    stream = pool.open()
    routed = await route(stream, body, headers={TENANT_HEADER: "a"})
    upstream = await fetch(routed.header, CHAT, body)
    events = upstream.data.split(b"\n\n")
    delivered = b"\n\n".join(events[:10]) + b"\n\n"  # role chunk + 9 tokens
    await stream.send(response_headers(200, upstream.content_type))
    await stream.reply()
    for piece in split(delivered, 3):
        await stream.send(response_body(piece, False))
        await stream.reply()
    assert await pool.metric("fairway_endpoint_inflight_tokens") > 0
    await stream.close()

    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome="cancelled")
    assert content_events(delivered) == 9
    assert await pool.metric("fairway_service_tokens_total", tenant="a", kind="completion") == 9
    assert await pool.metric("fairway_service_tokens_total", tenant="a",
                             kind="prompt") == estimated_prompt(content)
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0
    assert await pool.metric("fairway_running_requests") == 0


# -- the meter stream: the response on a second, observe-only filter --

METERED = (("fairway-response-path", "meter-stream"),)


def meter_id(reply: pb.ProcessingResponse) -> str:
    return reply.dynamic_metadata.fields["fairway"].struct_value.fields["request"].string_value


def observed(message: pb.ProcessingRequest, request_id: str) -> pb.ProcessingRequest:
    """``message`` as the observability-mode filter sends it: flagged, the request named."""
    message.observability_mode = True
    name = struct_pb2.Struct()
    name.update({"request": request_id})
    message.metadata_context.filter_metadata["fairway"].CopyFrom(name)
    return message


async def routed_for_meter(picker: Picker, body: bytes, tenant: str) -> tuple[Routed, str]:
    """Route on a metered stream, which Envoy then half-closes; returns the route and the id."""
    stream = picker.open(METERED)
    await send_request(stream, body, headers={TENANT_HEADER: tenant})
    first = await stream.reply()
    request_id = meter_id(first)
    await stream.reply()  # the body, echoed
    await stream.call.done_writing()
    assert await stream.ended()
    return Routed([first.request_headers.response.header_mutation.set_headers[0].header
                   .raw_value.decode()], ""), request_id


@pytest.mark.parametrize("finished", [True, False], ids=["complete", "client-left"])
async def test_meter_stream_charges_without_answering(
        pool: Picker, finished: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Envoy ends a client's meter stream deferred_close_timeout after the client left, long after
    # its last message: any quiet before the end is enough here (an end while the picker is still
    # reading is a lost meter, tests/integration/test_meter_backlog.py).
    monkeypatch.setattr(extproc_service, "METER_CUT_IDLE", 0.0)
    body = chat_body("tell me a story", max_tokens=12, stream=True)
    routed, request_id = await routed_for_meter(pool, body, "a")
    assert request_id
    # Envoy half-closed the picker's stream after the route: the request is still running.
    await pool.eventually("fairway_running_requests", 1, tenant="a")
    upstream = await fetch(routed.destinations[0], CHAT, body)
    events = upstream.data.split(b"\n\n")
    sent = upstream.data if finished else b"\n\n".join(events[:6]) + b"\n\n"
    meter = pool.open()
    await meter.send(observed(request_headers(headers={TENANT_HEADER: "a"}), request_id),
                     observed(response_headers(200, upstream.content_type), request_id))
    pieces = split(sent, 3)
    for i, piece in enumerate(pieces):
        await meter.send(observed(response_body(piece, finished and i == len(pieces) - 1),
                                  request_id))
    await meter.call.done_writing()
    assert await meter.ended()  # observe-only: the picker never answers

    outcome = "ok" if finished else "cancelled"
    await pool.eventually("fairway_requests_total", 1, tenant="a", outcome=outcome)
    assert await pool.metric("fairway_service_tokens_total", tenant="a",
                             kind="completion") == content_events(sent)
    assert content_events(sent) == (12 if finished else 5)
    assert await pool.metric("fairway_endpoint_inflight_tokens") == 0
    assert await pool.metric("fairway_running_requests") == 0


async def test_meter_stream_naming_no_request_is_ignored(pool: Picker) -> None:
    meter = pool.open()
    # Ended by the picker at its first message (nothing to meter, nothing more to read), as
    # Envoy's observe-only filter allows; a later message would find the stream gone.
    await meter.send(observed(response_headers(200, "application/json"), "not-a-request"))
    assert await meter.ended()
    stream = pool.open()
    await route(stream, chat_body(), headers={TENANT_HEADER: "b"})  # still serving


async def test_request_whose_meter_stream_never_comes_is_released(tmp_path: Path) -> None:
    async with running_picker(tmp_path, meter_claim_timeout=0.3,
                              tenants=[{"id": "a"}]) as picker:
        await routed_for_meter(picker, chat_body(max_tokens=3), "a")
        # Its response went out unseen: settled on the estimate, not as a client that left.
        await picker.eventually("fairway_requests_total", 1, tenant="a", outcome="unmetered")
        assert await picker.metric("fairway_settlements_estimated_total",
                                   reason="meter_unclaimed") == 1
        assert await picker.metric("fairway_endpoint_inflight_tokens") == 0


async def test_requests_without_meter_streams_are_logged_once_a_minute_not_each(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with running_picker(tmp_path, meter_claim_timeout=0.3,
                              tenants=[{"id": "a"}]) as picker:
        with caplog.at_level(logging.WARNING, logger="picker.extproc.service"):
            for _ in range(3):
                await routed_for_meter(picker, chat_body(max_tokens=3), "a")
            await picker.eventually("fairway_requests_total", 3, tenant="a",
                                    outcome="unmetered")
            assert await picker.metric("fairway_meter_unclaimed_total") == 3
    warnings = [r.getMessage() for r in caplog.records if "no meter stream" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "for 1 request(s)" in warnings[0]


# -- health --


async def test_grpc_health_reports_serving(pool: Picker) -> None:
    health = health_pb2_grpc.HealthStub(pool.channel)
    for service in ("", EXT_PROC_SERVICE):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service),
                                    timeout=TIMEOUT)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"),
                           timeout=TIMEOUT)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

