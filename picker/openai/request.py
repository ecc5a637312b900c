"""Parsing an inference request body: model, prompt size, output cap, streaming.

One parser per API kind (``picker.openai.paths.ApiKind``): OpenAI completions and chat
completions, the OpenAI Responses API, OpenAI embeddings (prompt only, no output) and Anthropic
Messages. Each says which body key holds the output cap, so a clamped cap is written where the
engine reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from picker.errors import BadRequest
from picker.openai.media import DEFAULT_COSTS, PartCosts
from picker.openai.paths import ApiKind
from picker.openai.tokens import text_tokens

CHARS_PER_TOKEN = 4
"""English BPE tokenizers average about four characters a token: what a body's size says of its
prompt before the body is read. A body's text is estimated by ``picker.openai.tokens`` (by
script), its images, audio and files by ``picker.openai.media`` (per model); the engine's
``usage.prompt_tokens`` settles the charge. No tokenizer is downloaded."""
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
    return text_tokens(text)


def _json_tokens(value: Any) -> int:
    """A structure as chat templates render it: JSON text (``tojson``, default separators)."""
    try:
        return text_tokens(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError):  # parsed JSON always dumps; be safe for other callers
        return 0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _url(value: Any) -> str:
    """An image or file reference: a string, or an object holding it under ``url``."""
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else ""


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _part_tokens(part: dict[str, Any], costs: PartCosts) -> int:
    """One content part or block of any API: text, image, audio, file, tool call or result."""
    tokens = 0
    for key in ("text", "thinking", "refusal"):
        if isinstance(part.get(key), str):
            tokens += _text_tokens(part[key])
    kind = part.get("type")
    if kind not in _TEXT_PARTS:
        tokens += _media_tokens(kind, part, costs)
    if part.get("content") is not None:  # tool_result, nested blocks
        tokens += _block_tokens(part["content"], costs)
    if isinstance(part.get("input"), dict):  # tool_use: its arguments as JSON
        tokens += _text_tokens(json.dumps(part["input"], separators=(",", ":")))
    return tokens


_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking",
                         "tool_use", "tool_result"})


def _media_tokens(kind: Any, part: dict[str, Any], costs: PartCosts) -> int:
    """An image, audio, video or file part (``picker.openai.media``); 0 for other kinds."""
    if kind in ("image_url", "input_image"):  # chat; Responses (a file_id: size unknown)
        return costs.image(_url(part.get("image_url")))
    if kind == "image":  # Anthropic: {"source": {"type": "base64", "data"} or a URL}
        source = _dict(part.get("source"))
        data = _str(source.get("data"))
        if source.get("type") == "base64" and data is not None:
            return costs.image(data, bare=True)
        return costs.image(_url(source))
    if kind == "input_audio":  # chat: {"input_audio": {"data", "format"}}
        data = _str(_dict(part.get("input_audio")).get("data"))
        return costs.audio_url() if data is None else costs.audio(data)
    if kind == "audio_url":
        return costs.audio_url()
    if kind == "video_url":  # a frame's worth at least: videos are not estimated further
        return costs.image_max_tokens
    if kind in ("file", "input_file"):  # chat {"file": {"file_data"}}; Responses flat
        holder = _dict(part.get("file")) if kind == "file" else part
        return costs.file(_str(holder.get("file_data")))
    if kind == "document":  # Anthropic: base64, plain text, nested content, or a URL
        source = _dict(part.get("source"))
        data = _str(source.get("data"))
        if source.get("type") == "text" and data is not None:
            return _text_tokens(data)
        if source.get("type") == "content":
            return _block_tokens(source.get("content"), costs)
        return costs.file(data)
    return 0


def _content_tokens(content: Any, costs: PartCosts = DEFAULT_COSTS) -> int:
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):  # multi-part content
        return sum(_part_tokens(p, costs) for p in content if isinstance(p, dict))
    return 0


TOOLS_OVERHEAD_TOKENS = 100
"""The instructions a chat template wraps function schemas in (Qwen 2.5's "# Tools ... within
<tools></tools> XML tags ..." is about 100 tokens, Llama 3.1's about 60)."""


def _structure_tokens(body: dict[str, Any], tools_key: str = "tools") -> int:
    """``tools`` (function schemas as the chat template renders them: JSON text, plus the
    template's instructions), a named ``tool_choice``, and a ``response_format`` /
    Responses ``text.format`` schema. vLLM does not put the schema in the prompt (it constrains
    decoding); it is counted as text anyway, which errs high by its size."""
    tokens = 0
    tools = body.get(tools_key)
    if isinstance(tools, list) and tools:
        tokens += TOOLS_OVERHEAD_TOKENS + _json_tokens(tools)
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        tokens += _json_tokens(choice)
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") != "text":
        tokens += _json_tokens(response_format)
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) \
            and text["format"].get("type") != "text":
        tokens += _json_tokens(text["format"])
    return tokens


def estimate_prompt_tokens(body: dict[str, Any], costs: PartCosts = DEFAULT_COSTS) -> int:
    """Prompt tokens of a chat or completions body, estimated without a tokenizer (>= 1)."""
    if "messages" in body:
        messages = body["messages"]
        total = sum(MESSAGE_OVERHEAD_TOKENS + _content_tokens(m.get("content"), costs)
                    + _tool_call_tokens(m)
                    for m in messages if isinstance(m, dict))
        total += _structure_tokens(body)
    else:
        total = _prompt_tokens(body.get("prompt", ""))
    return max(1, total)


def _tool_call_tokens(message: dict[str, Any]) -> int:
    """An assistant message's ``tool_calls``: the template renders each call's name and
    arguments."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return 0
    return _json_tokens(calls)


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


def _item_tokens(item: Any, costs: PartCosts = DEFAULT_COSTS) -> int:
    """A Responses ``input`` item: a message (content text or parts), a tool call or its output."""
    if isinstance(item, str):
        return _text_tokens(item)
    if not isinstance(item, dict):
        return 0
    tokens = MESSAGE_OVERHEAD_TOKENS
    content = item.get("content")
    if isinstance(content, list):
        # Parts: input_text / output_text carry "text", input_image / input_file their data;
        # tool results may nest further blocks.
        tokens += sum(_part_tokens(p, costs) for p in content if isinstance(p, dict))
    else:
        tokens += _content_tokens(content, costs)
    for key in ("output", "arguments"):  # function_call_output / function_call items
        value = item.get(key)
        if isinstance(value, str):
            tokens += _text_tokens(value)
    return tokens


def _block_tokens(content: Any, costs: PartCosts = DEFAULT_COSTS) -> int:
    """An Anthropic content: a string, or blocks (text, image, document, tool_use, tool_result
    with nested content, ...)."""
    if isinstance(content, str):
        return _text_tokens(content)
    if isinstance(content, list):
        return sum(_part_tokens(b, costs) for b in content if isinstance(b, dict))
    return 0


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


def parse_request(body: bytes, kind: ApiKind = ApiKind.CHAT,
                  part_costs: Callable[[str], PartCosts] | None = None) -> InferenceRequest:
    """Parse the JSON body of an inference request of ``kind``, or raise BadRequest naming the
    field. ``COMPLETIONS`` and ``CHAT`` accept either shape (``messages`` or ``prompt``).
    ``part_costs``: what an image, audio or file part costs for the body's model (the config's
    ``models``); default ``DEFAULT_COSTS``."""
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
    costs = DEFAULT_COSTS if part_costs is None else part_costs(model)
    if kind is ApiKind.RESPONSES:
        return _responses(model, data, costs)
    if kind is ApiKind.EMBEDDINGS:
        return _embeddings(model, data)
    if kind is ApiKind.MESSAGES:
        return _messages(model, data, costs)
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
    return InferenceRequest(model=model, prompt_tokens=estimate_prompt_tokens(data, costs),
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


def _responses(model: str, data: dict[str, Any], costs: PartCosts) -> InferenceRequest:
    """OpenAI Responses API: ``input`` (text or items), ``instructions``, ``max_output_tokens``."""
    if "input" not in data:
        raise BadRequest("'input' is required")
    items = data["input"]
    if isinstance(items, str):
        total = _text_tokens(items)
    elif isinstance(items, list):
        total = sum(_item_tokens(item, costs) for item in items)
    else:
        raise BadRequest("'input' must be a string or a list of input items")
    instructions = data.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string")
        total += MESSAGE_OVERHEAD_TOKENS + _text_tokens(instructions)
    total += _structure_tokens(data)
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


def _messages(model: str, data: dict[str, Any], costs: PartCosts) -> InferenceRequest:
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
        total += MESSAGE_OVERHEAD_TOKENS + _block_tokens(content, costs)
    system = data.get("system")
    if system is not None:
        if not isinstance(system, str | list):
            raise BadRequest("'system' must be a string or a list of text blocks")
        total += MESSAGE_OVERHEAD_TOKENS + _block_tokens(system, costs)
    total += _structure_tokens(data)
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
