"""The simulated model's tokenizer (``picker.sim.tokenizer``): deterministic ids, and token
counts by script as a byte-level BPE tokenizer gives them (English about 4 characters a token, CJK
one a character, emoji by UTF-8 bytes)."""

from __future__ import annotations

import os
import subprocess
import sys

from picker.sim import tokenizer

ENGLISH = ("The quick brown fox jumps over the lazy dog. In the beginning, engineers built a "
           "small service that answered questions about their documents; it grew into a "
           "platform serving thousands of requests per second, with careful attention to "
           "latency, fairness and cost. Nobody expected the traffic to double every month.")


def test_the_same_text_gives_the_same_ids_in_another_process() -> None:
    text = ENGLISH + " 人工智能 😀 привет 12345"
    code = ("import sys; from picker.sim import tokenizer; "
            "print(tokenizer.encode(sys.argv[1]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, text], capture_output=True, text=True,
                         check=True, env=env).stdout
    assert out.strip() == str(tokenizer.encode(text))
    assert tokenizer.encode(text) == tokenizer.encode(text)
    assert tokenizer.count(text) == len(tokenizer.encode(text))


def test_english_is_about_four_characters_a_token() -> None:
    ratio = len(ENGLISH) / tokenizer.count(ENGLISH)
    assert 3.5 <= ratio <= 4.5
    assert tokenizer.count("Hello, world!") == 4
    assert tokenizer.count("the quick brown fox") == 4  # the simulator's filler: a token a word


def test_cjk_is_one_token_a_character() -> None:
    assert tokenizer.count("人工智能正在改变世界" * 200) == 2000
    assert tokenizer.count("こんにちは") == 5 and tokenizer.count("안녕하세요") == 5


def test_emoji_and_other_symbols_count_their_utf8_bytes() -> None:
    assert tokenizer.count("😀") == 4
    assert tokenizer.count("👍🏽") == 8
    assert tokenizer.count("😀" * 100) == 400


def test_other_scripts_two_letters_a_token_digits_three() -> None:
    assert tokenizer.count("привет") == 3  # 2-byte letters, 5 bytes a piece: 2 letters
    assert tokenizer.count("1234567") == 3


def test_a_text_ending_in_a_newline_is_a_prefix_of_its_continuation() -> None:
    head = "You are a helpful assistant.\n"
    assert tokenizer.encode(head + "Answer briefly.")[:tokenizer.count(head)] \
        == tokenizer.encode(head)


def test_special_ids_are_stable_and_unlike_text() -> None:
    assert tokenizer.special_id("image") == tokenizer.special_id("image")
    assert tokenizer.special_id("image") not in tokenizer.encode("<|image|> image")
