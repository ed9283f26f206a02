"""A small HTTP/1.1 server for the operator endpoints (each service's ``/metrics``, ``hetsched console``):
asyncio streams, one request per connection, and two limits a hostile client cannot get around.

* **A read timeout**: a connection must send its whole request (head and body) within
  ``read_timeout_s`` of being accepted, and take its answer within as long again; otherwise it is closed.
* **A cap on concurrent connections**: at most ``max_connections`` are open at once. A connection
  arriving at the cap displaces the oldest one that has not finished sending its request (an idle one
  cannot keep a scrape out); when every open connection is being answered, the newcomer gets ``503``.

A connection is a coroutine, not a thread, so neither idle connections nor a flood of them adds threads
(prometheus-client's ``start_http_server`` starts one thread per connection, with no timeout: issue 23
row 6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("hetsched.http")

REASONS = {
    200: "OK",
    303: "See Other",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(frozen=True, slots=True)
class Limits:
    """What one server allows: concurrent connections, the time to send a request (and to take the answer),
    the size of a request's head and of its body (0: no body)."""

    max_connections: int
    read_timeout_s: float
    max_head_bytes: int = 16 * 1024
    max_body_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]  # lower-case names; a repeated header's values joined by ", "
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Awaitable[Response]]


def encode(response: Response, *, head: bool = False, common: tuple[tuple[str, str], ...] = ()) -> bytes:
    """The response on the wire; ``head``: without its body (a HEAD request)."""
    lines = [
        f"HTTP/1.1 {response.status} {REASONS.get(response.status, '')}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in (*common, *response.headers)),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else response.body)


class _BadRequest(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """Method, target and headers of a request head (ended by an empty line); ``_BadRequest`` if malformed."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
        raise _BadRequest(400, "bad request line")
    if not parts[1].startswith("/"):  # origin-form only: no absolute URL naming another host than Host
        raise _BadRequest(400, "bad request target")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise _BadRequest(400, "bad header line")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    return parts[0], parts[1], headers


@dataclass(eq=False, slots=True)
class _Connection:
    writer: asyncio.StreamWriter
    reading: bool = True  # until its whole request is in: the kind the cap displaces

    def drop(self) -> None:
        self.writer.transport.abort()


class HttpServer:
    """Serves ``handler`` within ``limits``. ``common``: headers added to every response."""

    def __init__(self, handler: Handler, limits: Limits, *, common: tuple[tuple[str, str], ...] = ()) -> None:
        self.handler = handler
        self.limits = limits
        self.common = common
        self._server: asyncio.Server | None = None
        self._open: dict[_Connection, None] = {}  # an ordered set: oldest first

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0: a free port); the address and port bound."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=self.limits.max_head_bytes)
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for connection in list(self._open):
                connection.drop()
            self._open.clear()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    def _admit(self, connection: _Connection) -> bool:
        if len(self._open) >= self.limits.max_connections:
            idle = next((c for c in self._open if c.reading), None)
            if idle is None:
                return False
            del self._open[idle]
            idle.drop()
        self._open[connection] = None
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        timeout_s = self.limits.read_timeout_s
        try:
            if not self._admit(connection):
                writer.write(encode(Response(503, b"busy\n"), common=self.common))
                await asyncio.wait_for(writer.drain(), timeout_s)
                return
            try:
                request = await asyncio.wait_for(self._read(reader), timeout_s)
            except _BadRequest as bad:
                connection.reading = False
                writer.write(encode(Response(bad.status, f"{bad}\n".encode()), common=self.common))
                await asyncio.wait_for(writer.drain(), timeout_s)
                return
            connection.reading = False
            try:
                response = await self.handler(request)
            except Exception:  # a bug in the handler: a 500, not a silently dropped connection
                log.exception("http handler failed", extra={"path": request.path})
                response = Response(500, b"internal error\n")
            writer.write(encode(response, head=request.method == "HEAD", common=self.common))
            await asyncio.wait_for(writer.drain(), timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.transport.abort()  # idle, too slow, or gone: close without an answer
        finally:
            self._open.pop(connection, None)
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> Request:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as exc:
            raise _BadRequest(431, "request head too large") from exc
        method, target, headers = parse_head(head[:-4])
        if "transfer-encoding" in headers:
            raise _BadRequest(400, "chunked bodies are not read")
        length_text = headers.get("content-length", "0")
        if not length_text.isdigit():
            raise _BadRequest(400, "bad content-length")
        length = int(length_text)
        if length > self.limits.max_body_bytes:
            raise _BadRequest(413, "request body too large")
        body = await reader.readexactly(length) if length else b""
        parts = urlsplit(target)
        return Request(
            method=method,
            path=parts.path,
            query=parse_qs(parts.query, keep_blank_values=True),
            headers=headers,
            body=body,
        )
