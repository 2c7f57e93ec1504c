"""A small torch transformer LM: raydp's reference engine core.

Real enough to exercise what an inference engine does each step (batch the
running requests, run a forward pass on the rank's device, sample greedily,
stream tokens, admit waiting requests when slots free up), small enough to run
on a laptop CPU. Weights are seeded, not trained: the point is the compute and
the scheduling, not the text.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from raydp.engine.core import EngineContext
from raydp.errors import ConfigError
from raydp.models.reference import ReferenceEngine, Running, fit_prompt
from raydp.wire.protocol import Output, Request


class TinyTransformer(nn.Module):  # type: ignore[misc]
    """A decoder-only transformer with learned positions and a causal mask."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits of each sequence in a right-padded batch.

        Right padding plus the causal mask keep a sequence's real tokens from
        ever seeing the padding, so its output does not depend on what it was
        batched with.
        """
        width = tokens.shape[1]
        positions = torch.arange(width, device=tokens.device)
        mask = nn.Transformer.generate_square_subsequent_mask(width, device=tokens.device)
        hidden = self.blocks(self.embed(tokens) + self.pos(positions), mask=mask, is_causal=True)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        last = lengths - 1 if lengths is not None else torch.full_like(rows, width - 1)
        logits: torch.Tensor = self.head(hidden[rows, last])
        return logits


@dataclass(kw_only=True)
class _Sequence(Running):
    tokens: list[int]  # the prompt and every token produced so far


class TinyLMEngine(ReferenceEngine[_Sequence]):
    """Greedy decoding over a batch of at most ``max_running`` sequences.

    ``prefix_cache_blocks`` and ``max_loras`` keep the reference engines'
    prefix cache and adapter slots (names only: adapters do not change the
    tokens), reported as vLLM engines report theirs.
    """

    engine_name: ClassVar[str] = "TinyLMEngine"

    def __init__(
        self,
        context: EngineContext,
        vocab: int = 256,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        max_len: int = 128,
        max_running: int = 32,
        seed: int = 0,
        step_delay_s: float = 0.0,
        prefix_cache_blocks: int = 0,
        block_size: int = 16,
        max_loras: int = 0,
        adapter_load_s: float = 0.0,
    ) -> None:
        if step_delay_s < 0:
            raise ConfigError(f"step_delay_s={step_delay_s!r}: must be >= 0 (seconds added to each busy step)")
        super().__init__(max_running)
        self.keep_prefix_cache(prefix_cache_blocks, block_size)  # which blocks it would hold: see ReferenceEngine
        self.keep_adapters(max_loras, adapter_load_s)
        self.step_delay_s = step_delay_s  # slows a stream down for tests that act in the middle of one
        torch.manual_seed(seed)
        torch.set_num_threads(int(os.environ.get("RAYDP_TORCH_THREADS", "1")))
        self.context = context
        self.device = torch.device("cuda" if torch.cuda.is_available() and context.device_ids else "cpu")
        self.model = TinyTransformer(vocab, dim, layers, heads, max_len).to(self.device).eval()
        self.vocab, self.max_len = vocab, max_len

    def capacity(self) -> int:
        return self.max_running * self.max_len

    def _start(self, request: Request) -> _Sequence:
        prompt, budget = fit_prompt(request, self.vocab, self.max_len)
        return _Sequence(budget=budget, tokens=prompt)

    def _on_token(self, state: _Sequence, token: int) -> None:
        state.tokens.append(token)  # the next step feeds it back

    def step(self) -> list[Output]:
        self._admit()
        if not self._running:
            return []
        ids = list(self._running)
        seqs = [self._running[r].tokens for r in ids]
        width = max(len(s) for s in seqs)
        batch = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=self.device)
        lengths = torch.tensor([len(s) for s in seqs], device=self.device)
        with torch.inference_mode():
            next_tokens = self.model(batch, lengths).argmax(dim=-1).tolist()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return [self._advance(rid, tok) for rid, tok in zip(ids, next_tokens, strict=True)]

    def execute_dummy_batch(self) -> None:
        with torch.inference_mode():
            self.model(torch.zeros((1, 1), dtype=torch.long, device=self.device))

    def stats(self) -> dict[str, Any]:
        return {"device": str(self.device), "params": sum(p.numel() for p in self.model.parameters())}
