"""One generation's text: token chunks in, text pieces out, cut at the first stop string.

:class:`TextStream` runs each token through a
:class:`~raydp.text.tokenizer.Detokenizer` and a
:class:`~raydp.text.stops.StopMatcher`, and says which tokens a piece covers:
when a stop string completes inside a chunk, the tokens after the one that
completed it are cut off too (they were generated past the stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raydp.text.stops import StopMatcher
from raydp.text.tokenizer import Detokenizer


@dataclass(frozen=True)
class Piece:
    """Text to send, the tokens it covers, and whether a stop string ended the text with it."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    stopped: bool = False


class TextStream:
    """See the module docstring: ``feed`` each token chunk in order, then ``finish`` once."""

    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str] = ()) -> None:
        self._detokenizer = detokenizer
        self._matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def feed(self, token_ids: Sequence[int]) -> Piece:
        if self.stopped:
            return Piece("", [], True)
        if not self._matcher.active:  # nothing to cut at: the whole chunk at once
            return Piece(self._detokenizer.feed(token_ids), list(token_ids))
        texts = []
        for i, token in enumerate(token_ids):
            text, stopped = self._matcher.feed(self._detokenizer.feed((token,)))
            texts.append(text)
            if stopped:
                return Piece("".join(texts), list(token_ids[: i + 1]), True)
        return Piece("".join(texts), list(token_ids))

    def finish(self) -> Piece:
        """The text held back when the tokens ended (a stop string may still complete in it)."""
        if self.stopped:
            return Piece("", [], True)
        text, stopped = self._matcher.feed(self._detokenizer.flush())
        return Piece(text if stopped else text + self._matcher.flush(), [], stopped)
