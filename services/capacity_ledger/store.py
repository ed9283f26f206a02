"""The ledger's transactions. Every one locks accelerator rows in id order before touching shares, so
concurrent commits, releases, expiries and capacity changes never deadlock; the database trigger
refuses any over-commit even if this code were wrong."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncSession

from services.capacity_ledger.tables import Allocation, Journal, LedgerAccelerator, Share
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.envelope import new_event
from shared.contracts.ledger import (
    ALLOCATION_COMMITTED,
    AcceleratorBalance,
    AllocationEvent,
    CommitReply,
    CommitRequest,
    ShareOut,
)
from shared.contracts.subjects import Context, Subjects
from shared.domain.ledger import AcceleratorState, ShareRequest, apply_shares, check_fit
from shared.infra.outbox import enqueue, enqueue_many

SCHEMA = "ledger"
SOURCE = "capacity-ledger"
ALLOCATIONS = Allocation.__table__  # type: ignore[attr-defined]
SHARES = Share.__table__  # type: ignore[attr-defined]
JOURNAL = Journal.__table__  # type: ignore[attr-defined]
ACCELERATORS = LedgerAccelerator.__table__  # type: ignore[attr-defined]


def _now() -> datetime:
    return datetime.now(UTC)


async def driver(session: AsyncSession) -> Any:
    """The asyncpg connection under the session's transaction: the hot path skips SQLAlchemy's statement
    machinery (it halves a single commit's time) while staying in the same transaction.

    SQLAlchemy opens the database transaction lazily, on its first statement; a raw statement before
    that would run in autocommit and silently drop its row locks, so this refuses to hand it out.
    """
    connection = await session.connection()
    raw = await connection.get_raw_connection()
    driver_connection = raw.driver_connection
    if driver_connection is None or not driver_connection.is_in_transaction():
        raise RuntimeError("run a statement through the session first: no database transaction is open yet")
    return driver_connection


async def lock_accelerators(session: AsyncSession, ids: Iterable[str]) -> dict[str, AcceleratorState]:
    """Lock the rows (id order: the one lock order every transaction uses) and return their state."""
    ids = sorted(set(ids))
    if not ids:
        return {}
    rows = await (await driver(session)).fetch(
        "SELECT id, hbm_usable, reserved, available FROM ledger.accelerators WHERE id = ANY($1) ORDER BY id FOR UPDATE",
        ids,
    )
    return {r["id"]: AcceleratorState(r["id"], r["hbm_usable"], r["reserved"], r["available"]) for r in rows}


def balances(view: dict[str, AcceleratorState], ids: Iterable[str]) -> list[AcceleratorBalance]:
    return [
        AcceleratorBalance(id=i, usable=view[i].usable, reserved=view[i].reserved, available=view[i].available)
        for i in sorted(set(ids))
        if i in view
    ]


def event_envelope(
    event: str,
    payload: dict[str, Any],
    *,
    tenant: str | None = None,
    correlation_id: str | None = None,
) -> Any:
    return new_event(
        type=f"ledger.{event}",
        source=SOURCE,
        payload=payload,
        occurred_at=_now(),
        tenant=tenant,
        correlation_id=correlation_id,
    )


async def emit(
    session: AsyncSession,
    subjects: Subjects,
    event: str,
    payload: dict[str, Any],
    *,
    tenant: str | None = None,
    correlation_id: str | None = None,
    causation_id: str | None = None,
) -> None:
    envelope = new_event(
        type=f"ledger.{event}",
        source=SOURCE,
        payload=payload,
        occurred_at=_now(),
        tenant=tenant,
        correlation_id=correlation_id,
        causation_id=causation_id,
    )
    await enqueue(session=session, schema=SCHEMA, subject=subjects.event(Context.LEDGER, event), event=envelope)


def _shares(request: CommitRequest) -> list[ShareRequest]:
    return [ShareRequest(s.accelerator_id, s.weights, s.kv, s.activation, s.workspace) for s in request.shares]


def _share_out(share: ShareRequest) -> ShareOut:
    return ShareOut(
        accelerator_id=share.accelerator_id,
        weights=share.weights,
        kv=share.kv,
        activation=share.activation,
        workspace=share.workspace,
        total=share.total,
    )


def allocation_payload(row: Any, shares: Sequence[ShareRequest]) -> dict[str, Any]:
    return AllocationEvent(
        allocation_id=row["id"],
        request_id=row["request_id"],
        tenant=row["tenant"],
        kind=row["kind"],
        parent_id=row["parent_id"],
        preemptible=row["preemptible"],
        priority=row["priority"],
        lease_expires_at=row["lease_expires_at"],
        counts_against_hbm=row["kind"] == "replica",
        shares=[_share_out(s) for s in shares],
    ).model_dump(mode="json")


@dataclass
class _Pending:
    index: int
    request: CommitRequest
    shares: list[ShareRequest]
    row: dict[str, Any]


async def _existing(session: AsyncSession, commits: Sequence[CommitRequest]) -> dict[tuple[str, str], Any]:
    keys = sorted({(c.tenant, c.request_id) for c in commits})
    # Through the session on purpose: this is the batch's first statement and opens its transaction.
    rows = (
        await session.execute(
            text(
                "SELECT a.id, a.tenant, a.request_id, a.lease_expires_at, a.state, "
                "COALESCE(json_agg(json_build_array(s.accelerator_id, s.weights, s.kv, s.activation, s.workspace)) "
                "FILTER (WHERE s.accelerator_id IS NOT NULL), '[]') AS shares "
                "FROM ledger.allocations a LEFT JOIN ledger.shares s ON s.allocation_id = a.id "
                "WHERE (a.tenant, a.request_id) IN "
                "(SELECT * FROM unnest(CAST(:tenants AS text[]), CAST(:rids AS text[]))) "
                "GROUP BY a.id"
            ),
            {"tenants": [k[0] for k in keys], "rids": [k[1] for k in keys]},
        )
    ).mappings()
    return {
        (r["tenant"], r["request_id"]): _Existing(r["id"], r["lease_expires_at"], _as_json(r["shares"])) for r in rows
    }


@dataclass(frozen=True)
class _Existing:
    id: str
    lease_expires_at: datetime
    shares: list[list[Any]]


def _as_json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _same_shares(stored: Any, shares: Sequence[ShareRequest]) -> bool:
    have = sorted(tuple(s) for s in stored)
    want = sorted([s.accelerator_id, s.weights, s.kv, s.activation, s.workspace] for s in shares)
    return [list(h) for h in have] == [list(w) for w in want]


async def commit_batch(
    session: AsyncSession, commits: Sequence[CommitRequest], *, subjects: Subjects, default_lease_s: int
) -> list[CommitReply]:
    """Apply commits in one transaction (the caller's); each is all-or-nothing on its own.

    A commit whose (tenant, request_id) exists returns that allocation (``duplicate``) and reserves
    nothing. One that does not fit is refused with the fresh view: ``conflict`` when the caller's
    ``expected`` view differs from the current one (it decided on stale data), else ``no_capacity``.
    """
    now = _now()
    results: list[CommitReply | None] = [None] * len(commits)
    existing = await _existing(session, commits)
    all_ids = [s.accelerator_id for c in commits for s in c.shares]
    view = await lock_accelerators(session, all_ids)
    pending: list[_Pending] = []
    parents = await _lock_parents(session, [c.parent_id for c in commits if c.parent_id])
    seen_keys: set[tuple[str, str]] = set()
    for i, request in enumerate(commits):
        shares = _shares(request)
        ids = [s.accelerator_id for s in shares]
        key = (request.tenant, request.request_id)
        if key in existing or key in seen_keys:
            results[i] = _duplicate(request, existing.get(key), shares, view, ids)
            continue
        if request.lease_expires_at is not None and request.lease_expires_at <= now:
            results[i] = _reject(request, ErrorCode.INVALID_REQUEST, "lease_expires_at is in the past")
            continue
        unknown = [a for a in ids if a not in view]
        if unknown:
            results[i] = _reject(request, ErrorCode.NOT_FOUND, f"unknown accelerator(s): {', '.join(sorted(unknown))}")
            continue
        if request.kind == "request":
            problem = _check_child(request, shares, parents)
            if problem is not None:
                results[i] = _reject(request, *problem)
                continue
            fit_ok = True
        else:
            fit = check_fit(view, shares)
            fit_ok = fit.ok
            if not fit_ok:
                stale = request.expected is not None and any(
                    request.expected.get(a) is not None and request.expected[a] != view[a].reserved for a in ids
                )
                code = ErrorCode.CONFLICT if stale else ErrorCode.NO_CAPACITY
                results[i] = _reject(request, code, fit.describe(), view=balances(view, ids))
                continue
            view = apply_shares(view, shares)
        lease = request.lease_expires_at or now + timedelta(seconds=request.lease_s or default_lease_s)
        row = {
            "id": f"al-{uuid.uuid4().hex}",
            "request_id": request.request_id,
            "tenant": request.tenant,
            "kind": request.kind,
            "parent_id": request.parent_id,
            "state": "active",
            "preemptible": request.preemptible,
            "priority": request.priority,
            "lease_expires_at": lease,
            "flagged": False,
            "created_at": now,
        }
        seen_keys.add(key)
        pending.append(_Pending(i, request, shares, row))
        if request.kind == "request" and request.parent_id:
            parents[request.parent_id]["used"] = _add_kv(parents[request.parent_id]["used"], shares)
    if pending:
        subject = subjects.event(Context.LEDGER, ALLOCATION_COMMITTED)
        events = [
            event_envelope(
                ALLOCATION_COMMITTED,
                allocation_payload(p.row, p.shares),
                tenant=p.request.tenant,
                correlation_id=p.request.request_id,
            )
            for p in pending
        ]
        await (await driver(session)).execute(
            INSERT_COMMITS,
            json.dumps([p.row for p in pending], default=_json_default),
            json.dumps(
                [
                    {
                        "allocation_id": p.row["id"],
                        "accelerator_id": s.accelerator_id,
                        "weights": s.weights,
                        "kv": s.kv,
                        "activation": s.activation,
                        "workspace": s.workspace,
                        "total": s.total,
                        "counts": p.request.kind == "replica",
                        "active": True,
                    }
                    for p in pending
                    for s in p.shares
                ]
            ),
            json.dumps(
                [
                    {
                        "op": "commit",
                        "allocation_id": p.row["id"],
                        "accelerator_id": s.accelerator_id,
                        "delta": s.total if p.request.kind == "replica" else 0,
                        "details": {
                            "tenant": p.request.tenant,
                            "request_id": p.request.request_id,
                            "kind": p.request.kind,
                        },
                    }
                    for p in pending
                    for s in p.shares
                ]
            ),
            json.dumps(
                [
                    {
                        "event_id": str(e.event_id),
                        "subject": subject,
                        "event_type": e.type,
                        "payload": e.model_dump(mode="json"),
                    }
                    for e in events
                ]
            ),
        )
        for p in pending:
            results[p.index] = CommitReply(
                status="committed",
                request_id=p.request.request_id,
                allocation_id=p.row["id"],
                lease_expires_at=p.row["lease_expires_at"],
                view=balances(view, [s.accelerator_id for s in p.shares]),
            )
    return [r for r in results if r is not None]


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(type(value).__name__)


# Allocations, shares (the trigger checks the invariant), journal and outbox rows of a batch of
# commits in one statement: one round trip however many commits the batch holds.
INSERT_COMMITS = """
WITH a AS (
    INSERT INTO ledger.allocations (id, request_id, tenant, kind, parent_id, state, preemptible, priority,
                                    lease_expires_at, flagged, created_at)
    SELECT id, request_id, tenant, kind, parent_id, state, preemptible, priority, lease_expires_at, flagged,
           created_at
    FROM json_populate_recordset(NULL::ledger.allocations, $1::json)
    RETURNING 1
), s AS (
    INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, total, counts,
                               active)
    SELECT allocation_id, accelerator_id, weights, kv, activation, workspace, total, counts, active
    FROM json_populate_recordset(NULL::ledger.shares, $2::json)
    RETURNING 1
), j AS (
    INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details)
    SELECT op, allocation_id, accelerator_id, delta, details
    FROM json_to_recordset($3::json)
         AS x(op text, allocation_id text, accelerator_id text, delta bigint, details jsonb)
    RETURNING 1
), o AS (
    INSERT INTO ledger.outbox (event_id, subject, event_type, payload)
    SELECT event_id, subject, event_type, payload
    FROM json_to_recordset($4::json) AS x(event_id uuid, subject text, event_type text, payload jsonb)
    RETURNING 1
)
SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM s), (SELECT count(*) FROM j), (SELECT count(*) FROM o)
"""


def _reject(request: CommitRequest, code: ErrorCode, message: str, **details: Any) -> CommitReply:
    body = rejected(code, message, **{k: [b.model_dump() for b in v] if k == "view" else v for k, v in details.items()})
    return CommitReply(status="rejected", request_id=request.request_id, error=body.error, view=details.get("view", []))


def _duplicate(
    request: CommitRequest, row: Any, shares: Sequence[ShareRequest], view: dict[str, AcceleratorState], ids: list[str]
) -> CommitReply:
    if row is None:  # the same request id twice in one batch
        return _reject(request, ErrorCode.INVALID_REQUEST, "request_id appears twice in this batch")
    if not _same_shares(row.shares, shares):
        return _reject(request, ErrorCode.INVALID_REQUEST, "request_id was already used for different shares")
    return CommitReply(
        status="committed",
        request_id=request.request_id,
        allocation_id=row.id,
        duplicate=True,
        lease_expires_at=row.lease_expires_at,
        view=balances(view, ids),
    )


async def _lock_parents(session: AsyncSession, parent_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Lock replica allocations that requests will live in, with their KV pools and what is in use."""
    if not parent_ids:
        return {}
    rows = await session.execute(
        text("SELECT id, tenant, state, kind FROM ledger.allocations WHERE id = ANY(:ids) ORDER BY id FOR UPDATE"),
        {"ids": sorted(set(parent_ids))},
    )
    parents: dict[str, dict[str, Any]] = {
        r.id: {"tenant": r.tenant, "state": r.state, "kind": r.kind, "pool": {}, "used": {}} for r in rows
    }
    shares = await session.execute(
        text(
            "SELECT s.allocation_id, a.parent_id, s.accelerator_id, s.kv FROM ledger.shares s "
            "JOIN ledger.allocations a ON a.id = s.allocation_id "
            "WHERE s.active AND (s.allocation_id = ANY(:ids) OR a.parent_id = ANY(:ids))"
        ),
        {"ids": list(parents)},
    )
    for r in shares:
        if r.allocation_id in parents:
            parents[r.allocation_id]["pool"][r.accelerator_id] = r.kv
        elif r.parent_id in parents:
            used = parents[r.parent_id]["used"]
            used[r.accelerator_id] = used.get(r.accelerator_id, 0) + r.kv
    return parents


def _add_kv(used: dict[str, int], shares: Sequence[ShareRequest]) -> dict[str, int]:
    out = dict(used)
    for s in shares:
        out[s.accelerator_id] = out.get(s.accelerator_id, 0) + s.total
    return out


def _check_child(
    request: CommitRequest, shares: Sequence[ShareRequest], parents: dict[str, dict[str, Any]]
) -> tuple[ErrorCode, str] | None:
    parent = parents.get(request.parent_id or "")
    if parent is None:
        return ErrorCode.NOT_FOUND, f"no replica allocation {request.parent_id!r}"
    if parent["tenant"] != request.tenant:
        return ErrorCode.FORBIDDEN, "the replica belongs to another tenant"
    if parent["kind"] != "replica" or parent["state"] != "active":
        return ErrorCode.CONFLICT, f"replica {request.parent_id} is not active"
    for s in shares:
        pool = parent["pool"].get(s.accelerator_id)
        if pool is None:
            return ErrorCode.INVALID_REQUEST, f"{s.accelerator_id} is not one of the replica's accelerators"
        free = pool - parent["used"].get(s.accelerator_id, 0)
        if s.total > free:
            return ErrorCode.NO_CAPACITY, f"{s.accelerator_id}: KV pool short by {(s.total - free) / 1e9:.2f} GB"
    return None


# -- release / expire / renew ----------------------------------------------------------------


async def end_allocation(
    session: AsyncSession,
    allocation_id: str,
    *,
    subjects: Subjects,
    state: str,
    event: str,
    tenant: str | None = None,
) -> tuple[str, Any]:
    """End an allocation (and the requests inside a replica). Returns ("ok" | "already" | "not_found" |
    "forbidden", row)."""
    row = (
        (
            await session.execute(
                text("SELECT * FROM ledger.allocations WHERE id = :id FOR UPDATE"), {"id": allocation_id}
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        return "not_found", None
    if tenant is not None and row["tenant"] != tenant:
        return "forbidden", row
    if row["state"] != "active":
        return "already", row
    ids = [row["id"]]
    apg = await driver(session)  # the session's first statement opened the transaction
    children = await apg.fetch(
        "SELECT * FROM ledger.allocations WHERE parent_id = $1 AND state = 'active' ORDER BY id FOR UPDATE",
        allocation_id,
    )
    ids += [c["id"] for c in children]
    share_rows = await apg.fetch(
        "SELECT allocation_id, accelerator_id, weights, kv, activation, workspace, total, counts "
        "FROM ledger.shares WHERE allocation_id = ANY($1::text[]) AND active",
        ids,
    )
    await lock_accelerators(session, [s["accelerator_id"] for s in share_rows if s["counts"]])
    await apg.execute("UPDATE ledger.shares SET active = false WHERE allocation_id = ANY($1::text[]) AND active", ids)
    await apg.execute(
        "UPDATE ledger.allocations SET state = $2, ended_at = now() WHERE id = ANY($1::text[])", ids, state
    )
    by_allocation: dict[str, list[ShareRequest]] = {}
    for s in share_rows:
        by_allocation.setdefault(s["allocation_id"], []).append(
            ShareRequest(s["accelerator_id"], s["weights"], s["kv"], s["activation"], s["workspace"])
        )
    journal = [
        (state, s["allocation_id"], s["accelerator_id"], -s["total"] if s["counts"] else 0) for s in share_rows
    ] or [(state, allocation_id, None, 0)]
    await apg.executemany(
        "INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details) VALUES ($1, $2, $3, $4, '{}')",
        journal,
    )
    subject = subjects.event(Context.LEDGER, event)
    await enqueue_many(
        session=session,
        schema=SCHEMA,
        events=[
            (
                subject,
                event_envelope(
                    event,
                    allocation_payload(ended, by_allocation.get(ended["id"], [])),
                    tenant=ended["tenant"],
                    correlation_id=ended["request_id"],
                ),
            )
            for ended in [row, *children]
        ],
    )
    return "ok", row


async def renew(session: AsyncSession, allocation_id: str, *, tenant: str, expires_at: datetime) -> tuple[str, Any]:
    row = (
        (
            await session.execute(
                text("SELECT * FROM ledger.allocations WHERE id = :id FOR UPDATE"), {"id": allocation_id}
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        return "not_found", None
    if row["tenant"] != tenant:
        return "forbidden", row
    if row["state"] != "active":
        return "ended", row
    await session.execute(
        text("UPDATE ledger.allocations SET lease_expires_at = :at WHERE id = :id"),
        {"id": allocation_id, "at": expires_at},
    )
    await session.execute(
        insert(JOURNAL),
        [
            {
                "op": "renew",
                "allocation_id": allocation_id,
                "accelerator_id": None,
                "delta": 0,
                "details": {"lease_expires_at": expires_at.isoformat()},
            }
        ],
    )
    return "ok", row


async def expired_ids(session: AsyncSession, *, limit: int) -> list[str]:
    rows = await session.execute(
        text(
            "SELECT id FROM ledger.allocations WHERE state = 'active' AND lease_expires_at < now() "
            "ORDER BY lease_expires_at LIMIT :limit"
        ),
        {"limit": limit},
    )
    return [r.id for r in rows]


# -- snapshot ----------------------------------------------------------------------------------


async def snapshot(
    session: AsyncSession, *, node: str | None, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    rows = (
        (
            await session.execute(
                text(
                    "SELECT a.id, a.node, a.hbm_usable, a.reserved, a.available, "
                    "COALESCE(array_agg(s.allocation_id ORDER BY s.allocation_id) "
                    "FILTER (WHERE s.allocation_id IS NOT NULL AND s.counts), '{}') AS allocations "
                    "FROM ledger.accelerators a LEFT JOIN ledger.shares s ON s.accelerator_id = a.id AND s.active "
                    "WHERE (CAST(:node AS text) IS NULL OR a.node = :node) "
                    "AND (CAST(:after AS text) IS NULL OR a.id > :after) "
                    "GROUP BY a.id ORDER BY a.id LIMIT :limit"
                ),
                {"node": node, "after": after, "limit": limit + 1},
            )
        )
        .mappings()
        .all()
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return [dict(r) for r in rows], (rows[-1]["id"] if more and rows else None)


# -- capacity (from topology events) ---------------------------------------------------------


async def upsert_capacity(
    session: AsyncSession, *, node: str, accelerators: Sequence[tuple[str, str, int]], ceiling: float, usable: Any
) -> dict[str, AcceleratorState]:
    """Register or resize a node's accelerators (id, sku, hbm_total); reserved bytes are kept."""
    existing = await session.execute(
        text("SELECT id FROM ledger.accelerators WHERE node = :node ORDER BY id FOR UPDATE"), {"node": node}
    )
    _ = existing.all()
    await lock_accelerators(session, [a[0] for a in accelerators])
    for acc_id, sku, total in sorted(accelerators):
        await session.execute(
            text(
                "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling, hbm_usable, reserved, available) "
                "VALUES (:id, :node, :sku, :total, :ceiling, :usable, 0, true) "
                "ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node, sku = EXCLUDED.sku, "
                "hbm_total = EXCLUDED.hbm_total, ceiling = EXCLUDED.ceiling, hbm_usable = EXCLUDED.hbm_usable, "
                "updated_at = now()"
            ),
            {
                "id": acc_id,
                "node": node,
                "sku": sku,
                "total": total,
                "ceiling": ceiling,
                "usable": usable(total, ceiling),
            },
        )
    return await lock_accelerators(session, [a[0] for a in accelerators])


async def set_node_available(
    session: AsyncSession, *, node: str, available: bool
) -> tuple[dict[str, AcceleratorState], list[str]]:
    """Mark a node's accelerators (un)available; when unavailable, flag the active allocations on them."""
    ids = [
        r.id
        for r in await session.execute(
            text("SELECT id FROM ledger.accelerators WHERE node = :node ORDER BY id FOR UPDATE"), {"node": node}
        )
    ]
    if not ids:
        return {}, []
    await session.execute(
        text("UPDATE ledger.accelerators SET available = :available, updated_at = now() WHERE node = :node"),
        {"node": node, "available": available},
    )
    flagged: list[str] = []
    if not available:
        flagged = [
            r.id
            for r in await session.execute(
                text(
                    "UPDATE ledger.allocations SET flagged = true WHERE state = 'active' AND id IN "
                    "(SELECT allocation_id FROM ledger.shares WHERE active AND accelerator_id = ANY(:ids)) RETURNING id"
                ),
                {"ids": ids},
            )
        ]
    await session.execute(
        insert(JOURNAL),
        [
            {
                "op": "available" if available else "unavailable",
                "allocation_id": None,
                "accelerator_id": i,
                "delta": 0,
                "details": {"node": node, "flagged": len(flagged)},
            }
            for i in ids
        ],
    )
    return await lock_accelerators(session, ids), sorted(flagged)
