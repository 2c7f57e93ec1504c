"""A Hugging Face tokenizer from a local directory, as a :class:`~raydp.text.tokenizer.TextTokenizer`.

Loaded with ``transformers.AutoTokenizer`` and ``local_files_only``: a model
or tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``, ...),
never a download. String prompts are encoded as vLLM encodes them (with the
tokenizer's special tokens, a BOS where it adds one); chat prompts are the
tokenizer's chat template with the generation prompt, whose special tokens
the template writes itself. Text comes back without special tokens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from raydp.errors import ConfigError
from raydp.text.detokenize import IncrementalDetokenizer

_WHAT = "must be a local directory holding a Hugging Face tokenizer (tokenizer.json or tokenizer_config.json)"


class HFTokenizer:
    """See the module docstring; :meth:`load` builds one from a directory."""

    def __init__(self, tokenizer: Any, path: str) -> None:
        self._tokenizer = tokenizer
        self.path = path
        self.name = f"the tokenizer in {path!r}"
        self.vocab_size: int = len(tokenizer)  # added tokens included: the ids an engine may see
        self.eos_token_ids = frozenset(_eos_ids(tokenizer))

    @classmethod
    def load(cls, path: str) -> HFTokenizer:
        """Raises :class:`~raydp.errors.ConfigError` naming ``tokenizer=path`` if none loads from there."""
        if not isinstance(path, str) or not path:
            raise ConfigError(f"tokenizer={path!r}: {_WHAT}")
        if not os.path.isdir(path):
            raise ConfigError(f"tokenizer={path!r}: no such directory; {_WHAT}")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError, ... by file and version
            raise ConfigError(
                f"tokenizer={path!r}: no tokenizer loads from it ({type(exc).__name__}: {_first_line(exc)}); {_WHAT}"
            ) from None
        return cls(tokenizer, path)

    @property
    def has_chat_template(self) -> bool:
        return getattr(self._tokenizer, "chat_template", None) is not None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer.encode(text)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise ConfigError(
                f"{self.name} has no chat template (no chat_template in its tokenizer_config.json "
                "or chat_template.jinja); serve one that has to render chat messages"
            )
        try:
            ids = self._tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception as exc:  # jinja's TemplateError, or a template's own raise_exception(...)
            raise ConfigError(
                f"messages: the chat template of {self.name} refused them ({type(exc).__name__}: {_first_line(exc)})"
            ) from None
        return [int(t) for t in ids]


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else []


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
