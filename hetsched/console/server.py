"""`hetsched console`: a read-only web page for operators, served with the standard library (asyncio streams
and a tiny HTTP/1.1 handler). ``GET /`` and the static files come from this package; ``GET /api/state`` asks
the services (``state.collect``) and adds the recent placements the PLACEMENT feed keeps."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from hetsched.console.feed import PlacementFeed
from hetsched.console.state import collect

log = logging.getLogger("hetsched.console")

STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console.css": ("console.css", "text/css; charset=utf-8"),
}
REQUEST_MAX_BYTES = 16 * 1024  # a GET with its headers; anything longer is refused
READ_TIMEOUT_S = 10.0
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error"}


def static_file(name: str) -> bytes:
    """One of the page's files, shipped in this package (no CDN, no build step)."""
    return resources.files("hetsched.console").joinpath("static", name).read_bytes()


class StateSource:
    """``/api/state``: one collection at a time, shared by the requests that arrive while it runs (two tabs
    polling every second ask the services once)."""

    def __init__(self, produce: Callable[[], Coroutine[Any, Any, dict[str, Any]]]) -> None:
        self._produce = produce
        self._running: asyncio.Task[dict[str, Any]] | None = None

    async def get(self) -> dict[str, Any]:
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._produce())
        return await asyncio.shield(self._running)


def _response(status: int, body: bytes, content_type: str, *, head: bool = False) -> bytes:
    headers = [
        f"HTTP/1.1 {status} {REASONS.get(status, '')}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        "X-Content-Type-Options: nosniff",
        # Everything the page loads comes from this server: no CDN, no inline script.
        "Content-Security-Policy: default-src 'self'; img-src 'self' data:; style-src 'self'",
        "Connection: close",
    ]
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + (b"" if head else body)


async def _route(method: str, path: str, state: StateSource) -> bytes:
    head = method == "HEAD"
    if method not in ("GET", "HEAD"):
        return _response(405, b"GET only\n", "text/plain; charset=utf-8")
    path = path.split("?", 1)[0]
    if path == "/api/state":
        try:
            document = await state.get()
        except Exception as exc:  # the page shows it and polls again
            log.warning("console: state failed", exc_info=True)
            body = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            return _response(500, body, "application/json", head=head)
        return _response(200, json.dumps(document).encode(), "application/json", head=head)
    if path in STATIC:
        name, content_type = STATIC[path]
        return _response(200, static_file(name), content_type, head=head)
    return _response(404, b"not found\n", "text/plain; charset=utf-8", head=head)


class ConsoleServer:
    """The HTTP server: the page's files and its state."""

    def __init__(self, state: StateSource) -> None:
        self.state = state
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> str:
        """Listen; the URL it serves (the port the system chose when ``port`` is 0)."""

        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _serve_one(reader, writer, self.state)

        self._server = await asyncio.start_server(on_connection, host, port, limit=REQUEST_MAX_BYTES)
        bound = self._server.sockets[0].getsockname()
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        return f"http://{shown}:{bound[1]}/"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: StateSource) -> None:
    try:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            return
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            writer.write(_response(400, b"bad request\n", "text/plain; charset=utf-8"))
        else:
            writer.write(await _route(parts[0], parts[1], state))
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def run_console(
    *,
    nats_url: str,
    subject_prefix: str,
    stream_prefix: str,
    host: str,
    port: int,
    timeout_s: float,
    connect_options: dict[str, Any],
    announce: Callable[[str], None],
) -> None:
    """Connect to NATS as the operator, follow the PLACEMENT stream, serve until SIGINT or SIGTERM."""
    import nats

    from shared.contracts.subjects import Subjects
    from shared.infra.rpc import RpcClient
    from shared.infra.settings import nats_servers

    subjects = Subjects(subject_prefix)
    # A console stays up for days: keep reconnecting (the CLI's one-shot clients give up after two tries).
    nc = await nats.connect(
        nats_servers(nats_url),
        name="hetsched-console",
        connect_timeout=max(1, int(timeout_s)),
        max_reconnect_attempts=-1,
        **connect_options,
    )
    rpc = RpcClient(nc, subjects, timeout_s=timeout_s)
    feed = PlacementFeed()
    feed.start(nc.jetstream(), subjects, stream_prefix=stream_prefix)

    async def produce() -> dict[str, Any]:
        document = await collect(
            rpc, now=lambda: datetime.now(UTC), placements=feed.placements(), allocations=feed.allocations()
        )
        if feed.problem:
            document["errors"]["placements"] = feed.problem
        document["nats_url"] = nats_url
        return document

    server = ConsoleServer(StateSource(produce))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        announce(await server.start(host, port))
        await stop.wait()
    finally:
        await server.close()
        await feed.stop()
        with contextlib.suppress(Exception):
            await nc.drain()
