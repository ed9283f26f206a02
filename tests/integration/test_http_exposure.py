"""Issue 23 rows 5 and 6: what the operator HTTP endpoints give a hostile client, on the stack with its own
permissions (test_security's authenticated NATS; topology with the demo fleet, the ledger and placement as
processes with their own NKeys; `python -m hetsched console` as the operator, as under `hetsched up`). All
HTTP is spoken over raw sockets, so each request carries exactly the Host and credentials the test means.

Row 5: the console answers nothing but its static login page without its token (401, no data), nothing at
all to a Host off its allow-list even with the token (421), and everything with the token (a bearer header,
or the HttpOnly SameSite=Strict cookie its login URL or form sets). Row 6: 200 idle connections to
placement's metrics endpoint add no thread per connection, at most the cap stays open, a scrape still
answers among them (it displaces the oldest idle one), and the rest are closed after the read timeout;
the console holds the same limits."""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from hetsched.stack import probe_health
from shared.contracts.subjects import Rpc
from shared.infra.rpc import RpcClient
from shared.infra.settings import ConsoleSettings, KitSettings
from tests.conftest import REPO, service_env
from tests.integration import test_security as security
from tests.waiting import wait_for, wait_for_sync

bus = security.bus  # this module's own authenticated stack (a module-scoped fixture)

TENANT = "acme"
IDLE_CONNECTIONS = 200
CONSOLE_READ_TIMEOUT_S = 3.0
METRICS_CAP = KitSettings.model_fields["metrics_max_connections"].default
METRICS_READ_TIMEOUT_S = KitSettings.model_fields["metrics_read_timeout_s"].default
CONSOLE_CAP = ConsoleSettings.model_fields["max_connections"].default
LOGIN_PAGE = (REPO / "hetsched" / "console" / "static" / "login.html").read_bytes()


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


def http(
    port: int,
    path: str,
    *,
    host: str | None,
    method: str = "GET",
    headers: tuple[tuple[str, str], ...] = (),
    body: bytes = b"",
) -> Answer:
    """One request over a raw socket to 127.0.0.1:``port``, sent exactly as given (``host`` None: no Host)."""
    lines = [f"{method} {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{name}: {value}" for name, value in headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, payload = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parsed = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
    return Answer(int(status_line.split(" ")[1]), parsed, payload)


def threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


class IdleClients:
    """Connections that send nothing (every tenth: half a request head, never finished)."""

    def __init__(self, port: int, count: int) -> None:
        self.socks: list[socket.socket] = []
        self.opened_at = time.monotonic()
        for i in range(count):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            if i % 10 == 9:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            sock.setblocking(False)
            self.socks.append(sock)
        self.closed: set[int] = set()

    def still_open(self) -> int:
        """How many the server has not closed (FIN or reset); what it sent them, if anything, is an error."""
        for i, sock in enumerate(self.socks):
            if i in self.closed:
                continue
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:  # reset: closed without an answer
                data = b""
            assert data == b"", data  # an idle connection is closed, never answered
            self.closed.add(i)
        return len(self.socks) - len(self.closed)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def no_data(body: bytes, *secrets: str) -> bool:
    return not any(secret.encode() in body for secret in secrets)


# -- the stack's data, and the console as the operator starts it -------------------------------------------


@dataclass(frozen=True)
class Console:
    proc: subprocess.Popen[bytes]
    port: int
    url: str
    second_line: str
    log: Path

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_console(bus: security.SecureBus, log: Path, **env: str) -> Console:
    """`python -m hetsched console --port 0` with the operator's seed; its first two lines read."""
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hetsched", "console", "--port", "0"],
            env={
                **service_env(bus.settings),
                "HETSCHED_NATS_NKEY_SEED_FILE": str(bus.seeds["operator"]),
                "HETSCHED_CONSOLE_READ_TIMEOUT_S": str(CONSOLE_READ_TIMEOUT_S),
                **env,
            },
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=REPO,
            bufsize=0,  # unbuffered: a readline takes one line, and select sees what is left
        )
    assert proc.stdout is not None
    first = proc.stdout.readline().decode()
    assert first.startswith("hetsched console at http://"), (first, log.read_text())
    url = first.split(" at ", 1)[1].strip()
    # The line after it says how to log in (within a few seconds; a console that prints none has no token).
    ready, _, _ = select.select([proc.stdout], [], [], 10)
    second = proc.stdout.readline().decode().strip() if ready else ""
    return Console(proc, int(url.rsplit(":", 1)[1].strip("/")), url, second, log)


def stop_console(console: Console) -> None:
    console.proc.terminate()
    assert console.proc.wait(timeout=30) == 0, console.log.read_text()


@dataclass(frozen=True)
class Placed:
    allocation_id: str
    node: str
    metrics_url: str
    placement_pid: int


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def placed(bus: security.SecureBus) -> AsyncIterator[Placed]:
    """A replica placed for acme (what the console would show), and placement's metrics URL and pid."""
    operator = await bus.connect("operator")

    async def place() -> dict[str, object] | None:
        reply = await operator.request(
            bus.subjects.rpc(Rpc.PLACEMENT_PLACE),
            {
                "request_id": f"hx-{uuid.uuid4().hex[:8]}",
                "tenant": TENANT,
                "model": "llama3-8b",
                "context_tokens": 4096,
            },
        )
        return reply if reply.get("status") == "placed" else None

    reply = await wait_for(place, 60, interval_s=0.5, what="a replica placed")
    allocation = str(reply["allocation_id"])
    node = str(reply["placements"][0]["node"])  # type: ignore[index]
    rpc = await RpcClient.connect(bus.url, bus.subjects, timeout_s=10, nkeys_seed=str(bus.seeds["operator"]))
    try:
        health = await probe_health(rpc, "placement")
    finally:
        await rpc.close()
    assert isinstance(health.get("metrics_url"), str), health
    assert bus.procs is not None
    yield Placed(allocation, node, health["metrics_url"], bus.procs.procs["placement"].pid)


@pytest.fixture(scope="module")
def console(placed: Placed, bus: security.SecureBus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    started = start_console(bus, tmp_path_factory.mktemp("console") / "console.log")
    try:
        yield started
    finally:
        stop_console(started)


@pytest.fixture(scope="module")
def token(console: Console) -> str:
    """The token `hetsched console` printed, in the URL that logs a browser in ("" if it printed none)."""
    return console.second_line.split("token=", 1)[1].split()[0] if "token=" in console.second_line else ""


# -- row 5 ----------------------------------------------------------------------------------------------


def test_without_its_token_the_console_sends_no_data(console: Console, placed: Placed, bus: security.SecureBus) -> None:
    secrets = (placed.allocation_id, TENANT, placed.node, bus.url)
    wrong = ("Authorization", "Bearer " + "x" * 43)
    forged_cookie = ("Cookie", f"hetsched_console_{console.port}=" + "0" * 64)
    for path in ("/api/state", "/", "/index.html", "/console.js", "/console.css", "/nope", "/api/state?token=x"):
        for headers in ((), (wrong,), (forged_cookie,)):
            answer = http(console.port, path, host=console.host, headers=headers)
            assert answer.status == 401, (path, headers, answer)
            assert "set-cookie" not in answer.headers
            assert no_data(answer.body, *secrets), (path, answer.body[:300])
            # What a browser gets instead: the static login page, or one line saying where it is.
            assert answer.body in (LOGIN_PAGE, b'{"error": "unauthorized: log in at /login"}'), (path, answer.body)
    assert http(console.port, "/login?token=not-the-token", host=console.host).status == 401
    refused = http(console.port, "/login", host=console.host, method="POST", body=b"token=not-the-token")
    assert refused.status == 401 and "set-cookie" not in refused.headers


def test_a_host_off_the_allow_list_gets_nothing_even_with_the_token(
    console: Console, placed: Placed, token: str, bus: security.SecureBus
) -> None:
    bearer = ("Authorization", f"Bearer {token}")
    # DNS rebinding: attacker.example resolves to 127.0.0.1, but the browser still sends its own name.
    for host in ("attacker.example", f"attacker.example:{console.port}", "127.0.0.1:1", "localhost", None):
        for path in ("/api/state", "/", "/login", f"/login?token={token}"):
            answer = http(console.port, path, host=host, headers=(bearer,))
            assert answer.status == 421, (host, path, answer)
            assert "set-cookie" not in answer.headers
            assert no_data(answer.body, placed.allocation_id, TENANT, placed.node, bus.url, token), answer.body
            assert b"<" not in answer.body  # not even the login page


def test_the_token_opens_the_console_as_a_bearer_or_through_the_login_cookie(
    console: Console, placed: Placed, token: str, bus: security.SecureBus
) -> None:
    assert console.second_line.startswith(f"open {console.url}login?token="), console.second_line
    state = http(console.port, "/api/state", host=console.host, headers=(("Authorization", f"Bearer {token}"),))
    assert state.status == 200, state
    assert placed.allocation_id.encode() in state.body and bus.url.encode() in state.body
    # The loopback names the allow-list holds by default, each with the console's port.
    for host in (f"localhost:{console.port}", f"LOCALHOST:{console.port}", f"[::1]:{console.port}"):
        assert http(console.port, "/", host=host, headers=(("Authorization", f"Bearer {token}"),)).status == 200

    # The printed URL: an HttpOnly SameSite=Strict cookie, then the page.
    login = http(console.port, f"/login?token={token}", host=console.host)
    assert login.status == 303 and login.headers["location"] == "/", login
    cookie = login.headers["set-cookie"]
    name_value, *attributes = [part.strip() for part in cookie.split(";")]
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(attributes), cookie
    assert token not in cookie  # the cookie is derived from the token, not the token
    for path in ("/", "/console.js", "/api/state"):
        answer = http(console.port, path, host=console.host, headers=(("Cookie", f"other=1; {name_value}"),))
        assert answer.status == 200, (path, answer)
    # The login page's form posts the token: the same cookie.
    posted = http(
        console.port,
        "/login",
        host=console.host,
        method="POST",
        headers=(("Content-Type", "application/x-www-form-urlencoded"),),
        body=f"token={token}".encode(),
    )
    assert posted.status == 303 and posted.headers["set-cookie"] == cookie


def test_the_login_page_is_static(console: Console, placed: Placed, bus: security.SecureBus) -> None:
    """The one route served without the token: the shipped file, byte for byte, whatever the stack holds."""
    for path, method in (("/login", "GET"), ("/login?next=/api/state", "GET")):
        answer = http(console.port, path, host=console.host, method=method)
        assert answer.status == 200 and answer.body == LOGIN_PAGE, answer
        assert answer.headers["content-type"].startswith("text/html")
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        assert no_data(answer.body, placed.allocation_id, TENANT, placed.node, bus.url)


def test_a_configured_token_is_required_and_never_printed(
    bus: security.SecureBus, placed: Placed, tmp_path: Path
) -> None:
    configured = "operator-chosen-" + uuid.uuid4().hex
    console = start_console(bus, tmp_path / "console.log", HETSCHED_CONSOLE_TOKEN=configured)
    try:
        assert configured not in console.second_line and "login" in console.second_line, console.second_line
        bearer = (("Authorization", f"Bearer {configured}"),)
        assert http(console.port, "/api/state", host=console.host, headers=bearer).status == 200
        assert http(console.port, "/api/state", host=console.host).status == 401
    finally:
        stop_console(console)
    assert configured not in console.log.read_text()
    short = subprocess.run(
        [sys.executable, "-m", "hetsched", "console", "--port", "0"],
        env={**service_env(bus.settings), "HETSCHED_CONSOLE_TOKEN": "too-short"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert short.returncode == 2 and "at least 16" in short.stderr, (short.stdout, short.stderr)


# -- row 6 ----------------------------------------------------------------------------------------------


def _scrape(url: str) -> set[str]:
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    answer = http(int(host_port.rsplit(":", 1)[1]), "/metrics", host=host_port)
    assert answer.status == 200, answer
    return {family.name for family in text_string_to_metric_families(answer.body.decode())}


def test_idle_connections_to_placements_metrics_add_no_threads_and_are_closed(placed: Placed) -> None:
    port = int(placed.metrics_url.rsplit(":", 1)[1].split("/", 1)[0])
    assert "hetsched_placements" in _scrape(placed.metrics_url)
    before = threads(placed.placement_pid)
    idle = IdleClients(port, IDLE_CONNECTIONS)
    try:
        # A scrape among them answers: it displaces the oldest connection still waiting for its request.
        assert "hetsched_placements" in _scrape(placed.metrics_url)
        answered = time.monotonic()
        # The scrape was accepted after all 200: every one of them was accepted by then.
        assert threads(placed.placement_pid) <= before + 8, (before, threads(placed.placement_pid))
        if answered - idle.opened_at < METRICS_READ_TIMEOUT_S:  # (on a machine this slow, the timeout came first)
            assert idle.still_open() > 0  # so the scrape answered while the newest idle ones were held
        # Each one past the cap displaced an older idle one as it was accepted: closed before the scrape was read.
        assert idle.still_open() <= METRICS_CAP
        # Then the read timeout closes the rest, the half-sent heads among them.
        wait_for_sync(lambda: idle.still_open() == 0, 60, interval_s=0.2, what="every idle connection closed")
        assert threads(placed.placement_pid) <= before + 8
        assert "hetsched_placements" in _scrape(placed.metrics_url)
    finally:
        idle.close()


def test_the_console_holds_the_same_limits(console: Console, token: str) -> None:
    bearer = (("Authorization", f"Bearer {token}"),)
    before = threads(console.proc.pid)
    idle = IdleClients(console.port, IDLE_CONNECTIONS)
    try:
        assert http(console.port, "/api/state", host=console.host, headers=bearer).status == 200
        assert idle.still_open() <= CONSOLE_CAP  # as for the metrics: displaced before the request was read
        wait_for_sync(lambda: idle.still_open() == 0, 60, interval_s=0.2, what="every idle connection closed")
        assert threads(console.proc.pid) <= before + 8
        assert http(console.port, "/api/state", host=console.host, headers=bearer).status == 200
    finally:
        idle.close()
