"""The simulated server refuses what vLLM refuses for the context length (``--max-model-len``):
a prompt plus ``max_tokens`` beyond it is a 400 in vLLM's words, not a request generating past
the context; a request without ``max_tokens`` has its default cut to what is left."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest

from picker.sim.server import SimServerConfig, build_parser, config_from_args
from tests.integration.test_sim_server import CHAT_PATH, COMPLETION_PATH, post, sim, words

CONTEXT = 64


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_max_tokens_beyond_the_context_is_vllm_s_400(
        http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=1024, max_model_len=CONTEXT) as server:
        # 20 prompt tokens + 50 > 64
        status, body = await post(http, server, COMPLETION_PATH,
                                  {"prompt": words(20), "max_tokens": 50})
        assert status == 400
        assert body["error"] == {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 50. This model's "
                       "maximum context length is 64 tokens and your request has 20 input "
                       "tokens (50 > 64 - 20).",
            "type": "BadRequestError", "param": None, "code": 400}
        # exactly the context fits, and generates what it asked for
        status, body = await post(http, server, COMPLETION_PATH,
                                  {"prompt": words(20), "max_tokens": 44, "ignore_eos": True})
        assert status == 200, body
        assert body["usage"] == {**body["usage"], "prompt_tokens": 20, "completion_tokens": 44}


async def test_chat_counts_the_template_and_max_completion_tokens(
        http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=1024, max_model_len=CONTEXT) as server:
        messages = [{"role": "user", "content": words(10)}]  # 10 + 4 + 3 = 17 tokens
        status, body = await post(http, server, CHAT_PATH,
                                  {"messages": messages, "max_completion_tokens": 48})
        assert status == 400
        assert "(48 > 64 - 17)" in body["error"]["message"]
        status, _ = await post(http, server, CHAT_PATH,
                               {"messages": messages, "max_completion_tokens": 47})
        assert status == 200


async def test_a_prompt_beyond_the_context_is_refused(http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=1024, max_model_len=CONTEXT) as server:
        status, body = await post(http, server, COMPLETION_PATH, {"prompt": words(65)})
        assert status == 400
        assert body["error"]["message"] == (
            "This model's maximum context length is 64 tokens. However, your request has 65 "
            "input tokens. Please reduce the length of the input messages.")


async def test_a_default_max_tokens_is_cut_to_the_context(http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=1024, max_model_len=CONTEXT) as server:
        status, body = await post(http, server, COMPLETION_PATH,
                                  {"prompt": words(60), "ignore_eos": True})
        assert status == 200
        assert body["usage"]["completion_tokens"] == 4  # not the default 16
        assert body["choices"][0]["finish_reason"] == "length"


async def test_the_context_defaults_to_the_model_s_own(http: aiohttp.ClientSession) -> None:
    """As vLLM without --max-model-len: the model's context (the simulated model's 32768)."""
    async with sim() as server:
        assert server.config.max_model_len == 32768
        status, _ = await post(http, server, COMPLETION_PATH,
                               {"prompt": words(10), "max_tokens": 32759})
        assert status == 400
        async with http.get(server.url + "/v1/models") as response:
            (model,) = (await response.json())["data"]
        assert model["max_model_len"] == 32768


async def test_a_prompt_the_kv_cache_cannot_hold_is_still_refused(
        http: aiohttp.ClientSession) -> None:
    async with sim(kv_budget_tokens=32) as server:
        status, body = await post(http, server, COMPLETION_PATH, {"prompt": words(40)})
        assert status == 400 and "KV cache" in body["error"]["message"]


def test_the_flag_and_its_bounds() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        SimServerConfig(max_model_len=0)
    assert config_from_args(build_parser().parse_args(["--max-model-len", "512"])) \
        .max_model_len == 512
    args = build_parser().parse_args(["--max-num-batched-tokens", "512"])
    assert config_from_args(args).max_num_batched_tokens == 512
    assert SimServerConfig().max_num_batched_tokens == 2048  # vLLM's OpenAI-server default
    done = subprocess.run([sys.executable, "-m", "picker.sim.server", "--port", "0",
                           "--max-model-len", "0"], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "max_model_len" in done.stderr
