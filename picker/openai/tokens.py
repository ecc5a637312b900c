"""How many tokens is this text, without a tokenizer? A script-aware rule over UTF-8 bytes.

Byte-level BPE tokenizers (GPT-2's lineage: Llama 3, Qwen, SmolLM2, Mistral's Tekken) split text
into pieces whose cost depends on the script: English prose runs about four characters a token,
digits are one token each in most of them, uppercase and punctuation merge less, and text
outside the vocabulary's main scripts falls back towards its UTF-8 bytes. The old rule (characters
÷ 4 for everything) counted a CJK ideograph as a quarter of a token, where engines count one to
two: 4,000 CJK characters were estimated at 1,000 tokens and the engine counted 4,000 to 8,000.

The rule weighs each character by its class, read off its UTF-8 lead byte (so one
``bytes.translate`` and a few ``bytes.count`` calls, all in C, cost the whole text):

================================  =============  ==========================================
class                             tokens a char  what
================================  =============  ==========================================
ASCII lowercase letter            1/4            prose, identifiers
ASCII space                       0              merged into the next word
ASCII uppercase, punctuation      1/2            merge less (CONSTANT_NAMES, ``{"":[]}``)
ASCII digit, newline, tab         1              digits split one a token; line breaks
2-byte: U+0080-U+027F             15/4           Latin supplements: a diacritic breaks its
                                                 word's merges
2-byte: U+0280-U+07FF             1              Greek, Cyrillic, Hebrew, Arabic, ...
3-byte: U+0800-U+2FFF, U+E000-    7/4            Indic, Thai, Vietnamese, symbols, arrows
U+FFFF
3-byte: U+3000-U+9FFF             2              CJK ideographs, kana, CJK punctuation
3-byte: U+A000-U+DFFF             3              Hangul syllables, Yi
4-byte: U+10000 and above         4              emoji, rare ideographs: their bytes
================================  =============  ==========================================

The weights were fitted against SmolLM2's tokenizer (a 49k-token byte-level BPE, the one
reference on the machine; ``bench/estimates.py``, report in ``bench/results/estimates.md``) and
rounded up to quarters. A large-vocabulary tokenizer (Llama 3, Qwen 2.5) counts CJK at about one
token a character or less, so there the rule errs high, which is the safe side: an estimate
decides what a request reserves of its tenant's budget, and the engine's ``usage`` settles it.
The per-tenant, per-model calibration (``picker.core.estimates``) learns the rest.

Pure and allocation-light (the encoded text and its class map): it runs on every request.
"""

from __future__ import annotations

import zlib

_QUARTERS = {
    "lower": 1, "space": 0, "half": 2, "one": 4,  # ASCII
    "continuation": 0, "latin": 15, "other2": 4, "other3": 7, "cjk": 8, "hangul": 12,
    "four_byte": 16,
}
"""Each class's weight in quarter tokens (on its lead byte; continuation bytes weigh 0)."""


def _weight_table() -> bytes:
    """Each byte of UTF-8 text mapped to its class's weight in quarter tokens."""
    q = _QUARTERS
    table = bytearray(256)
    for i in range(128):
        char = chr(i)
        if char == " ":
            table[i] = q["space"]
        elif char.isdigit() or char in "\n\t\r":
            table[i] = q["one"]
        elif char.islower():
            table[i] = q["lower"]
        else:
            table[i] = q["half"]  # uppercase, punctuation, control
    table[0x80:0xC0] = bytes([q["continuation"]]) * 64
    table[0xC0:0xCA] = bytes([q["latin"]]) * 10  # U+0000-U+027F (C0, C1 never occur)
    table[0xCA:0xE0] = bytes([q["other2"]]) * 22
    table[0xE0:0xE3] = bytes([q["other3"]]) * 3
    table[0xE3:0xEA] = bytes([q["cjk"]]) * 7
    table[0xEA:0xEE] = bytes([q["hangul"]]) * 4
    table[0xEE:0xF0] = bytes([q["other3"]]) * 2
    table[0xF0:0x100] = bytes([q["four_byte"]]) * 16
    return bytes(table)


_WEIGHTS = _weight_table()
_CHUNK = (65521 - 2) // max(_QUARTERS.values())
"""Bytes whose weights, plus Adler-32's initial 1, sum below its modulus (65521) whatever they
are."""


def text_tokens(text: str) -> int:
    """Tokens of ``text`` as a byte-level BPE tokenizer counts them, about (>= 0).

    Each UTF-8 byte is mapped to its weight in quarter tokens (``bytes.translate``) and the
    weights are summed by ``zlib.adler32``, whose low half is 1 + the sum of the bytes modulo
    65521: exact for chunks of up to ``_CHUNK`` bytes. Both run in C (about 6 µs for 4,000
    ASCII characters, 30 µs for 4,000 CJK ones), where a Python loop over the bytes took 70.
    """
    return (text_quarters(text) + 3) // 4


def text_quarters(text: str) -> int:
    """``text_tokens`` in quarter tokens, unrounded: what a streamed response's pieces add up
    to (rounding each piece up would count a stream of one-word events high)."""
    if not text:
        return 0
    # Lone surrogates can come from JSON escapes ("\ud800"): count them, do not fail.
    return utf8_quarters(text.encode("utf-8", "surrogatepass"))


def utf8_quarters(data: bytes) -> int:
    """``text_quarters`` of the text whose UTF-8 is ``data``, read from its bytes."""
    weights = data.translate(_WEIGHTS)
    if len(weights) <= _CHUNK:
        return (zlib.adler32(weights) & 0xFFFF) - 1
    view = memoryview(weights)
    return sum((zlib.adler32(view[start:start + _CHUNK]) & 0xFFFF) - 1
               for start in range(0, len(weights), _CHUNK))
