"""``ServerSettings``: the knobs of an API server process, validated once.

The app's (:func:`~raydp.serve.app.build_app`) and the connection's
(:func:`~raydp.serve.server.serve_on_socket`) in one picklable object, so a
spawned API server process gets them as one argument. Every validation
failure is a :class:`~raydp.errors.ConfigError` naming the field, the value
and what is allowed (an API key's value excepted: it is never shown). Times
are in seconds.

:class:`ServeEnvironment` reads what ``raydp serve`` takes from the
environment (``RAYDP_API_KEY``), with pydantic-settings.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from raydp.client.balancer import DEFAULT_PREFIX_LOAD_MARGIN, WAITING_WEIGHT, Policy
from raydp.client.client import Client
from raydp.config import format_validation_error
from raydp.errors import ConfigError
from raydp.wire.endpoints import ClusterEndpoints

MAX_TOKENS_LIMIT = 1 << 20
MAX_KEY_CHARS = 512


class ServerSettings(BaseModel):
    """See the module docstring; field descriptions say what each one bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, min_length=1, description="model id served (default: the cluster's name)")
    max_body_bytes: int = Field(1 << 20, ge=1, description="largest request body; more is a 413")
    request_timeout_s: float = Field(300.0, gt=0, description="a request running longer gets a 504")
    max_tokens_limit: int = Field(MAX_TOKENS_LIMIT, ge=1, description="largest max_tokens a request may ask")
    vocab_size: int | None = Field(
        None,
        ge=1,
        description="token ids must be below it (default: the tokenizer's "
        "vocabulary if one is given, else any < 2**31)",
    )
    tokenizer: str | None = Field(
        None,
        min_length=1,
        description="local directory of a Hugging Face tokenizer for "
        "text and chat (default: the byte tokenizer, one token per UTF-8 byte)",
    )
    idle_timeout_s: float = Field(5.0, gt=0, description="an idle connection is closed after it")
    read_timeout_s: float = Field(10.0, gt=0, description="a request must arrive whole within it of its first byte")
    max_connections: int = Field(2048, ge=1, description="open connections per process before requests get a 503")
    graceful_shutdown_s: float = Field(3.0, ge=0, description="on shutdown, running requests get this long")
    balancer: Policy = Field("least-loaded", description="how the server's client picks a rank for a request")
    prefix_load_margin: int = Field(
        DEFAULT_PREFIX_LOAD_MARGIN,
        ge=0,
        description="balancer 'prefix': a prompt "
        "leaves its prefix's rank once that rank's load passes the least-loaded "
        f"one's by this (score: {WAITING_WEIGHT} per waiting request, 1 per running)",
    )
    adapter_affinity: bool = Field(
        True,
        description="send a LoRA adapter's requests to the ranks that hold it (within a load margin); "
        "False routes adapter-blind",
    )
    max_restarts: int = Field(3, ge=0, description="times a dead server process is spawned again on the socket")
    startup_timeout_s: float = Field(
        300.0,
        gt=0,
        description="every server process must be serving within this of its spawn, or the start fails "
        "(a StartupError naming it); vLLM's front-end takes tens of seconds on a small machine",
    )
    ready_quorum: int = Field(
        1, ge=1, description="GET /ready answers 200 while this many ranks generate a one-token probe (else 503)"
    )
    migration_limit: int = Field(
        0,
        ge=0,
        description="times a stream may move to a live rank when its rank "
        "dies mid-stream, continuing from its last token (0: it fails, as without)",
    )
    api_keys: tuple[SecretStr, ...] = Field(
        (), description="if any, every /v1/* request needs 'Authorization: Bearer KEY' with one of them"
    )
    protect_metrics: bool = Field(False, description="GET /metrics needs an API key too (default: open)")
    ssl_certfile: str | None = Field(None, description="PEM certificate (chain): serve HTTPS")
    ssl_keyfile: str | None = Field(None, description="PEM private key of ssl_certfile")
    ssl_ca_certs: str | None = Field(None, description="PEM CA bundle: clients must present a certificate it signed")
    vllm_args: tuple[str, ...] = Field(
        (),
        description="if any, `vllm serve`'s flags (--model first): the server runs vLLM's own OpenAI "
        "front-end with them instead of raydp's (raydp.serve.vllm_server), with this object's TLS files and keys",
    )

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys(cls, keys: Any) -> tuple[SecretStr, ...]:
        # Checked here, so that no error message (and no log line after it) ever repeats a key.
        if isinstance(keys, (str, SecretStr)) or not isinstance(keys, (list, tuple)):
            raise ValueError(f"a {type(keys).__name__}; must be a list of API key strings")
        out = []
        for i, key in enumerate(keys):
            plain = key.get_secret_value() if isinstance(key, SecretStr) else key
            if (
                not isinstance(plain, str)
                or not 0 < len(plain) <= MAX_KEY_CHARS
                or not all("!" <= c <= "~" for c in plain)
            ):
                raise ValueError(
                    f"entry {i} (value not shown): must be 1 to {MAX_KEY_CHARS} visible ASCII characters, no spaces"
                )
            out.append(SecretStr(plain))
        return tuple(out)

    @field_validator("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")
    @classmethod
    def _a_file(cls, path: str | None) -> str | None:
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{path!r} is no file; must be a readable PEM file")
        return path

    @model_validator(mode="after")
    def _tls_pairs(self) -> ServerSettings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError(
                f"ssl_certfile={self.ssl_certfile!r}, ssl_keyfile={self.ssl_keyfile!r}: HTTPS needs "
                "both, or neither for plain HTTP"
            )
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError(
                f"ssl_ca_certs={self.ssl_ca_certs!r}: client certificates need HTTPS; set "
                "ssl_certfile and ssl_keyfile too"
            )
        if self.protect_metrics and not self.api_keys:
            raise ValueError("protect_metrics=True: needs at least one API key in api_keys")
        return self

    def client(
        self,
        endpoints: ClusterEndpoints,
        client_index: int,
        client_count: int,
        node_id: str | None,
        ranks: list[int] | None,
    ) -> Client:
        """The cluster client an API server with these settings routes with (to ``ranks`` only, if given)."""
        return Client(
            endpoints,
            node_id=node_id,
            client_index=client_index,
            client_count=client_count,
            ranks=ranks,
            balancer=self.balancer,
            migration_limit=self.migration_limit,
            prefix_load_margin=self.prefix_load_margin,
            adapter_affinity=self.adapter_affinity,
        )

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    @field_validator("tokenizer")
    @classmethod
    def _a_directory(cls, path: str | None) -> str | None:
        # Only that it is a directory: loading it is for the servers (``load_tokenizer``), and costs an import.
        if path is not None and not os.path.isdir(path):
            raise ValueError(
                f"{path!r} is no directory; must be a local directory holding a Hugging Face "
                "tokenizer (tokenizer.json or tokenizer_config.json)"
            )
        return path

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, ServerSettings, "API server settings")) from None


class ServeEnvironment(BaseSettings):
    """What ``raydp serve`` reads from the environment: ``RAYDP_API_KEY`` (kept out of ``ps``, unlike a flag)."""

    model_config = SettingsConfigDict(env_prefix="RAYDP_", extra="ignore")

    api_key: SecretStr | None = None
