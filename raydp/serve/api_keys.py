"""``ApiKeys``: the bearer-key check in front of the API routes, as ASGI middleware.

With keys configured, every request to a ``/v1/`` route (and ``/metrics``
when protected) must carry ``Authorization: Bearer KEY`` with one of them,
as OpenAI's SDKs send their ``api_key``. Anything else gets a 401 in
OpenAI's error shape (code ``invalid_api_key``) with ``WWW-Authenticate:
Bearer``, before the body is read. ``/health`` and ``/ready`` stay open for probes.

Why digests: the presented key is hashed and compared with every configured
key's SHA-256 digest by :func:`hmac.compare_digest`, all of them, every time.
Equal-length digests make the comparison's time independent of where (or
whether) the key differs and of its length; the keys themselves are never
kept in the app, logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from raydp.serve.api_errors import ApiError

_MISSING = ApiError(
    401,
    "missing API key: send 'Authorization: Bearer KEY' (the OpenAI SDK's api_key)",
    code="invalid_api_key",
    headers={"WWW-Authenticate": "Bearer"},
)
_WRONG = ApiError(401, "incorrect API key provided", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """ASGI middleware: see the module docstring. ``keys`` empty means no check at all (``build_app`` then
    leaves it out)."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], protect_metrics: bool = False) -> None:
        self.app = app
        self._digests = [_digest(k.encode()) for k in keys]
        self._prefixes = ("/v1/", "/metrics") if protect_metrics else ("/v1/",)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._digests and scope["path"].startswith(self._prefixes):
            refusal = self._refusal(dict(scope["headers"]).get(b"authorization"))
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, header: bytes | None) -> ApiError | None:
        if header is None:
            return _MISSING
        scheme, _, key = header.partition(b" ")
        presented = _digest(key.strip())
        matched = False
        for digest in self._digests:  # every one, whatever matched before
            matched |= hmac.compare_digest(presented, digest)
        return None if matched and scheme.lower() == b"bearer" else _WRONG
