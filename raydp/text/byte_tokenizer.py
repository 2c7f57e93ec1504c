"""The byte-level tokenizer: one token per UTF-8 byte.

* ``encode(text)``: the text's UTF-8 bytes, each a token id in 0..255;
* ``decode(ids)``: the same bytes back to text. A byte sequence that is not
  valid UTF-8 decodes as U+FFFD (the replacement character), and so does an id
  outside 0..255 (an engine with a larger vocabulary may produce one), so
  every output has a text;
* :class:`StreamDecoder` decodes a stream chunk by chunk: a character whose
  bytes are split over two chunks comes out whole, with the second;
* :class:`ByteTokenizer`: all of it as a :class:`~raydp.text.tokenizer.TextTokenizer`.

It needs no vocabulary file and fits any engine that takes token ids, which
is what raydp's engines do (TinyLM's vocabulary is exactly these 256 ids).
It has no end-of-sequence token and no chat template.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence

from raydp.errors import ConfigError

VOCAB_SIZE = 256
_INVALID = 0xFF  # never valid in UTF-8: an id outside 0..255 becomes U+FFFD


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(token_ids: Iterable[int]) -> str:
    decoder = StreamDecoder()
    return decoder.feed(token_ids) + decoder.flush()


class StreamDecoder:
    """Incremental :func:`decode`: ``feed`` chunks in order, then ``flush`` once."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: Iterable[int]) -> str:
        return self._decoder.decode(bytes(t if 0 <= t < VOCAB_SIZE else _INVALID for t in token_ids))

    def flush(self) -> str:
        """The text of bytes still held (an unfinished character decodes as U+FFFD)."""
        return self._decoder.decode(b"", final=True)


class ByteTokenizer:
    """The byte tokenizer as a :class:`~raydp.text.tokenizer.TextTokenizer`."""

    name = "the byte tokenizer (one token per UTF-8 byte)"
    vocab_size = VOCAB_SIZE
    eos_token_ids: frozenset[int] = frozenset()
    has_chat_template = False

    def encode(self, text: str) -> list[int]:
        return encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode(token_ids)

    def detokenizer(self) -> StreamDecoder:
        return StreamDecoder()

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        raise ConfigError(
            f"{self.name} has no chat template; serve a tokenizer that has one (tokenizer=DIR, "
            "raydp serve --tokenizer DIR) to render chat messages"
        )
