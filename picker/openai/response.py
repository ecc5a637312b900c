"""Metering a response as it streams: output tokens per SSE event, ``usage`` when present.

Each API kind has its own shapes (``picker.openai.paths.ApiKind``):

* chat and completions: ``data:`` chunks with ``choices[].delta`` / ``choices[].text``, a
  ``usage`` object (``prompt_tokens``, ``completion_tokens``,
  ``prompt_tokens_details.cached_tokens``) in the last chunk or the body, ``finish_reason``;
* Responses API: ``event: response.output_text.delta`` (and the other ``*.delta`` events) one
  decode step each; ``response.completed`` / ``response.incomplete`` / ``response.failed`` carry
  ``response.usage`` (``input_tokens``, ``output_tokens``, ``input_tokens_details.cached_tokens``)
  and the status; the non-streaming body is that ``response`` object;
* embeddings: a body with ``usage.prompt_tokens`` and no output (completion is always 0);
* Anthropic Messages: ``message_start`` (``message.usage.input_tokens``), ``content_block_delta``
  one decode step each, ``message_delta`` (``usage.output_tokens``, ``delta.stop_reason``),
  ``message_stop``; the non-streaming body has ``usage`` and ``stop_reason``. Anthropic's
  ``input_tokens`` leaves out prompt-cache reads and writes (``cache_read_input_tokens``,
  ``cache_creation_input_tokens``): the prompt is their sum, the cached part the reads.

Finish reasons are reported in OpenAI's words (``stop``, ``length``, ``tool_calls``) whatever the
API, so metering records compare across kinds.

Without ``usage`` a stream's output is counted from what its events carry: each event with new
content counts the tokens of its text as prompts are estimated (``picker.openai.tokens``, by
script), rounded down, and at least one (one decode step, as vLLM streams: an event of one
word up to seven letters stays one token), so an engine that packs many tokens into one event
(``include_usage: false``, speculative decoding, or a stream cut before its usage) is not counted
one token an event whatever it carries.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from picker.core.request import Usage
from picker.openai.paths import ApiKind
from picker.openai.tokens import text_quarters, utf8_quarters

_decode = json.JSONDecoder().raw_decode

_ASCII_STRING = rb'[\x20\x21\x23-\x5b\x5d-\x7e]*'
"""A JSON string's characters when they are printable ASCII and none is escaped."""
_TEXT = rb'([^"\\\x00-\x1f]*)'
"""A JSON string's characters when none is escaped (``json`` refuses raw control characters);
bytes past ASCII are read as UTF-8, and a payload that is not UTF-8 counts nothing."""
_NATURAL = rb"(?:0|[1-9][0-9]*)"
"""A JSON number that is a natural number (no sign, leading zero, fraction or exponent)."""
_DECODE_STEP = (
    rb'\{"id":"' + _ASCII_STRING + rb'","object":"' + _ASCII_STRING + rb'","created":' + _NATURAL
    + rb',"model":"' + _ASCII_STRING + rb'","choices":\[\{"index":' + _NATURAL
    + rb',(?:"delta":\{"content":"' + _TEXT + rb'"\}|"text":"' + _TEXT + rb'")'
    + rb',"logprobs":null,"finish_reason":null\}\]\}')
"""The payload of the event vLLM streams for each decode step of a chat or completions choice,
spelled as vLLM spells it (compact, in its key order; an id and a model name in ASCII, a text
without escapes): the event the streamed chunk path meets a hundred times a response. A payload
of this spelling is read without parsing it: what ``_take_openai`` takes from it is that
choice's text and nothing else (no finish reason, no usage). Any other spelling (whitespace,
another key, an escape, a usage) is parsed as before."""
_TEXT_PAYLOAD = re.compile(_DECODE_STEP)
_SSE_SPACE = rb"[ \t\x0b\x0c]*"
"""What ``bytes.strip`` takes from a data line's payload, but line ends."""
_TEXT_CHUNK = re.compile(rb"data:" + _SSE_SPACE + _DECODE_STEP + _SSE_SPACE + rb"\n\n")
"""A streamed chunk that is one decode step's event and nothing more (``feed``'s common chunk)."""


def _decode_step_tokens(step: re.Match[bytes]) -> int:
    """What ``_take_openai`` counts for a ``_DECODE_STEP`` payload (its ``_choice_tokens``)."""
    text = step[1] or step[2]
    if not text:
        return 0
    if not text.isascii():
        try:
            text.decode()
        except UnicodeDecodeError:
            return 0  # as the parse: a payload that is not UTF-8 counts nothing
    return _step_tokens(utf8_quarters(text))


MAX_BUFFERED_BYTES = 16 * 1024 * 1024
"""A non-streaming body larger than this is passed through unparsed (no usage read from it)."""


def _usage(data: dict[str, Any]) -> Usage | None:
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached if isinstance(cached, int) else 0)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def _responses_usage(response: dict[str, Any]) -> Usage | None:
    """``usage`` of a Responses API ``response`` object."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = _int(usage.get("input_tokens")), _int(usage.get("output_tokens"))
    if prompt is None or completion is None:
        return None
    details = usage.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt, completion, cached or 0)


def _embeddings_usage(data: dict[str, Any]) -> Usage | None:
    """An embeddings body's ``usage``: prompt only, whatever else it says."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
    return None if prompt is None else Usage(prompt, 0, 0)


def _anthropic_prompt(usage: dict[str, Any]) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) of an Anthropic ``usage``, if it has the input."""
    uncached = _int(usage.get("input_tokens"))
    if uncached is None:
        return None
    read = _int(usage.get("cache_read_input_tokens")) or 0
    written = _int(usage.get("cache_creation_input_tokens")) or 0
    return uncached + read + written, read


_ANTHROPIC_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length",
                     "tool_use": "tool_calls"}
_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_RESPONSES_UNCOUNTED_DELTA = "response.reasoning_summary_text.delta"
"""A summary of the reasoning, not decode steps (vLLM sends it beside ``reasoning_text.delta``)."""


def _anthropic_finish(reason: Any) -> str | None:
    if isinstance(reason, str) and reason:
        return _ANTHROPIC_FINISH.get(reason, reason)
    return None


def _responses_finish(response: dict[str, Any]) -> str | None:
    status = response.get("status")
    if status == "completed":
        return "stop"
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    if reason == "max_output_tokens":
        return "length"
    if isinstance(reason, str) and reason:
        return reason
    return status if isinstance(status, str) and status else None


def _wants_responses_event(name: bytes) -> bool:
    """Whether a Responses SSE event can change the count: deltas and the terminal events."""
    return name.endswith(b".delta") or name.startswith(b"response.completed") \
        or name.startswith(b"response.incomplete") or name.startswith(b"response.failed")


_ANTHROPIC_EVENTS = frozenset({b"message_start", b"content_block_delta", b"message_delta",
                               b"message_stop"})


def _quarters_of(value: Any) -> int:
    """Quarter tokens of a text field (0 for anything else)."""
    return text_quarters(value) if isinstance(value, str) else 0


def _tool_calls_quarters(calls: Any) -> int:
    """Quarter tokens of the names and arguments a ``tool_calls`` delta carries."""
    total = 0
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                total += _quarters_of(function.get("name")) \
                    + _quarters_of(function.get("arguments"))
    return total


def _content_tokens(event: dict[str, Any]) -> int:
    """Output tokens an OpenAI SSE event carries: per choice with new content, the estimate of
    its text (``_step_tokens``)."""
    tokens = 0
    for choice in event.get("choices") or ():
        if isinstance(choice, dict):
            tokens += _choice_tokens(choice)
    return tokens


def _choice_tokens(choice: dict[str, Any]) -> int:
    """Output tokens one choice of an SSE event carries (a chat delta or a completion's text)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content, reasoning = delta.get("content"), delta.get("reasoning_content")
        calls = delta.get("tool_calls")
        if not (content or reasoning or calls):
            return 0
        quarters = _quarters_of(content) + _quarters_of(reasoning)
        if calls:
            quarters += _tool_calls_quarters(calls)
        return _step_tokens(quarters)
    text = choice.get("text")
    return _step_tokens(_quarters_of(text)) if text else 0


def _step_tokens(quarters: int) -> int:
    """Tokens of one event's new content of ``quarters`` quarter tokens: rounded down, and one
    at least (a decode step)."""
    return max(1, quarters >> 2)


STREAM_EVENT_BYTES: dict[ApiKind, int] = {ApiKind.MESSAGES: 110, ApiKind.RESPONSES: 150}
"""The fewest bytes of an event delivering one token, for the APIs whose streams report their
output count only at their end (Anthropic's ``content_block_delta``, the Responses API's
``response.output_text.delta``, as vLLM writes them: compact JSON, a one-character token)."""


def streamed_output(kind: ApiKind, body_bytes: int) -> int | None:
    """Output tokens a stream of ``kind`` delivered in ``body_bytes`` bytes, when all that is
    known is its size (the access log of a stream its client left before the usage came): one
    token an event of ``STREAM_EVENT_BYTES``, so it errs high by the stream's opening events. None
    for an API not in the table."""
    size = STREAM_EVENT_BYTES.get(kind)
    return None if size is None else -(-body_bytes // size)


class ResponseMeter:
    """Counts what a response delivers. Feed it the body chunks in order.

    Streaming (``text/event-stream``): each event with new content counts its text's estimated
    tokens, one at least (vLLM streams one decode step per event); a ``usage`` object, when the
    engine sends one, is kept and wins at the end. Otherwise the body is buffered and its
    ``usage`` read at the end.
    ``kind`` says which API's shapes to read (the module docstring lists them).
    """

    def __init__(self, streaming: bool, kind: ApiKind = ApiKind.CHAT) -> None:
        self.streaming = streaming
        self.kind = kind
        self.counted_tokens = 0
        """Output tokens delivered so far, by the events' content (``_step_tokens``)."""
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        """The last finish reason the response gave, in OpenAI's words (``stop``, ``length``)."""
        self.done = False
        """The stream's end marker was seen (``data: [DONE]``, ``message_stop``, or a terminal
        ``response.*`` event)."""
        self._buffer = bytearray()
        self._overflow = False
        self._prompt: tuple[int, int] | None = None
        """Anthropic streams: (prompt, cached) from ``message_start``, until ``message_delta``."""
        self._take_data: Callable[[dict[str, Any]], None] = self._take_openai
        self._wants: Callable[[bytes], bool] | None = None
        """Whether an event named by its ``event:`` line is worth parsing (None: all are)."""
        self._text_events = kind is not ApiKind.RESPONSES and kind is not ApiKind.MESSAGES
        """OpenAI's shapes are read (``_take_openai``): a ``_DECODE_STEP`` needs no parse."""
        if kind is ApiKind.RESPONSES:
            self._take_data, self._wants = self._take_responses, _wants_responses_event
        elif kind is ApiKind.MESSAGES:
            self._take_data, self._wants = self._take_anthropic, _ANTHROPIC_EVENTS.__contains__

    def feed(self, chunk: bytes) -> int:
        """Take the next body chunk; returns the output tokens it newly delivered."""
        if not self.streaming:
            if not self._overflow:
                self._buffer += chunk
                if len(self._buffer) > MAX_BUFFERED_BYTES:
                    self._overflow = True
                    self._buffer.clear()
            return 0
        if self._text_events and not self._buffer:
            step = _TEXT_CHUNK.fullmatch(chunk)
            if step is not None:  # vLLM's decode step, read unparsed (``_DECODE_STEP``)
                tokens = _decode_step_tokens(step)
                self.counted_tokens += tokens
                return tokens
        before = self.counted_tokens
        if not self._buffer and chunk.find(b"\n\n") == len(chunk) - 2 \
                and b"\r" not in chunk:
            # The common chunk: one whole event and nothing left over (vLLM writes one event
            # per decode step, and Envoy hands each write on), read without buffering it.
            self._take_event(chunk[:-2])
            return self.counted_tokens - before
        self._buffer += chunk
        while True:
            end, sep = self._event_end()
            if end < 0:
                break
            event = bytes(self._buffer[:end])
            del self._buffer[: end + sep]
            self._take_event(event)
        return self.counted_tokens - before

    def finish(self) -> Usage | None:
        """The engine's usage, if the response reported it."""
        if not self.streaming and not self._overflow and self._buffer:
            try:
                data = json.loads(self._buffer)
            except (UnicodeDecodeError, json.JSONDecodeError):
                data = None
            if isinstance(data, dict):
                self._take_body(data)
            self._buffer.clear()
        elif self.streaming and self._buffer.strip():
            self._take_event(bytes(self._buffer))
            self._buffer.clear()
        return self.usage

    def _take_body(self, data: dict[str, Any]) -> None:
        """A whole (non-streaming) response body."""
        kind = self.kind
        if kind is ApiKind.RESPONSES:
            self.usage = _responses_usage(data)
            self.finish_reason = _responses_finish(data)
        elif kind is ApiKind.EMBEDDINGS:
            self.usage = _embeddings_usage(data)
        elif kind is ApiKind.MESSAGES:
            usage = data.get("usage")
            prompt = _anthropic_prompt(usage) if isinstance(usage, dict) else None
            output = _int(usage.get("output_tokens")) if isinstance(usage, dict) else None
            if prompt is not None and output is not None:
                self.usage = Usage(prompt[0], output, prompt[1])
            self.finish_reason = _anthropic_finish(data.get("stop_reason"))
        else:
            self.usage = _usage(data)
            self._take_finish_reason(data)

    def _event_end(self) -> tuple[int, int]:
        lf = self._buffer.find(b"\n\n")
        crlf = self._buffer.find(b"\r\n\r\n")
        if crlf >= 0 and (lf < 0 or crlf < lf):
            return crlf, 4
        return lf, 2

    def _take_event(self, event: bytes) -> None:
        if event.startswith(b"data:") and b"\n" not in event and b"\r" not in event:
            self._take_payload(event[5:].strip())  # one data line: the common event
            return
        name: bytes | None = None
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                if line.startswith(b"event:"):
                    name = line[6:].strip()
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            # An event named as one that cannot change the count is not parsed (Anthropic's
            # ping and block start/stop, the Responses API's many lifecycle events).
            if name is not None and self._wants is not None and not self._wants(name):
                continue
            self._take_payload(payload)

    def _take_payload(self, payload: bytes) -> None:
        """One ``data:`` line's payload (stripped): the end marker, or a JSON object to read."""
        if payload == b"[DONE]":
            self.done = True
            return
        if self._text_events:
            step = _TEXT_PAYLOAD.fullmatch(payload)
            if step is not None:  # vLLM's decode step, read unparsed
                self.counted_tokens += _decode_step_tokens(step)
                return
        try:
            # One JSON value filling the payload, as json.loads takes it, without its encoding
            # sniffing (SSE is UTF-8) and wrappers: half the CPU of each chunk's parse.
            text = payload.decode()
            data, end = _decode(text)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return
        if end == len(text) and isinstance(data, dict):
            self._take_data(data)

    def _take_openai(self, data: dict[str, Any]) -> None:
        choices = data.get("choices")
        if isinstance(choices, list):
            # One pass over the choices for their content and finish reason (every streamed
            # chunk comes here): ``_content_tokens`` and ``_take_finish_reason`` in one.
            tokens = 0
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                tokens += _choice_tokens(choice)
                reason = choice.get("finish_reason")
                if isinstance(reason, str) and reason:
                    self.finish_reason = reason
            self.counted_tokens += tokens
        elif choices:
            self.counted_tokens += _content_tokens(data)
        usage = _usage(data)
        if usage is not None:
            self.usage = usage

    def _take_responses(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if not isinstance(kind, str):
            return
        if kind.endswith(".delta"):
            delta = data.get("delta")
            if kind != _RESPONSES_UNCOUNTED_DELTA and delta:
                self.counted_tokens += _step_tokens(_quarters_of(delta))
        elif kind in _RESPONSES_TERMINAL:
            self.done = True
            response = data.get("response")
            if isinstance(response, dict):
                usage = _responses_usage(response)
                if usage is not None:
                    self.usage = usage
                self.finish_reason = _responses_finish(response) or self.finish_reason

    def _take_anthropic(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "content_block_delta":
            delta = data.get("delta")
            if isinstance(delta, dict):
                text, thinking = delta.get("text"), delta.get("thinking")
                partial = delta.get("partial_json")
                if text or thinking or partial:
                    self.counted_tokens += _step_tokens(_quarters_of(text) + _quarters_of(thinking)
                                                        + _quarters_of(partial))
        elif kind == "message_delta":
            usage = data.get("usage")
            if isinstance(usage, dict):
                # Newer shapes (vLLM's among them) repeat the input here; else message_start's.
                prompt = _anthropic_prompt(usage) or self._prompt
                output = _int(usage.get("output_tokens"))
                if prompt is not None and output is not None:
                    self.usage = Usage(prompt[0], output, prompt[1])
            delta = data.get("delta")
            if isinstance(delta, dict):
                self.finish_reason = _anthropic_finish(delta.get("stop_reason")) \
                    or self.finish_reason
        elif kind == "message_start":
            message = data.get("message")
            usage = message.get("usage") if isinstance(message, dict) else None
            if isinstance(usage, dict):
                self._prompt = _anthropic_prompt(usage)
        elif kind == "message_stop":
            self.done = True

    def _take_finish_reason(self, data: dict) -> None:
        choices = data.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                reason = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(reason, str) and reason:
                    self.finish_reason = reason
