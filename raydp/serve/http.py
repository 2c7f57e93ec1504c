"""A minimal HTTP/JSON front-end process over :class:`~raydp.client.aio.AsyncClient`.

Routes:

* ``POST /v1/generate`` with ``{"prompt_token_ids": [...], "max_tokens": n,
  "rank": r?}`` -> ``{"token_ids": [...]}``; 400 names the bad field, 503
  means the rank (or every rank) is dead, 500 any other raydp error;
* ``GET /health`` -> ``{"status": "ok", "client_index": i, "client_count": n}``.

N such processes share one listening socket (the kernel spreads connections
over them); each has its ``client_index`` of ``client_count`` so the load
balancer can account for its peers.
"""

from __future__ import annotations

import asyncio
import http
import socket
from typing import Any

import msgspec

from raydp.client.aio import AsyncClient
from raydp.client.client import Client
from raydp.errors import ComponentDeadError, ConfigError, RaydpError
from raydp.wire.endpoints import ClusterEndpoints

MAX_BODY = 1 << 20


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    prompt_token_ids: list[int]
    max_tokens: int = 16
    rank: int | None = None


_decode_generate = msgspec.json.Decoder(GenerateRequest)
_encode = msgspec.json.Encoder()


class ApiServer:
    """Serves HTTP on an already-listening socket until cancelled."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.aclient = AsyncClient(client)

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_server(self._connection, sock=sock, limit=MAX_BODY)
        async with server:
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                status, body = await self._route(*request)
                _write_response(writer, status, body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # a broken or malformed connection only ends itself
        finally:
            writer.close()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if method == "GET" and path == "/health":
            return 200, {"status": "ok", "client_index": self.client.client_index,
                         "client_count": self.client.client_count}
        if method == "POST" and path == "/v1/generate":
            return await self._generate(body)
        return 404, {"error": f"no route {method} {path}; try POST /v1/generate or GET /health"}

    async def _generate(self, body: bytes) -> tuple[int, Any]:
        try:
            req = _decode_generate.decode(body)
        except msgspec.DecodeError as exc:
            return 400, {"error": f"bad request body: {exc}"}
        try:
            tokens = await self.aclient.generate(req.prompt_token_ids, req.max_tokens, rank=req.rank)
        except ConfigError as exc:
            return 400, {"error": str(exc)}
        except ComponentDeadError as exc:
            return 503, {"error": str(exc)}
        except RaydpError as exc:
            return 500, {"error": str(exc)}
        return 200, {"token_ids": tokens}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    length = int(headers.get("content-length", "0"))
    if length > MAX_BODY:
        raise ValueError(f"body of {length} bytes exceeds {MAX_BODY}")
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _write_response(writer: asyncio.StreamWriter, status: int, payload: Any) -> None:
    body = _encode.encode(payload)
    reason = http.HTTPStatus(status).phrase
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


def serve_forever(
    sock: socket.socket, endpoints: ClusterEndpoints, client_index: int, client_count: int, node_id: str | None
) -> None:
    """Run one API server on ``sock`` until the process is told to stop."""
    client = Client(endpoints, node_id=node_id, client_index=client_index, client_count=client_count)
    try:
        asyncio.run(ApiServer(client).serve(sock))
    finally:
        client.close()
