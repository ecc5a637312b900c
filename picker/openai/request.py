"""Parsing an OpenAI request body: model, prompt size, output cap, streaming."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from picker.errors import BadRequest

CHARS_PER_TOKEN = 4
"""Prompt estimate: English BPE tokenizers average about four characters a token. The estimate only
orders the queue until the engine reports ``usage.prompt_tokens``; no tokenizer is downloaded."""
MESSAGE_OVERHEAD_TOKENS = 4
"""Chat template tokens added per message (role markers, separators)."""


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What the picker needs to know of a request to queue and charge it."""

    model: str
    prompt_tokens: int
    """Estimated from the body."""
    max_tokens: int | None
    stream: bool
    include_usage: bool
    """The client asked for a usage chunk at the end of the stream."""
    body: dict[str, Any]


def _text_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _content_tokens(content: Any) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):  # multi-part content: count the text parts
        return sum(_text_tokens(p.get("text", "")) for p in content
                   if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a chat or completions body, estimated without a tokenizer (>= 1)."""
    if "messages" in body:
        messages = body["messages"]
        total = sum(MESSAGE_OVERHEAD_TOKENS + _content_tokens(m.get("content"))
                    for m in messages if isinstance(m, dict))
    else:
        prompt = body.get("prompt", "")
        if isinstance(prompt, str):
            total = _text_tokens(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            total = len(prompt)  # already token ids
        elif isinstance(prompt, list):
            total = sum(_text_tokens(p) if isinstance(p, str) else len(p) for p in prompt
                        if isinstance(p, str | list))
        else:
            total = 0
    return max(1, total)


def parse_request(body: bytes) -> InferenceRequest:
    """Parse a ``/v1/completions`` or ``/v1/chat/completions`` body, or raise BadRequest."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string")
    if "messages" in data:
        if not isinstance(data["messages"], list) or not data["messages"]:
            raise BadRequest("'messages' must be a non-empty list")
    elif "prompt" not in data:
        raise BadRequest("one of 'messages' or 'prompt' is required")
    max_tokens = data.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = data.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise BadRequest("'max_tokens' must be a positive integer")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    options = data.get("stream_options") or {}
    include_usage = bool(stream and isinstance(options, dict) and options.get("include_usage"))
    return InferenceRequest(model=model, prompt_tokens=estimate_prompt_tokens(data),
                            max_tokens=max_tokens, stream=stream, include_usage=include_usage,
                            body=data)


def error_body(message: str, error_type: str, code: int | str | None = None) -> bytes:
    """An OpenAI-style error body."""
    return json.dumps({"error": {"message": message, "type": error_type, "param": None,
                                 "code": code}}).encode()
