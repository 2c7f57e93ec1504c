"""What the HTTP API needs of a tokenizer (:class:`TextTokenizer`), and :func:`load_tokenizer`.

Two tokenizers meet the protocol: the byte tokenizer
(:class:`~raydp.text.byte_tokenizer.ByteTokenizer`, the default: no files,
no chat template) and a Hugging Face tokenizer loaded from a local directory
(:class:`~raydp.text.hf_tokenizer.HFTokenizer`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from raydp.text.byte_tokenizer import ByteTokenizer

ChatMessage = Mapping[str, str]  # {"role": ..., "content": ...}, as OpenAI's chat API sends them


class Detokenizer(Protocol):
    """Token ids in, text out, chunk by chunk: ``feed`` the chunks in order, then ``flush`` once.

    The concatenated output equals decoding all the ids at once, and no chunk
    ends inside a character.
    """

    def feed(self, token_ids: Iterable[int]) -> str: ...

    def flush(self) -> str: ...


class TextTokenizer(Protocol):
    """A tokenizer as the HTTP API uses it.

    ``name`` says which one it is, in error messages; ``vocab_size`` bounds
    the token ids a request may send; ``eos_token_ids`` are the ids that end a
    sequence (none for the byte tokenizer).
    """

    @property
    def name(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def detokenizer(self) -> Detokenizer:
        """A fresh :class:`Detokenizer` for one stream of ids."""
        ...

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The prompt for ``messages``, ending where the assistant's answer starts.

        Raises :class:`~raydp.errors.ConfigError` if the tokenizer has no chat
        template, or its template refuses the messages.
        """
        ...


def load_tokenizer(path: str | None) -> TextTokenizer:
    """The tokenizer in the local directory ``path`` (no download), or the byte tokenizer for None.

    Raises :class:`~raydp.errors.ConfigError` naming ``tokenizer=path`` when
    there is no directory there or no tokenizer in it.
    """
    if path is None:
        return ByteTokenizer()
    from raydp.text.hf_tokenizer import HFTokenizer  # imports transformers, a cost only a user of it pays

    return HFTokenizer.load(path)
