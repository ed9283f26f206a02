"""Whom the console answers (issue 23 row 5). A request must name an allowed ``Host`` (loopback names by
default: a web page whose DNS name an attacker rebinds to 127.0.0.1 still sends its own name, so it is
refused before anything is read for it) and carry the console's token, either as ``Authorization: Bearer``
or as the session cookie the login page sets. Pure functions: no IO, no clock."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

SESSION_CONTEXT = b"hetsched console session"
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def _with_port(name: str, port: int) -> set[str]:
    """``name`` as a Host header names it: with the console's port unless it gives one; on port 80 also bare."""
    name = name.strip().lower()
    if not name:
        return set()
    if name.count(":") > 1 and not name.startswith("["):  # a bare IPv6 address
        name = f"[{name}]"
    has_port = name.rsplit("]", 1)[-1].count(":") == 1
    if has_port:
        return {name}
    return {f"{name}:{port}", name} if port == 80 else {f"{name}:{port}"}


def allowed_hosts(names: str, *, port: int, bound: str | None = None) -> frozenset[str]:
    """The ``Host`` values to answer: each comma-separated name with the console's ``port``, plus ``bound``,
    the address listened on, unless it is a wildcard (an IP literal cannot be rebound: a page that sends it
    as its Host is that address's own origin)."""
    allowed: set[str] = set()
    for name in names.split(","):
        allowed |= _with_port(name, port)
    if bound is not None and bound.strip() not in WILDCARDS:
        allowed |= _with_port(bound, port)
    return frozenset(allowed)


def host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    return host is not None and host.strip().lower() in allowed


def token_matches(given: str, token: str) -> bool:
    """Constant-time comparison (its time does not tell how much of the token was right)."""
    return hmac.compare_digest(given.encode(), token.encode())


def session_value(token: str) -> str:
    """What the session cookie holds: derived from the token (a new token ends every session)."""
    return hmac.new(token.encode(), SESSION_CONTEXT, hashlib.sha256).hexdigest()


def cookie_name(port: int) -> str:
    """Browsers share cookies between the ports of one host: each console's cookie has its own name."""
    return f"hetsched_console_{port}"


def authorised(headers: Mapping[str, str], *, token: str, cookie: str) -> bool:
    """Whether the request carries the token (``Authorization: Bearer``) or the session cookie ``cookie``."""
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token_matches(given.strip(), token):
        return True
    expected = session_value(token)
    for part in headers.get("cookie", "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == cookie and token_matches(value, expected):
            return True
    return False
