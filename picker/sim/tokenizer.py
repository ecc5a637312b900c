"""The simulated model's tokenizer: which token ids is this text, deterministically?

The simulated server counts prompt tokens and hashes prompt blocks for its prefix cache with the
same ids, so a text gives the same ids in every process and every run (nothing is downloaded,
nothing depends on ``PYTHONHASHSEED``). It behaves like a byte-level BPE tokenizer (GPT-2,
Llama-3) in how many tokens a script costs, without a vocabulary:

1. **Pre-tokenizer.** A regular expression splits the text as GPT-2/Llama-3's does: English
   contractions (``'s``, ``'ll``...), a letter run with at most one leading space, digits in runs
   of at most 3, a punctuation/symbol run with at most one leading space, and whitespace (a run
   before a word leaves its last space to that word).
2. **Pieces.** Each split becomes tokens:

   - letters: CJK ideographs, kana and Hangul one token per character; other letters in pieces of
     at most ``WORD_PIECE_BYTES`` (5) UTF-8 bytes, the leading space free, so an English word of
     up to 5 letters is one token and a longer one one per 5 letters (English text comes to about
     4 characters a token), Cyrillic or Greek 2 letters a token, Devanagari one;
   - digits: one token per run (at most 3 digits);
   - ASCII punctuation in pieces of at most 2 characters (``", "`` is one, ``"..."`` two);
   - any other character (emoji, symbols, curly quotes) one token per UTF-8 byte, as a
     byte-fallback tokenizer does for what its vocabulary lacks (an emoji is 4 tokens);
   - whitespace runs in pieces of at most 4 characters (``"\\n\\n"`` is one token).
3. **Ids.** A piece's id is the first 31 bits of its BLAKE2b hash: the same piece is the same id
   everywhere (ids of distinct pieces may collide, which a cache-hit model does not mind).

``count(text)`` is ``len(encode(text))``. The ids of one text are the ids of its splits in
order, so two texts with a common beginning share the ids of that beginning's whole splits (a
prompt's prefix is cached as vLLM caches the tokens of a shared system prompt).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re

WORD_PIECE_BYTES = 5
"""The most UTF-8 bytes of letters one token holds (its leading space not counted)."""
PUNCT_PIECE_CHARS = 2
SPACE_PIECE_CHARS = 4
ID_BITS = 31

_SPLIT = re.compile(
    r"'(?:[sdmt]|ll|ve|re)(?![^\W\d_])"  # contractions, as GPT-2's (only before a non-letter)
    r"|'(?:[sdmt]|ll|ve|re)"
    r"| ?[^\W\d_]+"                      # letters, one leading space
    r"|\d{1,3}"                          # digits, at most 3 a token (Llama-3's rule)
    r"| ?(?:[^\s\w]|_)+"                 # punctuation and symbols, one leading space
    r"|\s+(?!\S)|\s+")                   # whitespace; a run before a word leaves it a space


def _is_cjk(code: int) -> bool:
    return (0x3040 <= code <= 0x30FF or 0x3400 <= code <= 0x4DBF or 0x4E00 <= code <= 0x9FFF
            or 0xAC00 <= code <= 0xD7AF or 0xF900 <= code <= 0xFAFF or 0x1100 <= code <= 0x11FF
            or 0x20000 <= code <= 0x2FFFF)


def piece_id(piece: bytes) -> int:
    """The id of one token's bytes: stable across processes and runs."""
    return int.from_bytes(hashlib.blake2b(piece, digest_size=4).digest(), "big") \
        & ((1 << ID_BITS) - 1)


def _letter_pieces(split: str) -> list[bytes]:
    pieces: list[bytes] = []
    current, size = bytearray(), 0
    for char in split:
        encoded = char.encode("utf-8")
        if char == " ":  # the leading space rides with the first piece, free
            current += encoded
            continue
        if _is_cjk(ord(char)):
            if size:
                pieces.append(bytes(current))
                current, size = bytearray(), 0
            pieces.append(bytes(current) + encoded)  # with a leading space, if any
            current = bytearray()
            continue
        if size and size + len(encoded) > WORD_PIECE_BYTES:
            pieces.append(bytes(current))
            current, size = bytearray(), 0
        current += encoded
        size += len(encoded)
    if current:
        pieces.append(bytes(current))
    return pieces


def _symbol_pieces(split: str) -> list[bytes]:
    pieces: list[bytes] = []
    current, size = bytearray(), 0
    for char in split:
        encoded = char.encode("utf-8")
        if char == " " and not pieces and not size:
            current += encoded
            continue
        if len(encoded) > 1:  # not ASCII: one token per byte (byte fallback)
            if size:
                pieces.append(bytes(current))
                current, size = bytearray(), 0
            lead = bytes(current)
            pieces.extend([lead + encoded[:1]] + [encoded[i:i + 1] for i in range(1, len(encoded))])
            current = bytearray()
            continue
        if size >= PUNCT_PIECE_CHARS:
            pieces.append(bytes(current))
            current, size = bytearray(), 0
        current += encoded
        size += 1
    if current:
        pieces.append(bytes(current))
    return pieces


@functools.lru_cache(maxsize=65536)
def _split_ids(split: str) -> tuple[int, ...]:
    """The ids of one pre-tokenizer split (cached: prompts repeat their words)."""
    first = split.lstrip(" ")[:1] or split[:1]
    if first.isspace():
        encoded = split.encode("utf-8")
        step = SPACE_PIECE_CHARS
        return tuple(piece_id(encoded[i:i + step]) for i in range(0, len(encoded), step))
    if first.isdigit():
        return (piece_id(split.encode("utf-8")),)
    if first == "'" and len(split) <= 3 and split[1:].isalpha() and split.isascii():
        return (piece_id(split.encode("utf-8")),)
    if first.isalpha() and first != "_":
        return tuple(piece_id(p) for p in _letter_pieces(split))
    return tuple(piece_id(p) for p in _symbol_pieces(split))


def encode(text: str) -> list[int]:
    """The token ids of ``text`` (empty for an empty text)."""
    return list(itertools.chain.from_iterable(map(_split_ids, _SPLIT.findall(text))))


def count(text: str) -> int:
    """How many tokens ``text`` is: ``len(encode(text))``."""
    return sum(map(len, map(_split_ids, _SPLIT.findall(text))))


def special_id(name: str) -> int:
    """The id of a special token (a chat template's markers, an image placeholder): a hash of a
    name no text produces."""
    return piece_id(b"\x00<|" + name.encode("utf-8") + b"|>")
