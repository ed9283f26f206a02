"""A database that does not exist is one line saying how to make it (shared/infra/db.py)."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy.exc import DBAPIError

from shared.infra.db import DatabaseMissing, missing_database


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (
            "postgresql://postgres@127.0.0.1:5432/hetsched",
            "database hetsched does not exist: createdb -U postgres hetsched",
        ),
        ("postgresql://localhost/x", "database x does not exist: createdb x"),
        (
            "postgresql+asyncpg://app:secret@db.internal:6543/fleet",
            "database fleet does not exist: createdb -h db.internal -p 6543 -U app fleet",
        ),
    ],
)
def test_the_message_is_the_command_to_run(url: str, says: str) -> None:
    assert str(DatabaseMissing(url)) == says
    assert "secret" not in str(DatabaseMissing(url))


def _wrapped(driver_error: Exception) -> BaseException:
    """As SQLAlchemy raises it: the driver's error as ``orig`` and as the cause."""
    try:
        try:
            raise driver_error
        except Exception as exc:
            raise DBAPIError("connect", None, exc) from exc
    except DBAPIError as outer:
        return outer


def test_found_through_the_wrappers() -> None:
    assert missing_database(_wrapped(asyncpg.InvalidCatalogNameError('database "x" does not exist')))
    assert not missing_database(_wrapped(asyncpg.InvalidPasswordError("password authentication failed")))
    assert not missing_database(ConnectionRefusedError())
