"""The byte tokenizer, where the HTTP API first had it: it lives in :mod:`raydp.text.byte_tokenizer` now."""

from __future__ import annotations

from raydp.text.byte_tokenizer import VOCAB_SIZE, StreamDecoder, decode, encode

__all__ = ["VOCAB_SIZE", "StreamDecoder", "decode", "encode"]
