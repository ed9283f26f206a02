"""The console's access checks (``hetsched.console.access``) as data: which Host values a console on a port
answers, and which credentials open it (issue 23 row 5; the console itself is tested in
tests/integration/test_http_exposure.py)."""

from __future__ import annotations

import pytest

from hetsched.console.access import allowed_hosts, authorised, cookie_name, host_allowed, session_value
from shared.infra.settings import ConsoleSettings

DEFAULT = ConsoleSettings.model_fields["allowed_hosts"].default
TOKEN = "t" * 43


@pytest.mark.parametrize(
    ("names", "port", "bound", "expected"),
    [
        # The default: the three loopback names, each with the console's port only.
        (DEFAULT, 8470, "127.0.0.1", {"localhost:8470", "127.0.0.1:8470", "[::1]:8470"}),
        # On port 80 a browser sends no port.
        ("localhost", 80, None, {"localhost:80", "localhost"}),
        # A name with a port is taken as given; a bare IPv6 address gets its brackets; case does not matter.
        ("Console.Example:443, ::1", 8470, None, {"console.example:443", "[::1]:8470"}),
        # The address given to --host is added, unless it is a wildcard.
        ("localhost", 8470, "10.0.0.5", {"localhost:8470", "10.0.0.5:8470"}),
        ("localhost", 8470, "0.0.0.0", {"localhost:8470"}),
        ("localhost", 8470, "::", {"localhost:8470"}),
        ("", 8470, None, set()),
    ],
)
def test_allowed_hosts(names: str, port: int, bound: str | None, expected: set[str]) -> None:
    assert allowed_hosts(names, port=port, bound=bound) == expected


@pytest.mark.parametrize(
    ("host", "answered"),
    [
        ("127.0.0.1:8470", True),
        ("LOCALHOST:8470", True),
        ("[::1]:8470", True),
        ("attacker.example", False),  # DNS rebinding: the page's own name
        ("attacker.example:8470", False),
        ("localhost", False),  # another port (80)
        ("127.0.0.1:8471", False),
        ("127.0.0.1.attacker.example:8470", False),
        ("", False),
        (None, False),
    ],
)
def test_host_allowed(host: str | None, answered: bool) -> None:
    assert host_allowed(host, allowed_hosts(DEFAULT, port=8470, bound="127.0.0.1")) is answered


COOKIE = cookie_name(8470)


@pytest.mark.parametrize(
    ("headers", "opened"),
    [
        ({"authorization": f"Bearer {TOKEN}"}, True),
        ({"authorization": f"bearer  {TOKEN}"}, True),
        ({"cookie": f"a=1; {COOKIE}={session_value(TOKEN)}"}, True),
        ({}, False),
        ({"authorization": f"Basic {TOKEN}"}, False),
        ({"authorization": f"Bearer {TOKEN[:-1]}"}, False),
        ({"authorization": "Bearer "}, False),
        ({"cookie": f"{COOKIE}={TOKEN}"}, False),  # the cookie holds a value derived from the token
        ({"cookie": f"{cookie_name(8471)}={session_value(TOKEN)}"}, False),  # another console's cookie
        ({"cookie": f"{COOKIE}={session_value('another token, another session')}"}, False),
    ],
)
def test_authorised(headers: dict[str, str], opened: bool) -> None:
    assert authorised(headers, token=TOKEN, cookie=COOKIE) is opened
