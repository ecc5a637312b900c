"""Which prompt blocks a request carries: chained hashes over its text, for prefix affinity.

It answers: *which fixed-size blocks of prompt text does this request start with?* The text is
taken in the order a chat template renders it (system and chat messages with their roles,
tools, documents, tool calls and results; a completions prompt; a Responses ``instructions``
and ``input``), its UTF-8 bytes cut into blocks of ``block_chars`` bytes (characters, for
ASCII), and each full block hashed with the hash of everything before it, as vLLM chains its
KV block hashes: a block's hash names the whole prefix up to its end, so two requests share
block ``i`` only when they share every byte before it. The chain starts from the model's name
(two models on one server share no cache). The trailing partial block is not hashed (vLLM
caches full blocks only).

The hash is CRC-32 continued over the bytes (``zlib.crc32(block, parent)`` is the CRC of the
whole prefix): a C call per block, no allocation but the result. 32 bits is enough for an
approximate index: a false match between two prefixes on one endpoint (about one in 4·10⁹ per
block held there) only sends a request where its prefix is not, and the charge is settled from
the engine's own count. The text is hashed up to ``MAX_PREFIX_BLOCKS`` blocks; beyond that the
work grows and the routing decision does not change.

The core (``picker.core.prefix``) receives the tuple of hashes only.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any

from picker.openai.paths import ApiKind

MAX_PREFIX_BLOCKS = 1024
"""The most blocks hashed per request (64 KiB of text at 64-byte blocks)."""

_SEP = b"\x1e"
"""Between segments (a message's role and text, two messages): "ab" + "c" and "a" + "bc" are
different prompts to a chat template, and must hash apart."""


def _text_of(value: Any, out: list[str]) -> None:
    """The text of a content value (string, parts, blocks), in order."""
    if isinstance(value, str):
        out.append(value)
        return
    if isinstance(value, list):
        for part in value:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                _part_text(part, out)


def _part_text(part: dict[str, Any], out: list[str]) -> None:
    for key in ("text", "thinking", "refusal"):
        text = part.get(key)
        if isinstance(text, str):
            out.append(text)
    for key in ("image_url", "input_audio", "file", "source", "input", "file_data"):
        value = part.get(key)
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, dict):
            # An image or document reference (its URL or base64 data), a tool_use's arguments.
            data = value.get("url") or value.get("data") or value.get("file_data")
            if isinstance(data, str):
                out.append(data)
            elif key == "input":
                out.append(json.dumps(value, separators=(",", ":"), sort_keys=True))
            elif value.get("type") == "content":
                _text_of(value.get("content"), out)
    if part.get("content") is not None:  # tool_result, nested blocks
        _text_of(part["content"], out)


def _messages_text(messages: Sequence[Any], out: list[str]) -> None:
    for message in messages:
        if isinstance(message, str):
            out.append(message)
            continue
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if isinstance(role, str):
            out.append(role)
        _text_of(message.get("content"), out)
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            out.append(json.dumps(calls, separators=(",", ":"), sort_keys=True))
        for key in ("output", "arguments"):  # Responses function_call(_output) items
            value = message.get(key)
            if isinstance(value, str):
                out.append(value)


def prompt_segments(body: dict[str, Any], kind: ApiKind) -> list[str]:
    """The prompt's text segments in the order the engine sees them (as far as the body says:
    a chat template puts the system prompt and tools first)."""
    out: list[str] = []
    system = body.get("system")  # Anthropic
    if system is not None:
        out.append("system")
        _text_of(system, out)
    instructions = body.get("instructions")  # Responses
    if isinstance(instructions, str):
        out.append("system")
        out.append(instructions)
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        out.append(json.dumps(tools, separators=(",", ":"), sort_keys=True))
    documents = body.get("documents")  # vLLM's chat_template_kwargs-style RAG documents
    if isinstance(documents, list) and documents:
        out.append(json.dumps(documents, separators=(",", ":"), sort_keys=True))
    messages = body.get("messages")
    if isinstance(messages, list):
        _messages_text(messages, out)
    elif kind is ApiKind.RESPONSES or kind is ApiKind.EMBEDDINGS:
        value = body.get("input")
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            _messages_text(value, out)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            out.append(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            out.append(prompt[0])  # a prompt list is one engine request per prompt
    return out


def chain_blocks(data: bytes, block: int, seed: int, max_blocks: int = MAX_PREFIX_BLOCKS
                 ) -> tuple[int, ...]:
    """Chained hashes of the full ``block``-byte blocks of ``data``, starting from ``seed``."""
    full = min(len(data) // block, max_blocks)
    if not full:
        return ()
    view = memoryview(data)
    crc = zlib.crc32
    hashes = []
    h = seed
    for start in range(0, full * block, block):
        h = crc(view[start:start + block], h)
        hashes.append(h)
    return tuple(hashes)


def model_seed(model: str) -> int:
    """The chain's root for a model: its name's CRC."""
    return zlib.crc32(model.encode())


def prompt_blocks(model: str, body: dict[str, Any], kind: ApiKind, block_chars: int,
                  max_blocks: int = MAX_PREFIX_BLOCKS) -> tuple[tuple[int, ...], int]:
    """The request's chained block hashes and the length of the text they were cut from
    (bytes, up to the hashing limit): the share of the prompt the blocks cover."""
    limit = block_chars * max_blocks
    parts: list[bytes] = []
    size = 0
    for segment in prompt_segments(body, kind):
        encoded = segment.encode("utf-8", "surrogatepass")
        parts.append(encoded)
        size += len(encoded) + 1
        if size >= limit:
            break
    data = _SEP.join(parts)
    return chain_blocks(data, block_chars, model_seed(model), max_blocks), len(data)


def token_blocks(model: str, token_ids: Sequence[int], block_tokens: int,
                 max_blocks: int = MAX_PREFIX_BLOCKS) -> tuple[tuple[int, ...], int]:
    """The same chain over a prompt given as token ids (the pool simulator's planned requests
    and a completions prompt of ids): each id as four bytes."""
    ids = list(token_ids[: block_tokens * max_blocks])
    data = b"".join(i.to_bytes(4, "little", signed=False) for i in ids)
    return chain_blocks(data, block_tokens * 4, model_seed(model), max_blocks), len(data)
