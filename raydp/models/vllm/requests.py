"""raydp requests into vLLM requests, and vLLM outputs back into raydp outputs.

Kept apart from the engine so that the mapping reads in one place:

* :func:`sampling_params`: a request's :class:`~raydp.wire.sampling.Sampling`
  (None: greedy) and ``max_tokens`` as ``vllm.SamplingParams``. The prompt and
  parameters then go through vLLM's own ``InputProcessor``, which adds the
  model's end-of-sequence tokens and generation-config defaults exactly as
  ``LLM.generate`` does, and validates the request against the model (a
  prompt longer than ``max_model_len`` fails that request alone).
* :class:`Tracked`: what the engine remembers of a request in flight, for
  ``work()`` and for ``stop`` strings. vLLM's engine core leaves stop strings
  to its front-end's detokenizer; raydp's ranks detokenize themselves, only
  for requests that set ``stop``.
* :func:`finish_reason`: vLLM's ``FinishReason`` as the OpenAI string.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from raydp.wire.sampling import Sampling

_REASONS = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "stop"}  # vLLM's FinishReason values


def sampling_params(sampling: Sampling | None, max_tokens: int) -> Any:
    from vllm import SamplingParams

    s = sampling if sampling is not None else Sampling()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        # stop strings are matched by the rank (Tracked), not by vLLM's engine core
    )


def resumed(params: Any, streamed: int) -> Any:
    """The sampling parameters of a stream resumed on another rank with ``streamed`` tokens already out (now
    at the end of its prompt): that many fewer to make, and its prompt's logprobs, sent with its first
    output, not sent twice."""
    if params is None:
        return params
    params = copy.copy(params)
    params.prompt_logprobs = None
    if params.max_tokens is not None:
        params.max_tokens = max(1, params.max_tokens - streamed)
    params.min_tokens = max(0, params.min_tokens - streamed)
    return params


def prefill_params(params: Any) -> Any:
    """The sampling parameters of a P/D request's prefill: the first token only (the decode rank makes
    the rest), with ``min_tokens`` capped to it so the end-of-sequence rule for that token stays."""
    params = copy.copy(params)
    params.max_tokens = 1
    params.min_tokens = min(params.min_tokens, 1)
    return params


def finish_reason(reason: Any) -> str | None:
    """``FinishReason.LENGTH`` -> ``'length'``; None stays None."""
    return None if reason is None else _REASONS.get(int(reason), "stop")


@dataclass
class Tracked:
    """A request in flight: its token budget, and its generated text while it has stop strings."""

    max_tokens: int
    stops: list[str]
    native: bool = False  # vLLM's own request, for vLLM's own front-end
    prefill_only: bool = False  # P/D: its first token hands it to a decode rank
    kv_folders: tuple[str, ...] = ()  # with the ExampleConnector: the KV files it stores or loads (kv_files)
    produced: int = 0
    generated: list[int] = field(default_factory=list)

    def add(self, token_ids: list[int]) -> None:
        self.produced += len(token_ids)
        if self.stops:
            self.generated.extend(token_ids)

    def left(self) -> int:
        return max(self.max_tokens - self.produced, 0)

    def hit_stop(self, tokenizer: Any) -> bool:
        """Whether the text so far contains a stop string (the API server trims the text itself)."""
        if not self.stops or not self.generated:
            return False
        # The newest token can complete a stop string that began a few tokens back: decode a
        # window long enough for the longest one (a token holds at least one byte of text).
        window = self.generated[-(max(len(s.encode()) for s in self.stops) + 4) :]
        text = tokenizer.decode(window, skip_special_tokens=True)
        return any(stop in text for stop in self.stops)
