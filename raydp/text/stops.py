"""Cutting generated text at the first stop string, as it streams in.

:class:`StopMatcher` sees the text in pieces and never lets out text that
may turn out to be the start of a stop string: it holds back the longest end
of the text that is a start of one, and lets it out once it cannot be (or at
:meth:`~StopMatcher.flush`). Each stop string is matched by a Knuth-Morris-Pratt
automaton, so a piece costs time in its length, whatever the stop strings.

The text stops where a stop string is first complete, as a model that
checks after each character would stop; if several complete at the same
character, the longest wins. What comes out is the text before that stop
string; the stop string itself is not returned (OpenAI's behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence

from raydp.errors import ConfigError


class _Automaton:
    """One stop string's matcher: ``state`` is the longest end of the text so far that starts the stop string."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        self._fallback = _failure(stop)

    def step(self, char: str) -> bool:
        """Take one character; True once the stop string is complete."""
        stop, state = self.stop, self.state
        while state and stop[state] != char:
            state = self._fallback[state - 1]
        if stop[state] == char:
            state += 1
        self.state = state
        return state == len(stop)


def _failure(stop: str) -> list[int]:
    """KMP's prefix function: ``f[i]`` is the longest proper start of ``stop`` that ends ``stop[:i + 1]``."""
    f = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = f[k - 1]
        if stop[i] == stop[k]:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    """Text in, the text before the first stop string out; see the module docstring.

    ``feed(text)`` returns ``(emit, stopped)``: the text that is safe to send,
    and whether a stop string completed (then ``emit`` ends just before it,
    and later calls give nothing). ``flush()`` returns the text still held
    back, once the text has ended without a stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ConfigError(f"stop[{i}]={stop!r}: must be a non-empty string")
        self._automata = [_Automaton(stop) for stop in dict.fromkeys(stops)]
        self._held = ""
        self.stopped = False

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._automata)

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._automata:
            return text, False
        pending = self._held + text
        for i in range(len(self._held), len(pending)):
            char = pending[i]
            done = [a.stop for a in self._automata if a.step(char)]
            if done:
                self.stopped, self._held = True, ""
                return pending[: i + 1 - max(map(len, done))], True
        hold = max(a.state for a in self._automata)
        cut = len(pending) - hold
        self._held = pending[cut:]
        return pending[:cut], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
