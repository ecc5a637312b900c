"""The simulated vLLM server's ``n``, several prompts, image and tool counting, and prefix cache,
over real HTTP on 127.0.0.1: n choices whose completion tokens add up, one choice per prompt of a
completions list, ``cached_tokens`` on a repeated prompt, and the prefix-cache counters."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from picker.sim import tokenizer
from picker.sim.server import SimServer, SimServerConfig

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"
LONG = " ".join(["alpha", "beta", "gamma", "delta"] * 20)  # 80 tokens: 5 full blocks


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


async def post(http: aiohttp.ClientSession, server: SimServer, path: str,
               body: dict[str, Any]) -> Any:
    async with http.post(server.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def counters(http: aiohttp.ClientSession, server: SimServer) -> dict[str, float]:
    async with http.get(server.url + "/metrics") as resp:
        text = await resp.text()
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


async def test_n_gives_n_choices_and_their_tokens_add_up(http: aiohttp.ClientSession) -> None:
    async with sim() as server:
        out = await post(http, server, CHAT_PATH, {
            "messages": [{"role": "user", "content": LONG}], "n": 3, "max_tokens": 40})
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    lengths = [len(c["message"]["content"].split()) for c in choices]
    assert out["usage"]["completion_tokens"] == sum(lengths)
    assert len(set(lengths)) > 1  # each sample draws its own length
    assert out["usage"]["prompt_tokens"] == tokenizer.count(LONG) + 4 + 3  # counted once


async def test_n_streams_every_choice_to_its_end(http: aiohttp.ClientSession) -> None:
    async with sim() as server, http.post(server.url + COMPLETION_PATH, json={
            "prompt": LONG, "n": 2, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        raw = await resp.text()
    events = [json.loads(line[6:]) for line in raw.split("\n\n")
              if line.startswith("data: {")]
    tokens = {0: 0, 1: 0}
    finished = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            tokens[choice["index"]] += 1
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    assert tokens == {0: 5, 1: 5} and finished == {0: "length", 1: "length"}
    assert events[-1]["usage"]["completion_tokens"] == 10
    assert events[-1]["usage"]["prompt_tokens"] == tokenizer.count(LONG)


async def test_a_prompt_list_gives_one_choice_per_prompt(http: aiohttp.ClientSession) -> None:
    prompts = ["one small prompt", "another prompt here", "and a third"]
    async with sim() as server:
        out = await post(http, server, COMPLETION_PATH, {
            "prompt": prompts, "max_tokens": 4, "ignore_eos": True})
        both = await post(http, server, COMPLETION_PATH, {
            "prompt": prompts[:2], "n": 2, "max_tokens": 3, "ignore_eos": True})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == sum(map(tokenizer.count, prompts))
    assert out["usage"]["completion_tokens"] == 12
    async with sim() as server:
        ids = await post(http, server, COMPLETION_PATH, {
            "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 1})
    assert len(ids["choices"]) == 2 and ids["usage"]["prompt_tokens"] == 5
    assert [c["index"] for c in both["choices"]] == [0, 1, 2, 3]  # prompt i: choices 2i, 2i+1
    assert both["usage"]["completion_tokens"] == 12


async def test_a_repeated_prompt_reports_its_cached_tokens(http: aiohttp.ClientSession) -> None:
    body = {"messages": [{"role": "system", "content": LONG},
                         {"role": "user", "content": "first question"}], "max_tokens": 2}
    async with sim() as server:
        first = await post(http, server, CHAT_PATH, body)
        second = await post(http, server, CHAT_PATH, {**body, "messages": [
            body["messages"][0], {"role": "user", "content": "a different question"}]})
        metrics = await counters(http, server)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # The system message (3 + 80 + 1 tokens) is shared: its 5 full blocks are hits.
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 80}
    queries = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    assert metrics["vllm:prefix_cache_queries_total"] == queries
    assert metrics["vllm:prefix_cache_hits_total"] == 80


async def test_prefix_caching_can_be_turned_off(http: aiohttp.ClientSession) -> None:
    body = {"prompt": LONG + " tail", "max_tokens": 2}
    async with sim(enable_prefix_caching=False) as server:
        await post(http, server, COMPLETION_PATH, body)
        again = await post(http, server, COMPLETION_PATH, body)
        metrics = await counters(http, server)
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert metrics["vllm:prefix_cache_hits_total"] == 0


async def test_images_cost_their_flag_and_tools_their_json(http: aiohttp.ClientSession) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    plain = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}]}],
             "max_tokens": 1}
    with_parts = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, image, image]}], "tools": tools, "max_tokens": 1}
    async with sim(image_tokens=100) as server:
        base = (await post(http, server, CHAT_PATH, plain))["usage"]["prompt_tokens"]
        more = (await post(http, server, CHAT_PATH, with_parts))["usage"]["prompt_tokens"]
    assert more - base == 2 * 100 + tokenizer.count(json.dumps(tools))


async def test_cjk_prompts_count_a_token_a_character(http: aiohttp.ClientSession) -> None:
    async with sim() as server:
        out = await post(http, server, COMPLETION_PATH, {"prompt": "字" * 2000,
                                                         "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == 2000
