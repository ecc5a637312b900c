"""The other inference APIs: Responses, embeddings and Anthropic Messages request bodies, their
response metering (streamed and not), and an output cap of 0 flowing through admission and the
dispatcher as "no output" (embeddings are charged for their prompt only)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from picker.config.schema import load_config
from picker.core import Usage
from picker.core.admission import Admission, Admitted, TenantRules
from picker.dispatch import Dispatcher
from picker.errors import BadRequest
from picker.metrics import PickerMetrics
from picker.openai import ResponseMeter, parse_request
from picker.openai.media import DEFAULT_COSTS
from picker.openai.paths import ApiKind
from picker.openai.request import MESSAGE_OVERHEAD_TOKENS
from picker.openai.tokens import text_tokens

R, E, M = ApiKind.RESPONSES, ApiKind.EMBEDDINGS, ApiKind.MESSAGES


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def _named(*events: tuple[str, dict[str, Any]]) -> bytes:
    return b"".join(b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode()
                    + b"\n\n" for name, data in events)


# -- chat and completions keep their behaviour, and say where the cap lives --

@pytest.mark.parametrize("kind", [ApiKind.CHAT, ApiKind.COMPLETIONS])
def test_chat_and_completions_accept_either_shape(kind: ApiKind) -> None:
    chat = parse_request(_body(messages=[{"role": "user", "content": "abcd"}]), kind)
    completion = parse_request(_body(prompt="abcdefgh"), kind)
    assert chat.kind is kind and completion.kind is kind
    assert chat.prompt_tokens == 1 + MESSAGE_OVERHEAD_TOKENS and completion.prompt_tokens == 2


def test_the_cap_key_is_the_one_the_body_used() -> None:
    assert parse_request(_body(prompt="x", max_tokens=5)).output_cap_key == "max_tokens"
    assert parse_request(_body(prompt="x")).output_cap_key == "max_tokens"
    both = parse_request(_body(prompt="x", max_tokens=50, max_completion_tokens=5))
    assert (both.max_tokens, both.output_cap_key) == (5, "max_completion_tokens")
    assert parse_request(_body(prompt="x", max_completion_tokens=None, max_tokens=3)) \
        .output_cap_key == "max_tokens"


def test_default_kind_is_chat() -> None:
    assert parse_request(_body(prompt="x")).kind is ApiKind.CHAT


# -- Responses API requests --

def test_responses_string_input_and_instructions() -> None:
    request = parse_request(_body(input="a" * 40, instructions="b" * 8, max_output_tokens=30,
                                  stream=True), R)
    assert request.kind is R and request.output_cap_key == "max_output_tokens"
    assert request.prompt_tokens == 10 + MESSAGE_OVERHEAD_TOKENS + 2
    assert request.max_tokens == 30 and request.stream and request.include_usage


def test_responses_item_list_counts_messages_parts_and_tool_items() -> None:
    items = [
        {"role": "user", "content": "a" * 8},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "b" * 12},
                     {"type": "input_image", "image_url": "http://x/" + "z" * 400}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "c" * 4}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "d" * 16},
        {"type": "function_call_output", "call_id": "c1", "output": "e" * 20},
    ]
    request = parse_request(_body(input=items), R)
    image = DEFAULT_COSTS.image_max_tokens  # a remote URL: its size is not known
    assert request.prompt_tokens == 2 + 3 + image + 1 + 4 + 5 + 5 * MESSAGE_OVERHEAD_TOKENS
    assert request.max_tokens is None and not request.stream and not request.include_usage


@pytest.mark.parametrize(("fields", "fragment"), [
    ({}, "'input' is required"),
    ({"input": 5}, "'input' must be a string or a list"),
    ({"input": {"role": "user"}}, "'input' must be a string or a list"),
    ({"input": "x", "instructions": ["x"]}, "'instructions' must be a string"),
    ({"input": "x", "max_output_tokens": 0}, "'max_output_tokens' must be a positive integer"),
    ({"input": "x", "max_output_tokens": "9"}, "'max_output_tokens' must be a positive integer"),
    ({"input": "x", "stream": "yes"}, "'stream' must be true or false"),
])
def test_bad_responses_bodies_name_the_field(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(_body(**fields), R)
    assert fragment in caught.value.message


# -- embeddings requests --

@pytest.mark.parametrize(("value", "tokens"), [
    ("a" * 41, 11),
    (["a" * 8, "b" * 5], 2 + 2),
    ([1, 2, 3, 4, 5], 5),
    ([[1, 2], [3, 4, 5]], 5),
])
def test_embeddings_are_prompt_only_with_a_zero_cap(value: Any, tokens: int) -> None:
    request = parse_request(_body(input=value, max_tokens=100), E)
    assert request.kind is E and request.prompt_tokens == tokens
    assert request.max_tokens == 0 and request.output_cap_key is None
    assert not request.stream and not request.include_usage


@pytest.mark.parametrize("value", ["", [], [1, "a"], [[1], "a"], [[]], {"a": 1}, 5, [True]])
def test_bad_embeddings_input_is_refused(value: Any) -> None:
    with pytest.raises(BadRequest, match="'input'"):
        parse_request(_body(input=value), E)


def test_embeddings_need_input() -> None:
    with pytest.raises(BadRequest, match="'input' is required"):
        parse_request(_body(), E)


# -- Anthropic Messages requests --

def test_messages_count_blocks_and_system() -> None:
    body = _body(max_tokens=64, stream=True, system=[{"type": "text", "text": "s" * 8}],
                 messages=[
                     {"role": "user", "content": "a" * 12},
                     {"role": "assistant", "content": [
                         {"type": "text", "text": "b" * 4},
                         {"type": "tool_use", "id": "t", "name": "f", "input": {"k": "vv"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "t",
                          "content": [{"type": "text", "text": "c" * 8}]},
                         {"type": "image", "source": {"type": "base64", "data": "z" * 999}}]},
                 ])
    request = parse_request(body, M)
    tool_input = text_tokens('{"k":"vv"}')
    image = DEFAULT_COSTS.image_max_tokens  # not an image format the picker can measure
    assert request.prompt_tokens == \
        2 + 3 + 1 + tool_input + 2 + image + 4 * MESSAGE_OVERHEAD_TOKENS
    assert request.kind is M and request.max_tokens == 64 and request.output_cap_key == "max_tokens"
    assert request.stream and request.include_usage


def test_messages_system_string() -> None:
    request = parse_request(_body(max_tokens=1, system="s" * 40,
                                  messages=[{"role": "user", "content": "hi"}]), M)
    assert request.prompt_tokens == 10 + 1 + 2 * MESSAGE_OVERHEAD_TOKENS


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     "'max_tokens' must be a positive integer"),
    ({"max_tokens": 5}, "'messages' is required"),
    ({"max_tokens": 5, "messages": []}, "'messages' is required"),
    ({"max_tokens": 5, "messages": ["x"]}, "'messages[0]' must be an object"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]},
     "'messages[0].content' must be a string or a list"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "system": 3},
     "'system' must be a string or a list"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "stream": 1},
     "'stream' must be true or false"),
])
def test_bad_messages_bodies_name_the_field(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(_body(**fields), M)
    assert fragment in caught.value.message


@pytest.mark.parametrize("kind", list(ApiKind))
def test_every_kind_needs_a_model(kind: ApiKind) -> None:
    with pytest.raises(BadRequest, match="'model' is required"):
        parse_request(json.dumps({"input": "x", "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 1}).encode(), kind)


# -- Responses API metering --

def _delta(text: str, kind: str = "response.output_text.delta") -> tuple[str, dict[str, Any]]:
    return kind, {"type": kind, "item_id": "msg_1", "output_index": 0, "content_index": 0,
                  "delta": text}


def _terminal(name: str, status: str, usage: dict[str, Any] | None,
              reason: str | None = None) -> tuple[str, dict[str, Any]]:
    response = {"id": "resp_1", "object": "response", "status": status, "usage": usage,
                "incomplete_details": {"reason": reason} if reason else None}
    return name, {"type": name, "response": response}


RESPONSES_USAGE = {"input_tokens": 30, "input_tokens_details": {"cached_tokens": 12},
                   "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 1},
                   "total_tokens": 34}


def test_responses_stream_counts_deltas_and_reads_the_final_usage() -> None:
    raw = _named(
        ("response.created", {"type": "response.created", "response": {"status": "x"}}),
        ("response.output_item.added", {"type": "response.output_item.added", "item": {}}),
        _delta("think", "response.reasoning_text.delta"),
        _delta("think", "response.reasoning_summary_text.delta"),  # a summary: not counted
        _delta("Hel"), _delta(""), _delta("lo"),
        _delta('{"a":', "response.function_call_arguments.delta"),
        ("response.output_text.done", {"type": "response.output_text.done", "text": "Hello"}),
        _terminal("response.completed", "completed", RESPONSES_USAGE))
    meter = ResponseMeter(True, R)
    fed = [meter.feed(raw[i:i + 9]) for i in range(0, len(raw), 9)]
    # Four deltas, one estimated at 2 tokens ('{"a":' is mostly punctuation, half a token a
    # character): until the usage comes.
    assert sum(fed) == 5 == meter.counted_tokens
    assert meter.finish() == Usage(30, 4, 12)
    assert meter.finish_reason == "stop" and meter.done


def test_responses_stream_without_event_lines_is_read_from_the_data() -> None:
    raw = b"".join(b"data: " + json.dumps(data).encode() + b"\n\n" for _, data in (
        _delta("a"), _delta("b"), _terminal("response.incomplete", "incomplete",
                                            RESPONSES_USAGE, "max_output_tokens")))
    meter = ResponseMeter(True, R)
    assert meter.feed(raw) == 2
    assert meter.finish() == Usage(30, 4, 12) and meter.finish_reason == "length"


def test_responses_stream_cut_before_the_end_has_no_usage() -> None:
    meter = ResponseMeter(True, R)
    assert meter.feed(_named(_delta("a"), _delta("b"))) == 2
    assert meter.finish() is None and not meter.done


def test_responses_failed_event_ends_the_stream() -> None:
    meter = ResponseMeter(True, R)
    meter.feed(_named(_delta("a"), _terminal("response.failed", "failed", None)))
    assert meter.done and meter.usage is None and meter.finish_reason == "failed"


def test_responses_body() -> None:
    body = {"id": "resp_1", "object": "response", "status": "completed", "output": [],
            "usage": RESPONSES_USAGE}
    meter = ResponseMeter(False, R)
    raw = json.dumps(body).encode()
    assert meter.feed(raw[:10]) == 0 and meter.feed(raw[10:]) == 0
    assert meter.finish() == Usage(30, 4, 12) and meter.finish_reason == "stop"


def test_responses_body_with_bad_usage_has_none() -> None:
    meter = ResponseMeter(False, R)
    meter.feed(json.dumps({"status": "completed", "usage": {"input_tokens": "3",
                                                            "output_tokens": 1}}).encode())
    assert meter.finish() is None


# -- embeddings metering --

def test_embeddings_body_is_prompt_only() -> None:
    body = {"object": "list", "data": [{"embedding": [0.1] * 4}],
            "usage": {"prompt_tokens": 17, "total_tokens": 17}}
    meter = ResponseMeter(False, E)
    meter.feed(json.dumps(body).encode())
    assert meter.finish() == Usage(17, 0, 0)


def test_embeddings_completion_is_zero_whatever_the_body_says() -> None:
    body = {"usage": {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}}
    meter = ResponseMeter(False, E)
    meter.feed(json.dumps(body).encode())
    assert meter.finish() == Usage(5, 0, 0)


# -- Anthropic metering --

def _anthropic_stream(stop: str = "end_turn", delta_usage: dict[str, Any] | None = None,
                      start_usage: dict[str, Any] | None = None) -> bytes:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
               "usage": start_usage or {"input_tokens": 25, "output_tokens": 1}}
    return _named(
        ("message_start", {"type": "message_start", "message": message}),
        ("ping", {"type": "ping"}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "signature_delta", "signature": "sig"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "Hi"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": " there"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2,
                                 "delta": {"type": "input_json_delta", "partial_json": "{}"}}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": stop, "stop_sequence": None},
                           "usage": delta_usage or {"output_tokens": 15}}),
        ("message_stop", {"type": "message_stop"}))


def test_anthropic_stream_counts_content_deltas_and_reads_usage() -> None:
    raw = _anthropic_stream()
    meter = ResponseMeter(True, M)
    assert sum(meter.feed(raw[i:i + 11]) for i in range(0, len(raw), 11)) == 4
    assert meter.finish() == Usage(25, 15, 0)
    assert meter.finish_reason == "stop" and meter.done


@pytest.mark.parametrize(("stop", "finish"), [("max_tokens", "length"), ("tool_use", "tool_calls"),
                                              ("stop_sequence", "stop"), ("refusal", "refusal")])
def test_anthropic_stop_reasons_in_openai_words(stop: str, finish: str) -> None:
    meter = ResponseMeter(True, M)
    meter.feed(_anthropic_stream(stop))
    assert meter.finish_reason == finish


def test_anthropic_cache_tokens_are_part_of_the_prompt() -> None:
    start = {"input_tokens": 5, "cache_read_input_tokens": 100,
             "cache_creation_input_tokens": 20, "output_tokens": 1}
    meter = ResponseMeter(True, M)
    meter.feed(_anthropic_stream(start_usage=start))
    assert meter.finish() == Usage(125, 15, 100)


def test_anthropic_message_delta_with_input_wins() -> None:
    """vLLM repeats the input tokens in ``message_delta``."""
    meter = ResponseMeter(True, M)
    meter.feed(_anthropic_stream(delta_usage={"input_tokens": 31, "output_tokens": 7}))
    assert meter.finish() == Usage(31, 7, 0)


def test_anthropic_stream_cut_before_message_delta_has_no_usage() -> None:
    raw = _anthropic_stream()
    meter = ResponseMeter(True, M)
    meter.feed(raw[: raw.index(b"event: message_delta")])
    assert meter.finish() is None and meter.counted_tokens == 4 and not meter.done


def test_anthropic_body() -> None:
    body = {"id": "msg_1", "type": "message", "content": [{"type": "text", "text": "hi"}],
            "stop_reason": "max_tokens",
            "usage": {"input_tokens": 10, "cache_read_input_tokens": 6, "output_tokens": 3}}
    meter = ResponseMeter(False, M)
    meter.feed(json.dumps(body).encode())
    assert meter.finish() == Usage(16, 3, 6) and meter.finish_reason == "length"


def test_anthropic_body_without_usage_has_none() -> None:
    meter = ResponseMeter(False, M)
    meter.feed(b'{"type": "message", "stop_reason": "end_turn"}')
    assert meter.finish() is None and meter.finish_reason == "stop"


# -- a zero cap is "no output", not "no cap" --

def test_admission_takes_a_zero_cap_and_expects_no_output() -> None:
    rules = TenantRules(max_output_tokens=100)
    decision = Admission({}, rules).admit("t", "default", 50, 0, 200, 0.0)
    assert isinstance(decision, Admitted)
    assert decision.max_output_tokens == 0  # not replaced by the limit, as "absent" would be
    assert decision.reservation.reserved_tokens == 50


def _dispatcher() -> Dispatcher:
    config = load_config({"endpoints": [{"address": "10.0.0.1:8000"}],
                          "capacity": {"kvBudgetTokens": 1000, "defaultOutputTokens": 256}})
    return Dispatcher(config, metrics=PickerMetrics(CollectorRegistry()), clock=lambda: 0.0)


async def test_embeddings_are_charged_and_reserved_for_their_prompt_only() -> None:
    d = _dispatcher()
    request = parse_request(_body(input="a" * 400), E)
    ticket = await d.admit("a", request)
    assert d.output_estimate(ticket) == 0
    assert ticket.reserved_tokens == 100  # the default output estimate (256) is not added
    assert d.scheduler.service["a"] == 100.0  # prefill weight 1, nothing for output
    d.complete(ticket, Usage(90, 0, 0), "ok")
    assert d.scheduler.service["a"] == 90.0
    assert d.endpoints["10.0.0.1:8000"].inflight_tokens == 0


async def test_embeddings_do_not_move_the_tenants_output_estimate() -> None:
    d = _dispatcher()
    chat = parse_request(_body(prompt="x"))
    first = await d.admit("a", chat)
    d.complete(first, Usage(1, 80, 0), "ok")
    embedding = await d.admit("a", parse_request(_body(input="x"), E))
    d.complete(embedding, Usage(1, 0, 0), "ok")
    second = await d.admit("a", chat)
    assert d.output_estimate(second) == 80
