"""Async database engine and sessions (SQLAlchemy 2 / SQLModel over asyncpg), the per-service roles'
names, and the connection options every hetsched connection to Postgres carries (TLS, application_name)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import ssl
from typing import TYPE_CHECKING, Any

import asyncpg
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

if TYPE_CHECKING:
    from shared.infra.settings import Settings

# One schema per service (DESIGN §6); only the owner reads or writes its schema. `gateway`: the
# OpenAI-compatible gateway's API keys and usage (migration 0019).
SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance", "gateway")
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/hetsched"
SCRAM_ITERATIONS = 4096
"""Postgres's own default (``scram_iterations``): what a server-side ``PASSWORD 'plain'`` would use."""


def role_of(schema: str) -> str:
    """The Postgres role a service connects as: DML on its own schema only, owns nothing (migrations 0005, 0009)."""
    return f"hetsched_{schema}"


def owner_role_of(schema: str) -> str:
    """The NOLOGIN role that owns a schema, its tables and functions (migration 0009): only migrations act
    as it, so no service connection can alter, drop, truncate or disable a trigger on what it uses."""
    return f"hetsched_{schema}_owner"


def application_name(schema: str) -> str:
    """``application_name`` of a service's connections (``pg_stat_activity``, server logs): ``hetsched-ledger``."""
    return f"hetsched-{schema}"


MISSING_DATABASE_SQLSTATE = "3D000"  # invalid_catalog_name


class DatabaseMissing(RuntimeError):
    """The URL names a database the server does not have: say how to make it, in one line."""

    def __init__(self, url: str) -> None:
        parsed = make_url(async_url(url))
        name = parsed.database or "postgres"
        where = []
        if (parsed.host or "127.0.0.1") not in ("127.0.0.1", "localhost") or (parsed.port or 5432) != 5432:
            where = [f"-h {parsed.host or '127.0.0.1'}", f"-p {parsed.port or 5432}"]
        if parsed.username:
            where.append(f"-U {parsed.username}")
        super().__init__(f"database {name} does not exist: createdb {' '.join([*where, name])}")
        self.database = name


def missing_database(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it: SQLAlchemy and Alembic wrap the driver's error) is the server
    saying the database does not exist."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if getattr(current, "sqlstate", None) == MISSING_DATABASE_SQLSTATE:
            return True
        orig = getattr(current, "orig", None)
        todo.extend([current.__cause__, current.__context__, orig if isinstance(orig, BaseException) else None])
    return False


async def check_database(url: str, *, tls: ssl.SSLContext | None = None, timeout_s: float = 5.0) -> None:
    """``DatabaseMissing`` when the server says the URL's database does not exist. Any other failure
    (server down, restarting, a role not made yet) is left to the caller's own retries."""
    try:
        conn = await asyncpg.connect(plain_url(url), timeout=timeout_s, **connect_args(tls=tls))
    except Exception as exc:
        if missing_database(exc):
            raise DatabaseMissing(url) from None
        return
    await conn.close()


def async_url(url: str) -> str:
    """The asyncpg form of a Postgres URL (``postgresql://`` and ``postgres://`` accepted)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgresql+psycopg2", "postgresql+psycopg"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    return parsed.render_as_string(hide_password=False)


def plain_url(url: str) -> str:
    """The driver-less form (``postgresql://``), for asyncpg.connect and other tools."""
    parsed = make_url(async_url(url)).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


def without_password(url: str) -> str:
    """``url`` with no password in it (what may be shown, logged, or handed to a process that has its own)."""
    # ``URL.set(password=None)`` keeps the password (None means "unchanged" there).
    return make_url(url)._replace(password=None).render_as_string(hide_password=False)


def database_tls(settings: Settings) -> ssl.SSLContext | None:
    """TLS for connections to an operator's Postgres: with ``HETSCHED_DATABASE_TLS_CA_FILE`` set, the
    server's certificate must chain to that CA and name the URL's host (libpq's ``verify-full``);
    unset, asyncpg's default (TLS if the server offers it, unverified, else plain)."""
    if settings.kit.database_tls_ca_file is None:
        return None
    return tls_context(ca_file=str(settings.kit.database_tls_ca_file))


def tls_context(*, ca_file: str) -> ssl.SSLContext:
    """A client context that trusts only ``ca_file`` and checks the host name (``verify-full``)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def connect_args(*, application_name: str | None = None, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """asyncpg ``connect`` keywords: ``server_settings`` (``application_name``) and ``ssl``."""
    args: dict[str, Any] = {}
    if application_name:
        args["server_settings"] = {"application_name": application_name}
    if tls is not None:
        args["ssl"] = tls
    return args


def make_engine(
    url: str, *, pool_size: int = 10, application_name: str | None = None, tls: ssl.SSLContext | None = None
) -> AsyncEngine:
    """An engine without pre-ping (it costs a round trip per checkout): a connection broken by a Postgres
    restart is invalidated on first use, and writers retry their transaction on a fresh one.
    ``application_name`` names every connection in ``pg_stat_activity``; ``tls`` (``database_tls``)
    verifies the server."""
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=False,
        connect_args=connect_args(application_name=application_name, tls=tls),
    )


def make_sessions(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def service_database_url(settings: Settings, schema: str) -> str:
    """The URL a service connects with: the configured server and database, as the service's own role
    (unless ``HETSCHED_DATABASE_ROLES`` is off), so a read of another service's schema fails loudly."""
    url = settings.kit.database_url or DEFAULT_DATABASE_URL
    if not settings.kit.database_roles:
        return url
    password = settings.kit.database_role_password.get_secret_value() if settings.kit.database_role_password else None
    # Never the URL's own password (the migrating user's): ``URL.set(password=None)`` would keep it.
    parsed = make_url(url)._replace(username=role_of(schema), password=password)
    return parsed.render_as_string(hide_password=False)


# -- passwords -----------------------------------------------------------------------------------


def generate_password() -> str:
    """A random password (256 bits, URL-safe: it can sit in a connection URL unquoted)."""
    return secrets.token_urlsafe(32)


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier Postgres stores for ``password`` (RFC 5802/7677, Postgres's
    ``SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>``). ``ALTER ROLE ... PASSWORD`` given
    the verifier instead of the password keeps the password itself out of statement logs and
    ``pg_stat_activity``. Postgres normalizes a password with SASLprep first, which leaves ASCII
    printable text as it is; other text must be sent as plain text (``scram_ready``)."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def scram_ready(password: str) -> bool:
    """Whether ``scram_verifier`` computes what the server would (SASLprep is the identity on it)."""
    return password.isascii() and password.isprintable()


def scram_matches(verifier: str | None, password: str) -> bool:
    """Whether the stored ``verifier`` (``pg_authid.rolpassword``) is ``password``'s: a password already
    in place is not set again (an ``ALTER ROLE`` racing another on the same role can fail)."""
    if not verifier or not verifier.startswith("SCRAM-SHA-256$") or not scram_ready(password):
        return False
    try:
        params, keys = verifier[len("SCRAM-SHA-256$") :].split("$", 1)
        iterations, salt = params.split(":", 1)
        expected = scram_verifier(password, salt=base64.b64decode(salt), iterations=int(iterations))
    except ValueError:
        return False
    return hmac.compare_digest(expected.rsplit("$", 1)[1], keys)


def password_sql(password: str) -> str:
    """The SQL literal for ``ALTER ROLE ... PASSWORD``: the SCRAM verifier when it can be computed
    here, else the quoted password (the server hashes it)."""
    value = scram_verifier(password) if scram_ready(password) else password
    return "'" + value.replace("'", "''") + "'"
