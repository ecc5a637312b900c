"""Parsing an inference request body: model, prompt size, output cap, streaming.

One parser per API kind (``picker.openai.paths.ApiKind``): OpenAI completions and chat
completions, the OpenAI Responses API, OpenAI embeddings (prompt only, no output) and Anthropic
Messages. Each says which body key holds the output cap, so a clamped cap is written where the
engine reads it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from picker.errors import BadRequest
from picker.openai.paths import ApiKind

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
    """The output cap the body sets (None: none); 0 for embeddings, which produce no output."""
    stream: bool
    include_usage: bool
    """The response will end with usage (chat and completions: the client asked for a usage chunk;
    Responses and Messages streams always report it)."""
    body: dict[str, Any]
    kind: ApiKind = ApiKind.CHAT
    output_cap_key: str | None = "max_tokens"
    """The body key holding the output cap (``max_tokens``, ``max_completion_tokens``,
    ``max_output_tokens``), where a clamped cap must be written; None for embeddings."""
    choices: int = 1
    """Output sequences the engine generates: ``max(n, best_of)`` (chat and completions), each up
    to the output cap."""


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
        total = _prompt_tokens(body.get("prompt", ""))
    return max(1, total)


def _prompt_tokens(prompt: Any) -> int:
    """A completions ``prompt`` or an embeddings ``input``: text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)  # already token ids
    if isinstance(prompt, list):
        return sum(_text_tokens(p) if isinstance(p, str) else len(p) for p in prompt
                   if isinstance(p, str | list))
    return 0


def _item_tokens(item: Any) -> int:
    """A Responses ``input`` item: a message (content text or parts), a tool call or its output."""
    if isinstance(item, str):
        return _text_tokens(item)
    if not isinstance(item, dict):
        return 0
    tokens = MESSAGE_OVERHEAD_TOKENS
    content = item.get("content")
    if isinstance(content, list):
        # Parts: input_text / output_text carry "text"; tool results may nest further blocks.
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    tokens += _text_tokens(text)
                elif part.get("content") is not None:
                    tokens += _content_tokens(part["content"])
    else:
        tokens += _content_tokens(content)
    for key in ("output", "arguments"):  # function_call_output / function_call items
        value = item.get(key)
        if isinstance(value, str):
            tokens += _text_tokens(value)
    return tokens


def _block_tokens(content: Any) -> int:
    """An Anthropic content: a string, or blocks (text, tool_result with nested content, ...)."""
    if isinstance(content, str):
        return _text_tokens(content)
    tokens = 0
    if isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                continue
            for key in ("text", "thinking"):
                if isinstance(block.get(key), str):
                    tokens += _text_tokens(block[key])
            if block.get("content") is not None:  # tool_result
                tokens += _block_tokens(block["content"])
            if isinstance(block.get("input"), dict):  # tool_use: its arguments as JSON
                tokens += _text_tokens(json.dumps(block["input"], separators=(",", ":")))
    return tokens


def _positive_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise BadRequest(f"'{key}' must be a positive integer")
    return value


def _stream(data: dict[str, Any]) -> bool:
    stream = data.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    return stream


def parse_request(body: bytes, kind: ApiKind = ApiKind.CHAT) -> InferenceRequest:
    """Parse the JSON body of an inference request of ``kind``, or raise BadRequest naming the
    field. ``COMPLETIONS`` and ``CHAT`` accept either shape (``messages`` or ``prompt``)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        # Thousands of nested brackets: valid JSON that no inference API uses.
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string")
    if kind is ApiKind.RESPONSES:
        return _responses(model, data)
    if kind is ApiKind.EMBEDDINGS:
        return _embeddings(model, data)
    if kind is ApiKind.MESSAGES:
        return _messages(model, data)
    if "messages" in data:
        if not isinstance(data["messages"], list) or not data["messages"]:
            raise BadRequest("'messages' must be a non-empty list")
    elif "prompt" not in data:
        raise BadRequest("one of 'messages' or 'prompt' is required")
    cap_key = "max_tokens"
    max_tokens = data.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = data.get("max_tokens")
    else:
        cap_key = "max_completion_tokens"
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise BadRequest(f"'{cap_key}' must be a positive integer")
    stream = _stream(data)
    options = data.get("stream_options") or {}
    include_usage = bool(stream and isinstance(options, dict) and options.get("include_usage"))
    return InferenceRequest(model=model, prompt_tokens=estimate_prompt_tokens(data),
                            max_tokens=max_tokens, stream=stream, include_usage=include_usage,
                            body=data, kind=kind, output_cap_key=cap_key,
                            choices=_choices(data))


def _choices(data: dict[str, Any]) -> int:
    """``max(n, best_of)``: the sequences vLLM generates (``best_of`` of them, ``n`` returned),
    each costing output up to the cap. vLLM refuses ``best_of`` below ``n``; so does this."""
    n = _positive_int(data, "n") or 1
    best_of = _positive_int(data, "best_of")
    if best_of is None:
        return n
    if best_of < n:
        raise BadRequest(f"'best_of' ({best_of}) must be at least 'n' ({n})")
    return best_of


def _responses(model: str, data: dict[str, Any]) -> InferenceRequest:
    """OpenAI Responses API: ``input`` (text or items), ``instructions``, ``max_output_tokens``."""
    if "input" not in data:
        raise BadRequest("'input' is required")
    items = data["input"]
    if isinstance(items, str):
        total = _text_tokens(items)
    elif isinstance(items, list):
        total = sum(_item_tokens(item) for item in items)
    else:
        raise BadRequest("'input' must be a string or a list of input items")
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string")
        total += MESSAGE_OVERHEAD_TOKENS + _text_tokens(instructions)
    stream = _stream(data)
    return InferenceRequest(model=model, prompt_tokens=max(1, total),
                            max_tokens=_positive_int(data, "max_output_tokens"), stream=stream,
                            include_usage=stream, body=data, kind=ApiKind.RESPONSES,
                            output_cap_key="max_output_tokens")


def _embeddings(model: str, data: dict[str, Any]) -> InferenceRequest:
    """OpenAI embeddings: ``input`` is text, texts, token ids or lists of ids; no output."""
    if "input" not in data:
        raise BadRequest("'input' is required")
    value = data["input"]
    if isinstance(value, str):
        if not value:
            raise BadRequest("'input' must not be an empty string")
    elif isinstance(value, list) and value:
        if not (all(isinstance(v, str) for v in value) or all(_is_ids(v) for v in value)
                or _is_ids(value)):
            raise BadRequest("'input' must be a string, a list of strings, a list of token ids, "
                             "or a list of lists of token ids")
    else:
        raise BadRequest("'input' must be a non-empty string or list")
    return InferenceRequest(model=model, prompt_tokens=max(1, _prompt_tokens(value)),
                            max_tokens=0, stream=False, include_usage=False, body=data,
                            kind=ApiKind.EMBEDDINGS, output_cap_key=None)


def _is_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def _messages(model: str, data: dict[str, Any]) -> InferenceRequest:
    """Anthropic Messages: ``messages``, ``system`` (text or text blocks), required
    ``max_tokens``."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list")
    total = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"'messages[{i}]' must be an object")
        content = message.get("content")
        if not isinstance(content, str | list):
            raise BadRequest(f"'messages[{i}].content' must be a string or a list of blocks")
        total += MESSAGE_OVERHEAD_TOKENS + _block_tokens(content)
    system = data.get("system")
    if system is not None:
        if not isinstance(system, str | list):
            raise BadRequest("'system' must be a string or a list of text blocks")
        total += MESSAGE_OVERHEAD_TOKENS + _block_tokens(system)
    if data.get("max_tokens") is None:
        raise BadRequest("'max_tokens' is required")
    max_tokens = _positive_int(data, "max_tokens")
    stream = _stream(data)
    return InferenceRequest(model=model, prompt_tokens=max(1, total), max_tokens=max_tokens,
                            stream=stream, include_usage=stream, body=data,
                            kind=ApiKind.MESSAGES, output_cap_key="max_tokens")


def error_body(message: str, error_type: str, code: str | None = None,
               param: str | None = None) -> bytes:
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, in its key order.

    ``code`` is a string or null, as OpenAI sends it (``rate_limit_exceeded``), never the HTTP
    status: clients such as the ``openai`` library read it as ``str | None``.
    """
    return json.dumps({"error": {"message": message, "type": error_type, "param": param,
                                 "code": code}}).encode()


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         405: "invalid_request_error", 413: "request_too_large",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                         529: "overloaded_error"}
"""Anthropic's error ``type`` for each HTTP status (its Messages API documents one per status)."""


def anthropic_error_body(message: str, status: int) -> bytes:
    """Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``: what clients of
    ``/v1/messages`` (the ``anthropic`` libraries) parse."""
    return json.dumps({"type": "error", "error": {
        "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}).encode()
