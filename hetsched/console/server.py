"""`hetsched console`: a read-only web page for operators, served by ``shared.infra.httpserver`` (asyncio
streams, a read timeout and a cap on connections). ``GET /`` and the static files come from this package;
``GET /api/state`` asks the services (``state.collect``) and adds the recent placements the PLACEMENT feed
keeps. Every route but the login page needs the console's token and an allowed Host (``access``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable, Coroutine
from dataclasses import replace
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from hetsched.console import access
from hetsched.console.feed import PlacementFeed
from hetsched.console.state import collect
from shared.infra.httpserver import HttpServer, Limits, Request, Response

log = logging.getLogger("hetsched.console")

STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console.css": ("console.css", "text/css; charset=utf-8"),
}
PAGES = {"/", "/index.html"}  # a browser asking for these without a session gets the login page
LOGIN = "/login"
HTML = "text/html; charset=utf-8"
COMMON_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    # Everything the page loads comes from this server: no CDN, no inline script; no framing.
    (
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; frame-ancestors 'none'; form-action 'self'",
    ),
    ("Referrer-Policy", "no-referrer"),  # the login URL carries the token
)
LOGIN_BODY_MAX_BYTES = 4096  # the login form's body; no other route reads one


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


async def _route(request: Request, state: StateSource) -> Response:
    if request.method not in ("GET", "HEAD"):
        return Response(405, b"GET only\n")
    if request.path == "/api/state":
        try:
            document = await state.get()
        except Exception as exc:  # the page shows it and polls again
            log.warning("console: state failed", exc_info=True)
            return Response(500, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode(), "application/json")
        return Response(200, json.dumps(document).encode(), "application/json")
    if request.path in STATIC:
        name, content_type = STATIC[request.path]
        return Response(200, static_file(name), content_type)
    return Response(404, b"not found\n")


class ConsoleServer:
    """The HTTP server: the page's files and its state, to requests that name an allowed Host and carry the
    token (``hetsched.console.access``); a request failing either check gets no data. The static login page
    (``/login``) is the one route served without the token: it sets the session cookie."""

    def __init__(self, state: StateSource, *, token: str, allowed_hosts: str, limits: Limits) -> None:
        self.state = state
        self._token = token
        self._names = allowed_hosts
        self._limits = replace(limits, max_body_bytes=LOGIN_BODY_MAX_BYTES)
        self._http: HttpServer | None = None
        self._allowed: frozenset[str] = frozenset()
        self._cookie = ""

    async def start(self, host: str, port: int) -> str:
        """Listen; the URL it serves (the port the system chose when ``port`` is 0)."""
        self._http = HttpServer(self._answer, self._limits, common=COMMON_HEADERS)
        bound_host, bound_port = await self._http.start(host, port)
        self._allowed = access.allowed_hosts(self._names, port=bound_port, bound=host)
        self._cookie = access.cookie_name(bound_port)
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        return f"http://{shown}:{bound_port}/"

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def _answer(self, request: Request) -> Response:
        # The Host first: a rebound DNS name learns nothing, not even whether it holds a token.
        if not access.host_allowed(request.headers.get("host"), self._allowed):
            return Response(421, b"misdirected request: this Host is not served here\n")
        if request.path == LOGIN:
            return self._login(request)
        if not access.authorised(request.headers, token=self._token, cookie=self._cookie):
            challenge = (("WWW-Authenticate", "Bearer"),)
            if request.path in PAGES:
                return Response(401, static_file("login.html"), HTML, challenge)
            return Response(401, b'{"error": "unauthorized: log in at /login"}', "application/json", challenge)
        return await _route(request, self.state)

    def _login(self, request: Request) -> Response:
        if request.method == "POST":
            given = parse_qs(request.body.decode("utf-8", "replace")).get("token", [""])[0]
        elif request.method in ("GET", "HEAD"):
            asked = request.query.get("token")
            if not asked:
                return Response(200, static_file("login.html"), HTML)
            given = asked[0]
        else:
            return Response(405, b"GET or POST only\n")
        if not access.token_matches(given, self._token):
            return Response(401, static_file("login.html"), HTML, (("WWW-Authenticate", "Bearer"),))
        session = f"{self._cookie}={access.session_value(self._token)}; HttpOnly; SameSite=Strict; Path=/"
        return Response(303, b"", headers=(("Location", "/"), ("Set-Cookie", session)))


async def run_console(
    *,
    nats_url: str,
    subject_prefix: str,
    stream_prefix: str,
    host: str,
    port: int,
    timeout_s: float,
    connect_options: dict[str, Any],
    token: str,
    allowed_hosts: str,
    limits: Limits,
    announce: Callable[[str], None],
) -> None:
    """Connect to NATS as the operator, follow the PLACEMENT stream, serve until SIGINT or SIGTERM."""
    from shared.contracts.subjects import Subjects
    from shared.infra.refusal import ConnectionGuard, NatsRefused
    from shared.infra.refusal import connect as guarded_connect
    from shared.infra.rpc import RpcClient

    subjects = Subjects(subject_prefix)
    stop = asyncio.Event()
    refused: list[NatsRefused] = []

    def on_refused(refusal: NatsRefused) -> None:  # its credential revoked while it runs: stop, say why
        refused.append(refusal)
        stop.set()

    # A console stays up for days: keep reconnecting (the CLI's one-shot clients give up after two tries),
    # except when NATS refuses its credential (raised as NatsRefused, at the start or later).
    guard = ConnectionGuard.of(nats_url, connect_options, operator=True, on_refused=on_refused)
    nc = await guarded_connect(
        nats_url,
        guard,
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

    server = ConsoleServer(StateSource(produce), token=token, allowed_hosts=allowed_hosts, limits=limits)
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
    if refused:
        raise refused[0]
