"""Prompt estimates for every request shape (issue 26 point 2): each rule pinned.

Text by script (``picker.openai.tokens``), images, audio and files as vLLM counts them
(``picker.openai.media``, per model from ``models[]``), and the structures chat templates render
(tools, tool_choice, response_format) in every API. How close the text rule comes to a real
tokenizer is tests/integration/test_prompt_estimates_reference.py.
"""

from __future__ import annotations

import base64
import io
import json
import struct
from typing import Any

import pytest
from PIL import Image

from picker.config.schema import load_config
from picker.openai import parse_request
from picker.openai.media import DEFAULT_COSTS, PartCosts, audio_seconds, image_size
from picker.openai.paths import ApiKind
from picker.openai.request import MESSAGE_OVERHEAD_TOKENS, TOOLS_OVERHEAD_TOKENS
from picker.openai.tokens import text_tokens

# -- text by script --


@pytest.mark.parametrize(("text", "tokens"), [
    ("", 0),
    ("abcd" * 100, 100),                  # lowercase: 4 characters a token
    ("word " * 100, 100),                 # a space is free (merged into the next word)
    ("ABCD" * 100, 200),                  # uppercase: 2 a token
    ("{}[]" * 100, 200),                  # punctuation: 2 a token
    ("1234" * 100, 400),                  # digits: one each
    ("\n" * 100, 100),                    # newlines: one each
    ("漢字" * 100, 400),                   # CJK ideographs: 2 each
    ("ひらがな" * 25, 200),                 # kana: 2 each
    ("한국" * 100, 600),                   # Hangul: 3 each
    ("привет" * 100, 600),                # Cyrillic: 1 each
    ("é" * 100, 375),                     # a Latin supplement: breaks its word's merges
    ("😀" * 100, 400),                    # emoji: their 4 bytes
    ("ก" * 100, 175),                     # Thai, Devanagari, symbols: 7/4
])
def test_each_script_has_its_weight(text: str, tokens: int) -> None:
    assert text_tokens(text) == tokens


def test_quarters_round_up() -> None:
    assert text_tokens("a") == 1
    assert text_tokens("abcde") == 2


def test_cjk_is_no_longer_estimated_at_a_quarter_of_a_token() -> None:
    """The attack: 4,000 CJK characters were 1,000 tokens by chars/4."""
    assert text_tokens("中" * 4000) == 8000


def test_lone_surrogates_from_json_escapes_are_counted_not_fatal() -> None:
    text = json.loads('"\\ud800x"')
    assert text_tokens(text) >= 1


def test_texts_longer_than_one_adler_chunk_sum_exactly() -> None:
    # 4-byte characters weigh 16 quarters, the most: 100,000 of them span many chunks.
    assert text_tokens("😀" * 100_000) == 400_000
    assert text_tokens("a" * 1_000_001) == 250_001


# -- images --


def _data_url(fmt: str, size: tuple[int, int]) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 40, 40)).save(buffer, format=fmt)
    mime = {"JPEG": "jpeg", "PNG": "png", "GIF": "gif", "WEBP": "webp"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_an_images_size_is_read_from_its_header(fmt: str) -> None:
    url = _data_url(fmt, (1000, 700))
    assert image_size(url, url.index(",") + 1) == (1000, 700)


def test_a_jpeg_size_behind_large_metadata_is_found() -> None:
    """EXIF and ICC segments can put the frame header tens of kilobytes in."""
    buffer = io.BytesIO()
    Image.new("RGB", (640, 480)).save(buffer, format="JPEG")
    jpeg = buffer.getvalue()
    filler = b"\xff\xe1" + struct.pack(">H", 65000) + b"\0" * 64998  # one 65 KB APP1 segment
    data = jpeg[:2] + filler + filler + jpeg[2:]
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    assert image_size(url, url.index(",") + 1) == (640, 480)


def test_image_tokens_follow_qwen2_vl_patches_and_cap() -> None:
    costs = PartCosts()
    assert costs.image(_data_url("PNG", (1000, 700))) == 36 * 25  # ceil(1000/28), ceil(700/28)
    assert costs.image(_data_url("PNG", (10, 10))) == 1
    assert costs.image(_data_url("PNG", (5000, 5000))) == costs.image_max_tokens
    assert PartCosts(image_patch_pixels=16).image(_data_url("PNG", (1024, 1024))) == 4096


def test_an_image_the_picker_cannot_measure_costs_the_cap() -> None:
    costs = PartCosts(image_max_tokens=5000)
    assert costs.image("https://example.com/cat.png") == 5000
    assert costs.image("data:image/png;base64,bm90IGFuIGltYWdl") == 5000  # not an image
    assert costs.image("data:image/png;base64,%%%%") == 5000  # not base64


def test_a_fixed_image_count_overrides_the_size_rule() -> None:
    assert PartCosts(image_tokens=576).image(_data_url("PNG", (4000, 4000))) == 576
    assert PartCosts(image_tokens=576).image("https://example.com/x.png") == 576


def _chat(content: Any, **fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}],
                       **fields}).encode()


def test_every_apis_image_part_is_counted() -> None:
    url = _data_url("PNG", (280, 280))  # 10 x 10 patches
    bare = url.split(",", 1)[1]
    chat = parse_request(_chat([{"type": "image_url", "image_url": {"url": url}}]))
    chat_string_url = parse_request(_chat([{"type": "image_url", "image_url": url}]))
    responses = parse_request(json.dumps({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": url}]}]}).encode(), ApiKind.RESPONSES)
    messages = parse_request(json.dumps({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": bare}}]}]}).encode(),
        ApiKind.MESSAGES)
    for request in (chat, chat_string_url, responses, messages):
        assert request.prompt_tokens == 100 + MESSAGE_OVERHEAD_TOKENS


def test_the_image_attack_body_is_estimated_at_what_its_images_cost() -> None:
    """Four base64 images a request were 0 tokens; the calibration could raise them 4x of
    nothing."""
    url = _data_url("JPEG", (1120, 1120))  # 40 x 40 patches
    parts = [{"type": "text", "text": "describe these"}]
    parts += [{"type": "image_url", "image_url": {"url": url}}] * 4
    assert parse_request(_chat(parts)).prompt_tokens >= 4 * 1600


# -- audio, video, files --


def _wav(seconds: float, rate: int = 16000) -> str:
    frames = int(seconds * rate)
    header = (b"RIFF" + struct.pack("<I", 36 + 2 * frames) + b"WAVEfmt "
              + struct.pack("<IHHIIHH", 16, 1, 1, rate, 2 * rate, 2, 16)
              + b"data" + struct.pack("<I", 2 * frames))
    return base64.b64encode(header + b"\0" * (2 * frames)).decode()


def test_wav_duration_from_its_header() -> None:
    assert audio_seconds(_wav(3.0)) == pytest.approx(3.0, abs=0.01)
    assert PartCosts().audio(_wav(2.0)) == 50  # 25 a second (Qwen2-Audio)
    assert PartCosts(audio_tokens_per_second=50).audio(_wav(2.0)) == 100


def test_other_audio_is_counted_long_at_a_low_bitrate() -> None:
    mp3 = base64.b64encode(b"\xff\xfb" + b"\0" * 15998).decode()  # 16 KB
    assert audio_seconds(mp3) == pytest.approx(2.0, abs=0.01)  # 64 kbit/s


def test_audio_and_video_parts_in_a_chat() -> None:
    body = _chat([{"type": "input_audio", "input_audio": {"data": _wav(4.0), "format": "wav"}},
                  {"type": "audio_url", "audio_url": {"url": "https://x/a.mp3"}},
                  {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}])
    assert parse_request(body).prompt_tokens == \
        100 + 750 + DEFAULT_COSTS.image_max_tokens + MESSAGE_OVERHEAD_TOKENS


def test_files_count_as_text_of_their_bytes_or_by_reference() -> None:
    data = "data:application/pdf;base64," + base64.b64encode(b"x" * 4000).decode()
    chat = parse_request(_chat([{"type": "file", "file": {"file_data": data}},
                                {"type": "file", "file": {"file_id": "file-1"}}]))
    assert chat.prompt_tokens == 1000 + DEFAULT_COSTS.file_tokens + MESSAGE_OVERHEAD_TOKENS
    responses = parse_request(json.dumps({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_file", "file_data": data}]}]}).encode(), ApiKind.RESPONSES)
    assert responses.prompt_tokens == 1000 + MESSAGE_OVERHEAD_TOKENS
    documents = parse_request(json.dumps({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "data": data.split(",")[1]}},
            {"type": "document", "source": {"type": "text", "data": "abcd" * 10}},
            {"type": "document", "source": {"type": "url", "url": "https://x/d.pdf"}}]}]}
    ).encode(), ApiKind.MESSAGES)
    assert documents.prompt_tokens == \
        1000 + 10 + DEFAULT_COSTS.file_tokens + MESSAGE_OVERHEAD_TOKENS


# -- tools and schemas --

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_chat_tools_count_as_their_json_and_the_templates_instructions() -> None:
    plain = parse_request(_chat("hi")).prompt_tokens
    with_tools = parse_request(_chat("hi", tools=TOOLS)).prompt_tokens
    assert with_tools - plain == TOOLS_OVERHEAD_TOKENS + text_tokens(json.dumps(TOOLS))


def test_a_named_tool_choice_and_a_response_schema_count() -> None:
    plain = parse_request(_chat("hi")).prompt_tokens
    choice = {"type": "function", "function": {"name": "get_weather"}}
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"t": {"type": "number"}}}}}
    assert parse_request(_chat("hi", tool_choice="auto")).prompt_tokens == plain
    assert parse_request(_chat("hi", tool_choice=choice)).prompt_tokens == \
        plain + text_tokens(json.dumps(choice))
    assert parse_request(_chat("hi", response_format=schema)).prompt_tokens == \
        plain + text_tokens(json.dumps(schema))
    assert parse_request(_chat("hi", response_format={"type": "text"})).prompt_tokens == plain


def test_responses_tools_and_text_format_count() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}

    def tokens(**fields: Any) -> int:
        return parse_request(json.dumps({"model": "m", "input": "hi", **fields}).encode(),
                             ApiKind.RESPONSES).prompt_tokens
    assert tokens(tools=tools) - tokens() == TOOLS_OVERHEAD_TOKENS + text_tokens(json.dumps(tools))
    assert tokens(text={"format": fmt}) - tokens() == text_tokens(json.dumps(fmt))


def test_anthropic_tools_and_tool_choice_count() -> None:
    tools = [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
    choice = {"type": "tool", "name": "f"}

    def tokens(**fields: Any) -> int:
        return parse_request(json.dumps({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "hi"}], **fields}).encode(), ApiKind.MESSAGES).prompt_tokens
    assert tokens(tools=tools, tool_choice=choice) - tokens() == \
        TOOLS_OVERHEAD_TOKENS + text_tokens(json.dumps(tools)) + text_tokens(json.dumps(choice))


def test_assistant_tool_calls_count() -> None:
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    body = json.dumps({"model": "m", "messages": [
        {"role": "assistant", "content": None, "tool_calls": calls}]}).encode()
    assert parse_request(body).prompt_tokens == \
        MESSAGE_OVERHEAD_TOKENS + text_tokens(json.dumps(calls))


# -- per model, from the config --


def test_the_config_sets_each_models_costs_and_a_default() -> None:
    config = load_config({"models": [
        {"name": "llava", "imageTokens": 576},
        {"name": "pixtral", "imagePatchPixels": 16, "imageMaxTokens": 4096},
        {"name": "*", "imageMaxTokens": 2000, "audioTokensPerSecond": 50, "fileTokens": 10}]})
    assert config.part_costs("llava") == PartCosts(image_tokens=576)
    assert config.part_costs("pixtral") == PartCosts(image_patch_pixels=16,
                                                     image_max_tokens=4096)
    assert config.part_costs("other") == PartCosts(image_max_tokens=2000,
                                                   audio_tokens_per_second=50, file_tokens=10)
    assert load_config({}).part_costs("any") is DEFAULT_COSTS
    remote = _chat([{"type": "image_url", "image_url": {"url": "https://x/y.png"}}])
    assert parse_request(remote, ApiKind.CHAT, config.part_costs).prompt_tokens == \
        2000 + MESSAGE_OVERHEAD_TOKENS
    llava = remote.replace(b'"model": "m"', b'"model": "llava"')
    assert parse_request(llava, ApiKind.CHAT, config.part_costs).prompt_tokens == \
        576 + MESSAGE_OVERHEAD_TOKENS
