"""NATS refusing a process (``shared.infra.refusal``): which errors count as a refusal, the one line each
gives (naming the setting to fix), and when the guard raises (the first connection) or tells (later)."""

from __future__ import annotations

from pathlib import Path

import nkeys
import pytest
from nats.errors import AuthorizationError, UnexpectedEOF
from nats.errors import Error as NatsError

from shared.infra.refusal import ConnectionGuard, NatsRefused, refusal_reason

URL = "nats://127.0.0.1:4222"


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NatsError("nats: 'Authorization Violation'"), "Authorization Violation"),  # at CONNECT
        (AuthorizationError(), "Authorization Violation"),  # the server's -ERR on a live connection
        (NatsError("nats: 'User Authentication Expired'"), "User Authentication Expired"),
        (UnexpectedEOF(), None),  # a server going away: nats-py reconnects, as it should
        (ConnectionRefusedError(111, "Connection refused"), None),
        (NatsError("nats: 'Permissions Violation for Publish to \"x\"'"), None),  # one subject, not the credential
    ],
)
def test_only_a_refused_credential_is_a_refusal(error: Exception, reason: str | None) -> None:
    assert refusal_reason(error) == reason


def test_each_refusal_is_one_line_naming_the_setting() -> None:
    anonymous = ConnectionGuard.of(URL, {"inbox_prefix": "_INBOX"}).credential_refused("Authorization Violation")
    assert anonymous.line == (
        f"NATS at {URL} refused this client (Authorization Violation): the server admits NKeys only: set "
        "HETSCHED_NATS_NKEY_SEED_FILE to this process's seed file (a node's agent: `hetsched credentials issue "
        "--agent NODE --out FILE`)"
    )
    operator = ConnectionGuard.of(URL, {}, operator=True).credential_refused("Authorization Violation")
    assert "set HETSCHED_NATS_NKEY_SEED_FILE to the operator's seed" in operator.line and "--data-dir" in operator.line
    seeded = ConnectionGuard.of(URL, {"nkeys_seed": "/etc/agent.nk"}).credential_refused("Authorization Violation")
    assert seeded.line.startswith(f"NATS at {URL} refused the NKey in /etc/agent.nk (Authorization Violation): set ")
    for refused in (anonymous, operator, seeded):
        assert "\n" not in refused.line and "HETSCHED_NATS_NKEY_SEED_FILE" in refused.line


def test_a_refused_inbox_names_the_inbox_setting() -> None:
    guard = ConnectionGuard.of(URL, {"nkeys_seed": "/a.nk", "inbox_prefix": "_INBOX"})
    inbox = guard.refusal(NatsError("nats: 'Permissions Violation for Subscription to \"_INBOX.abc.*\"'"))
    assert inbox is not None and "HETSCHED_NATS_INBOX_PREFIX" in inbox.line and "under _INBOX " in inbox.line
    # Another subject's subscription refused is that subject's business, not the inbox's.
    assert guard.refusal(NatsError("nats: 'Permissions Violation for Subscription to \"hetsched.x\"'")) is None


def test_an_unusable_seed_file_names_it(tmp_path: Path) -> None:
    seed = tmp_path / "gone.nk"
    guard = ConnectionGuard.of(URL, {"nkeys_seed": str(seed)})
    missing = guard.seed_unusable(FileNotFoundError(2, "No such file or directory", str(seed)))
    assert missing is not None and f"{seed} is unusable (No such file or directory)" in missing.line
    garbled = guard.seed_unusable(nkeys.ErrInvalidSeed())
    assert garbled is not None and "not an NKey seed" in garbled.line
    assert guard.seed_unusable(FileNotFoundError(2, "No such file", "/other")) is None  # not its seed


async def test_the_guard_raises_on_the_first_connection_and_tells_once_later() -> None:
    told: list[NatsRefused] = []
    guard = ConnectionGuard.of(URL, {"nkeys_seed": "/a.nk"}, on_refused=told.append)
    with pytest.raises(NatsRefused, match=r"refused the NKey in /a\.nk"):
        await guard.error_cb(NatsError("nats: 'Authorization Violation'"))  # nats-py's connect loop stops here
    assert told == []  # the caller of connect hears it as the exception

    later = ConnectionGuard.of(URL, {"nkeys_seed": "/a.nk"}, on_refused=told.append)
    later.bind(object())  # type: ignore[arg-type]  # connected: nothing is raised into nats-py's own tasks
    await later.error_cb(NatsError("nats: 'Authorization Violation'"))
    await later.error_cb(NatsError("nats: 'Authorization Violation'"))  # every reconnect attempt says it again
    assert len(told) == 1 and told[0].line.startswith(f"NATS at {URL} refused the NKey in /a.nk")
