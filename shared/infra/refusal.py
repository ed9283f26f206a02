"""NATS refusing this process: one line naming the setting to fix, instead of a reconnect loop.

A credential the server does not admit (none, another server's, a revoked one), a seed file that cannot
be read, or an inbox prefix the credential may not receive replies under: retrying cannot help, so
every long-running process (the services, the topology agent) and the command line connect through a
``ConnectionGuard``. On the first connection the refusal is raised as ``NatsRefused`` out of the
connect call (nats-py would retry it forever, logging a traceback each time); on a connection that was
up (the credential revoked while it runs) ``on_refused`` is told once, and the process stops.
``NatsRefused.line`` says who refused what and which setting fixes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats
import nkeys
from nats.aio.client import Client as NatsClient
from nats.aio.client import _default_error_callback
from nats.errors import AuthorizationError

from shared.infra.settings import nats_servers

REFUSED_EXIT = 78
"""Exit status of a service or agent that NATS refused (``EX_CONFIG``: its configuration must change)."""

SEED_SETTING = "HETSCHED_NATS_NKEY_SEED_FILE"
INBOX_SETTING = "HETSCHED_NATS_INBOX_PREFIX"
# Server reasons that no retry can cure (lower case, as the server words them after "-ERR").
_CREDENTIAL_REFUSALS = ("authorization violation", "user authentication expired", "account authentication expired")


class NatsRefused(Exception):
    """NATS refused this process's credential (or it has none the server admits): retrying cannot help.
    ``line`` is the one line to print: the server, the reason and the setting to fix."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def refusal_reason(exc: BaseException) -> str | None:
    """The server's reason when ``exc`` is a refusal of the credential itself, else None."""
    if isinstance(exc, AuthorizationError):
        return "Authorization Violation"
    text = str(exc).removeprefix("nats:").strip().strip("'\"")
    return text if any(reason in text.lower() for reason in _CREDENTIAL_REFUSALS) else None


@dataclass
class ConnectionGuard:
    """The ``error_cb`` / ``closed_cb`` of one NATS connection (``options``) that turn a refusal into
    ``NatsRefused``. ``operator``: the command line, whose fix is the operator's seed or ``--data-dir``."""

    url: str
    seed_file: str | None = None
    inbox_prefix: str | None = None
    operator: bool = False
    on_refused: Callable[[NatsRefused], None] | None = None
    refused: NatsRefused | None = None
    _client: NatsClient | None = field(default=None, repr=False)

    @classmethod
    def of(cls, url: str, options: dict[str, Any], **fields: Any) -> ConnectionGuard:
        """A guard for a connection made with ``options`` (``shared.infra.identity.connect_options``)."""
        seed = options.get("nkeys_seed")
        return cls(url=url, seed_file=str(seed) if seed else None, inbox_prefix=options.get("inbox_prefix"), **fields)

    def options(self) -> dict[str, Any]:
        return {"error_cb": self.error_cb, "closed_cb": self.closed_cb}

    def bind(self, client: NatsClient) -> NatsClient:
        """The connection is up: from now on a refusal goes to ``on_refused`` (nothing is raised into
        nats-py's own tasks)."""
        self._client = client
        return client

    # -- what the server said, in one line ---------------------------------------------------------------------

    def credential_refused(self, reason: str) -> NatsRefused:
        if self.seed_file:
            fix = (
                f"set {SEED_SETTING} to a seed this server admits (`hetsched credentials list` shows the identities "
                "it admits; a revoked or lost credential is issued again)"
            )
            return NatsRefused(f"NATS at {self.url} refused the NKey in {self.seed_file} ({reason}): {fix}")
        if self.operator:
            fix = (
                f"set {SEED_SETTING} to the operator's seed (`<data-dir>/nats/admin.nk` of the `hetsched up` that "
                "runs this server), or pass that --data-dir"
            )
        else:
            fix = (
                f"the server admits NKeys only: set {SEED_SETTING} to this process's seed file (a node's agent: "
                "`hetsched credentials issue --agent NODE --out FILE`)"
            )
        return NatsRefused(f"NATS at {self.url} refused this client ({reason}): {fix}")

    def inbox_refused(self, message: str) -> NatsRefused | None:
        """A refused subscription to this process's own reply subjects: its inbox prefix is not its
        credential's (every request it makes would time out)."""
        if not self.inbox_prefix or "permissions violation for subscription" not in message.lower():
            return None
        if f'"{self.inbox_prefix.lower()}.' not in message.lower():
            return None
        return NatsRefused(
            f"NATS at {self.url} refused this client's replies under {self.inbox_prefix} (Permissions Violation): "
            f"set {INBOX_SETTING} to the prefix its credential was issued with (`_INBOX_<identity>`, printed by "
            "`hetsched credentials issue`)"
        )

    def seed_unusable(self, exc: BaseException) -> NatsRefused | None:
        """The seed file cannot be read or holds no seed."""
        if not self.seed_file:
            return None
        if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) == self.seed_file:
            why = exc.strerror or type(exc).__name__
        elif isinstance(exc, nkeys.NkeysError):
            why = "not an NKey seed"
        else:
            return None
        return NatsRefused(
            f"cannot connect to NATS at {self.url}: the NKey seed file {self.seed_file} is unusable ({why}): "
            f"set {SEED_SETTING} to a readable seed file (`hetsched credentials issue` writes one)"
        )

    def refusal(self, exc: BaseException) -> NatsRefused | None:
        reason = refusal_reason(exc)
        if reason is not None:
            return self.credential_refused(reason)
        return self.inbox_refused(str(exc)) or self.seed_unusable(exc)

    # -- the callbacks -------------------------------------------------------------------------------------------

    async def error_cb(self, exc: Exception) -> None:
        refused = self.refusal(exc)
        if refused is None:
            if self.refused is None:  # after a refusal the process stops: what its connections say is noise
                await _default_error_callback(exc)  # what nats-py does with every other error
            return
        self._refuse(refused)
        if self._client is None:
            raise refused  # out of the first connect: nats-py would otherwise try again forever

    async def closed_cb(self) -> None:
        # A server that revokes a connected client sends "Authorization Violation" and nats-py closes
        # the connection for good, with no error callback: the reason is its last error.
        error = self._client.last_error if self._client is not None else None
        refused = self.refusal(error) if error is not None else None
        if refused is not None:
            self._refuse(refused)

    def _refuse(self, refused: NatsRefused) -> None:
        if self.refused is not None:
            return
        self.refused = refused
        if self._client is not None and self.on_refused is not None:
            self.on_refused(refused)

    def silence(self, refused: NatsRefused) -> None:
        """Another connection of this process was refused: it stops, so this one says nothing more."""
        if self.refused is None:
            self.refused = refused


async def connect(url: str, guard: ConnectionGuard, **options: Any) -> NatsClient:
    """``nats.connect`` to ``url`` (a cluster's URLs, comma-separated) through ``guard``: a refusal
    raises ``NatsRefused`` at once instead of being retried."""
    try:
        client = await nats.connect(nats_servers(url), **options, **guard.options())
    except NatsRefused:
        raise
    except (OSError, nkeys.NkeysError) as exc:
        refused = guard.seed_unusable(exc)
        if refused is None:
            raise
        raise refused from exc
    return guard.bind(client)
