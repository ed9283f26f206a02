"""Placement's repository over its own tables (`placement.decisions`, `placement.ledger_allocations`,
`placement.queue`): SQL only, keyword-only parameters, domain objects out. The rules are in
``shared.domain.placement.ownership``."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Text, and_, any_, cast, delete, func, not_, or_, select, text, tuple_, update
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.placement.records import (
    PlacedAllocation,
    PlacedReplica,
    QueuedRequest,
    ReplicaFilter,
    SeenAllocation,
    StoredIntent,
    Turn,
)
from services.placement.tables import DecisionRow, LedgerAllocationRow, QueueRow
from shared.contracts.ledger import CommitRequest
from shared.contracts.placement import PlaceReply, PlaceRequest
from shared.domain.placement.listing import Position
from shared.domain.placement.ownership import Intent, IntentState

DECISIONS = DecisionRow.__table__  # type: ignore[attr-defined]
ALLOCATIONS = LedgerAllocationRow.__table__  # type: ignore[attr-defined]
QUEUE = QueueRow.__table__  # type: ignore[attr-defined]


def _intent(row: Any) -> Intent:
    return Intent(
        tenant=row.tenant,
        request_id=row.request_id,
        body_hash=row.body_hash,
        status=IntentState(row.status),
        attempt=row.attempt,
        claimed_until=row.claimed_until,
        updated_at=row.updated_at,
        allocation_id=row.allocation_id,
    )


# The hot path's statements, built once (a statement built per call costs more than its round trip).
_INSERT_DECIDED = text(
    f"INSERT INTO {DECISIONS.fullname} (tenant, request_id, status, body_hash, attempt, claimed_until, "
    "ledger_commit, reply, created_at, updated_at) VALUES (:tenant, :request_id, :status, :body_hash, 1, "
    ":claimed_until, CAST(:commit AS jsonb), CAST(:reply AS jsonb), :now, :now) "
    "ON CONFLICT DO NOTHING RETURNING attempt"
)
_FINISH = text(
    f"UPDATE {DECISIONS.fullname} SET status = :status, reply = CAST(:reply AS jsonb), allocation_id = :allocation_id, "
    "lease_expires_at = :lease_expires_at, claimed_until = NULL, updated_at = :now "
    "WHERE tenant = :tenant AND request_id = :request_id AND attempt = :attempt "
    f"AND status = '{IntentState.COMMITTING.value}' RETURNING attempt"
)
_ALLOCATION_SEEN = text(
    f"INSERT INTO {ALLOCATIONS.fullname} (allocation_id, tenant, request_id, state, seen_at) "
    "VALUES (:allocation_id, :tenant, :request_id, 'active', :now) ON CONFLICT DO NOTHING"
)

# A placement committed on the one-durable-step path, recorded from its `allocation_committed` (the ledger's
# record of it): a new row, or one that was waiting (queued, committing, rejected) for the same request id.
# Nothing changes for a row already placed or ended: RETURNING says whether this event placed it.
_RECORD_PLACED = text(
    f"INSERT INTO {DECISIONS.fullname} AS d (tenant, request_id, status, body_hash, attempt, allocation_id, reply, "
    "lease_expires_at, lease_s, created_at, updated_at) "
    "VALUES (:tenant, :request_id, 'placed', :body_hash, 1, :allocation_id, CAST(:reply AS jsonb), :lease_expires_at, "
    ":lease_s, :now, :now) "
    "ON CONFLICT (tenant, request_id) DO UPDATE SET status = 'placed', allocation_id = EXCLUDED.allocation_id, "
    "reply = EXCLUDED.reply, lease_expires_at = EXCLUDED.lease_expires_at, lease_s = EXCLUDED.lease_s, "
    "claimed_until = NULL, updated_at = EXCLUDED.updated_at "
    f"WHERE d.status IN ('{IntentState.COMMITTING.value}', '{IntentState.QUEUED.value}', "
    f"'{IntentState.REJECTED.value}', '{IntentState.ABANDONED.value}') "
    "RETURNING d.attempt"
)

# One lock per tenant's queue (its hash), held to the end of the transaction: the per-tenant cap.
_LOCK_TENANT_QUEUE = text("SELECT pg_advisory_xact_lock(hashtextextended('placement.queue:' || :tenant, 0))")


def _key(tenant: str, request_id: str) -> Any:
    return and_(DECISIONS.c.tenant == tenant, DECISIONS.c.request_id == request_id)


def _replica_clauses(where: ReplicaFilter) -> list[Any]:
    """The placed decisions (with their allocation and reply) that ``where`` keeps."""
    reply = DECISIONS.c.reply
    clauses: list[Any] = [
        DECISIONS.c.status == IntentState.PLACED.value,
        DECISIONS.c.allocation_id.is_not(None),
        reply.is_not(None),
    ]
    if where.tenant is not None:
        clauses.append(DECISIONS.c.tenant == where.tenant)
    if where.model is not None:
        clauses.append(reply["model"].astext == where.model)
    if where.node is not None:
        # A GPU replica's nodes (every stage's) are its `placements`; a TPU replica's pod is its slice's.
        clauses.append(
            or_(reply["placements"].contains([{"node": where.node}]), reply["tpu_slice"]["pod"].astext == where.node)
        )
    if where.only is not None:
        clauses.append(DECISIONS.c.allocation_id == any_(cast(sorted(where.only), ARRAY(Text))))
    if where.excluding:
        clauses.append(not_(DECISIONS.c.allocation_id == any_(cast(sorted(where.excluding), ARRAY(Text)))))
    return clauses


class DecisionStore:
    """Intents and decisions by (tenant, request id); placement's ledger allocations by id."""

    # -- intents ---------------------------------------------------------------------------------------

    async def lock(self, *, session: AsyncSession, tenant: str, request_id: str) -> StoredIntent | None:
        """The intent of this (tenant, request id), locked for this transaction; None if there is none."""
        row = (await session.execute(select(DECISIONS).where(_key(tenant, request_id)).with_for_update())).one_or_none()
        if row is None:
            return None
        return StoredIntent(
            intent=_intent(row),
            commit=CommitRequest.model_validate(row.ledger_commit) if row.ledger_commit is not None else None,
            reply=PlaceReply.model_validate(row.reply) if row.reply is not None else None,
        )

    async def insert(
        self,
        *,
        session: AsyncSession,
        tenant: str,
        request_id: str,
        body_hash: str,
        claimed_until: datetime,
        now: datetime,
    ) -> bool:
        """Record a new intent (attempt 1, ``committing``); False when another request recorded it first."""
        inserted = await session.execute(
            insert(DECISIONS)
            .values(
                tenant=tenant,
                request_id=request_id,
                status=IntentState.COMMITTING.value,
                body_hash=body_hash,
                attempt=1,
                claimed_until=claimed_until,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing()
            .returning(DECISIONS.c.attempt)
        )
        return inserted.scalar_one_or_none() is not None

    async def insert_decided(
        self,
        *,
        session: AsyncSession,
        tenant: str,
        request_id: str,
        body_hash: str,
        status: IntentState,
        claimed_until: datetime | None,
        commit: CommitRequest | None,
        pending: PlaceReply | None,
        now: datetime,
    ) -> bool:
        """A new request id decided before its intent was written (the fast path): its intent at attempt 1,
        ``committing`` with the commit about to be sent, or ``rejected``, in one statement. False when the
        id has an intent already (the caller then takes the ordinary path)."""
        inserted = await session.execute(
            _INSERT_DECIDED,
            {
                "tenant": tenant,
                "request_id": request_id,
                "status": status.value,
                "body_hash": body_hash,
                "claimed_until": claimed_until,
                "commit": commit.model_dump_json() if commit is not None else None,
                "reply": pending.model_dump_json() if pending is not None else None,
                "now": now,
            },
        )
        return inserted.scalar_one_or_none() is not None

    async def take(
        self,
        *,
        session: AsyncSession,
        tenant: str,
        request_id: str,
        claimed_until: datetime,
        now: datetime,
        keep_commit: bool,
    ) -> int:
        """Take an intent over for a new attempt (``committing`` again); its attempt number."""
        values: dict[str, Any] = {
            "status": IntentState.COMMITTING.value,
            "attempt": DECISIONS.c.attempt + 1,
            "claimed_until": claimed_until,
            "updated_at": now,
        }
        if not keep_commit:
            values.update(ledger_commit=None, reply=None, allocation_id=None)
        taken = await session.execute(
            update(DECISIONS).where(_key(tenant, request_id)).values(**values).returning(DECISIONS.c.attempt)
        )
        return int(taken.scalar_one())

    async def save_commit(
        self,
        *,
        session: AsyncSession,
        turn: Turn,
        commit: CommitRequest,
        pending: PlaceReply,
        claimed_until: datetime,
        now: datetime,
    ) -> bool:
        """Keep the commit about to be sent (and the reply it would give); False if the attempt lost the intent."""
        saved = await session.execute(
            update(DECISIONS)
            .where(
                _key(turn.tenant, turn.request_id),
                DECISIONS.c.attempt == turn.attempt,
                DECISIONS.c.status == IntentState.COMMITTING.value,
            )
            .values(ledger_commit=commit.model_dump(mode="json"), reply=pending.model_dump(mode="json"), updated_at=now)
            .returning(DECISIONS.c.attempt)
        )
        return saved.scalar_one_or_none() is not None

    async def finish(
        self,
        *,
        session: AsyncSession,
        turn: Turn,
        status: IntentState,
        reply: PlaceReply | None,
        allocation_id: str | None,
        now: datetime,
        lease_expires_at: datetime | None = None,
    ) -> bool:
        """Record an attempt's outcome (``placed`` or ``rejected``, a placed one with when its lease ends);
        False if the attempt lost the intent."""
        finished = await session.execute(
            _FINISH,
            {
                "tenant": turn.tenant,
                "request_id": turn.request_id,
                "attempt": turn.attempt,
                "status": status.value,
                "reply": reply.model_dump_json() if reply is not None else None,
                "allocation_id": allocation_id,
                "lease_expires_at": lease_expires_at,
                "now": now,
            },
        )
        return finished.scalar_one_or_none() is not None

    async def settle(
        self,
        *,
        session: AsyncSession,
        turn: Turn,
        was: IntentState,
        status: IntentState,
        reply: PlaceReply | None,
        now: datetime,
    ) -> bool:
        """Move an intent from ``was`` to ``status`` with ``reply`` (a queued request timing out); False
        when it is no longer ``was`` at that attempt."""
        settled = await session.execute(
            update(DECISIONS)
            .where(
                _key(turn.tenant, turn.request_id), DECISIONS.c.attempt == turn.attempt, DECISIONS.c.status == was.value
            )
            .values(
                status=status.value,
                reply=reply.model_dump(mode="json") if reply is not None else None,
                claimed_until=None,
                updated_at=now,
            )
            .returning(DECISIONS.c.attempt)
        )
        return settled.scalar_one_or_none() is not None

    async def unclaim(self, *, session: AsyncSession, turn: Turn, now: datetime) -> None:
        """Let a retry take the intent over at once (the outcome of this attempt's commit is unknown)."""
        await session.execute(
            update(DECISIONS)
            .where(_key(turn.tenant, turn.request_id), DECISIONS.c.attempt == turn.attempt)
            .values(claimed_until=now, updated_at=now)
        )

    # -- what the ledger ended ---------------------------------------------------------------------------

    async def mark_released(self, *, session: AsyncSession, allocation_id: str) -> None:
        await session.execute(
            update(DECISIONS)
            .where(DECISIONS.c.allocation_id == allocation_id)
            .values(status=IntentState.RELEASED.value)
        )

    async def mark_ended(
        self, *, session: AsyncSession, allocation_id: str, status: IntentState, now: datetime
    ) -> str | None:
        """The decision that placed this allocation learns that it ended (``expired`` or ``released``); its
        tenant, or None when no placed decision held it."""
        ended = await session.execute(
            update(DECISIONS)
            .where(DECISIONS.c.allocation_id == allocation_id, DECISIONS.c.status == IntentState.PLACED.value)
            .values(status=status.value, updated_at=now)
            .returning(DECISIONS.c.tenant)
        )
        tenant = ended.scalar_one_or_none()
        await session.execute(
            update(ALLOCATIONS)
            .where(ALLOCATIONS.c.allocation_id == allocation_id, ALLOCATIONS.c.state == "active")
            .values(state=status.value, ended_at=now)
        )
        return str(tenant) if tenant is not None else None

    async def record_placed(
        self,
        *,
        session: AsyncSession,
        tenant: str,
        request_id: str,
        body_hash: str | None,
        reply: PlaceReply,
        lease_expires_at: datetime | None,
        lease_s: int | None,
        now: datetime,
    ) -> bool:
        """A placement the ledger committed with its record (the one-durable-step path), written from its
        event: False when the request id's decision is placed or ended already (nothing to announce). A
        queued request it places leaves the queue."""
        recorded = await session.execute(
            _RECORD_PLACED,
            {
                "tenant": tenant,
                "request_id": request_id,
                "body_hash": body_hash,
                "allocation_id": reply.allocation_id,
                "reply": reply.model_dump_json(),
                "lease_expires_at": lease_expires_at,
                "lease_s": lease_s,
                "now": now,
            },
        )
        if recorded.scalar_one_or_none() is None:
            return False
        await self.dequeue(session=session, tenant=tenant, request_id=request_id)
        return True

    async def first_leases(self, *, session: AsyncSession) -> list[tuple[str, str, int, list[str]]]:
        """The placed replicas still on their first lease: (allocation id, tenant, the lease asked for, nodes)."""
        rows = await session.execute(
            select(DECISIONS.c.allocation_id, DECISIONS.c.tenant, DECISIONS.c.lease_s, DECISIONS.c.reply).where(
                DECISIONS.c.status == IntentState.PLACED.value, DECISIONS.c.lease_s.is_not(None)
            )
        )
        out: list[tuple[str, str, int, list[str]]] = []
        for allocation_id, tenant, lease_s, reply in rows:
            nodes = [p.get("node") for p in (reply or {}).get("placements") or [] if isinstance(p, dict)]
            out.append((allocation_id, tenant, int(lease_s), [n for n in nodes if isinstance(n, str)]))
        return out

    async def lease_renewed(self, *, session: AsyncSession, allocation_id: str, lease_expires_at: datetime) -> bool:
        """A placed replica's lease, as the ledger answered its renewal; False when no placed decision holds
        the id (not recorded yet: a direct placement's row follows the ledger's event)."""
        done = await session.execute(
            update(DECISIONS)
            .where(DECISIONS.c.allocation_id == allocation_id, DECISIONS.c.status == IntentState.PLACED.value)
            .values(lease_expires_at=lease_expires_at, lease_s=None)
        )
        return bool(getattr(done, "rowcount", 0))

    async def lease_of(self, *, session: AsyncSession, allocation_id: str) -> tuple[str, datetime | None] | None:
        """A placed replica's tenant and lease end as placement last recorded it; None when no placed
        decision holds the allocation."""
        row = (
            await session.execute(
                select(DECISIONS.c.tenant, DECISIONS.c.lease_expires_at).where(
                    DECISIONS.c.allocation_id == allocation_id, DECISIONS.c.status == IntentState.PLACED.value
                )
            )
        ).first()
        return (row.tenant, row.lease_expires_at) if row is not None else None

    # -- the placed replicas, listed (`placement.replicas`) ---------------------------------------------------

    async def replicas(
        self, *, session: AsyncSession, where: ReplicaFilter, after: Position | None, limit: int
    ) -> list[PlacedReplica]:
        """Up to ``limit`` placed replicas matching ``where``, in (tenant, request id) order, those after
        ``after`` (keyset paging: the next page starts after the last row of this one)."""
        if where.empty:
            return []
        stmt = (
            select(
                DECISIONS.c.tenant,
                DECISIONS.c.request_id,
                DECISIONS.c.allocation_id,
                DECISIONS.c.reply,
                DECISIONS.c.lease_expires_at,
                DECISIONS.c.updated_at,
            )
            .where(*_replica_clauses(where))
            .order_by(DECISIONS.c.tenant, DECISIONS.c.request_id)
            .limit(limit)
        )
        if after is not None:
            position = tuple_(DECISIONS.c.tenant, DECISIONS.c.request_id)
            stmt = stmt.where(position > tuple_(after.tenant, after.request_id))
        rows = await session.execute(stmt)
        return [
            PlacedReplica(
                tenant=r.tenant,
                request_id=r.request_id,
                allocation_id=r.allocation_id,
                reply=r.reply,
                lease_expires_at=r.lease_expires_at,
                placed_at=r.updated_at,
            )
            for r in rows
        ]

    async def count_replicas(self, *, session: AsyncSession, where: ReplicaFilter) -> int:
        """How many placed replicas match ``where``."""
        if where.empty:
            return 0
        counted = await session.execute(select(func.count()).where(*_replica_clauses(where)))
        return int(counted.scalar_one())

    # -- placement's allocations in the ledger (the reconciler's input) -----------------------------------

    async def allocation_seen(
        self, *, session: AsyncSession, allocation_id: str, tenant: str, request_id: str, now: datetime
    ) -> None:
        await session.execute(
            _ALLOCATION_SEEN, {"allocation_id": allocation_id, "tenant": tenant, "request_id": request_id, "now": now}
        )

    async def committing(self, *, session: AsyncSession, touched_before: datetime, limit: int) -> list[Intent]:
        """Intents still ``committing`` that no attempt touched since ``touched_before``."""
        rows = await session.execute(
            select(DECISIONS)
            .where(DECISIONS.c.status == IntentState.COMMITTING.value, DECISIONS.c.updated_at < touched_before)
            .order_by(DECISIONS.c.updated_at)
            .limit(limit)
        )
        return [_intent(r) for r in rows]

    async def abandon(self, *, session: AsyncSession, turn: Turn, now: datetime) -> bool:
        """Mark an intent ``abandoned`` unless an attempt took it over meanwhile."""
        done = await session.execute(
            update(DECISIONS)
            .where(
                _key(turn.tenant, turn.request_id),
                DECISIONS.c.attempt == turn.attempt,
                DECISIONS.c.status == IntentState.COMMITTING.value,
            )
            .values(status=IntentState.ABANDONED.value, claimed_until=None, updated_at=now)
            .returning(DECISIONS.c.attempt)
        )
        return done.scalar_one_or_none() is not None

    async def active_allocations(
        self, *, session: AsyncSession, seen_before: datetime, limit: int
    ) -> list[SeenAllocation]:
        """Placement's allocations still active in the ledger, first seen before ``seen_before``, each with
        its intent (None when there is none)."""
        rows = await session.execute(
            select(
                ALLOCATIONS.c.allocation_id.label("seen_allocation_id"),
                ALLOCATIONS.c.tenant.label("seen_tenant"),
                ALLOCATIONS.c.request_id.label("seen_request_id"),
                ALLOCATIONS.c.seen_at,
                DECISIONS,
            )
            .select_from(
                ALLOCATIONS.outerjoin(
                    DECISIONS,
                    and_(
                        DECISIONS.c.tenant == ALLOCATIONS.c.tenant, DECISIONS.c.request_id == ALLOCATIONS.c.request_id
                    ),
                )
            )
            .where(ALLOCATIONS.c.state == "active", ALLOCATIONS.c.seen_at < seen_before)
            .order_by(ALLOCATIONS.c.seen_at)
            .limit(limit)
        )
        return [
            SeenAllocation(
                allocation_id=r.seen_allocation_id,
                tenant=r.seen_tenant,
                request_id=r.seen_request_id,
                seen_at=r.seen_at,
                intent=_intent(r) if r.status is not None else None,
            )
            for r in rows
        ]

    async def placed(self, *, session: AsyncSession) -> list[tuple[str, PlaceReply]]:
        """Every placed decision whose allocation has not ended: (tenant, reply), for admission's replicas."""
        rows = await session.execute(
            select(DECISIONS.c.tenant, DECISIONS.c.reply).where(
                DECISIONS.c.status == IntentState.PLACED.value, DECISIONS.c.reply.is_not(None)
            )
        )
        placed: list[tuple[str, PlaceReply]] = []
        for tenant, reply in rows:
            try:
                placed.append((tenant, PlaceReply.model_validate(reply)))
            except ValueError:
                continue
        return placed

    # -- the queue ------------------------------------------------------------------------------------------

    async def enqueue(
        self,
        *,
        session: AsyncSession,
        request: PlaceRequest,
        enqueued_at: datetime,
        deadline_at: datetime,
    ) -> None:
        """Append a request to the queue (once per tenant and request id: a repeat keeps its place)."""
        await session.execute(
            insert(QUEUE)
            .values(
                tenant=request.tenant,
                request_id=request.request_id,
                request=request.model_dump(mode="json"),
                enqueued_at=enqueued_at,
                deadline_at=deadline_at,
            )
            .on_conflict_do_nothing()
        )

    async def queue_position(self, *, session: AsyncSession, tenant: str, request_id: str) -> int | None:
        """1 + the requests ahead of this one in the (fleet-wide) queue; None when it is not queued."""
        mine = select(QUEUE.c.seq).where(QUEUE.c.tenant == tenant, QUEUE.c.request_id == request_id).scalar_subquery()
        position = (await session.execute(select(func.count()).where(QUEUE.c.seq <= mine))).scalar_one()
        return int(position) or None

    async def dequeue(self, *, session: AsyncSession, tenant: str, request_id: str) -> None:
        await session.execute(delete(QUEUE).where(QUEUE.c.tenant == tenant, QUEUE.c.request_id == request_id))

    async def queued(self, *, session: AsyncSession, limit: int, after: int | None = None) -> list[QueuedRequest]:
        """Up to ``limit`` queued requests in arrival order, those after ``seq`` ``after`` (keyset paging:
        the next page starts after the last row of this one)."""
        stmt = select(QUEUE).order_by(QUEUE.c.seq).limit(limit)
        if after is not None:
            stmt = stmt.where(QUEUE.c.seq > after)
        rows = await session.execute(stmt)
        return [
            QueuedRequest(
                seq=r.seq,
                tenant=r.tenant,
                request_id=r.request_id,
                body=r.request,
                enqueued_at=r.enqueued_at,
                deadline_at=r.deadline_at,
            )
            for r in rows
        ]

    async def queued_of(self, *, session: AsyncSession, tenant: str, request_id: str) -> int:
        """How many other requests of ``tenant`` wait in the queue, counted under a lock per tenant held to
        the end of the transaction (two concurrent enqueues of one tenant count one after the other)."""
        await session.execute(_LOCK_TENANT_QUEUE, {"tenant": tenant})
        counted = await session.execute(
            select(func.count()).where(QUEUE.c.tenant == tenant, QUEUE.c.request_id != request_id)
        )
        return int(counted.scalar_one())

    async def placed_allocations(self, *, session: AsyncSession) -> list[PlacedAllocation]:
        """Every placed decision whose allocation has not ended, with the accelerators its commit named."""
        rows = await session.execute(
            select(DECISIONS.c.tenant, DECISIONS.c.allocation_id, DECISIONS.c.ledger_commit).where(
                DECISIONS.c.status == IntentState.PLACED.value, DECISIONS.c.allocation_id.is_not(None)
            )
        )
        placed: list[PlacedAllocation] = []
        for tenant, allocation_id, commit in rows:
            shares = commit.get("shares") if isinstance(commit, dict) else None
            if not isinstance(shares, list):
                continue
            accelerators = tuple(
                str(s["accelerator_id"]) for s in shares if isinstance(s, dict) and "accelerator_id" in s
            )
            placed.append(PlacedAllocation(allocation_id=allocation_id, tenant=tenant, accelerators=accelerators))
        return placed
