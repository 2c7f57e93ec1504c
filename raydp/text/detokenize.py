"""Incremental detokenizing for tokenizers whose pieces depend on their neighbours.

A Hugging Face tokenizer cannot decode token by token and concatenate: a
character may span several byte tokens (an emoji in a byte-level BPE), and
decoders such as SentencePiece's drop the leading space of a sequence's
first token. :class:`IncrementalDetokenizer` keeps a sliding window instead
(the method vLLM and Hugging Face's ``DecodeStream`` use): each new token is
decoded together with the tokens since ``prefix``, and the text beyond what
the window up to ``read`` already gave is new. Text that ends in U+FFFD may be
a character still arriving, so it waits for the next token, and
:meth:`~IncrementalDetokenizer.flush` gives what is left once the stream ends.

The pieces concatenate to ``decode(all_ids)``, and for valid text no piece
ends inside a character.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Final

REPLACEMENT: Final = "\ufffd"  # what a decoder makes of bytes that are (so far) no character


class IncrementalDetokenizer:
    """``decode`` applied incrementally: ``feed`` token chunks in order, then ``flush`` once.

    ``decode`` must decode a sequence of ids on its own (for a Hugging Face
    tokenizer: ``tokenizer.decode(ids, skip_special_tokens=True)``).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here: the tokens before ``read`` that give later ones context
        self._read = 0  # the text of the tokens before here is out
        self._prefix_text = ""  # decode(ids[prefix:read])

    def feed(self, token_ids: Iterable[int]) -> str:
        """The text the new tokens complete (possibly empty)."""
        pieces = []
        for token in token_ids:
            self._ids.append(token)
            # Token by token, so that a chunk ending inside a character still gives the characters before it.
            text = self._decode(self._ids[self._prefix :])
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT):
                pieces.append(text[len(self._prefix_text) :])
                self._advance()
        return "".join(pieces)

    def flush(self) -> str:
        """The text still held back at the end of the stream (an unfinished character as U+FFFD)."""
        text = self._decode(self._ids[self._prefix :])
        rest = text[len(self._prefix_text) :]
        self._advance()
        return rest

    def _advance(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
