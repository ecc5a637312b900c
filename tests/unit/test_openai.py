"""OpenAI formats: request parsing and prompt estimates, error bodies, and response metering."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.core.request import Usage
from picker.errors import BadRequest
from picker.openai import ResponseMeter, error_body, parse_request
from picker.openai.media import DEFAULT_COSTS
from picker.openai.paths import ApiKind
from picker.openai.request import CHARS_PER_TOKEN, MESSAGE_OVERHEAD_TOKENS, estimate_prompt_tokens
from picker.openai.response import _TEXT_CHUNK, _TEXT_PAYLOAD, MAX_BUFFERED_BYTES
from picker.openai.tokens import text_quarters, text_tokens


def _body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def _sse(*events: dict[str, Any] | str, crlf: bool = False) -> bytes:
    """An SSE body: each event a ``data:`` line (a dict as JSON, a str as is)."""
    end = b"\r\n\r\n" if crlf else b"\n\n"
    out = b""
    for event in events:
        payload = event if isinstance(event, str) else json.dumps(event)
        out += b"data: " + payload.encode() + end
    return out


def _chat_chunk(content: str | None = None, role: str | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}


def _usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"object": "chat.completion.chunk", "choices": [], "usage": usage}


# -- prompt estimates --

def test_chat_estimate_counts_each_message_with_its_overhead() -> None:
    body = {"messages": [{"role": "system", "content": "x" * 8},
                         {"role": "user", "content": "y" * 9}]}
    # 8 chars → 2 tokens, 9 chars → 3 tokens (rounded up), plus the per-message overhead.
    assert estimate_prompt_tokens(body) == 2 + 3 + 2 * MESSAGE_OVERHEAD_TOKENS


def test_chat_estimate_counts_text_parts_and_an_image_it_cannot_measure_at_the_cap() -> None:
    content = [{"type": "text", "text": "a" * 12},
               {"type": "image_url", "image_url": {"url": "http://x/" + "z" * 400}},
               {"type": "text", "text": "b" * 4}]
    body = {"messages": [{"role": "user", "content": content}]}
    assert estimate_prompt_tokens(body) == \
        3 + 1 + DEFAULT_COSTS.image_max_tokens + MESSAGE_OVERHEAD_TOKENS


def test_chat_estimate_of_a_message_without_content_is_its_overhead() -> None:
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": []}]}
    assert estimate_prompt_tokens(body) == MESSAGE_OVERHEAD_TOKENS


def test_completions_estimate_of_a_string_prompt_is_chars_over_four_rounded_up() -> None:
    assert estimate_prompt_tokens({"prompt": "a" * (10 * CHARS_PER_TOKEN + 1)}) == 11


def test_completions_estimate_of_a_list_of_strings_sums_them() -> None:
    assert estimate_prompt_tokens({"prompt": ["a" * 8, "b" * 5]}) == 2 + 2


def test_completions_estimate_of_token_ids_is_their_count() -> None:
    assert estimate_prompt_tokens({"prompt": [101, 7592, 2088, 102, 5]}) == 5


def test_completions_estimate_of_a_batch_of_token_id_lists_sums_their_lengths() -> None:
    assert estimate_prompt_tokens({"prompt": [[1, 2, 3], [4, 5]]}) == 5


def test_estimate_is_at_least_one_token() -> None:
    assert estimate_prompt_tokens({"prompt": ""}) == 1
    assert estimate_prompt_tokens({"prompt": []}) == 1


def test_parse_request_carries_the_estimate_and_the_fields() -> None:
    parsed = parse_request(_body(prompt="a" * 40, max_tokens=7, stream=True))
    assert parsed.model == "m"
    assert parsed.prompt_tokens == 10
    assert parsed.max_tokens == 7
    assert parsed.stream is True
    assert parsed.body["prompt"] == "a" * 40


def test_parse_chat_request_uses_the_chat_estimate() -> None:
    parsed = parse_request(_body(messages=[{"role": "user", "content": "abcd"}]))
    assert parsed.prompt_tokens == 1 + MESSAGE_OVERHEAD_TOKENS
    assert parsed.max_tokens is None
    assert parsed.stream is False


# -- parse errors --

@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe\x00", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"a string"', "must be a JSON object"),
        (json.dumps({"prompt": "x"}).encode(), "'model' is required"),
        (json.dumps({"model": "", "prompt": "x"}).encode(), "'model' is required"),
        (json.dumps({"model": 3, "prompt": "x"}).encode(), "'model' is required"),
        (_body(messages=[]), "'messages' must be a non-empty list"),
        (_body(messages="hello"), "'messages' must be a non-empty list"),
        (_body(), "one of 'messages' or 'prompt' is required"),
        (_body(prompt="x", max_tokens=0), "'max_tokens' must be a positive integer"),
        (_body(prompt="x", max_tokens=-5), "'max_tokens' must be a positive integer"),
        (_body(prompt="x", max_tokens=True), "'max_tokens' must be a positive integer"),
        (_body(prompt="x", max_tokens=2.5), "'max_tokens' must be a positive integer"),
        (_body(prompt="x", max_tokens="10"), "'max_tokens' must be a positive integer"),
        (_body(prompt="x", max_completion_tokens=0),
         "'max_completion_tokens' must be a positive integer"),
        (_body(prompt="x", stream="yes"), "'stream' must be true or false"),
        (_body(prompt="x", stream=1), "'stream' must be true or false"),
    ],
    ids=["bad-json", "not-utf8", "list", "string", "no-model", "empty-model", "model-int",
         "empty-messages", "messages-str", "neither", "max-tokens-0", "max-tokens-negative",
         "max-tokens-bool", "max-tokens-float", "max-tokens-str", "max-completion-0",
         "stream-str", "stream-int"],
)
def test_malformed_request_is_a_bad_request_saying_why(body: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse_request(body)
    assert fragment in caught.value.message
    assert caught.value.http_status == 400


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert parse_request(_body(prompt="x", max_tokens=100, max_completion_tokens=9)).max_tokens == 9


def test_include_usage_only_when_streaming() -> None:
    options = {"include_usage": True}
    assert parse_request(_body(prompt="x", stream=True, stream_options=options)).include_usage
    assert not parse_request(_body(prompt="x", stream=False, stream_options=options)).include_usage
    assert not parse_request(_body(prompt="x", stream=True)).include_usage
    assert not parse_request(_body(prompt="x", stream=True,
                                   stream_options={"include_usage": False})).include_usage
    assert not parse_request(_body(prompt="x", stream=True, stream_options="yes")).include_usage


def test_error_body_is_openai_shaped() -> None:
    decoded = json.loads(error_body("over budget", "tokens", "rate_limit_exceeded"))
    assert decoded == {"error": {"message": "over budget", "type": "tokens",
                                 "param": None, "code": "rate_limit_exceeded"}}
    assert json.loads(error_body("x", "server_error"))["error"]["code"] is None


# -- response metering: streaming --

STREAM = _sse(
    _chat_chunk(role="assistant"),
    _chat_chunk("Hel"),
    _chat_chunk("lo"),
    {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},
    {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]},
    _usage_chunk(12, 3, cached=8),
    "[DONE]",
)


def test_meter_counts_content_events_but_not_the_role_only_chunk() -> None:
    meter = ResponseMeter(streaming=True)
    assert meter.feed(STREAM) == 3
    assert meter.counted_tokens == 3
    assert meter.done
    assert meter.finish() == Usage(12, 3, 8)


def test_meter_feed_returns_the_tokens_each_chunk_newly_delivered() -> None:
    meter = ResponseMeter(streaming=True)
    first = _sse(_chat_chunk("a"))
    assert meter.feed(first[:10]) == 0  # the event is not complete yet
    assert meter.feed(first[10:]) == 1
    assert meter.feed(_sse(_chat_chunk("b"), _chat_chunk("c"))) == 2
    assert meter.counted_tokens == 3
    assert not meter.done


def test_meter_reads_crlf_separated_events() -> None:
    meter = ResponseMeter(streaming=True)
    body = _sse(_chat_chunk("a"), _chat_chunk("b"), _usage_chunk(5, 2), "[DONE]", crlf=True)
    assert meter.feed(body) == 2
    assert meter.done
    assert meter.finish() == Usage(5, 2, 0)


def test_meter_counts_completions_text_events() -> None:
    meter = ResponseMeter(streaming=True)
    body = _sse({"object": "text_completion", "choices": [{"index": 0, "text": "foo"}]},
                {"object": "text_completion", "choices": [{"index": 0, "text": ""}]},
                {"object": "text_completion", "choices": [{"index": 0, "text": "bar"}]},
                "[DONE]")
    assert meter.feed(body) == 2


def test_meter_counts_one_token_per_choice_with_content() -> None:
    meter = ResponseMeter(streaming=True)
    event = {"choices": [{"index": 0, "delta": {"content": "a"}},
                         {"index": 1, "delta": {"content": "b"}}]}
    assert meter.feed(_sse(event)) == 2


def test_meter_keeps_the_latest_continuous_usage() -> None:
    meter = ResponseMeter(streaming=True)
    chunks = [{**_chat_chunk("t"), "usage": {"prompt_tokens": 10, "completion_tokens": n}}
              for n in (1, 2, 3)]
    meter.feed(_sse(*chunks))
    assert meter.usage == Usage(10, 3, 0)
    assert meter.counted_tokens == 3


def test_meter_ignores_null_usage_in_ordinary_chunks() -> None:
    meter = ResponseMeter(streaming=True)
    meter.feed(_sse(_usage_chunk(4, 1), {**_chat_chunk("x"), "usage": None}))
    assert meter.usage == Usage(4, 1, 0)


def test_meter_without_usage_finishes_with_none_and_skips_garbage_events() -> None:
    meter = ResponseMeter(streaming=True)
    meter.feed(b": keep-alive comment\n\nevent: ping\ndata: {broken\n\n" + _sse(_chat_chunk("x")))
    assert meter.counted_tokens == 1
    assert meter.finish() is None
    assert not meter.done


def test_meter_takes_a_final_event_without_trailing_blank_line() -> None:
    meter = ResponseMeter(streaming=True)
    meter.feed(_sse(_chat_chunk("a")) + b"data: " + json.dumps(_usage_chunk(3, 1)).encode())
    assert meter.usage is None
    assert meter.finish() == Usage(3, 1, 0)


def _chunkings(body: bytes) -> st.SearchStrategy[list[bytes]]:
    cuts = st.lists(st.integers(0, len(body)), max_size=40).map(sorted)
    return cuts.map(lambda points: [body[a:b] for a, b in
                                    zip([0, *points], [*points, len(body)], strict=True)])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), crlf=st.booleans())
def test_any_chunking_of_a_stream_gives_the_same_count_and_usage(data: st.DataObject,
                                                                   crlf: bool) -> None:
    words = data.draw(st.lists(st.text(min_size=0, max_size=6), max_size=12), label="words")
    events: list[dict[str, Any] | str] = [_chat_chunk(role="assistant")]
    events += [_chat_chunk(w) for w in words]
    events += [_usage_chunk(7, len(words), cached=2), "[DONE]"]
    body = _sse(*events, crlf=crlf)
    chunks = data.draw(_chunkings(body), label="chunks")
    assert b"".join(chunks) == body
    meter = ResponseMeter(streaming=True)
    delivered = sum(meter.feed(chunk) for chunk in chunks)
    # Each event its text's estimate rounded down, one at least (a decode step).
    expected = sum(max(1, text_quarters(w) // 4) for w in words if w)
    assert delivered == meter.counted_tokens == expected
    assert meter.finish() == Usage(7, len(words), 2)
    assert meter.done


# -- response metering: non-streaming --

def test_non_streaming_usage_with_cached_tokens() -> None:
    meter = ResponseMeter(streaming=False)
    body = json.dumps({"id": "x", "choices": [{"message": {"content": "hi"}}],
                       "usage": {"prompt_tokens": 30, "completion_tokens": 4,
                                 "prompt_tokens_details": {"cached_tokens": 16}}}).encode()
    assert meter.feed(body[:7]) == 0
    assert meter.feed(body[7:]) == 0
    assert meter.counted_tokens == 0
    assert meter.finish() == Usage(30, 4, 16)


def test_non_streaming_usage_without_details_has_no_cached_tokens() -> None:
    meter = ResponseMeter(streaming=False)
    meter.feed(json.dumps({"usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                     "prompt_tokens_details": None}}).encode())
    assert meter.finish() == Usage(3, 2, 0)


@pytest.mark.parametrize("body", [b"<html>502</html>", b"\xff\xfe", b"[1]",
                                  b'{"usage": {"prompt_tokens": "3", "completion_tokens": 2}}',
                                  b'{"choices": []}', b""])
def test_non_streaming_body_without_readable_usage_gives_none(body: bytes) -> None:
    meter = ResponseMeter(streaming=False)
    meter.feed(body)
    assert meter.finish() is None


def test_oversize_non_streaming_body_is_not_parsed_for_usage() -> None:
    usage = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}'
    small = ResponseMeter(streaming=False)
    small.feed(usage)
    assert small.finish() == Usage(3, 2, 0)  # the same body, under the limit, is read
    meter = ResponseMeter(streaming=False)
    meter.feed(b" " * (MAX_BUFFERED_BYTES + 1))  # JSON allows leading whitespace
    meter.feed(usage)  # the tail alone would parse: it must not be read either
    assert meter.finish() is None


def test_null_max_completion_tokens_falls_back_to_max_tokens() -> None:
    body = b'{"model": "m", "prompt": "x", "max_completion_tokens": null, "max_tokens": 5}'
    assert parse_request(body).max_tokens == 5


@pytest.mark.parametrize("fields, choices", [
    ({}, 1), ({"n": None}, 1), ({"n": 8}, 8), ({"best_of": 3}, 3), ({"n": 2, "best_of": 5}, 5),
    ({"n": 4, "best_of": 4}, 4)])
def test_choices_are_the_larger_of_n_and_best_of(fields: dict[str, Any], choices: int) -> None:
    for shape in ({"prompt": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}):
        body = json.dumps({"model": "m", "max_tokens": 10, **shape, **fields}).encode()
        assert parse_request(body).choices == choices


@pytest.mark.parametrize("fields, fragment", [
    ({"n": 0}, "'n'"), ({"n": -1}, "'n'"), ({"n": 1.5}, "'n'"), ({"n": True}, "'n'"),
    ({"n": "8"}, "'n'"), ({"best_of": 0}, "'best_of'"),
    ({"n": 4, "best_of": 2}, "'best_of' (2) must be at least 'n' (4)")])
def test_bad_n_or_best_of_is_a_bad_request(fields: dict[str, Any], fragment: str) -> None:
    body = json.dumps({"model": "m", "prompt": "hi", **fields}).encode()
    with pytest.raises(BadRequest) as error:
        parse_request(body)
    assert fragment in str(error.value)


# -- a stream without usage is counted by what its events carry (issue 26) --


def test_events_carrying_many_tokens_are_not_counted_one_each() -> None:
    """``include_usage: false`` and an engine packing text into few events: each event was
    counted one token whatever it carried (40 characters, 8 tokens by the estimate, counted 1)."""
    text = "the quick brown fox jumps over a lazy do"  # 32 letters a quarter each, 8 spaces
    assert text_tokens(text) == 8
    meter = ResponseMeter(streaming=True)
    assert meter.feed(_sse(_chat_chunk(text), _chat_chunk(text))) == 16
    assert meter.feed(_sse(_chat_chunk("a"), "[DONE]")) == 1  # a step is one token at least
    assert meter.counted_tokens == 17 and meter.finish() is None


def test_one_word_events_count_one_each_not_rounded_up_each() -> None:
    meter = ResponseMeter(streaming=True)
    assert meter.feed(_sse(*[_chat_chunk(" jumps")] * 4)) == 4  # 5 quarters each
    cjk = ResponseMeter(streaming=True)
    assert cjk.feed(_sse(_chat_chunk("猫が座った"))) == text_tokens("猫が座った") == 10


@pytest.mark.parametrize(("kind", "event"), [
    (ApiKind.MESSAGES, b'event: content_block_delta\ndata: {"type": "content_block_delta", '
                       b'"index": 0, "delta": {"type": "text_delta", "text": "%s"}}\n\n'),
    (ApiKind.RESPONSES, b'event: response.output_text.delta\ndata: {"type": '
                        b'"response.output_text.delta", "delta": "%s"}\n\n'),
    (ApiKind.COMPLETIONS, b'data: {"choices": [{"index": 0, "text": "%s"}]}\n\n'),
])
def test_every_api_counts_the_text_its_events_carry(kind: ApiKind, event: bytes) -> None:
    meter = ResponseMeter(streaming=True, kind=kind)
    assert meter.feed(event % (b"x" * 40)) == 10
    assert meter.feed(event % b"y") == 1


def test_tool_call_arguments_count_as_text() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]}}]}
    meter = ResponseMeter(streaming=True)
    expected = (text_quarters("get_weather") + text_quarters('{"city": "Paris", "unit": "c"}')
                ) // 4
    assert expected > 1 and meter.feed(_sse(chunk)) == expected


def _fed_whole(chunks: list[bytes]) -> ResponseMeter:
    meter = ResponseMeter(True)
    for chunk in chunks:
        meter.feed(chunk)
    meter.finish()
    return meter


def test_a_chunk_of_one_event_is_read_as_the_buffered_path_reads_it() -> None:
    """The streamed chunk path reads a chunk holding exactly one event without buffering it:
    what it counts, and the usage and finish reason it keeps, are those of the same bytes split
    anywhere (the buffered path)."""
    events = [
        b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" the quick"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":"\\u00e9t\\u00e9"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,'
        b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n',
        b"data: [DONE]\n\n"]
    whole = _fed_whole(events)
    split = _fed_whole([b"".join(events)[i:i + 7] for i in range(0, len(b"".join(events)), 7)])
    assert whole.counted_tokens == split.counted_tokens > 0
    assert whole.usage == split.usage == Usage(9, 3, 4)
    assert whole.finish_reason == split.finish_reason == "length"
    assert whole.done and split.done


def test_a_payload_with_more_than_one_json_value_counts_nothing() -> None:
    """As ``json.loads`` refuses it ("Extra data"), so does the chunk path's decoder."""
    meter = ResponseMeter(True)
    assert meter.feed(b'data: {"choices":[{"delta":{"content":"abc"}}]} {"x":1}\n\n') == 0
    assert meter.feed(b'data: {"choices":[{"delta":{"content":"abc"}}]}\n\n') == 1
    # CRLF-separated and several events in one chunk take the buffered path, same counts.
    assert meter.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
                      b'data: {"choices":[{"delta":{"content":"b"}}]}\r\n\r\n') == 2


# -- the decode-step event read without a parse (``_DECODE_STEP``) --

def _vllm_event(content: str, *, kind: str = "delta") -> bytes:
    """A decode step's event as vLLM writes it (compact JSON, its key order, raw UTF-8)."""
    choice = '{"index":0,' + (f'"delta":{{"content":{json.dumps(content, ensure_ascii=False)}}}'
                              if kind == "delta" else
                              f'"text":{json.dumps(content, ensure_ascii=False)}') \
        + ',"logprobs":null,"finish_reason":null}'
    return ('data: {"id":"chatcmpl-0cc7","object":"chat.completion.chunk","created":1796304202,'
            f'"model":"sim-model","choices":[{choice}]}}\n\n').encode()


def _parsed_only(kind: ApiKind = ApiKind.CHAT) -> ResponseMeter:
    """A meter that parses every event (the reading before ``_DECODE_STEP``)."""
    meter = ResponseMeter(True, kind)
    meter._text_events = False
    return meter


def _state(meter: ResponseMeter) -> tuple[Any, ...]:
    return meter.counted_tokens, meter.usage, meter.finish_reason, meter.done


@pytest.mark.parametrize("content", [" the", "", "été", "日本語のテキスト", "a" * 40, "<|x|>"])
@pytest.mark.parametrize("kind", ["delta", "text"])
def test_a_decode_step_event_counts_its_text_unparsed(content: str, kind: str) -> None:
    event = _vllm_event(content, kind=kind)
    assert _TEXT_CHUNK.fullmatch(event) is not None
    fast, parsed = ResponseMeter(True), _parsed_only()
    expected = max(1, text_quarters(content) // 4) if content else 0
    assert fast.feed(event) == parsed.feed(event) == expected
    assert _state(fast) == _state(parsed)


@pytest.mark.parametrize("payload", [
    # An escape in the text, another key, whitespace, a finish reason, a usage, a second choice,
    # a leading zero, a raw control character, a negative index: each is parsed as before.
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"a\\nb"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"ab","role":"assistant"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content": "ab"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"ab"},"logprobs":null,"finish_reason":"stop"}]}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"ab"},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":5,'
    '"completion_tokens":1}}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"ab"},"logprobs":null,"finish_reason":null},{"index":1,"delta":'
    '{"content":"cd"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"a","object":"o","created":01,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"ab"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"a\x01b"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":-1,"delta":'
    '{"content":"ab"},"logprobs":null,"finish_reason":null}]}',
    '{"id":"a","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    '{"content":"ab"},"logprobs":null,"finish_reason":null}]} {"x":1}',
])
def test_an_event_spelled_otherwise_is_parsed_as_before(payload: str) -> None:
    _parsed_as_before(payload.encode())


@pytest.mark.parametrize("payload", [
    # JSON refuses a raw control character and a payload that is not UTF-8 anywhere: nothing
    # counted, as the parse counts nothing; a non-ASCII id or model is parsed (and counted).
    b'{"id":"a\x01","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    b'{"content":"ab"},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"a\xff","object":"o","created":1,"model":"m","choices":[{"index":0,"delta":'
    b'{"content":"ab"},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"a","object":"o","created":1,"model":"m\xc3","choices":[{"index":0,"delta":'
    b'{"content":"ab"},"logprobs":null,"finish_reason":null}]}',
    b'{"id":"a","object":"o\x7f","created":1,"model":"m\xc3\xa9","choices":[{"index":0,'
    b'"delta":{"content":"ab"},"logprobs":null,"finish_reason":null}]}',
])
def test_an_id_or_model_past_printable_ascii_is_parsed_as_before(payload: bytes) -> None:
    _parsed_as_before(payload)


def _parsed_as_before(payload: bytes) -> None:
    assert _TEXT_PAYLOAD.fullmatch(payload) is None
    event = b"data: " + payload + b"\n\n"
    fast, parsed = ResponseMeter(True), _parsed_only()
    assert fast.feed(event) == parsed.feed(event)
    assert fast.finish() == parsed.finish()
    assert _state(fast) == _state(parsed)


_FIELD = st.one_of(st.sampled_from(["chatcmpl-1", "sim-model", "", "é", 'a"b', "a\\b", "\x01",
                                    "\u2028", "\U0001f600"]), st.text(max_size=8))


_PIECES = ("id", "object", "created", "model", "index", "choice", "finish", "logprobs", "choices",
           "end", "bytes", "utf8")
_NOT_UTF8 = "\ue000"
"""Marks where the text gets bytes that are not UTF-8."""


@st.composite
def _near_vllm_events(draw: st.DrawFn) -> bytes:
    """Payloads around vLLM's decode-step spelling: a few of its pieces (none: vLLM's own event)
    varied or broken (raw quotes, backslashes and control characters, escapes, numbers JSON
    refuses, other keys, a finish reason, a usage, bytes that are not UTF-8)."""
    varied = draw(st.sets(st.sampled_from(_PIECES), max_size=2))

    def text(piece: str) -> str:
        usual = st.characters(blacklist_categories=("Cs",), blacklist_characters='"\\') \
            if piece == "choice" else st.characters(min_codepoint=0x20, max_codepoint=0x7E,
                                                    blacklist_characters='"\\')
        value = draw(_FIELD if piece in varied else st.text(usual, max_size=8))
        if piece not in varied:
            return json.dumps(value, ensure_ascii=False)
        return draw(st.sampled_from([json.dumps(value), json.dumps(value, ensure_ascii=False),
                                     f'"{value}"']))

    def number(piece: str, usual: str) -> str:
        if piece not in varied:
            return usual
        return draw(st.sampled_from(["0", "7", "1796304202", "01", "-1", "1.5", "1e3", '"1"']))

    content = text("choice")
    if "utf8" in varied:
        content = content[:-1] + _NOT_UTF8 + content[-1:]
    shape = draw(st.sampled_from(["delta", "text", "both", "role", "spaced"])) \
        if "choice" in varied else draw(st.sampled_from(["delta", "text"]))
    body = {"delta": f'"delta":{{"content":{content}}}', "text": f'"text":{content}',
            "both": f'"delta":{{"content":{content}}},"text":{content}',
            "role": f'"delta":{{"role":"assistant","content":{content}}}',
            "spaced": f'"delta": {{"content": {content}}}'}[shape]
    finish = draw(st.sampled_from(['"stop"', '"length"', "1", "null "])) \
        if "finish" in varied else "null"
    logprobs = draw(st.sampled_from(["{}", "[]", "0"])) if "logprobs" in varied else "null"
    choice = (f'{{"index":{number("index", "0")},{body},"logprobs":{logprobs},'
              f'"finish_reason":{finish}}}')
    choices = draw(st.sampled_from([f"[{choice},{choice}]", "[]", f" [{choice}]"])) \
        if "choices" in varied else f"[{choice}]"
    payload = (f'{{"id":{text("id")},"object":{text("object")},'
               f'"created":{number("created", "1796304202")},"model":{text("model")},'
               f'"choices":{choices}')
    payload += draw(st.sampled_from([',"usage":{"prompt_tokens":9,"completion_tokens":2}}',
                                     ',"usage":null}', "} ", "}}", '} {"x":1}'])) \
        if "end" in varied else "}"
    raw = payload.encode("utf-8", "surrogatepass").replace(
        _NOT_UTF8.encode(), draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc3\xa9"])))
    return raw + (draw(st.sampled_from([b"\xff", b"\xc3"])) if "bytes" in varied else b"")


@settings(max_examples=400, deadline=None)
@given(events=st.lists(_near_vllm_events(), min_size=1, max_size=4),
       kind=st.sampled_from([ApiKind.CHAT, ApiKind.COMPLETIONS, ApiKind.EMBEDDINGS]),
       space=st.sampled_from([(b" ", b""), (b"", b""), (b"  ", b" "), (b"\t", b"\x0b"),
                              (b"\x0c", b"\t")]),
       end=st.sampled_from([b"\n\n", b"\n\n", b"\r\n\r\n", b"\n"]))
def test_reading_decode_steps_unparsed_changes_no_count(events: list[bytes], kind: ApiKind,
                                                       space: tuple[bytes, bytes],
                                                       end: bytes) -> None:
    """Whatever the payload and the spaces around it, the meter counts, keeps and finishes as the
    parse alone did: one event a chunk (the chunk path) and all of them in one chunk (the
    buffered path)."""
    chunks = [b"data:" + space[0] + event + space[1] + end for event in events]
    one_each, parsed_each = ResponseMeter(True, kind), _parsed_only(kind)
    for chunk in chunks:
        assert one_each.feed(chunk) == parsed_each.feed(chunk)
    assert one_each.finish() == parsed_each.finish()
    assert _state(one_each) == _state(parsed_each)
    together, parsed_together = ResponseMeter(True, kind), _parsed_only(kind)
    assert together.feed(b"".join(chunks)) == parsed_together.feed(b"".join(chunks))
    assert together.finish() == parsed_together.finish()
    assert _state(together) == _state(parsed_together)
