"""The simulated vLLM server's other inference APIs over real HTTP: ``/v1/responses``,
``/v1/embeddings`` and the Anthropic-shaped ``/v1/messages``, streamed and not.

Each answer is also read by the picker's own ``ResponseMeter`` of the same kind, which must find
the usage the server reports and count one output token per generated token: the e2e tests
through Envoy depend on the two agreeing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.core.request import Usage
from picker.openai import ResponseMeter
from picker.openai.paths import ApiKind
from picker.sim.openai_fmt import CHAT_REPLY_TOKENS, CHAT_TOKENS_PER_MESSAGE
from picker.sim.server import SimServer
from tests.integration.test_sim_server import CHAT_PATH, COMPLETION_PATH, http, sim, until, words

RESPONSES_PATH = "/v1/responses"
EMBEDDINGS_PATH = "/v1/embeddings"
MESSAGES_PATH = "/v1/messages"
__all__ = ["http"]  # the fixture, imported for the tests below


async def post_raw(http: aiohttp.ClientSession, server: SimServer, path: str,
                   body: dict[str, Any]) -> tuple[int, str, bytes]:
    async with http.post(server.url + path, json=body) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def named_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``event:`` + ``data:`` SSE blocks, checking the framing exactly."""
    text = raw.decode()
    blocks = text.split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") \
            and lines[1].startswith("data: "), block
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert data["type"] == name
        out.append((name, data))
    assert "[DONE]" not in text
    return out


def metered(kind: ApiKind, streaming: bool, raw: bytes, piece: int = 7) -> ResponseMeter:
    """The picker's meter fed ``raw`` in small pieces (events split across chunks)."""
    meter = ResponseMeter(streaming, kind)
    counted = sum(meter.feed(raw[i:i + piece]) for i in range(0, len(raw), piece))
    assert counted == meter.counted_tokens
    meter.finish()
    return meter


# -- /v1/responses --


async def test_responses_json(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "input": words(5), "instructions": words(3),
            "max_output_tokens": 4, "ignore_eos": True}
    async with sim() as server:
        status, ctype, raw = await post_raw(http, server, RESPONSES_PATH, body)
    assert status == 200 and ctype.startswith("application/json")
    out = json.loads(raw)
    prompt = CHAT_REPLY_TOKENS + 2 * CHAT_TOKENS_PER_MESSAGE + 5 + 3
    assert out["object"] == "response" and out["id"].startswith("resp_")
    assert out["status"] == "incomplete"  # ignore_eos: the output reached max_output_tokens
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["usage"]["input_tokens"] == prompt and out["usage"]["output_tokens"] == 4
    assert out["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    message = out["output"][0]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert len(message["content"][0]["text"].split()) == 4
    meter = metered(ApiKind.RESPONSES, False, raw)
    assert meter.usage == Usage(prompt, 4, 0) and meter.finish_reason == "length"


async def test_responses_stream(http: aiohttp.ClientSession) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": words(6)}]}]
    body = {"model": "sim-model", "input": items, "max_output_tokens": 64, "stream": True}
    async with sim() as server:
        status, ctype, raw = await post_raw(http, server, RESPONSES_PATH, body)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = named_events(raw)
    names = [name for name, _ in events]
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    output = final["usage"]["output_tokens"]
    assert 1 <= output < 64 and len(deltas) == output and final["status"] == "completed"
    assert events[-4][1]["text"] == "".join(deltas)
    prompt = CHAT_REPLY_TOKENS + CHAT_TOKENS_PER_MESSAGE + 6
    meter = metered(ApiKind.RESPONSES, True, raw)
    assert meter.counted_tokens == output and meter.usage == Usage(prompt, output, 0)
    assert meter.finish_reason == "stop" and meter.done


async def test_responses_stream_at_its_cap_ends_incomplete(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "input": "hi", "max_output_tokens": 3, "ignore_eos": True,
            "stream": True}
    async with sim() as server:
        _, _, raw = await post_raw(http, server, RESPONSES_PATH, body)
    name, data = named_events(raw)[-1]
    assert name == "response.incomplete" and data["response"]["status"] == "incomplete"
    assert metered(ApiKind.RESPONSES, True, raw).finish_reason == "length"


# -- /v1/embeddings --


@pytest.mark.parametrize(("value", "prompt", "vectors"), [
    (words(7), 7, 1),
    ([words(2), words(3)], 5, 2),
    ([5, 6, 7, 8], 4, 1),
    ([[1, 2], [3, 4, 5]], 5, 2),
])
async def test_embeddings_are_prompt_only(http: aiohttp.ClientSession, value: Any, prompt: int,
                                          vectors: int) -> None:
    async with sim() as server:
        status, _, raw = await post_raw(http, server, EMBEDDINGS_PATH,
                                        {"model": "sim-model", "input": value})
        engine = server.engine
        assert engine is not None
        steps = engine.steps
        assert engine.running == 0 and engine.waiting == 0 and engine.used_blocks == 0
    assert status == 200
    out = json.loads(raw)
    assert out["object"] == "list" and len(out["data"]) == vectors
    assert [d["index"] for d in out["data"]] == list(range(vectors))
    assert all(d["object"] == "embedding" and len(d["embedding"]) == 8 for d in out["data"])
    assert out["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt,
                            "completion_tokens": 0, "prompt_tokens_details": None}
    assert steps == 1  # prefilled in one step, nothing decoded
    meter = metered(ApiKind.EMBEDDINGS, False, raw)
    assert meter.usage == Usage(prompt, 0, 0) and meter.counted_tokens == 0


async def test_embeddings_do_not_count_generation_tokens(http: aiohttp.ClientSession) -> None:
    async with sim() as server:
        await post_raw(http, server, EMBEDDINGS_PATH, {"model": "sim-model", "input": words(9)})
        async with http.get(server.url + "/metrics") as resp:
            text = await resp.text()
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("vllm:generation_tokens_total", None)] == 0
    assert samples[("vllm:prompt_tokens_total", None)] == 9
    assert samples[("vllm:request_success_total", "stop")] == 1


@pytest.mark.parametrize("value", ["", [], [""], [1, "a"], {"text": "x"}, None, [[]]])
async def test_embeddings_refuse_bad_input(http: aiohttp.ClientSession, value: Any) -> None:
    body = {"model": "sim-model"} if value is None else {"model": "sim-model", "input": value}
    async with sim() as server:
        status, _, raw = await post_raw(http, server, EMBEDDINGS_PATH, body)
    assert status == 400
    error = json.loads(raw)["error"]
    assert error["param"] == "input" and error["code"] == 400


# -- /v1/messages --


async def test_messages_json(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "max_tokens": 5, "ignore_eos": True,
            "system": [{"type": "text", "text": words(2)}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": words(4)}]}]}
    async with sim() as server:
        status, _, raw = await post_raw(http, server, MESSAGES_PATH, body)
    assert status == 200
    out = json.loads(raw)
    prompt = CHAT_REPLY_TOKENS + 2 * CHAT_TOKENS_PER_MESSAGE + 2 + 4
    assert out["type"] == "message" and out["role"] == "assistant"
    assert out["id"].startswith("msg_") and out["stop_reason"] == "max_tokens"
    assert out["usage"] == {"input_tokens": prompt, "output_tokens": 5}
    assert out["content"][0]["type"] == "text" and len(out["content"][0]["text"].split()) == 5
    meter = metered(ApiKind.MESSAGES, False, raw)
    assert meter.usage == Usage(prompt, 5, 0) and meter.finish_reason == "length"


async def test_messages_stream(http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": words(3)}]}
    async with sim() as server:
        status, ctype, raw = await post_raw(http, server, MESSAGES_PATH, body)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = named_events(raw)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [d["delta"]["text"] for n, d in events if n == "content_block_delta"]
    prompt = CHAT_REPLY_TOKENS + CHAT_TOKENS_PER_MESSAGE + 3
    assert events[0][1]["message"]["usage"] == {"input_tokens": prompt, "output_tokens": 0}
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "end_turn"
    assert final["usage"]["output_tokens"] == len(deltas) >= 1
    meter = metered(ApiKind.MESSAGES, True, raw, piece=5)
    assert meter.counted_tokens == len(deltas)
    assert meter.usage == Usage(prompt, len(deltas), 0)
    assert meter.finish_reason == "stop" and meter.done


async def test_messages_without_max_tokens_is_an_anthropic_400(
        http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    async with sim() as server:
        status, _, raw = await post_raw(http, server, MESSAGES_PATH, body)
        assert server.engine is not None and server.engine.waiting == 0
    assert status == 400
    out = json.loads(raw)
    assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in out["error"]["message"]


async def test_messages_chunked_request_body(http: aiohttp.ClientSession) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "sim-model", "max_tokens": 2, "ignore_eos": true, "messa'
        yield b'ges": [{"role": "user", "content": "split across chunks"}]}'

    async with sim() as server, http.post(server.url + MESSAGES_PATH, data=body(),
                                          headers={"Content-Type": "application/json"}) as resp:
        assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
        assert resp.status == 200
        out = await resp.json()
    assert out["usage"]["output_tokens"] == 2


# -- the request priority: refused by an FCFS engine, as vLLM refuses it --

PRIORITY_BODIES = [
    (COMPLETION_PATH, {"prompt": words(3), "max_tokens": 2}),
    (CHAT_PATH, {"messages": [{"role": "user", "content": words(3)}], "max_tokens": 2}),
    (RESPONSES_PATH, {"input": words(3), "max_output_tokens": 2}),
    (EMBEDDINGS_PATH, {"input": words(3)}),
]
STREAMABLE = [(path, body) for path, body in PRIORITY_BODIES if path != EMBEDDINGS_PATH]


@pytest.mark.parametrize(("path", "body"), PRIORITY_BODIES + [
    (path, {**body, "stream": True}) for path, body in STREAMABLE])
@pytest.mark.parametrize("priority", [3, -1])
async def test_fcfs_engine_refuses_a_non_zero_priority_as_vllm_does(
        http: aiohttp.ClientSession, path: str, body: dict[str, Any], priority: int) -> None:
    async with sim() as server:
        status, ctype, raw = await post_raw(http, server, path, {**body, "priority": priority})
        assert server.engine is not None and server.engine.waiting == 0
        assert server.engine.running == 0
    assert status == 400 and ctype.startswith("application/json")
    assert json.loads(raw) == {"error": {
        "message": f"Got priority {priority} but Priority scheduling is not enabled.",
        "type": "BadRequestError", "param": None, "code": 400}}


@pytest.mark.parametrize(("path", "body"), PRIORITY_BODIES)
async def test_fcfs_engine_takes_priority_zero(http: aiohttp.ClientSession, path: str,
                                                body: dict[str, Any]) -> None:
    async with sim() as server:
        status, _, raw = await post_raw(http, server, path, {**body, "priority": 0})
    assert status == 200, raw


@pytest.mark.parametrize(("path", "body"), PRIORITY_BODIES + [
    (path, {**body, "stream": True}) for path, body in STREAMABLE])
async def test_priority_engine_takes_a_non_zero_priority(
        http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> None:
    async with sim(scheduling_policy="priority") as server:
        status, _, raw = await post_raw(http, server, path, {**body, "priority": 3})
    assert status == 200, raw


async def test_fcfs_length_error_comes_before_the_priority_error(
        http: aiohttp.ClientSession) -> None:
    # vLLM's server checks the context before its engine sees the priority.
    async with sim(max_model_len=16) as server:
        status, _, raw = await post_raw(http, server, COMPLETION_PATH,
                                        {"prompt": words(10), "max_tokens": 10, "priority": 3})
    assert status == 400 and "maximum context length" in json.loads(raw)["error"]["message"]


async def test_messages_ignore_a_priority_in_either_mode(http: aiohttp.ClientSession) -> None:
    """vLLM's Anthropic request has no ``priority``: an FCFS engine does not refuse one, and a
    priority engine queues the request at 0, ahead of a completion at 1 sent before it."""
    messages = {"messages": [{"role": "user", "content": words(3)}], "max_tokens": 2,
                "ignore_eos": True}
    async with sim() as server:
        status, _, raw = await post_raw(http, server, MESSAGES_PATH,
                                        {**messages, "priority": 5})
    assert status == 200, raw
    order: list[str] = []

    async def send(name: str, path: str, body: dict[str, Any]) -> None:
        status, _, raw = await post_raw(http, server, path, body)
        assert status == 200, raw
        order.append(name)

    async with sim(max_num_seqs=1, step_ms=3.0, scheduling_policy="priority") as server:
        engine = server.engine
        assert engine is not None
        # It would run for 8000 steps: B and C queue behind it however slow the machine is;
        # then its client goes away.
        blocker = asyncio.create_task(post_raw(http, server, COMPLETION_PATH, {
            "prompt": words(10), "max_tokens": 8000, "ignore_eos": True}))
        await until(lambda: engine.running == 1)
        sends = [asyncio.create_task(send("B", COMPLETION_PATH, {
            "prompt": words(3), "max_tokens": 2, "ignore_eos": True, "priority": 1}))]
        await until(lambda: engine.waiting == 1)
        sends.append(asyncio.create_task(send("C", MESSAGES_PATH, {**messages, "priority": 5})))
        await until(lambda: engine.waiting == 2)
        assert engine.running == 1 and order == []
        blocker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await blocker
        await asyncio.gather(*sends)
    assert order == ["C", "B"]


async def test_health_answers_get(http: aiohttp.ClientSession) -> None:
    async with sim() as server, http.get(server.url + "/health") as resp:
        assert resp.status == 200
