"""The HTTP API's byte tokenizer: one token per UTF-8 byte, invalid input as U+FFFD."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raydp.text import byte_tokenizer as tokenizer

pytestmark = pytest.mark.timeout(60)


def test_each_utf8_byte_is_one_token() -> None:
    assert tokenizer.encode("hi") == [104, 105]
    assert tokenizer.encode("é€") == [0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    assert tokenizer.decode([0xC3, 0xA9, 0xE2, 0x82, 0xAC]) == "é€"


@given(st.text())
def test_decode_inverts_encode(text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_invalid_bytes_and_ids_outside_the_bytes_decode_as_the_replacement_character() -> None:
    assert tokenizer.decode([0xC3]) == "\ufffd", "a character cut short"
    assert tokenizer.decode([104, 0xFF, 105]) == "h\ufffdi", "a byte never valid in UTF-8"
    assert tokenizer.decode([104, 256, 2**31 - 1, 105]) == "h\ufffd\ufffdi", "ids an engine's larger vocabulary made"


def test_a_character_split_over_stream_chunks_comes_out_whole_with_the_second() -> None:
    decoder = tokenizer.StreamDecoder()
    assert decoder.feed([104, 0xE2]) == "h"
    assert decoder.feed([0x82]) == ""
    assert decoder.feed([0xAC, 105]) == "€i"
    assert decoder.feed([0xC3]) == ""
    assert decoder.flush() == "\ufffd", "the stream ended inside a character"


@given(st.lists(st.integers(0, 300), max_size=40), st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_stream_decoding_matches_decoding_the_whole(ids: list[int], cuts: list[int]) -> None:
    decoder, text, start = tokenizer.StreamDecoder(), "", 0
    for size in cuts * len(ids):
        if start >= len(ids):
            break
        text += decoder.feed(ids[start : start + size])
        start += size
    text += decoder.feed(ids[start:]) + decoder.flush()
    assert text == tokenizer.decode(ids)
