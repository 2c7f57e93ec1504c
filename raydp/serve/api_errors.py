"""Errors as the HTTP API returns them: OpenAI's error shape, with the status that fits.

Every error body is ``{"error": {"message", "type", "param", "code"}}``; the
message names the field, the value given and what is allowed, and ``param``
names the field (null when no one field is at fault).

====== ======================= ====================================================
status type                    when
====== ======================= ====================================================
400    invalid_request_error   malformed JSON, an unknown field, a bad value
401    invalid_request_error   a missing or wrong API key (``invalid_api_key``, :mod:`.api_keys`)
404    invalid_request_error   unknown route (code ``not_found``) or model (``model_not_found``)
405    invalid_request_error   a route asked with the wrong method (``method_not_allowed``)
413    invalid_request_error   a body over ``max_body_bytes`` (``request_too_large``);
                               the connection is closed after the answer
500    server_error            the request failed inside its engine, or a bug
503    service_unavailable     the chosen rank, or every rank, is dead (``engine_unavailable``),
                               the server is stopping (``shutting_down``, :mod:`.draining`), or
                               its process is at ``max_connections`` (``server_overloaded``)
504    timeout                 the request ran past ``request_timeout_s``
====== ======================= ====================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from raydp.errors import ClusterClosedError, ComponentDeadError, ConfigError, RaydpError, ShuttingDownError
from raydp.serve.responses import JSON

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(RaydpError):
    """An error answer: raised anywhere in a handler, rendered by :func:`api_error_handler`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return JSON(self.body(), status_code=self.status, headers=self.headers)


def from_raydp_error(exc: RaydpError) -> ApiError:
    """The answer to a request the client could not serve."""
    if isinstance(exc, ApiError):  # already an answer
        return exc
    if isinstance(exc, ConfigError):
        return ApiError(400, str(exc))
    if isinstance(exc, ShuttingDownError):
        return ApiError(503, str(exc), code="shutting_down")
    if isinstance(exc, (ComponentDeadError, ClusterClosedError)):
        return ApiError(503, str(exc), code="engine_unavailable")
    return ApiError(500, str(exc), code="engine_error")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no route, wrong method) in the API's shape."""
    assert isinstance(exc, HTTPException)
    return _describe(request, exc).response()


async def internal_error_handler(request: Request, exc: Exception) -> Response:
    """A bug: a 500 in the API's shape (Starlette still logs the traceback)."""
    return ApiError(500, f"internal server error ({type(exc).__name__})").response()


def _describe(request: Request, exc: HTTPException) -> ApiError:
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        return ApiError(404, f"no route {method} {path}; routes: {_routes(request)}", code="not_found")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return ApiError(
            405,
            f"method {method} is not allowed on {path}; allowed: {allowed}",
            code="method_not_allowed",
            headers=exc.headers,
        )
    return ApiError(exc.status_code, exc.detail, headers=exc.headers)


def _routes(request: Request) -> str:
    routes = [r for r in request.app.routes if isinstance(r, Route)]
    return ", ".join(f"{'/'.join(sorted((r.methods or set()) - {'HEAD'}))} {r.path}" for r in routes)
