"""The simulated vLLM server over real HTTP: wire shapes, usage, metrics, engine order, disconnects.

Every test runs the server on 127.0.0.1 with an ephemeral port (in-process, except the CLI test,
which runs ``python -m picker.sim.server`` as a subprocess) and talks to it with aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.sim.openai_fmt import count_text_tokens
from picker.sim.server import SimServer, SimServerConfig, build_parser, config_from_args

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"


@contextlib.asynccontextmanager
async def sim(**overrides: Any) -> AsyncIterator[SimServer]:
    server = SimServer(SimServerConfig(**{"step_ms": 2.0, **overrides}))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def words(n: int) -> str:
    """A prompt of exactly ``n`` tokens by the server's counting rule."""
    return " ".join(["word"] * n)


async def post(http: aiohttp.ClientSession, server: SimServer, path: str,
               body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(server.url + path, json=body) as resp:
        return resp.status, await resp.json()


async def stream(http: aiohttp.ClientSession, server: SimServer, path: str,
                 body: dict[str, Any]) -> list[Any]:
    """POST with ``stream: true``; the parsed events, checking the SSE framing exactly."""
    async with http.post(server.url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.text()
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    events: list[Any] = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


async def metrics(http: aiohttp.ClientSession, server: SimServer) -> dict[str, Any]:
    async with http.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], family: str, suffix: str = "", **labels: str) -> float:
    for s in families[family].samples:
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{family}{suffix} {labels}")


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


# -- plain endpoints --


async def test_health_and_models(http: aiohttp.ClientSession) -> None:
    async with sim(model="m-1") as server:
        async with http.get(server.url + "/health") as resp:
            assert resp.status == 200
        async with http.get(server.url + "/v1/models") as resp:
            body = await resp.json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["m-1"]
        assert body["data"][0]["object"] == "model"


def test_token_counting_rule() -> None:
    assert count_text_tokens("Hello, world!") == 4
    # Whitespace is tokens too, as for a real tokenizer: " ", " two", " words", " ".
    assert count_text_tokens("  two words ") == 4
    assert count_text_tokens("") == 0


# -- JSON responses --


async def test_completion_json(http: aiohttp.ClientSession) -> None:
    async with sim() as server:
        status, body = await post(http, server, COMPLETION_PATH, {
            "model": "sim-model", "prompt": "Hello, world! How are you?", "max_tokens": 5,
            "ignore_eos": True})
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "sim-model"
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == " the quick brown fox jumps"
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 0}}


async def test_chat_json_without_model(http: aiohttp.ClientSession) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    async with sim() as server:
        status, body = await post(http, server, CHAT_PATH, {
            "messages": messages, "max_completion_tokens": 3, "ignore_eos": True})
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "the quick brown"
    assert choice["finish_reason"] == "length"
    # 3 + 2 content tokens, 4 per message, 3 for the reply header.
    assert body["usage"]["prompt_tokens"] == 3 + 2 + 2 * 4 + 3
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_output_length_is_deterministic_and_capped(http: aiohttp.ClientSession) -> None:
    async with sim(step_ms=1.0) as server:
        async def length(body: dict[str, Any]) -> tuple[int, str]:
            status, out = await post(http, server, COMPLETION_PATH, body)
            assert status == 200, out
            (choice,) = out["choices"]
            tokens = out["usage"]["completion_tokens"]
            assert count_text_tokens(choice["text"]) == tokens
            return tokens, choice["finish_reason"]

        bodies = [{"prompt": f"prompt number {i}", "max_tokens": 12} for i in range(16)]
        first = await asyncio.gather(*(length(b) for b in bodies))
        again = await asyncio.gather(*(length(b) for b in bodies))
        assert first == again
        assert all(1 <= n <= 12 for n, _ in first)
        assert all((reason == "length") == (n == 12) for n, reason in first)
        assert len({n for n, _ in first}) > 3  # lengths vary with the prompt
        assert await length({"prompt": "x", "max_tokens": 12, "min_tokens": 12}) == (12, "length")
        assert await length({"prompt": "x", "max_tokens": 1}) == (1, "length")
        default, _ = await length({"prompt": "no max_tokens here", "ignore_eos": True})
        assert default == 16


# -- streaming --


async def test_completion_stream_shape(http: aiohttp.ClientSession) -> None:
    async with sim() as server:
        events = await stream(http, server, COMPLETION_PATH,
                              {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert len(events) == 4
    assert len({e["id"] for e in events}) == 1
    for i, event in enumerate(events):
        assert set(event) == {"id", "object", "created", "model", "choices"}  # no usage
        assert event["object"] == "text_completion" and event["model"] == "sim-model"
        (choice,) = event["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None
        assert choice["finish_reason"] == ("length" if i == 3 else None)
    assert "".join(e["choices"][0]["text"] for e in events) == " the quick brown fox"


async def test_chat_stream_shape(http: aiohttp.ClientSession) -> None:
    async with sim() as server:
        events = await stream(http, server, CHAT_PATH, {
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
            "ignore_eos": True})
    assert len(events) == 1 + 3
    for event in events:
        assert set(event) == {"id", "object", "created", "model", "choices"}  # no usage
        assert event["object"] == "chat.completion.chunk"
    first = events[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["finish_reason"] is None
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    assert deltas == [{"content": "the"}, {"content": " quick"}, {"content": " brown"}]
    assert [e["choices"][0]["finish_reason"] for e in events[1:]] == [None, None, "length"]


@pytest.mark.parametrize("path", [COMPLETION_PATH, CHAT_PATH])
async def test_include_usage_final_chunk(http: aiohttp.ClientSession, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 9, "stream_options": {"include_usage": True}}
    if path == CHAT_PATH:
        body["messages"] = [{"role": "user", "content": "count these words"}]
    else:
        body["prompt"] = "count these words"
    async with sim() as server:
        events = await stream(http, server, path, body)
    *chunks, last = events
    assert last["choices"] == []
    assert all("usage" not in e for e in chunks)
    content = chunks
    if path == CHAT_PATH:  # after the role chunk, one chunk per token
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = chunks[1:]
    usage = last["usage"]
    assert usage["completion_tokens"] == len(content)
    assert 1 <= usage["completion_tokens"] <= 9
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] == (3 + 4 + 3 if path == CHAT_PATH else 3)
    assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("path", [COMPLETION_PATH, CHAT_PATH])
async def test_continuous_usage_stats(http: aiohttp.ClientSession, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 5, "ignore_eos": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}
    if path == CHAT_PATH:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    async with sim() as server:
        events = await stream(http, server, path, body)
    *chunks, last = events
    prompt = last["usage"]["prompt_tokens"]
    offset = 1 if path == CHAT_PATH else 0  # the chat role chunk reports 0 generated
    assert len(chunks) == 5 + offset
    for i, event in enumerate(chunks):
        generated = i + 1 - offset
        assert event["usage"] == {"prompt_tokens": prompt, "completion_tokens": generated,
                                  "total_tokens": prompt + generated}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5


async def test_continuous_usage_needs_include_usage(http: aiohttp.ClientSession) -> None:
    async with sim() as server:
        events = await stream(http, server, COMPLETION_PATH, {
            "prompt": "hi", "max_tokens": 3, "stream_options": {"continuous_usage_stats": True}})
    assert events and all("usage" not in e for e in events)


# -- metrics --


async def test_metrics_names_types_and_cache_config(http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=1000, block_size=32, model="m") as server:
        await post(http, server, COMPLETION_PATH, {"prompt": "a b c", "max_tokens": 2,
                                                   "ignore_eos": True})
        families = await metrics(http, server)
    expected = {
        "vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
        "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert families[name].type == kind, name
        assert all(s.labels["model_name"] == "m" for s in families[name].samples), name
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert info.labels["block_size"] == "32" and info.labels["num_gpu_blocks"] == "31"
    assert sample(families, "vllm:prompt_tokens", "_total") == 3
    assert sample(families, "vllm:generation_tokens", "_total") == 2
    assert sample(families, "vllm:request_success", "_total", finished_reason="length") == 1
    assert sample(families, "vllm:time_to_first_token_seconds", "_count") == 1


async def test_metrics_under_load_rise_and_fall(http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=100, step_ms=5.0) as server:
        # Six different prompts (their first word differs): no block is shared.
        requests = asyncio.gather(*(post(http, server, COMPLETION_PATH, {
            "prompt": "abcdef"[i] + " " + words(29), "max_tokens": 20, "ignore_eos": True})
            for i in range(6)))
        seen: list[tuple[float, float, float]] = []
        while not requests.done():
            families = await metrics(http, server)
            seen.append((sample(families, "vllm:num_requests_waiting"),
                         sample(families, "vllm:num_requests_running"),
                         sample(families, "vllm:kv_cache_usage_perc")))
            await asyncio.sleep(0.005)
        assert all(status == 200 for status, _ in await requests)
        families = await metrics(http, server)
    assert max(w for w, _, _ in seen) >= 2
    assert 2 <= max(r for _, r, _ in seen) <= 3
    assert 0.6 < max(k for _, _, k in seen) <= 1.0
    assert sample(families, "vllm:num_requests_waiting") == 0
    assert sample(families, "vllm:num_requests_running") == 0
    assert sample(families, "vllm:kv_cache_usage_perc") == 0
    assert sample(families, "vllm:prompt_tokens", "_total") == 6 * 30
    assert sample(families, "vllm:generation_tokens", "_total") == 6 * 20
    assert sample(families, "vllm:request_success", "_total", finished_reason="length") == 6
    assert sample(families, "vllm:time_to_first_token_seconds", "_count") == 6


async def test_max_num_seqs_caps_running(http: aiohttp.ClientSession) -> None:
    async with sim(max_num_seqs=2, step_ms=3.0) as server:
        assert server.engine is not None
        body = {"prompt": "short", "max_tokens": 5, "ignore_eos": True}
        requests = asyncio.gather(*(post(http, server, COMPLETION_PATH, body)
                                    for _ in range(5)))
        peak = 0
        while not requests.done():
            peak = max(peak, server.engine.running)
            await asyncio.sleep(0.001)
        await requests
    assert peak == 2


# -- engine order --


async def _finish_order(http: aiohttp.ClientSession, server: SimServer,
                        submissions: list[tuple[str, int]]) -> list[str]:
    """Submit a blocker alone, wait until it runs, then the rest one by one; once they all wait
    behind it, its client goes away. The others' names in finish order."""
    assert server.engine is not None
    engine = server.engine
    order: list[str] = []

    async def one(name: str, priority: int) -> None:
        body: dict[str, Any] = {"prompt": words(10), "max_tokens": 4, "ignore_eos": True}
        if priority:
            body["priority"] = priority
        status, _ = await post(http, server, COMPLETION_PATH, body)
        assert status == 200
        order.append(name)

    # It would run for 8000 steps: the others queue behind it however slow the machine is.
    blocker = asyncio.create_task(post(http, server, COMPLETION_PATH, {
        "prompt": words(10), "max_tokens": 8000, "ignore_eos": True}))
    await until(lambda: engine.running == 1)
    tasks = []
    for i, (name, priority) in enumerate(submissions):
        tasks.append(asyncio.create_task(one(name, priority)))
        await until(lambda n=i + 1: engine.waiting == n)
    assert engine.running == 1 and order == []
    blocker.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await blocker
    await asyncio.gather(*tasks)
    return order


async def test_priority_lower_value_submitted_later_finishes_first(
        http: aiohttp.ClientSession) -> None:
    # One request runs at a time (max_num_seqs), the rest wait in the engine's queue.
    async with sim(max_num_seqs=1, step_ms=3.0, scheduling_policy="priority") as server:
        order = await _finish_order(http, server, [("B", 5), ("C", 5), ("D", 1)])
    assert order == ["D", "B", "C"]


async def test_fcfs_engine_serves_in_arrival_order(http: aiohttp.ClientSession) -> None:
    async with sim(max_num_seqs=1, step_ms=3.0) as server:
        order = await _finish_order(http, server, [("B", 0), ("C", 0), ("D", 0)])
        status, body = await post(http, server, COMPLETION_PATH,
                                  {"prompt": "x", "priority": 1})
    assert order == ["B", "C", "D"]
    assert status == 400 and "priority" in body["error"]["message"].lower()


# -- vLLM V1 scheduling: preemption, chunked prefill, the KV cache --


def _generated(server: SimServer) -> float:
    value = server.metrics.registry.get_sample_value("vllm:generation_tokens_total",
                                                     {"model_name": server.config.model})
    return value or 0.0


async def _two_streams_in_a_full_cache(http: aiohttp.ClientSession, server: SimServer,
                                       priorities: tuple[int, int]) -> tuple[list[str], float]:
    """A, then B, queued behind a request holding the whole 4-block cache; once it has gone
    both are admitted in the same step (however slow the machine), and each alone fills the
    cache at its end, so one of them is preempted; both must still stream exactly their 40
    tokens. Names in finish order, and the tokens generated for A and B."""
    assert server.engine is not None
    engine = server.engine
    order: list[str] = []
    alone = (await post(http, server, COMPLETION_PATH, {"prompt": words(10), "max_tokens": 40,
                                                        "ignore_eos": True}))[1]
    expected = alone["choices"][0]["text"]

    async def one(name: str, priority: int) -> None:
        body: dict[str, Any] = {"prompt": words(10), "max_tokens": 40, "ignore_eos": True}
        if priority:
            body["priority"] = priority
        events = await stream(http, server, COMPLETION_PATH, body)
        assert len(events) == 40
        assert "".join(e["choices"][0]["text"] for e in events) == expected
        order.append(name)

    gate = asyncio.create_task(post(http, server, COMPLETION_PATH, {
        "prompt": words(60), "max_tokens": 5000, "ignore_eos": True}))  # 4 blocks from the start
    await until(lambda: _generated(server) > 40)  # its first token: its prompt is counted
    tasks = [asyncio.create_task(one("A", priorities[0]))]
    await until(lambda: engine.waiting == 1)
    tasks.append(asyncio.create_task(one("B", priorities[1])))
    await until(lambda: engine.waiting == 2)
    before: list[float] = []  # what was generated when the gate left, before A and B ran
    cancel = engine.cancel

    def counted(job: Any) -> None:
        before.append(_generated(server))
        cancel(job)

    engine.cancel = counted  # type: ignore[method-assign]
    gate.cancel()  # its client goes away
    with contextlib.suppress(asyncio.CancelledError):
        await gate
    await asyncio.gather(*tasks)
    return order, _generated(server) - before[0]


async def test_fcfs_preempts_the_later_request_and_it_resumes(
        http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=64, step_ms=3.0) as server:
        order, generated = await _two_streams_in_a_full_cache(http, server, (0, 0))
        families = await metrics(http, server)
        assert server.engine is not None and server.engine.scheduler.recomputed_tokens_total > 0
    assert order == ["A", "B"]
    assert sample(families, "vllm:num_preemptions", "_total") >= 1
    assert generated == 2 * 40  # the recomputed tokens are not generated again
    assert sample(families, "vllm:prompt_tokens", "_total") == 3 * 10 + 60  # once per request


async def test_priority_preempts_the_less_urgent_running_request(
        http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=64, step_ms=3.0, scheduling_policy="priority") as server:
        order, _ = await _two_streams_in_a_full_cache(http, server, (5, 1))
        families = await metrics(http, server)
    assert order == ["B", "A"]
    assert sample(families, "vllm:num_preemptions", "_total") >= 1


async def test_a_long_prompt_is_prefilled_in_chunks(http: aiohttp.ClientSession) -> None:
    async with sim(max_num_batched_tokens=8) as server:
        assert server.engine is not None
        status, _ = await post(http, server, COMPLETION_PATH,
                               {"prompt": words(30), "max_tokens": 3, "ignore_eos": True})
        assert status == 200
        # 30 prompt tokens, 8 a step: 4 steps, the 4th yields token 1; then 2 decode steps
        assert server.engine.steps == 4 + 2


async def test_a_request_outgrowing_the_cache_still_completes(
        http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=32) as server:  # 2 blocks of 16
        assert server.engine is not None
        engine = server.engine
        task = asyncio.create_task(stream(http, server, COMPLETION_PATH, {
            "prompt": words(10), "max_tokens": 40, "ignore_eos": True}))
        peak = 0.0
        while not task.done():
            peak = max(peak, engine.kv_usage)
            await asyncio.sleep(0.001)
        assert len(await task) == 40
        assert peak == 1.0 and engine.used_blocks == 0


def test_the_cache_holds_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="block"):
        SimServerConfig(kv_budget_tokens=15)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SimServerConfig(max_num_batched_tokens=0)
    assert SimServerConfig(kv_budget_tokens=100).total_blocks == 6



# -- step time: prompt tokens lengthen a step --


async def test_prompt_tokens_lengthen_the_step(http: aiohttp.ClientSession) -> None:
    async with sim(step_ms=1.0, prefill_ms_per_1k_tokens=200.0) as server:
        assert server.engine is not None
        engine = server.engine
        took: dict[int, float] = {}
        for prompt in (10, 1000):
            steps, step_time, prefilled = engine.steps, engine.step_time_s, engine.prefill_tokens
            started = time.monotonic()
            status, _ = await post(http, server, COMPLETION_PATH, {
                "prompt": words(prompt), "max_tokens": 1, "ignore_eos": True})
            took[prompt] = time.monotonic() - started
            assert status == 200
            # One step computed the prompt and yielded the token: 1 ms + 0.2 ms per prompt token.
            assert engine.steps - steps == 1
            assert engine.prefill_tokens - prefilled == prompt
            assert engine.step_time_s - step_time == pytest.approx(0.001 + prompt * 0.0002)
    # The token is released only when its step's time has elapsed (a lower bound, never flaky).
    assert took[1000] >= 0.2


async def test_a_client_gone_during_a_long_step_is_freed_at_once(
        http: aiohttp.ClientSession) -> None:
    async with sim(step_ms=1.0, prefill_ms_per_1k_tokens=4000.0) as server:
        assert server.engine is not None
        engine = server.engine
        body = {"prompt": words(500), "max_tokens": 3, "ignore_eos": True}  # a 2 s step
        request = asyncio.create_task(post(http, server, COMPLETION_PATH, body))
        await until(lambda: engine.steps == 1)
        ended: list[float] = []
        release = engine.release

        def recorded(out: Any, now: float) -> None:
            ended.append(now)
            release(out, now)

        engine.release = recorded  # type: ignore[method-assign]
        request.cancel()  # the client goes away during the step
        with contextlib.suppress(asyncio.CancelledError):
            await request
        # Freed before the step it was in ended (not by that step's end).
        await until(lambda: (engine.running == 0 and engine.used_blocks == 0) or bool(ended))
        assert engine.running == 0 and engine.used_blocks == 0 and not ended
        # The step's output for the gone request is dropped; the engine serves on.
        status, out = await post(http, server, COMPLETION_PATH, {
            "prompt": "x", "max_tokens": 2, "ignore_eos": True})
        families = await metrics(http, server)
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    assert sample(families, "vllm:request_success", "_total", finished_reason="abort") == 1
    assert sample(families, "vllm:generation_tokens", "_total") == 2
    assert sample(families, "vllm:time_to_first_token_seconds", "_count") == 1


def test_the_prefill_cost_flag() -> None:
    args = build_parser().parse_args(["--prefill-ms-per-1k-tokens", "50", "--step-ms", "12"])
    config = config_from_args(args)
    assert config.prefill_ms_per_1k_tokens == 50.0
    assert config.step_seconds(2000) == pytest.approx(0.012 + 0.1)
    assert SimServerConfig().step_seconds(10_000) == pytest.approx(0.010)
    with pytest.raises(ValueError, match="prefill_ms_per_1k_tokens"):
        SimServerConfig(prefill_ms_per_1k_tokens=-1.0)


# -- disconnects --


async def test_disconnect_mid_stream_frees_the_slot(http: aiohttp.ClientSession) -> None:
    async with sim(step_ms=5.0) as server:
        assert server.engine is not None
        engine = server.engine
        resp = await http.post(server.url + CHAT_PATH, json={
            "messages": [{"role": "user", "content": words(50)}], "max_tokens": 5000,
            "ignore_eos": True, "stream": True})
        received = 0
        async for line in resp.content:
            if line.startswith(b"data: "):
                received += 1
                if received == 4:
                    break
        assert engine.running == 1 and engine.used_blocks >= 4  # 57 prompt tokens, 16 a block
        resp.close()
        steps = engine.steps
        await until(lambda: engine.running == 0)
        # At once, not when the request would have ended (some 5000 steps on).
        assert engine.steps - steps < 1000
        assert engine.used_blocks == 0
        families = await metrics(http, server)
    assert sample(families, "vllm:num_requests_running") == 0
    assert sample(families, "vllm:kv_cache_usage_perc") == 0
    assert sample(families, "vllm:request_success", "_total", finished_reason="abort") == 1


async def test_disconnect_while_queued_leaves_the_queue(http: aiohttp.ClientSession) -> None:
    async with sim(max_num_seqs=1, step_ms=5.0) as server:
        assert server.engine is not None
        engine = server.engine
        body = {"prompt": words(10), "max_tokens": 1000, "ignore_eos": True}
        blocker = asyncio.create_task(post(http, server, COMPLETION_PATH, body))
        await until(lambda: engine.running == 1)
        queued = asyncio.create_task(post(http, server, COMPLETION_PATH, body))
        await until(lambda: engine.waiting == 1)
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued
        steps = engine.steps
        await until(lambda: engine.waiting == 0)
        # Left the queue at once, not when the blocker (1000 steps) made room for it.
        assert engine.running == 1 and engine.steps - steps < 500
        blocker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await blocker
        await until(lambda: engine.running == 0 and engine.used_blocks == 0)


# -- errors and transport --


@pytest.mark.parametrize(("path", "raw", "status"), [
    (COMPLETION_PATH, b"{not json", 400),
    (CHAT_PATH, b"{not json", 400),
    (COMPLETION_PATH, b"[1, 2]", 400),
    (COMPLETION_PATH, b'{"prompt": "hi", "model": "other"}', 404),
    (COMPLETION_PATH, b'{"max_tokens": 3}', 400),
    (CHAT_PATH, b'{"messages": []}', 400),
    (COMPLETION_PATH, b'{"prompt": "hi", "max_tokens": 0}', 400),
    (COMPLETION_PATH, b'{"prompt": "hi", "n": 0}', 400),
    (COMPLETION_PATH, b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400),
    (COMPLETION_PATH, b'{"prompt": ["one", 2]}', 400),
    (COMPLETION_PATH, b'{"prompt": "' + b"w " * 40 + b'"}', 400),  # 40 tokens > 32 of KV
])
async def test_errors_are_openai_shaped(http: aiohttp.ClientSession, path: str, raw: bytes,
                                        status: int) -> None:
    async with sim(kv_budget_tokens=32) as server:
        async with http.post(server.url + path, data=raw,
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status
            body = await resp.json()
        assert server.engine is not None and server.engine.waiting == 0
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]


async def test_chunked_request_body(http: aiohttp.ClientSession) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"prompt": "split across'
        yield b' chunks", "max_tokens": 2, "ignore_eos": true}'

    async with sim() as server, http.post(server.url + COMPLETION_PATH, data=body(),
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.request_info.headers.get("Transfer-Encoding") == "chunked"
        assert resp.status == 200
        out = await resp.json()
    assert out["usage"]["prompt_tokens"] == count_text_tokens("split across chunks") \
        and out["usage"]["completion_tokens"] == 2


async def test_stream_socket_has_tcp_nodelay(http: aiohttp.ClientSession) -> None:
    async with sim(step_ms=5.0) as server:
        resp = await http.post(server.url + COMPLETION_PATH, json={
            "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True})
        await resp.content.readline()
        assert server.runner is not None and server.runner.server is not None
        connections = server.runner.server.connections
        assert connections
        for conn in connections:
            assert conn.transport is not None
            sock = conn.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        resp.close()


async def test_engine_does_not_step_while_idle(http: aiohttp.ClientSession) -> None:
    async with sim(step_ms=1.0) as server:
        assert server.engine is not None
        await post(http, server, COMPLETION_PATH, {"prompt": "x", "max_tokens": 3,
                                                   "ignore_eos": True})
        steps = server.engine.steps
        assert steps >= 3
        await asyncio.sleep(0.1)
        assert server.engine.steps == steps


async def _read_line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(proc.stdout.readline(), 10)).decode().strip()


async def test_cli_subprocess_prints_listening_and_stops_on_sigterm(
        http: aiohttp.ClientSession) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "picker.sim.server", "--port", "0", "--step-ms", "1",
        "--model", "cli-model", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        line = await _read_line(proc)
        assert line.startswith("listening on http://127.0.0.1:")
        url = line.removeprefix("listening on ")
        async with http.post(url + COMPLETION_PATH, json={"model": "cli-model", "prompt": "hi",
                                                          "max_tokens": 2}) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 5) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_step_trace(http: aiohttp.ClientSession, tmp_path: Any) -> None:
    """``--trace``: the request's arrival, then one line per step (its prompt step first, then
    one decode token a step), the last with the request finished; written at the server's
    stop, at the bound port's file."""
    async with sim(trace=str(tmp_path / "engine-{port}.jsonl")) as server:
        status, _ = await post(http, server, COMPLETION_PATH,
                               {"prompt": words(40), "max_tokens": 3, "ignore_eos": True})
        port = server.port
    assert status == 200
    lines = [json.loads(line) for line in
             (tmp_path / f"engine-{port}.jsonl").read_text().splitlines()]
    assert lines[0]["ev"] == "a" and lines[0]["n"] == 1
    steps = lines[1:]
    assert [s["pre"] for s in steps] == [40, 0, 0]
    assert [s["dec"] for s in steps] == [0, 1, 1]
    assert steps[-1]["fin"] == 1 and steps[-1]["run"] == 0 and steps[-1]["arr"] == 1
    assert all(s["t"] >= s["t0"] for s in steps)


async def test_catch_up_keeps_the_modelled_timeline(http: aiohttp.ClientSession,
                                                    tmp_path: Any) -> None:
    """``--catch-up-ms``: however late the event loop notices a step's end (here it is blocked
    for 30 ms mid-request), each step starts where the last one ended on the model's timeline,
    so the engine makes its steps at the modelled pace."""
    async def block() -> None:
        await asyncio.sleep(0.01)
        time.sleep(0.03)  # the event loop stalls, as on a busy machine

    async with sim(trace=str(tmp_path / "t-{port}.jsonl"), catch_up_s=1.0) as server:
        stall = asyncio.create_task(block())
        status, _ = await post(http, server, COMPLETION_PATH,
                               {"prompt": words(8), "max_tokens": 20, "ignore_eos": True})
        await stall
        port = server.port
    assert status == 200
    steps = [json.loads(line) for line in (tmp_path / f"t-{port}.jsonl").read_text().splitlines()
             if '"ev"' not in line]
    assert len(steps) == 20
    starts = [s["t0"] for s in steps]
    assert [round(b - a, 4) for a, b in itertools.pairwise(starts)] == [0.002] * 19
