"""`hetsched console`: a read-only web page for operators, served by ``shared.infra.httpserver`` (asyncio
streams, a read timeout and a cap on connections). ``GET /`` and the static files come from this package;
the page reads ``GET /api/summary`` (the fleet per region, cluster and SKU, reservations, recent placements,
the rebalancer) and, on demand, ``GET /api/nodes`` (a page of one group's nodes) and ``GET /api/node`` (one
node's GPUs), all from ``source.FleetSource``. ``GET /api/state`` is the older whole-fleet document (every node,
GPU and NVLink domain at once; ``state.collect``), kept for scripts. Every route but the login page needs the
console's token and an allowed Host (``access``)."""

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
from hetsched.console.fleetview import ViewError
from hetsched.console.source import DETAIL_MAX_AGE_S, FleetSource
from hetsched.console.state import collect
from shared.infra.httpserver import HttpServer, Limits, Request, Response

log = logging.getLogger("hetsched.console")

STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console.css": ("console.css", "text/css; charset=utf-8"),
}
FLEET_ROUTES = {"/api/summary", "/api/nodes", "/api/node"}  # the page's data (``source.FleetSource``)
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


def _json(status: int, document: Any) -> Response:
    return Response(status, json.dumps(document).encode(), "application/json")


def _one(request: Request, name: str, default: str | None = None) -> str:
    values = request.query.get(name)
    if not values:
        if default is None:
            raise ViewError(400, f"{name}: required")
        return default
    return values[0]


def _number(request: Request, name: str, default: int) -> int:
    text = _one(request, name, str(default))
    if not text.isdigit() or len(text) > 9:
        raise ViewError(400, f"{name}: a whole number")
    return int(text)


async def _fleet_route(request: Request, fleet: FleetSource) -> Response:
    """``/api/summary`` (the fleet in rows per region, cluster and SKU, and the rest of the page),
    ``/api/nodes?by=cluster&key=us-west-1/c1&offset=0&limit=100`` (a page of a group's nodes) and
    ``/api/node?name=n00001`` (one node's GPUs). Bad input gets 400 (or 404) with ``{"error": ...}``."""
    try:
        if request.path == "/api/summary":
            return Response(200, (await fleet.current()).summary, "application/json")
        collected = await fleet.current(max_age_s=DETAIL_MAX_AGE_S)
        if collected.view is None:
            return _json(503, {"error": f"no fleet yet: {collected.errors.get('fleet', 'not asked yet')}"})
        view = collected.view
        if request.path == "/api/nodes":
            grouping, key = _one(request, "by"), _one(request, "key")
            page = view.group_nodes(
                grouping, key, offset=_number(request, "offset", 0), limit=_number(request, "limit", 100)
            )
            return _json(200, page)
        name = _one(request, "name")
        if name not in view.nodes:
            raise ViewError(404, f"no node {name!r} in the fleet")
        profile = await fleet.profile(name, view.index.version)
        node = view.node(name, profile=profile)
        node["labels"] = fleet.labels(node["allocations"])  # who placed them (tenant, model), when seen
        return _json(200, node)
    except ViewError as refused:
        return _json(refused.status, {"error": str(refused)})
    except Exception as exc:  # a service did not answer: the page shows it and polls again
        log.warning("console: %s failed", request.path, exc_info=True)
        return _json(500, {"error": f"{type(exc).__name__}: {exc}"})


async def _route(request: Request, state: StateSource, fleet: FleetSource | None = None) -> Response:
    if request.method not in ("GET", "HEAD"):
        return Response(405, b"GET only\n")
    if request.path in FLEET_ROUTES and fleet is not None:
        return await _fleet_route(request, fleet)
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

    def __init__(
        self,
        state: StateSource,
        *,
        token: str,
        allowed_hosts: str,
        limits: Limits,
        fleet: FleetSource | None = None,
    ) -> None:
        self.state = state
        self.fleet = fleet
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
        return await _route(request, self.state, self.fleet)

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


def _marks_changed(fleet: FleetSource) -> Callable[[Any], Coroutine[Any, Any, None]]:
    async def on_event(_msg: Any) -> None:
        fleet.fleet_changed()

    return on_event


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
    from shared.contracts.subjects import Context, Subjects
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

    fleet = FleetSource(rpc, now=lambda: datetime.now(UTC), feed=feed, extra={"nats_url": nats_url})
    # Any topology event (a node profiled, changed, lost, recovered) means the fleet is asked again.
    topology = await nc.subscribe(subjects.events_of(Context.TOPOLOGY), cb=_marks_changed(fleet))
    server = ConsoleServer(StateSource(produce), token=token, allowed_hosts=allowed_hosts, limits=limits, fleet=fleet)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        announce(await server.start(host, port))
        warm = asyncio.create_task(fleet.current())  # the fleet's index ready before the first page asks
        await stop.wait()
        warm.cancel()
    finally:
        await server.close()
        with contextlib.suppress(Exception):
            await topology.unsubscribe()
        await feed.stop()
        with contextlib.suppress(Exception):
            await nc.drain()
    if refused:
        raise refused[0]
