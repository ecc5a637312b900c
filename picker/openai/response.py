"""Metering a response as it streams: output tokens per SSE event, ``usage`` when present."""

from __future__ import annotations

import json
from typing import Any

from picker.core.request import Usage

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


def _content_tokens(event: dict[str, Any]) -> int:
    """Output tokens an SSE event carries: one per choice with new content (one decode step)."""
    tokens = 0
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                tokens += 1
        elif choice.get("text"):
            tokens += 1
    return tokens


class ResponseMeter:
    """Counts what a response delivers. Feed it the body chunks in order.

    Streaming (``text/event-stream``): each ``data:`` event with new content counts one output
    token, the way vLLM streams one decode step per event; a ``usage`` object, when the engine sends
    one, is kept and wins at the end. Otherwise the body is buffered and its ``usage`` read at the
    end.
    """

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self.counted_tokens = 0
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        """The last ``finish_reason`` the response gave (``stop``, ``length``, ...)."""
        self.done = False
        """The stream's ``data: [DONE]`` was seen."""
        self._buffer = bytearray()
        self._overflow = False

    def feed(self, chunk: bytes) -> int:
        """Take the next body chunk; returns the output tokens it newly delivered."""
        if not self.streaming:
            if not self._overflow:
                self._buffer += chunk
                if len(self._buffer) > MAX_BUFFERED_BYTES:
                    self._overflow = True
                    self._buffer.clear()
            return 0
        self._buffer += chunk
        before = self.counted_tokens
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
                self.usage = _usage(data)
                self._take_finish_reason(data)
            self._buffer.clear()
        elif self.streaming and self._buffer.strip():
            self._take_event(bytes(self._buffer))
            self._buffer.clear()
        return self.usage

    def _event_end(self) -> tuple[int, int]:
        lf = self._buffer.find(b"\n\n")
        crlf = self._buffer.find(b"\r\n\r\n")
        if crlf >= 0 and (lf < 0 or crlf < lf):
            return crlf, 4
        return lf, 2

    def _take_event(self, event: bytes) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                data = json.loads(payload)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(data, dict):
                self.counted_tokens += _content_tokens(data)
                self._take_finish_reason(data)
                usage = _usage(data)
                if usage is not None:
                    self.usage = usage

    def _take_finish_reason(self, data: dict) -> None:
        choices = data.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                reason = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(reason, str) and reason:
                    self.finish_reason = reason
