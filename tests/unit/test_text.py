"""raydp.text: loading tokenizers, incremental detokenizing, stop strings, and the two together."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raydp.errors import ConfigError
from raydp.models.checkpoint import make_model
from raydp.text.byte_tokenizer import ByteTokenizer
from raydp.text.detokenize import IncrementalDetokenizer
from raydp.text.hf_tokenizer import HFTokenizer
from raydp.text.stops import StopMatcher
from raydp.text.stream import Piece, TextStream
from raydp.text.tokenizer import TextTokenizer, load_tokenizer

pytestmark = pytest.mark.timeout(300)

EMOJI_TEXT = "Good morning 🙂! The café 🙂🙂 opens at nine, 東京 too 🚀."


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    tokenizer = load_tokenizer(str(make_model(tmp_path_factory.mktemp("text") / "tiny")))
    assert isinstance(tokenizer, HFTokenizer)
    return tokenizer


def pieces(detokenizer: IncrementalDetokenizer | TextTokenizer, ids: Sequence[int], cuts: Sequence[int]) -> list[str]:
    """The detokenizer's outputs for ``ids`` fed in chunks of the sizes in ``cuts`` (repeated), then flushed."""
    d = detokenizer.detokenizer() if not isinstance(detokenizer, IncrementalDetokenizer) else detokenizer
    out, start, sizes = [], 0, list(cuts) or [1]
    while start < len(ids):
        size = sizes[len(out) % len(sizes)]
        out.append(d.feed(ids[start : start + size]))
        start += size
    return [*out, d.flush()]


# ---- loading ----------------------------------------------------------------------------------------------


def test_no_path_is_the_byte_tokenizer_which_has_no_chat_template() -> None:
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eos_token_ids, tokenizer.has_chat_template) == (256, frozenset(), False)
    assert tokenizer.encode("hé") == [104, 0xC3, 0xA9] and tokenizer.decode([104, 0xC3, 0xA9]) == "hé"
    with pytest.raises(ConfigError, match=r"byte tokenizer .* has no chat template; .*--tokenizer DIR"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_missing_or_empty_directory_is_refused_naming_the_tokenizer(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=rf"tokenizer='{missing}': no such directory; must be a local directory"):
        load_tokenizer(missing)
    with pytest.raises(ConfigError, match=rf"tokenizer='{tmp_path}': no tokenizer loads from it \(.*\); must be"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=rf"tokenizer='{tmp_path}': no tokenizer loads from it"):
        load_tokenizer(str(tmp_path))


def test_a_hugging_face_directory_loads_with_its_vocabulary_eos_and_chat_template(hf: HFTokenizer) -> None:
    assert hf.vocab_size == 1024 and hf.eos_token_ids == frozenset({1}) and hf.has_chat_template
    assert hf.decode(hf.encode(EMOJI_TEXT)) == EMOJI_TEXT
    assert len(hf.encode("🙂")) > 1, "an emoji is several byte tokens in this vocabulary"
    prompt = hf.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert hf._tokenizer.decode(prompt) == "<|system|>\nBe brief.</s>\n<|user|>\nhi</s>\n<|assistant|>\n"
    assert hf.decode(prompt) == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n", "without special tokens"


def test_a_tokenizer_without_a_chat_template_refuses_chat(hf: HFTokenizer) -> None:
    plain = HFTokenizer(hf._tokenizer, hf.path)
    original = hf._tokenizer.chat_template
    hf._tokenizer.chat_template = None
    try:
        assert not plain.has_chat_template
        with pytest.raises(ConfigError, match="has no chat template"):
            plain.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        hf._tokenizer.chat_template = original


# ---- incremental detokenizing -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 1023), max_size=40), cuts=st.lists(st.integers(1, 5), max_size=6))
def test_pieces_concatenate_to_decoding_everything_at_once(hf: HFTokenizer, ids: list[int], cuts: list[int]) -> None:
    assert "".join(pieces(hf, ids, cuts)) == hf.decode(ids)


@pytest.mark.parametrize("cuts", [[1], [2], [3], [1, 4], [100]])
def test_no_piece_of_valid_text_splits_a_character(hf: HFTokenizer, cuts: list[int]) -> None:
    out = pieces(hf, hf.encode(EMOJI_TEXT), cuts)
    assert "".join(out) == EMOJI_TEXT
    assert not any("\ufffd" in piece for piece in out), out
    if cuts == [1]:
        assert "🙂" in out or any(p.startswith("🙂") for p in out), "the emoji came out whole, once complete"


def test_special_tokens_are_skipped(hf: HFTokenizer) -> None:
    ids = [0, *hf.encode("hi"), 1]
    assert "".join(pieces(hf, ids, [1])) == "hi" == hf.decode(ids)


def test_an_unfinished_character_at_the_end_comes_out_as_the_replacement_character(hf: HFTokenizer) -> None:
    ids = hf.encode("a🙂")[:-1]
    out = pieces(hf, ids, [1])
    assert out[-1] == "\ufffd" and "".join(out) == "a\ufffd" == hf.decode(ids)


# A SentencePiece-like decoder: "▁" is a space, and a sequence's leading space is dropped. Decoding token
# by token would lose every word's space; the window keeps them.
VOCAB = ["▁hello", "▁world", "!", "▁", "a", "\ufffd"]


def spm_decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids).replace("▁", " ").removeprefix(" ")


@given(ids=st.lists(st.integers(0, len(VOCAB) - 1), max_size=20), cuts=st.lists(st.integers(1, 4), max_size=4))
def test_a_decoder_that_drops_the_leading_space_still_concatenates(ids: list[int], cuts: list[int]) -> None:
    assert "".join(pieces(IncrementalDetokenizer(spm_decode), ids, cuts)) == spm_decode(ids)


def test_words_keep_their_spaces_token_by_token() -> None:
    assert pieces(IncrementalDetokenizer(spm_decode), [0, 1, 2], [1]) == ["hello", " world", "!", ""]


# ---- stop strings -------------------------------------------------------------------------------------------


def feed_all(matcher: StopMatcher, parts: Sequence[str]) -> tuple[list[str], bool]:
    out: list[str] = []
    for part in parts:
        emit, stopped = matcher.feed(part)
        out.append(emit)
        if stopped:
            return out, True
    return [*out, matcher.flush()], False


def test_without_stop_strings_text_passes_through() -> None:
    matcher = StopMatcher([])
    assert not matcher.active
    assert matcher.feed("abc") == ("abc", False) and matcher.flush() == ""


def test_a_stop_string_spanning_two_feeds_is_held_back_then_cut() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False), "'ST' may start the stop string"
    assert matcher.feed("OP and more") == ("", True)
    assert matcher.feed("later") == ("", True) and matcher.flush() == "", "nothing after a stop"


def test_held_text_comes_out_once_it_cannot_be_a_stop_string() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed("S") == ("", False)
    assert matcher.flush() == "S", "the text ended without a stop"


def test_the_first_stop_string_to_complete_wins_and_the_longest_at_a_tie() -> None:
    assert feed_all(StopMatcher(["abcd", "bc"]), ["xabcd"]) == (["xa"], True), "bc completes first"
    assert feed_all(StopMatcher(["bc", "abc"]), ["xab", "c"]) == (["x", ""], True), "both at once: the longer"
    assert feed_all(StopMatcher(["aab"]), ["aaa", "ab!"]) == (["a", "a"], True), "overlapping starts"


def test_an_empty_stop_string_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"stop\[1\]='': must be a non-empty string"):
        StopMatcher(["a", ""])


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Where the text stops: the earliest end of a stop string, the longest one at a tie."""
    found = [(i + len(s), -len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return text, False
    end, minus_length = min(found)
    return text[: end + minus_length], True


@given(
    text=st.text("ab!", max_size=30),
    stops=st.lists(st.text("ab", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=5),
)
def test_any_split_of_the_text_stops_where_the_whole_text_would(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    out, stopped = feed_all(StopMatcher(stops), [text[a:b] for a, b in itertools.pairwise(bounds)])
    assert ("".join(out), stopped) == reference(text, stops)


# ---- both together ------------------------------------------------------------------------------------------


def test_a_stop_inside_a_chunk_cuts_the_tokens_after_the_one_that_completed_it() -> None:
    stream = TextStream(ByteTokenizer().detokenizer(), ["lo"])
    assert stream.feed(list(b"hel")) == Piece("he", list(b"hel"))
    assert stream.feed(list(b"lo world")) == Piece("l", list(b"lo"), True), "hel|lo: the held l, then the stop"
    assert stream.stopped and stream.feed(list(b"x")) == Piece("", [], True)
    assert stream.finish() == Piece("", [], True)


def test_the_end_releases_held_text_or_completes_a_stop() -> None:
    stream = TextStream(ByteTokenizer().detokenizer(), ["ab"])
    assert stream.feed(list(b"xa")) == Piece("x", list(b"xa"))
    assert stream.finish() == Piece("a")
    stream = TextStream(ByteTokenizer().detokenizer(), ["x\ufffd"])  # a cut-off character decodes at the end
    assert stream.feed([ord("x"), 0xC3]) == Piece("", [ord("x"), 0xC3])
    assert stream.finish() == Piece("", [], True)


def test_an_emoji_stop_string_spanning_tokens_stops_the_text(hf: HFTokenizer) -> None:
    ids = hf.encode("tea 🙂 then 🙂🙂 and more")
    stream = TextStream(hf.detokenizer(), ["🙂🙂"])
    out = [stream.feed([t]) for t in ids]
    assert "".join(p.text for p in out) == "tea 🙂 then "
    assert [p.stopped for p in out].index(True) == len(hf.encode("tea 🙂 then 🙂🙂")) - 1
    assert sum(len(p.token_ids) for p in out) == len(hf.encode("tea 🙂 then 🙂🙂"))
