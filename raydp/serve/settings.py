"""``ServerSettings``: the knobs of an API server process, validated once.

The app's (:func:`~raydp.serve.app.build_app`) and the connection's
(:func:`~raydp.serve.server.serve_on_socket`) in one picklable object, so a
spawned API server process gets them as one argument. Every validation
failure is a :class:`~raydp.errors.ConfigError` naming the field, the value
and what is allowed. Times are in seconds.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raydp.client.balancer import Policy
from raydp.config import format_validation_error
from raydp.errors import ConfigError

MAX_TOKENS_LIMIT = 1 << 20


class ServerSettings(BaseModel):
    """See the module docstring; field descriptions say what each one bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, min_length=1, description="model id served (default: the cluster's name)")
    max_body_bytes: int = Field(1 << 20, ge=1, description="largest request body; more is a 413")
    request_timeout_s: float = Field(300.0, gt=0, description="a request running longer gets a 504")
    max_tokens_limit: int = Field(MAX_TOKENS_LIMIT, ge=1, description="largest max_tokens a request may ask")
    vocab_size: int | None = Field(None, ge=1, description="token ids must be below it (default: the tokenizer's "
                                   "vocabulary if one is given, else any < 2**31)")
    tokenizer: str | None = Field(None, min_length=1, description="local directory of a Hugging Face tokenizer for "
                                  "text and chat (default: the byte tokenizer, one token per UTF-8 byte)")
    idle_timeout_s: float = Field(5.0, gt=0, description="an idle connection is closed after it")
    read_timeout_s: float = Field(10.0, gt=0, description="a request must arrive whole within it of its first byte")
    max_connections: int = Field(2048, ge=1, description="open connections per process before requests get a 503")
    graceful_shutdown_s: float = Field(3.0, ge=0, description="on shutdown, running requests get this long")
    balancer: Policy = Field("least-loaded", description="how the server's client picks a rank for a request")
    max_restarts: int = Field(3, ge=0, description="times a dead server process is spawned again on the socket")

    @field_validator("tokenizer")
    @classmethod
    def _a_directory(cls, path: str | None) -> str | None:
        # Only that it is a directory: loading it is for the servers (``load_tokenizer``), and costs an import.
        if path is not None and not os.path.isdir(path):
            raise ValueError(f"{path!r} is no directory; must be a local directory holding a Hugging Face "
                             "tokenizer (tokenizer.json or tokenizer_config.json)")
        return path

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, ServerSettings, "API server settings")) from None
