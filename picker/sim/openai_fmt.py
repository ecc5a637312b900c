"""The OpenAI/vLLM wire format of the simulated model server: what a request asks, what to answer.

It answers three questions for ``picker.sim.server``, with no I/O:

* **Which prompt tokens is this request?** Token ids from ``picker.sim.tokenizer`` (a
  deterministic byte-level-BPE-like tokenizer: English about 4 characters a token, CJK one a
  character, emoji and other non-ASCII symbols one a UTF-8 byte, whitespace counted; its
  docstring states the rule), so ``"Hello, world!"`` is 4 tokens and the same text is the same
  ids: the engine's prefix cache hashes them. The count is the ids' length.

  - ``/v1/completions``: ``prompt`` is a string (its tokens, at least 1), a list of token ids, or
    a list of strings or of token-id lists: several prompts, each its own engine request and
    choice (as vLLM serves a batch), each checked against the context alone, usage over all.
  - ``/v1/chat/completions``: ``tools`` (their JSON text, first, as a template renders them), then
    per message ``CHAT_TOKENS_PER_MESSAGE`` (4) template tokens (3 before the content: start,
    role, separator; 1 after) around the content's tokens, then ``CHAT_REPLY_TOKENS`` (3) for the
    assistant reply header. A content may be a string, null, or a list of parts: ``text`` parts
    count their text, image parts (``image_url``, ``image``, ``input_image``) the server's
    ``--image-tokens`` each (576 by default, LLaVA-1.5's), ids distinct per image; other parts 0.
  - ``/v1/responses`` (OpenAI Responses API): ``input`` is a string (one user message) or a list
    of items (messages whose ``content`` is a string or parts with ``text`` or an image);
    ``instructions`` is one more message, ``tools`` as chat; then as chat.
  - ``/v1/messages`` (Anthropic Messages): ``tools``, ``system`` (a string or text blocks, one more
    message) and ``messages`` (content a string or blocks: ``text`` and ``image`` blocks count);
    then as chat.
  - ``/v1/embeddings``: ``input`` is a string, a list of strings, a list of token ids or a list of
    lists of ids; the tokens of all of them (a batch is one engine request).

* **How many choices?** ``n`` (chat and completions; default 1) samples of each prompt, each its
  own engine request (added in order, so the later ones hit the first's prompt blocks): choice
  ``i`` answers prompt ``i // n``; usage counts each prompt once and every choice's output.

* **How many tokens will it generate?** ``max_tokens`` (chat: ``max_completion_tokens`` first,
  then ``max_tokens``; default ``DEFAULT_MAX_TOKENS`` = 16) caps the output. With vLLM's extension
  ``ignore_eos: true`` the output is exactly ``max_tokens`` long; otherwise its length is
  ``1 + H % max_tokens`` where ``H`` is a SHA-256 hash of the request's ``seed`` (default 0) and
  its prompt (the ``prompt`` or ``messages`` JSON; sample ``j > 0`` of ``n`` hashes ``j`` in too),
  raised to vLLM's ``min_tokens`` if that is larger. ``finish_reason`` is ``length`` when the
  output reached ``max_tokens``, else ``stop``.
  The text is filler words from ``FILLER``, one word (one token by the rule above) per step.
  The Responses API caps with ``max_output_tokens`` (default 16); Anthropic Messages with
  ``max_tokens``, which it requires (400 without it). Embeddings generate nothing: the engine
  prefills the prompt and the request ends in that step, without a decode step.

* **What do the responses, stream chunks and errors look like?** vLLM's shapes, built by the
  functions below: chat and completions chunks as ``data:`` lines ending with ``data: [DONE]``;
  Responses API events (``event: response.output_text.delta`` ... ``response.completed``, or
  ``response.incomplete`` when the output reached its cap) with ``usage.input_tokens`` /
  ``output_tokens``; Anthropic events (``message_start``, ``ping``, ``content_block_*``,
  ``message_delta`` with ``usage`` and ``stop_reason``, ``message_stop``) and Anthropic's error
  body on ``/v1/messages``.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from picker.openai.request import ANTHROPIC_ERROR_TYPES
from picker.sim import tokenizer

CHAT_TOKENS_PER_MESSAGE = 4
CHAT_REPLY_TOKENS = 3
DEFAULT_MAX_TOKENS = 16
FILLER = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "rests",
          "under", "a", "warm", "sun", "again")

CHAT = "chat"
COMPLETION = "completion"
RESPONSES = "responses"
EMBEDDINGS = "embeddings"
MESSAGES = "messages"
EMBEDDING_DIMENSIONS = 8


class ApiError(Exception):
    """An OpenAI-style error answer: HTTP status, message, vLLM error type and offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self, kind: str | None = None) -> dict[str, Any]:
        if kind == MESSAGES:
            return anthropic_error_body(self.status, self.message)
        return error_body(self.status, self.message, self.param)


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def count_text_tokens(text: str) -> int:
    """Tokens in ``text`` by the simulated tokenizer (0 for an empty text)."""
    return tokenizer.count(text)


_START, _END, _SEP = (tokenizer.special_id(n) for n in ("start_header", "eot", "end_header"))
_ASSISTANT = tokenizer.special_id("role:assistant")
_EMPTY_PROMPT = (tokenizer.special_id("bos"),)
IMAGE_PARTS = ("image_url", "image", "input_image")
"""Content part types that are an image (chat, Anthropic, Responses)."""


def image_ids(part: dict[str, Any], image_tokens: int) -> list[int]:
    """An image part's ``image_tokens`` placeholder ids, distinct per image (as vLLM's block
    hashes carry the image's hash): the same image gives the same ids."""
    digest = hashlib.sha256(json.dumps(part, sort_keys=True).encode()).digest()
    base = int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
    return [(base + i) & 0x7FFFFFFF for i in range(image_tokens)]


def tools_ids(tools: object) -> list[int]:
    """A request's ``tools`` (or ``functions``) as the template renders them: their JSON text."""
    if tools is None or tools == []:
        return []
    return tokenizer.encode(json.dumps(tools))


def _message_ids(role: str, content_ids: list[int]) -> list[int]:
    # The template around one message: 3 tokens before its content, 1 after (4 a message).
    return [_START, tokenizer.special_id("role:" + role), _SEP, *content_ids, _END]


def completion_prompts(prompt: object) -> list[tuple[int, ...]]:
    """The prompts of a ``/v1/completions`` ``prompt`` field: a string, a list of token ids, or a
    non-empty list of strings or of token-id lists (several prompts); raises ApiError."""
    if isinstance(prompt, list):
        if prompt and all(_is_int(t) for t in prompt):
            return [tuple(prompt)]
        if prompt and all(isinstance(p, str) for p in prompt):
            return [_text_prompt(p) for p in prompt]
        if prompt and all(isinstance(p, list) and p and all(_is_int(t) for t in p)
                          for p in prompt):
            return [tuple(p) for p in prompt]
    elif isinstance(prompt, str):
        return [_text_prompt(prompt)]
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of strings or "
                   "of token-id lists", "prompt")


def _text_prompt(text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text)) or _EMPTY_PROMPT


def completion_prompt_tokens(prompt: object) -> int:
    """Prompt tokens of a ``/v1/completions`` ``prompt`` field, all its prompts (raises
    ApiError)."""
    return sum(len(p) for p in completion_prompts(prompt))


def chat_prompt_ids(messages: object, tools: object = None,
                    image_tokens: int = 576) -> list[int]:
    """The prompt's ids of a ``/v1/chat/completions`` ``messages`` and ``tools`` (raises
    ApiError)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    ids = tools_ids(tools)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role",
                           "messages")
        ids += _message_ids(message["role"], _content_ids(message.get("content"), i,
                                                          image_tokens))
    return [*ids, _START, _ASSISTANT, _SEP]


def chat_prompt_tokens(messages: object, tools: object = None, image_tokens: int = 576) -> int:
    """Prompt tokens of a ``/v1/chat/completions`` ``messages`` field (raises ApiError)."""
    return len(chat_prompt_ids(messages, tools, image_tokens))


def _content_ids(content: object, index: int, image_tokens: int) -> list[int]:
    if content is None:
        return []
    if isinstance(content, str):
        return tokenizer.encode(content)
    if isinstance(content, list):
        ids: list[int] = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, f"messages[{index}].content parts must be objects",
                               "messages")
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                ids += tokenizer.encode(part["text"])
            elif part.get("type") in IMAGE_PARTS:
                ids += image_ids(part, image_tokens)
        return ids
    raise ApiError(400, f"messages[{index}].content must be a string, a list or null",
                   "messages")


def output_length(prompt_key: str, max_tokens: int, *, ignore_eos: bool = False,
                  min_tokens: int = 0, seed: int = 0) -> int:
    """The number of tokens a request generates (see the module docstring)."""
    if ignore_eos:
        return max_tokens
    digest = hashlib.sha256(f"{seed}|{prompt_key}".encode()).digest()
    length = 1 + int.from_bytes(digest[:8], "big") % max_tokens
    return min(max_tokens, max(length, min_tokens))


def token_text(kind: str, index: int) -> str:
    """Text of the ``index``-th generated token (0-based): one filler word."""
    word = FILLER[index % len(FILLER)]
    return word if kind == CHAT and index == 0 else " " + word


def generated_text(kind: str, tokens: int) -> str:
    return "".join(token_text(kind, i) for i in range(tokens))


_FILLER_IDS = {(first, i): tokenizer.encode(word if first else " " + word)[0]
               for i, word in enumerate(FILLER) for first in (True, False)}


def generated_ids(kind: str, tokens: int) -> list[int]:
    """The token ids of the first ``tokens`` generated tokens: each filler word is one token of
    the simulated tokenizer, so a conversation resending this reply gives the same ids."""
    size = len(FILLER)
    return [_FILLER_IDS[(kind == CHAT and i == 0, i % size)] for i in range(tokens)]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the server needs from one completion request body."""

    kind: str
    model: str | None
    prompt_tokens: int
    max_tokens: int
    output_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    priority: int
    prompts: tuple[tuple[int, ...], ...] = ()
    """Each prompt's token ids (several on ``/v1/completions`` with a list of prompts)."""
    outputs: tuple[int, ...] = ()
    """Tokens each choice generates, ``n`` per prompt in prompt order (choice ``i`` answers
    prompt ``i // n``); ``output_tokens`` is the first's."""
    n: int = 1

    @property
    def finish_reason(self) -> str:
        return "length" if self.output_tokens >= self.max_tokens else "stop"

    def finish_reason_of(self, choice: int) -> str:
        return "length" if self.output_of(choice) >= self.max_tokens else "stop"

    def output_of(self, choice: int) -> int:
        return self.outputs[choice] if self.outputs else self.output_tokens

    @property
    def choices(self) -> int:
        return len(self.outputs) or 1

    @property
    def completion_tokens(self) -> int:
        """The output of every choice together (usage's ``completion_tokens``)."""
        return sum(self.outputs) if self.outputs else self.output_tokens

    @property
    def longest_prompt(self) -> int:
        return max(map(len, self.prompts)) if self.prompts else self.prompt_tokens


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int) -> ApiError:
    """vLLM's 400 for a request whose prompt plus ``max_tokens`` exceeds the context (its
    wording, from ``OpenAIServing._validate_input``)."""
    return ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. "
                    f"This model's maximum context length is {max_model_len} tokens and your "
                    f"request has {prompt_tokens} input tokens ({max_tokens} > {max_model_len} "
                    f"- {prompt_tokens}).")


def parse_request(kind: str, body: object, max_model_len: int | None = None,
                  image_tokens: int = 576) -> ParsedRequest:
    """Validate a decoded JSON body of ``kind`` (``chat`` or ``completion``); raises ApiError.

    ``max_model_len``: the context (prompt + generated tokens) a request must fit, as vLLM's
    ``--max-model-len``: an explicit ``max_tokens`` beyond it is refused
    (``context_length_error``), a defaulted one is cut to what is left (each prompt of several
    checked alone). ``image_tokens``: the prompt tokens of one image part."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if kind == EMBEDDINGS:
        return _parse_embeddings(model, body)
    tools = body.get("tools")
    if kind == RESPONSES:
        prompts = [tuple(responses_prompt_ids(body.get("input"), body.get("instructions"),
                                              tools, image_tokens))]
        keys = [json.dumps([body.get("instructions"), body.get("input")], sort_keys=True)]
        max_tokens = _optional_int(body, "max_output_tokens", 1)
    elif kind == MESSAGES:
        prompts = [tuple(messages_prompt_ids(body.get("messages"), body.get("system"), tools,
                                             image_tokens))]
        keys = [json.dumps([body.get("system"), body.get("messages")], sort_keys=True)]
        max_tokens = _optional_int(body, "max_tokens", 1)
        if max_tokens is None:
            raise ApiError(400, "max_tokens: Field required", "max_tokens")
    elif kind == CHAT:
        prompts = [tuple(chat_prompt_ids(body.get("messages"), tools, image_tokens))]
        keys = [json.dumps(body.get("messages"), sort_keys=True)]
        max_tokens = _optional_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _optional_int(body, "max_tokens", 1)
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", "prompt")
        prompts = completion_prompts(body["prompt"])
        keys = [json.dumps(body["prompt"], sort_keys=True)] if len(prompts) == 1 \
            else [json.dumps(p) for p in body["prompt"]]
        max_tokens = _optional_int(body, "max_tokens", 1)
    prompt_tokens = max(map(len, prompts))  # the context check is per prompt
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
        if max_model_len is not None and prompt_tokens < max_model_len:
            max_tokens = min(max_tokens, max_model_len - prompt_tokens)
    elif max_model_len is not None and prompt_tokens < max_model_len \
            and max_tokens > max_model_len - prompt_tokens:
        # (A prompt that alone reaches the context gets the server's own prompt error.)
        raise context_length_error(max_model_len, prompt_tokens, max_tokens)
    # n parallel samples of each prompt (chat and completions; the other APIs have no n).
    n = (_optional_int(body, "n", 1) or 1) if kind in (CHAT, COMPLETION) else 1
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options") if kind in (CHAT, COMPLETION) else None
    include_usage = continuous = False
    if options is not None:
        if not stream:
            raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                           "stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        include_usage = _optional_bool(options, "include_usage", "stream_options")
        # vLLM sends continuous usage only together with include_usage.
        continuous = include_usage and _optional_bool(options, "continuous_usage_stats",
                                                      "stream_options")
    min_tokens = _optional_int(body, "min_tokens", 0) or 0
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) must be less than or equal to "
                       f"max_tokens ({max_tokens})", "min_tokens")
    seed = _optional_int(body, "seed", None) or 0
    # vLLM's Anthropic request has no ``priority`` field: a body's own is dropped unread.
    priority = 0 if kind == MESSAGES else _optional_int(body, "priority", None) or 0
    ignore_eos = _optional_bool(body, "ignore_eos")
    # The first sample of a prompt keeps the prompt's own length; sample j > 0 hashes j in too.
    outputs = tuple(output_length(key if j == 0 else f"{key}|{j}", max_tokens,
                                  ignore_eos=ignore_eos, min_tokens=min_tokens, seed=seed)
                    for key in keys for j in range(n))
    return ParsedRequest(kind=kind, model=model, prompt_tokens=sum(map(len, prompts)),
                         max_tokens=max_tokens, output_tokens=outputs[0], stream=stream,
                         include_usage=include_usage, continuous_usage=continuous,
                         priority=priority, prompts=tuple(prompts), outputs=outputs, n=n)


def _parse_embeddings(model: str | None, body: dict[str, Any]) -> ParsedRequest:
    ids = tuple(embeddings_prompt_ids(body.get("input")))
    return ParsedRequest(kind=EMBEDDINGS, model=model, prompt_tokens=len(ids),
                         max_tokens=0, output_tokens=0, stream=False, include_usage=False,
                         continuous_usage=False,
                         priority=_optional_int(body, "priority", None) or 0, prompts=(ids,),
                         outputs=(0,))


def responses_prompt_ids(items: object, instructions: object, tools: object = None,
                        image_tokens: int = 576) -> list[int]:
    """The prompt's ids of a ``/v1/responses`` ``input``, ``instructions`` and ``tools``."""
    if isinstance(items, str):
        messages: list[object] = [{"role": "user", "content": items}]
    elif isinstance(items, list) and items:
        messages = [{"role": "user", "content": item} if isinstance(item, str) else item
                    for item in items]
    else:
        raise ApiError(400, "input must be a string or a non-empty list of items", "input")
    ids = tools_ids(tools)
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "instructions must be a string", "instructions")
        ids += _message_ids("system", tokenizer.encode(instructions))
    for i, item in enumerate(messages):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be a string or an object", "input")
        role = item.get("role") if isinstance(item.get("role"), str) else "user"
        ids += _message_ids(str(role), _parts_ids(item.get("content"), "input", i,
                                                  image_tokens))
    return [*ids, _START, _ASSISTANT, _SEP]


def responses_prompt_tokens(items: object, instructions: object) -> int:
    """Prompt tokens of a ``/v1/responses`` ``input`` and ``instructions`` (raises ApiError)."""
    return len(responses_prompt_ids(items, instructions))


def messages_prompt_ids(messages: object, system: object, tools: object = None,
                        image_tokens: int = 576) -> list[int]:
    """The prompt's ids of a ``/v1/messages`` ``messages``, ``system`` and ``tools``."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: must be a non-empty list", "messages")
    ids = tools_ids(tools)
    if system is not None:
        if not isinstance(system, str | list):
            raise ApiError(400, "system: must be a string or a list of text blocks", "system")
        ids += _message_ids("system", _parts_ids(system, "system", 0, image_tokens))
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages.{i}: role must be user or assistant", "messages")
        ids += _message_ids(message["role"], _parts_ids(message.get("content"), "messages", i,
                                                        image_tokens))
    return [*ids, _START, _ASSISTANT, _SEP]


def messages_prompt_tokens(messages: object, system: object) -> int:
    """Prompt tokens of a ``/v1/messages`` ``messages`` and ``system`` (raises ApiError)."""
    return len(messages_prompt_ids(messages, system))


def _parts_ids(content: object, field: str, index: int, image_tokens: int) -> list[int]:
    """A content that is a string, null, or a list of parts/blocks whose ``text`` counts (and
    images at ``image_tokens`` each)."""
    if content is None:
        return []
    if isinstance(content, str):
        return tokenizer.encode(content)
    if isinstance(content, list):
        ids: list[int] = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, f"{field}[{index}] content parts must be objects", field)
            if isinstance(part.get("text"), str):
                ids += tokenizer.encode(part["text"])
            elif part.get("type") in IMAGE_PARTS:
                ids += image_ids(part, image_tokens)
        return ids
    raise ApiError(400, f"{field}[{index}] content must be a string or a list", field)


def embeddings_prompt_ids(value: object) -> list[int]:
    """The ids of a ``/v1/embeddings`` ``input``, all its inputs in order (raises ApiError)."""
    if isinstance(value, str) and value:
        return list(_text_prompt(value))
    if isinstance(value, list) and value:
        if all(_is_int(t) for t in value):
            return list(value)
        if all(isinstance(v, str) and v for v in value):
            return [t for v in value for t in _text_prompt(v)]
        if all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
            return [t for v in value for t in v]
    raise ApiError(400, "input must be a non-empty string, a list of strings, a list of token "
                   "ids or a list of lists of token ids", "input")


def embeddings_prompt_tokens(value: object) -> int:
    """Prompt tokens of a ``/v1/embeddings`` ``input`` (raises ApiError)."""
    return len(embeddings_prompt_ids(value))


def embeddings_count(value: object) -> int:
    """How many embeddings an (already validated) ``input`` asks for."""
    if isinstance(value, list) and not all(_is_int(t) for t in value):
        return len(value)
    return 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: dict[str, Any], name: str, minimum: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise ApiError(400, f"{name} must be an integer", name)
    if minimum is not None and value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}", name)
    return value


def _optional_bool(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean", param or name)
    return value


# -- responses --


_ID_PREFIX = {CHAT: "chatcmpl-", COMPLETION: "cmpl-", RESPONSES: "resp_", EMBEDDINGS: "embd-",
              MESSAGES: "msg_"}


def new_id(kind: str) -> str:
    return _ID_PREFIX[kind] + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, details: bool = True,
          cached_tokens: int = 0) -> dict[str, Any]:
    """An OpenAI ``usage`` object; ``details`` adds ``prompt_tokens_details.cached_tokens``
    (the prompt tokens the engine found in its prefix cache)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                           "total_tokens": prompt_tokens + completion_tokens,
                           "completion_tokens": completion_tokens}
    if details:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def full_response(req: ParsedRequest, response_id: str, created: int, model: str,
                  cached_tokens: int = 0) -> dict:
    """The non-streaming response body (not for embeddings: ``embeddings_response``): one choice
    per prompt and sample, usage over them all."""
    if req.kind == RESPONSES:
        return responses_object(req, response_id, created, model, "completed", cached_tokens)
    if req.kind == MESSAGES:
        return {"id": response_id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": generated_text(CHAT, req.output_tokens)}],
                "stop_reason": anthropic_stop_reason(req), "stop_sequence": None,
                "usage": {"input_tokens": req.prompt_tokens,
                          "output_tokens": req.output_tokens}}
    choices: list[dict[str, Any]] = []
    for index in range(req.choices):
        text = generated_text(req.kind, req.output_of(index))
        if req.kind == CHAT:
            choices.append({
                "index": index,
                "message": {"role": "assistant", "content": text, "refusal": None,
                            "tool_calls": [], "reasoning_content": None},
                "logprobs": None, "finish_reason": req.finish_reason_of(index),
                "stop_reason": None})
        else:
            choices.append({"index": index, "text": text, "logprobs": None,
                            "finish_reason": req.finish_reason_of(index), "stop_reason": None,
                            "prompt_logprobs": None})
    obj = "chat.completion" if req.kind == CHAT else "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": choices, "system_fingerprint": None,
            "usage": usage(req.prompt_tokens, req.completion_tokens,
                           cached_tokens=cached_tokens)}


class StreamFormatter:
    """Builds the SSE events of one streamed response, in vLLM's shapes."""

    def __init__(self, req: ParsedRequest, response_id: str, model: str,
                 created: int | None = None) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.object = "chat.completion.chunk" if req.kind == CHAT else "text_completion"

    def _event(self, choices: list[dict[str, Any]], completion_tokens: int | None) -> bytes:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created,
                                 "model": self.model, "choices": choices}
        if completion_tokens is not None:
            chunk["usage"] = usage(self.req.prompt_tokens, completion_tokens, details=False)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def first(self, choice_index: int = 0) -> bytes:
        """Chat only: the chunk announcing the assistant role (sent with the first token)."""
        choice = {"index": choice_index, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return self._event([choice], 0 if self.req.continuous_usage else None)

    def token(self, index: int, choice_index: int = 0) -> bytes:
        """The chunk of the ``index``-th token (1-based) of a choice; the last one has the
        finish reason."""
        req = self.req
        last = index >= req.output_of(choice_index)
        text = token_text(req.kind, index - 1)
        finish = req.finish_reason_of(choice_index) if last else None
        if req.kind == CHAT:
            choice: dict[str, Any] = {"index": choice_index, "delta": {"content": text},
                                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": choice_index, "text": text, "logprobs": None,
                      "finish_reason": finish}
        if last:
            choice["stop_reason"] = None
        return self._event([choice], index if req.continuous_usage else None)

    def usage_chunk(self, cached_tokens: int = 0) -> bytes:
        """The final ``choices: []`` chunk carrying the whole usage (``include_usage``)."""
        chunk = {"id": self.id, "object": self.object, "created": self.created,
                 "model": self.model, "choices": [],
                 "usage": usage(self.req.prompt_tokens, self.req.completion_tokens,
                                cached_tokens=cached_tokens)}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"


def anthropic_stop_reason(req: ParsedRequest) -> str:
    return "max_tokens" if req.finish_reason == "length" else "end_turn"


def responses_usage(prompt_tokens: int, output_tokens: int,
                    cached_tokens: int = 0) -> dict[str, Any]:
    """The Responses API ``usage`` object."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def _responses_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": None}]}


def responses_object(req: ParsedRequest, response_id: str, created: int, model: str,
                     phase: str, cached_tokens: int = 0) -> dict[str, Any]:
    """The Responses API ``response`` object: ``phase`` ``in_progress`` (no output yet) or
    ``completed`` (its status then ``completed``, or ``incomplete`` when the output reached
    ``max_output_tokens``)."""
    done = phase == "completed"
    incomplete = done and req.finish_reason == "length"
    status = ("incomplete" if incomplete else "completed") if done else "in_progress"
    output = [_responses_message("msg_" + response_id.removeprefix("resp_"),
                                 generated_text(CHAT, req.output_tokens), "completed")] \
        if done else []
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": output, "max_output_tokens": req.max_tokens, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0,
            "usage": responses_usage(req.prompt_tokens, req.output_tokens, cached_tokens)
            if done else None}


def embeddings_response(req: ParsedRequest, body: dict[str, Any], response_id: str,
                        created: int, model: str) -> dict[str, Any]:
    """vLLM's embeddings body: one vector per input, ``usage`` with prompt tokens only."""
    data = []
    for index in range(embeddings_count(body.get("input"))):
        digest = hashlib.sha256(f"{index}|{json.dumps(body.get('input'))}".encode()).digest()
        vector = [round(b / 255.0 - 0.5, 6) for b in digest[:EMBEDDING_DIMENSIONS]]
        data.append({"index": index, "object": "embedding", "embedding": vector})
    return {"id": response_id, "object": "list", "created": created, "model": model,
            "data": data, "usage": {"prompt_tokens": req.prompt_tokens,
                                    "total_tokens": req.prompt_tokens, "completion_tokens": 0,
                                    "prompt_tokens_details": None}}


def _named_event(name: str, data: dict[str, Any]) -> bytes:
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")


class ResponsesStreamFormatter:
    """The SSE events of a streamed ``/v1/responses`` answer, in vLLM's (OpenAI's) shapes."""

    def __init__(self, req: ParsedRequest, response_id: str, model: str,
                 created: int | None = None) -> None:
        self.req = req
        self.id = response_id
        self.item_id = "msg_" + response_id.removeprefix("resp_")
        self.model = model
        self.created = int(time.time()) if created is None else created
        self.sequence = 0

    def _event(self, name: str, fields: dict[str, Any]) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return _named_event(name, data)

    def first(self) -> bytes:
        """Everything before the first token: created, in progress, item and part added."""
        response = responses_object(self.req, self.id, self.created, self.model, "in_progress")
        return b"".join((
            self._event("response.created", {"response": response}),
            self._event("response.in_progress", {"response": response}),
            self._event("response.output_item.added", {
                "output_index": 0,
                "item": {"id": self.item_id, "type": "message", "role": "assistant",
                         "status": "in_progress", "content": []}}),
            self._event("response.content_part.added", {
                "item_id": self.item_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}),
        ))

    def token(self, index: int) -> bytes:
        """The delta of the ``index``-th token (1-based)."""
        return self._event("response.output_text.delta", {
            "item_id": self.item_id, "output_index": 0, "content_index": 0,
            "delta": token_text(CHAT, index - 1), "logprobs": []})

    def last(self, cached_tokens: int = 0) -> bytes:
        """Text and part and item done, then ``response.completed`` (or ``.incomplete``)."""
        text = generated_text(CHAT, self.req.output_tokens)
        response = responses_object(self.req, self.id, self.created, self.model, "completed",
                                    cached_tokens)
        terminal = "response.incomplete" if response["status"] == "incomplete" \
            else "response.completed"
        return b"".join((
            self._event("response.output_text.done", {
                "item_id": self.item_id, "output_index": 0, "content_index": 0, "text": text,
                "logprobs": []}),
            self._event("response.content_part.done", {
                "item_id": self.item_id, "output_index": 0, "content_index": 0,
                "part": {"type": "output_text", "text": text, "annotations": []}}),
            self._event("response.output_item.done", {
                "output_index": 0, "item": _responses_message(self.item_id, text, "completed")}),
            self._event(terminal, {"response": response}),
        ))


class MessagesStreamFormatter:
    """The SSE events of a streamed ``/v1/messages`` answer, in vLLM's (Anthropic's) shapes."""

    def __init__(self, req: ParsedRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model

    def first(self) -> bytes:
        """``message_start`` (with the input tokens), a ``ping``, the text block's start."""
        message: dict[str, object] = {
                   "id": self.id, "type": "message", "role": "assistant", "content": [],
                   "model": self.model, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.req.prompt_tokens, "output_tokens": 0}}
        return b"".join((
            _named_event("message_start", {"type": "message_start", "message": message}),
            _named_event("ping", {"type": "ping"}),
            _named_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}}),
        ))

    def token(self, index: int) -> bytes:
        return _named_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": token_text(CHAT, index - 1)}})

    def last(self, cached_tokens: int = 0) -> bytes:
        """The block's stop, ``message_delta`` (stop reason, usage), ``message_stop``.
        ``cached_tokens`` is not shown: this usage has input and output tokens only."""
        return b"".join((
            _named_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _named_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": anthropic_stop_reason(self.req), "stop_sequence": None},
                "usage": {"input_tokens": self.req.prompt_tokens,
                          "output_tokens": self.req.output_tokens}}),
            _named_event("message_stop", {"type": "message_stop"}),
        ))
