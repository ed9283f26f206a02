"""The gateway's API keys and usage (schema `gateway`): SQL only. Each function runs in the caller's
transaction (an ``AsyncConnection`` or ``AsyncSession``) and commits nothing; the caller commits.

Only a key's hash is stored (``shared.domain.gateway.keys``); the plaintext leaves ``issue`` once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date
from typing import Any

from sqlalchemy import RowMapping, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from services.gateway.tables import SCHEMA, ApiKeyRow
from shared.domain.gateway.keys import ApiKey, Entropy, allow_list, hash_secret, new_key

API_KEYS = ApiKeyRow.__table__  # type: ignore[attr-defined]

Conn = AsyncConnection | AsyncSession

ISSUE_ATTEMPTS = 3
"""A new key id taken already (48 random bits: practically never) is drawn again, this many times in all."""

# Rows as arrays (unnest): one statement text whatever the number of rows; the batch is summed per key first
# (ON CONFLICT cannot update one row twice in a statement) and sorted (concurrent batches lock in one order).
ADD_USAGE = text(
    f"INSERT INTO {SCHEMA}.usage (tenant, day, model, key_id, requests, prompt_tokens, completion_tokens) "
    "SELECT * FROM unnest(CAST(:tenants AS text[]), CAST(:days AS date[]), CAST(:models AS text[]), "
    "CAST(:key_ids AS text[]), CAST(:requests AS bigint[]), CAST(:prompt AS bigint[]), "
    "CAST(:completion AS bigint[])) "
    "ON CONFLICT ON CONSTRAINT usage_pkey DO UPDATE SET requests = usage.requests + excluded.requests, "
    "prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = usage.completion_tokens + excluded.completion_tokens, updated_at = now()"
)
USAGE_OF = text(
    "SELECT tenant, day, model, key_id, requests, prompt_tokens, completion_tokens "
    f"FROM {SCHEMA}.usage WHERE tenant = :tenant AND day >= :since ORDER BY day, model, key_id"
)


@dataclass(frozen=True, slots=True)
class UsageDelta:
    """What the gateway served since it last wrote: added to the day's totals of (tenant, model, key)."""

    tenant: str
    day: date
    model: str
    key_id: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


def _api_key(row: RowMapping) -> ApiKey:
    models = row["models"]
    return ApiKey(
        key_id=row["key_id"],
        tenant=row["tenant"],
        secret_hash=row["secret_hash"],
        name=row["name"],
        priority=row["priority"],
        rpm=row["rpm"],
        tpm=row["tpm"],
        models=allow_list(str(m) for m in models) if models is not None else None,
        revoked=row["revoked_at"] is not None,
    )


async def issue(
    conn: Conn,
    *,
    tenant: str,
    name: str | None = None,
    priority: int = 0,
    rpm: int | None = None,
    tpm: int | None = None,
    models: Iterable[str] | None = None,
    entropy: Entropy | None = None,
) -> tuple[ApiKey, str]:
    """A new key for ``tenant``: the stored key and its plaintext (show it once; it is not kept)."""
    allowed = allow_list(models)
    for _ in range(ISSUE_ATTEMPTS):
        made = new_key(entropy) if entropy is not None else new_key()
        key = ApiKey(
            key_id=made.key_id,
            tenant=tenant,
            secret_hash=hash_secret(made.secret),
            name=name,
            priority=priority,
            rpm=rpm,
            tpm=tpm,
            models=allowed,
        )
        stored = await conn.execute(
            insert(API_KEYS)
            .values(
                key_id=key.key_id,
                tenant=key.tenant,
                secret_hash=key.secret_hash,
                name=key.name,
                priority=key.priority,
                rpm=key.rpm,
                tpm=key.tpm,
                models=sorted(allowed) if allowed is not None else None,
            )
            .on_conflict_do_nothing(index_elements=[API_KEYS.c.key_id])
            .returning(API_KEYS.c.key_id)
        )
        if stored.first() is not None:
            return key, made.plaintext
    raise RuntimeError(f"no free key id after {ISSUE_ATTEMPTS} attempts")


async def revoke(conn: Conn, key_id: str) -> bool:
    """Revoke a key: False when there is no such key. Revoking one already revoked keeps its first time."""
    revoked = await conn.execute(
        update(API_KEYS)
        .where(API_KEYS.c.key_id == key_id)
        .values(revoked_at=func.coalesce(API_KEYS.c.revoked_at, func.now()))
        .returning(API_KEYS.c.key_id)
    )
    return revoked.first() is not None


async def active_keys(conn: Conn) -> list[ApiKey]:
    """Every key not revoked, by id: what the gateway admits requests with."""
    rows = await conn.execute(select(API_KEYS).where(API_KEYS.c.revoked_at.is_(None)).order_by(API_KEYS.c.key_id))
    return [_api_key(row) for row in rows.mappings()]


async def list_keys(conn: Conn) -> list[ApiKey]:
    """Every key, revoked ones too, by tenant then id."""
    rows = await conn.execute(select(API_KEYS).order_by(API_KEYS.c.tenant, API_KEYS.c.key_id))
    return [_api_key(row) for row in rows.mappings()]


async def add_usage(conn: Conn, rows: Iterable[UsageDelta]) -> None:
    """Add ``rows`` to the stored totals (a row for a new tenant, day, model and key starts at zero)."""
    totals: dict[tuple[str, date, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for row in rows:
        total = totals[(row.tenant, row.day, row.model, row.key_id)]
        total[0] += row.requests
        total[1] += row.prompt_tokens
        total[2] += row.completion_tokens
    if not totals:
        return
    keys = sorted(totals)
    await conn.execute(
        ADD_USAGE,
        {
            "tenants": [k[0] for k in keys],
            "days": [k[1] for k in keys],
            "models": [k[2] for k in keys],
            "key_ids": [k[3] for k in keys],
            "requests": [totals[k][0] for k in keys],
            "prompt": [totals[k][1] for k in keys],
            "completion": [totals[k][2] for k in keys],
        },
    )


async def usage_of(conn: Conn, tenant: str, since_day: date) -> list[dict[str, Any]]:
    """``tenant``'s totals from ``since_day`` on, by day, model and key: one dict per row, with ``tenant``,
    ``day``, ``model``, ``key_id``, ``requests``, ``prompt_tokens`` and ``completion_tokens``."""
    rows = await conn.execute(USAGE_OF, {"tenant": tenant, "since": since_day})
    return [dict(row) for row in rows.mappings()]
