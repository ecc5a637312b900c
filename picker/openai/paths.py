"""Which API a request path names: one of the inference paths, a configured pass-through, or none.

It answers the question the fair queue depends on: *is this request an inference request, and of
which kind?* A path that escapes the answer escapes admission, budgets and metering, so every
spelling of an inference path must be recognised. ``normalise_path`` reduces a raw ``:path`` to
one canonical form and ``classify`` matches the canonical form:

1. the query (``?``) and fragment (``#``) are cut off;
2. percent-escapes are decoded, all of them (``%2F`` becomes ``/`` and ``%5C`` becomes ``\\``),
   **repeatedly until no escape is left** (at most ``MAX_DECODE_ROUNDS`` rounds): a
   double-encoded ``%2563`` becomes ``c``, so a hop that decodes once more than we expect still
   cannot turn a path we let through uncharged into an inference path. A path still holding an
   escape after the last round, an invalid escape in the path as sent (``%zz``, a lone ``%``;
   one that decoding produced, from ``%25zz``, is a literal ``%``), bytes that are not UTF-8, or
   a control character (NUL included, raw or decoded) is refused with ``BadRequest``;
3. ``\\`` is read as ``/`` (some servers do), runs of ``/`` merge into one;
4. ``.`` and ``..`` segments are resolved (RFC 3986 ``remove_dot_segments``; ``..`` above the root
   stays at the root);
5. the path is lower-cased and a trailing ``/`` removed (except the root's); a ``%``, ``?`` or
   ``#`` that decoding produced is written as its escape again (``%25``, ``%3F``, ``%23``), so
   normalising a normalised path changes nothing.

The rules over-approximate what any server behind the gateway might do: a model server that
decodes once and matches exactly (vLLM) sees an inference path only where ``classify`` does too.
So that the server serves what the picker judged, the picker sends it the canonical path
(``forward_path``, set as ``:path`` with the route); a gateway that will not let it and a server
that answers 404 cost the tenant nothing (an engine's refusal is charged nothing). The reverse,
an inference request let through uncharged, cannot happen. A path without ``%``, ``\\``,
``//``, ``/.``, upper case, a query or a trailing slash takes a fast path (one regular-expression
search).
"""

from __future__ import annotations

import enum
import functools
import re
from urllib.parse import unquote_to_bytes

from picker.errors import BadRequest, MethodNotAllowed, NotFound


class ApiKind(enum.Enum):
    """The inference APIs the picker admits, queues and charges."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    MESSAGES = "messages"


INFERENCE_PATHS: dict[str, ApiKind] = {
    "/v1/completions": ApiKind.COMPLETIONS,
    "/v1/chat/completions": ApiKind.CHAT,
    "/v1/responses": ApiKind.RESPONSES,
    "/v1/embeddings": ApiKind.EMBEDDINGS,
    "/v1/messages": ApiKind.MESSAGES,
}
"""Canonical (normalised) inference paths and their kind."""

INFERENCE_METHOD = "POST"
MAX_DECODE_ROUNDS = 4
"""Percent-decoding rounds before a path still holding escapes is refused (``%252563`` needs 3)."""
MAX_PATH_IN_MESSAGE = 200

# Anything but lower-case unreserved and sub-delimiter characters and "/" (so "%", "\", "?", "#",
# upper case, control and non-ASCII characters), "//", "/." (dot segments), a trailing "/", or a
# first character that is not "/": the slow path.
_NEEDS_WORK = re.compile(r"[^a-z0-9\-._~!$&'()*+,;=:@/]|//|/\.|./\Z|\A[^/]|\A\Z")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SLASHES = re.compile(r"/{2,}")
_LITERAL = re.compile(r"[%?#]")
_REENCODE = str.maketrans({"%": "%25", "?": "%3F", "#": "%23"})


def normalise_path(raw: str) -> str:
    """The canonical form of a request's ``:path`` (see the module docstring); BadRequest when it
    cannot be decoded safely."""
    if not _NEEDS_WORK.search(raw):
        return raw
    for cut in ("?", "#"):
        index = raw.find(cut)
        if index >= 0:
            raw = raw[:index]
    path = raw
    if "%" in path:
        if _BAD_ESCAPE.search(path):
            raise BadRequest("the request path has an invalid percent-escape")
        for _ in range(MAX_DECODE_ROUNDS):
            try:
                path = unquote_to_bytes(path).decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest("the request path does not decode to UTF-8") from None
            # A "%" a round produced that starts no escape is a literal percent sign: no
            # server can decode it into anything else.
            if not _ESCAPE.search(path):
                break
        else:
            raise BadRequest(f"the request path is percent-encoded more than "
                             f"{MAX_DECODE_ROUNDS} times")
    if _CONTROL.search(path):
        raise BadRequest("the request path holds a control character")
    path = _SLASHES.sub("/", "/" + path.replace("\\", "/"))
    if "/." in path:
        path = _remove_dot_segments(path)
    path = path.lower()
    if len(path) > 1 and path.endswith("/"):
        path = path[:-1]
    if _LITERAL.search(path):
        # Decoded "%", "?" and "#" are literal characters of the path; encoded again, they keep
        # meaning that when the result is normalised once more (idempotence).
        path = path.translate(_REENCODE)
    return path


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 for an absolute path without empty segments; ``..`` stops at the root."""
    out: list[str] = []
    segments = path.split("/")[1:]
    for segment in segments:
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
    # A final "." or ".." leaves a directory ("/a/b/.." is "/a/"): the trailing slash is stripped
    # afterwards anyway, so it is not added here.
    return "/" + "/".join(out)


def normalise_method(method: str) -> str:
    """A pass-through entry's method as compared: upper case (``*`` stays ``*``)."""
    return method.upper()


@functools.lru_cache(maxsize=16)
def _pass_through_paths(pass_through: frozenset[tuple[str, str]]) -> frozenset[str]:
    return frozenset(path for _, path in pass_through)


def classify(method: str, raw_path: str,
             pass_through: frozenset[tuple[str, str]]) -> ApiKind | None:
    """The inference API ``raw_path`` names, or None for a configured pass-through.

    ``pass_through`` holds ``(METHOD, normalised path)`` pairs; method ``*`` matches any.
    Raises ``MethodNotAllowed`` (405) for an inference path asked with a method other than POST,
    or a pass-through path asked with a method its entries do not list; ``NotFound`` (404) for any
    other path; ``BadRequest`` (400) for a path that cannot be decoded.
    """
    kind = INFERENCE_PATHS.get(raw_path)  # the usual spelling: no normalising needed
    path = raw_path if kind is not None else normalise_path(raw_path)
    if kind is None:
        kind = INFERENCE_PATHS.get(path)
    if kind is not None:
        if method != INFERENCE_METHOD:
            raise MethodNotAllowed(f"{_shown(method)} is not allowed on {path}; inference "
                                   f"requests use {INFERENCE_METHOD}")
        return kind
    if (method, path) in pass_through or ("*", path) in pass_through:
        return None
    if path in _pass_through_paths(pass_through):
        allowed = sorted(m for m, p in pass_through if p == path)
        raise MethodNotAllowed(f"{_shown(method)} is not allowed on {path}; allowed: "
                               f"{', '.join(allowed)}")
    raise NotFound(f"Invalid URL ({_shown(method)} {_shown(path)})")


def forward_path(raw: str) -> str | None:
    """The path to send the engine for an inference request whose ``:path`` is ``raw``: None
    when ``raw`` is already canonical (the usual case: one look-up), else its canonical form
    with ``raw``'s query kept. A gateway forwards the spelling it got (``/V1/chat/completions``,
    ``/v1/chat/completions/``), which vLLM answers 404 although the picker judged (and charged)
    an inference request: the picker sends the path it judged instead."""
    path, mark, query = raw.partition("?")
    if path in INFERENCE_PATHS:
        return None
    canonical = normalise_path(raw)
    return canonical + mark + query.partition("#")[0] if mark else canonical


def _shown(text: str) -> str:
    """``text`` safe to put in an error message: bounded, without control characters."""
    text = _CONTROL.sub("?", text)
    return text if len(text) <= MAX_PATH_IN_MESSAGE else text[:MAX_PATH_IN_MESSAGE] + "..."
