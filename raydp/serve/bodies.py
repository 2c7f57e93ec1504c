"""Request bodies of the HTTP API: their models, and parsing with errors that name the field.

pydantic checks the JSON in strict mode (``1.0`` is no int, ``true`` no
token id) and refuses unknown fields; :func:`parse` turns its first complaint
into a 400 whose message reads ``field=value: what is allowed`` and whose
``param`` is the field (``prompt[3]`` for one token). Limits that depend on
the server (the model name, the max_tokens cap, the vocabulary, the number of
ranks) are checked after parsing, by :class:`Limits`.

Completions and chat share OpenAI's sampling fields (``temperature``,
``top_p``, ``seed``, ``stop``) and vLLM's extensions (``top_k``,
``stop_token_ids``, ``ignore_eos``): :meth:`TextBody.sampling` makes the
:class:`~raydp.wire.sampling.Sampling` the engine gets (stop strings stay in
the API server, :meth:`TextBody.stops`), and its refusals are 400s naming the field.

:func:`read_body` reads a body up to ``max_body_bytes`` (a 413 beyond).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import Request

from raydp.errors import ConfigError
from raydp.serve.api_errors import ApiError
from raydp.wire.protocol import MAX_TOKEN_ID  # what the client and the wire accept
from raydp.wire.sampling import MAX_STOP_CHARS, MAX_STOPS, Sampling

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_kind(value: Any) -> str | None:
    return "text" if isinstance(value, str) else "tokens" if isinstance(value, list) else None


Prompt = Annotated[
    Union[Annotated[str, Tag("text"), Field(min_length=1)], Annotated[TokenIds, Tag("tokens")]],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a string or a list of token ids",
    ),
]


def _stop_kind(value: Any) -> str | None:
    return "one" if isinstance(value, str) else "list" if isinstance(value, list) else None


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Annotated[
    Union[Annotated[StopString, Tag("one")], Annotated[list[StopString], Tag("list"), Field(max_length=MAX_STOPS)]],
    Discriminator(
        _stop_kind,
        custom_error_type="stop_type",
        custom_error_message=f"Input should be a string or a list of at most {MAX_STOPS} strings",
    ),
]
_UNION_TAGS = frozenset({"text", "tokens", "one", "list"})  # the unions' tags, which a param does not name
_ENGINE_FIELDS = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class TextBody(_Body):
    """What completions and chat share: the model, streaming, sampling, and ``rank`` (pin to a rank)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = None
    rank: int | None = Field(None, ge=0)
    temperature: float | None = None  # the ranges are Sampling's, checked by sampling()
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None

    def stops(self) -> list[str]:
        """The stop strings, which the API server applies to the text."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def sampling(self) -> Sampling | None:
        """What the engine gets (None: greedy), or a 400 naming the field Sampling refuses."""
        given = {name: getattr(self, name) for name in _ENGINE_FIELDS if getattr(self, name) is not None}
        if given.get("top_k") == -1:
            given["top_k"] = 0  # vLLM's spelling of "every token"
        try:
            sampling = Sampling(**given)
        except ConfigError as exc:
            field = re.match(r"\w+", str(exc))
            raise ApiError(400, str(exc), param=field.group() if field else None) from None
        return None if sampling.is_greedy() else sampling

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options`` without ``stream`` is a 400)."""
        if self.stream_options is None:
            return False
        if not self.stream:
            raise ApiError(
                400,
                f"stream_options={self.stream_options.model_dump()}: allowed only with stream=true",
                param="stream_options",
            )
        return self.stream_options.include_usage


class CompletionBody(TextBody):
    """``POST /v1/completions``: a prompt (text or token ids) and OpenAI's fields that raydp serves."""

    prompt: Prompt
    max_tokens: int = Field(16, ge=1)


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(TextBody):
    """``POST /v1/chat/completions``: ``messages`` and OpenAI's fields that raydp serves.

    ``max_completion_tokens`` is OpenAI's newer name for ``max_tokens`` (it
    wins if both are given); with neither, the server's cap applies.
    """

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def max_new_tokens(self, cap: int) -> int:
        return self.max_completion_tokens or self.max_tokens or cap


_NESTED: dict[str, type[_Body]] = {"stream_options": StreamOptions, "messages": Message}


class GenerateBody(_Body):
    """``POST /v1/generate``: token ids in, token ids out."""

    prompt_token_ids: list[TokenId]
    max_tokens: int = Field(16, ge=1)
    rank: int | None = Field(None, ge=0)


B = TypeVar("B", bound=_Body)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed ``limit`` bytes: from its
    Content-Length before reading any of it, or while reading a chunked one.

    (Starlette's own ``max_body_size`` answers an oversized Content-Length with a
    plain-text 413 whatever the app answers; the API promises its JSON error shape.)
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"Content-Length {declared}", limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(f"more than {limit} bytes", limit)
    return bytes(body)


def _too_large(what: str, limit: int) -> ApiError:
    # Closing is cheaper than reading and discarding the rest of an oversized body.
    return ApiError(
        413,
        f"request body: {what}; must be at most max_body_bytes={limit}",
        code="request_too_large",
        headers={"Connection": "close"},
    )


def parse(model: type[B], body: bytes) -> B:
    """``body`` as a ``model``, or an :class:`ApiError` (400) naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _describe(exc.errors(include_url=False)[0], model) from None


def _describe(error: ErrorDetails, model: type[_Body]) -> ApiError:
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", error["msg"])
        return ApiError(400, f"request body: not valid JSON ({reason})", code="invalid_json")
    if not error["loc"]:
        return ApiError(400, f"request body={_short(error['input'])}: must be a JSON object")
    param = _param(error["loc"])
    if error["type"] == "extra_forbidden":
        owner = _NESTED[str(error["loc"][0])] if len(error["loc"]) > 1 else model
        message = f"{param}: unknown field; allowed fields: {', '.join(owner.model_fields)}"
    elif error["type"] == "missing":
        message = f"{param}: required"
    else:
        message = f"{param}={_short(error['input'])}: {error['msg']}"
    return ApiError(400, message, param=param)


def _param(loc: tuple[int | str, ...]) -> str:
    """``('prompt', 'tokens', 3)`` -> ``prompt[3]``, ``('messages', 0, 'role')`` -> ``messages[0].role``
    (the unions' tags dropped)."""
    param = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part not in _UNION_TAGS:
            param += f".{part}"
    return param


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Limits:
    """What a valid request may ask of this server; each check raises an :class:`ApiError`."""

    model: str
    max_tokens: int
    ranks: int | Callable[[], int]  # a callable follows a cluster that scales
    vocab_size: int | None = None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ApiError(
                404,
                f"model={model!r}: not served here; this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )

    def check_max_tokens(self, max_tokens: int) -> None:
        if max_tokens > self.max_tokens:
            raise ApiError(
                400, f"max_tokens={max_tokens}: must be <= {self.max_tokens} (this server's cap)", param="max_tokens"
            )

    def check_rank(self, rank: int | None) -> None:
        ranks = self.ranks() if callable(self.ranks) else self.ranks
        if rank is not None and rank >= ranks:
            raise ApiError(400, f"rank={rank}: must be in [0, {ranks}) (the cluster's ranks)", param="rank")

    def check_token_ids(self, token_ids: list[int], field: str) -> None:
        if self.vocab_size is None:
            return  # the model checked 0 <= id <= MAX_TOKEN_ID
        for i, token in enumerate(token_ids):
            if token >= self.vocab_size:
                raise ApiError(
                    400,
                    f"{field}[{i}]={token}: must be in [0, {self.vocab_size}) (the vocabulary)",
                    param=f"{field}[{i}]",
                )
