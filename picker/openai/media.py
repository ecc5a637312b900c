"""What an image, audio or file part of a request costs in prompt tokens, as vLLM counts it.

vLLM replaces each multimodal item by placeholder tokens whose number its model's processor
decides (``vllm/model_executor/models/<model>.py``, ``get_num_image_tokens``); those tokens are in
``usage.prompt_tokens`` and take KV cache like text. The rules, per model (``models[]`` in the
config, ``PartCosts`` here):

- **Images.** A fixed count when the processor resizes every image to one grid
  (``imageTokens``: LLaVA-1.5 576, Gemma 3 256, Llama 3.2 Vision up to 6,404 with its tiles).
  Otherwise Qwen2-VL's rule, the densest common one: the image is resized to multiples of 28
  pixels (14-pixel patches merged 2×2) and each 28×28 square is one token,
  ``ceil(h/28)·ceil(w/28)`` (vLLM rounds to the nearest multiple; ceil errs high by a row or
  column at most), capped at ``max_pixels / 28²`` (12,845,056 / 784 = 16,384, the processor's
  default). The size is read from the image's own header when the body carries it (a base64
  ``data:`` URL of a PNG, JPEG, GIF or WebP); an image the picker cannot measure (a remote URL,
  another format) costs the cap, since an under-estimate lets a tenant outrun its budget and the
  engine's ``usage`` settles the rest. ``imagePatchPixels`` and ``imageMaxTokens`` set the rule
  for other models (Pixtral: 16 pixels, 4,096 at its 1,024-pixel limit).
- **Audio.** ``input_audio`` data: its duration (a WAV header's byte rate; other formats at
  64 kbit/s, a low bitrate, so long rather than short) times ``audioTokensPerSecond`` (Qwen2-Audio:
  Whisper's 100 mel frames a second, halved twice: 25). Audio by URL: 30 seconds, the Whisper
  window most vLLM audio models pad or cut to.
- **Files.** vLLM's chat parser has no file part (its ``MM_PARSER_MAP``): the engine refuses
  one and the request is settled to nothing. Until then a file in the body counts as text, a
  token per four bytes of its data; one by reference (``file_id``, a URL) costs ``fileTokens``.

Pure: nothing is fetched, and only the few bytes of a header are decoded (a JPEG's size may sit
behind its metadata: up to 48 KB are decoded before the whole image is).
"""

from __future__ import annotations

import binascii
import math
from dataclasses import dataclass

UNSIZED_AUDIO_SECONDS = 30
"""What audio by URL is counted as: Whisper's 30-second window."""
UNKNOWN_AUDIO_BYTES_PER_SECOND = 8000
"""Compressed audio without a header the picker reads: 64 kbit/s (speech MP3 or Opus at a low
bitrate), so its duration is over- rather than under-estimated."""
_HEAD_CHARS = 64
"""Base64 characters decoded first: 48 bytes, a PNG's, GIF's or WebP's size and a WAV's rate."""
_JPEG_CHARS = 65536
"""Base64 characters decoded to find a JPEG's size before the whole image is decoded."""


@dataclass(frozen=True, slots=True)
class PartCosts:
    """Prompt tokens of the non-text parts of a request to one model."""

    image_tokens: int | None = None
    """Tokens of every image (a processor that resizes to a fixed grid); None: by size."""
    image_patch_pixels: int = 28
    """Side in pixels of the square one image token covers (Qwen2-VL, Qwen2.5-VL: 28)."""
    image_max_tokens: int = 16384
    """Tokens of the largest image, and of one whose size cannot be read."""
    audio_tokens_per_second: float = 25.0
    """Tokens a second of audio (Qwen2-Audio: 25)."""
    file_tokens: int = 4096
    """Tokens of a file part given by reference (``file_id``, a URL)."""

    def image(self, url: str, *, bare: bool = False) -> int:
        """Tokens of one image given as ``url`` (a ``data:`` URL or a remote one; ``bare``:
        base64 data without the URL's prefix, as Anthropic sends it)."""
        if self.image_tokens is not None:
            return self.image_tokens
        size = image_size(url, 0 if bare else _payload_start(url))
        if size is None:
            return self.image_max_tokens
        width, height = size
        patch = self.image_patch_pixels
        return max(1, min(self.image_max_tokens,
                          math.ceil(width / patch) * math.ceil(height / patch)))

    def audio(self, data: str) -> int:
        """Tokens of base64 audio ``data`` (``input_audio``)."""
        return math.ceil(audio_seconds(data) * self.audio_tokens_per_second)

    def audio_url(self) -> int:
        """Tokens of audio given by URL (its length unknown)."""
        return math.ceil(UNSIZED_AUDIO_SECONDS * self.audio_tokens_per_second)

    def file(self, data: str | None) -> int:
        """Tokens of a file part: its base64 ``data`` (a ``data:`` URL or bare), else by
        reference."""
        if not data:
            return self.file_tokens
        return math.ceil(_decoded_length(data, max(0, _payload_start(data))) / 4)


DEFAULT_COSTS = PartCosts()
"""The costs of a model without a ``models[]`` entry."""


def _decoded_length(text: str, start: int) -> int:
    """Bytes the base64 in ``text`` from ``start`` decodes to (its padding taken off)."""
    padding = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    return max(0, (len(text) - start) * 3 // 4 - padding)


def _payload_start(url: str) -> int:
    """Where the base64 payload of a ``data:...;base64,`` URL starts, or -1."""
    if not url.startswith("data:"):
        return -1
    comma = url.find(",", 5, 256)
    if comma < 0 or not url.endswith(";base64", 0, comma):
        return -1
    return comma + 1


def _decode(text: str, start: int, chars: int) -> bytes:
    """Up to ``chars`` base64 characters of ``text`` from ``start`` (a multiple of 4), decoded;
    b"" when they are not base64."""
    try:
        return binascii.a2b_base64(text[start:start + chars])
    except (binascii.Error, ValueError):
        return b""


def image_size(url: str, start: int) -> tuple[int, int] | None:
    """``(width, height)`` of a base64 image (PNG, JPEG, GIF, WebP) starting at ``start`` of
    ``url`` (-1: not base64, a remote URL), from its header; None when it cannot be read."""
    if start < 0:
        return None
    head = _decode(url, start, _HEAD_CHARS)
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return int.from_bytes(head[6:8], "little"), int.from_bytes(head[8:10], "little")
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_size(head)
    if head[:2] == b"\xff\xd8":
        size = _jpeg_size(_decode(url, start, _JPEG_CHARS))
        if size is None and len(url) - start > _JPEG_CHARS:
            size = _jpeg_size(_decode(url, start, len(url) - start))
        return size
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8X" and len(head) >= 30:
        return (1 + int.from_bytes(head[24:27], "little"),
                1 + int.from_bytes(head[27:30], "little"))
    if chunk == b"VP8 " and len(head) >= 30:
        return (int.from_bytes(head[26:28], "little") & 0x3FFF,
                int.from_bytes(head[28:30], "little") & 0x3FFF)
    if chunk == b"VP8L" and len(head) >= 25:
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    return None


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
"""JPEG start-of-frame markers (0xC4 Huffman tables, 0xC8 reserved, 0xCC arithmetic coding)."""


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """Walk a JPEG's segments to its start-of-frame, which holds height then width."""
    pos = 2
    while pos + 9 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker in _SOF:
            return (int.from_bytes(data[pos + 7:pos + 9], "big"),
                    int.from_bytes(data[pos + 5:pos + 7], "big"))
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
        else:
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return None


def audio_seconds(data: str) -> float:
    """Seconds of base64 audio ``data`` (bare or a ``data:`` URL): a WAV header's byte rate, or
    ``UNKNOWN_AUDIO_BYTES_PER_SECOND`` for other formats."""
    start = max(0, _payload_start(data))
    length = _decoded_length(data, start)
    head = _decode(data, start, _HEAD_CHARS)
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE" and head[12:16] == b"fmt ":
        byte_rate = int.from_bytes(head[28:32], "little")
        if byte_rate > 0:
            return max(0, length - 44) / byte_rate
    return length / UNKNOWN_AUDIO_BYTES_PER_SECOND
