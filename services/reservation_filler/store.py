"""The reservation filler's repository over its own tables (schema `reservation`): SQL only,
keyword-only parameters, domain values out."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import ColumnElement, delete, func, select, text, update
from sqlalchemy.dialects.postgresql import array, insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.reservation_filler.tables import SCHEMA, HoldRow, InventoryRow, ReservationRow, UseRow
from shared.contracts.reservation_state import ReservationState
from shared.domain.reservations import Reservation, Slot, Use
from shared.infra.reservations import reservation_of, state_of
from shared.infra.tables import outbox_table

RESERVATIONS = ReservationRow.__table__  # type: ignore[attr-defined]
HOLDS = HoldRow.__table__  # type: ignore[attr-defined]
INVENTORY = InventoryRow.__table__  # type: ignore[attr-defined]
USES = UseRow.__table__  # type: ignore[attr-defined]
OUTBOX = outbox_table(SCHEMA)


class HeldElsewhere(Exception):
    """Some of the accelerators asked for are in another reservation (the transaction is rolled back)."""

    def __init__(self, accelerators: Sequence[str]) -> None:
        super().__init__(f"already reserved: {', '.join(accelerators[:8])}")
        self.accelerators = list(accelerators)


def _reservation(body: dict[str, object]) -> Reservation:
    return reservation_of(ReservationState.model_validate(body))


# One lock per tenant (its hash), held to the end of the transaction: its quota of reserved GPUs.
_LOCK_TENANT = text("SELECT pg_advisory_xact_lock(hashtextextended('reservation.quota:' || :tenant, 0))")


def _use(row: object) -> Use:
    return Use(
        allocation_id=row.allocation_id,  # type: ignore[attr-defined]
        tenant=row.tenant,  # type: ignore[attr-defined]
        preemptible=row.preemptible,  # type: ignore[attr-defined]
        bytes={k: int(v) for k, v in row.bytes.items()},  # type: ignore[attr-defined]
        since=row.since,  # type: ignore[attr-defined]
    )


# The reservations on an allocation's accelerators come back with its write (an allocation event is one
# statement: most touch no reservation).
_HELD_ON = (
    f"ARRAY(SELECT DISTINCT h.reservation_id FROM {HOLDS.fullname} h "
    "WHERE h.accelerator = ANY(CAST(:accelerators AS text[])) ORDER BY 1) AS reservations"
)
_ADD_USE = text(
    f"WITH added AS (INSERT INTO {USES.fullname} (allocation_id, tenant, preemptible, bytes, since) "
    "VALUES (:allocation_id, :tenant, :preemptible, CAST(:bytes AS jsonb), :since) "
    "ON CONFLICT (allocation_id) DO NOTHING RETURNING allocation_id) "
    f"SELECT {_HELD_ON} FROM added"
)
_REMOVE_USE = text(
    f"WITH gone AS (DELETE FROM {USES.fullname} WHERE allocation_id = :allocation_id "
    "RETURNING allocation_id, tenant, preemptible, bytes, since) "
    "SELECT gone.allocation_id, gone.tenant, gone.preemptible, gone.bytes, gone.since, "
    f"ARRAY(SELECT DISTINCT h.reservation_id FROM {HOLDS.fullname} h "
    "WHERE h.accelerator IN (SELECT jsonb_object_keys(gone.bytes)) ORDER BY 1) AS reservations FROM gone"
).columns(USES.c.allocation_id, USES.c.tenant, USES.c.preemptible, USES.c.bytes, USES.c.since)


def _unsent() -> list[ColumnElement[bool]]:
    return [OUTBOX.c.sent_at.is_(None), OUTBOX.c.quarantined_at.is_(None)]


class ReservationStore:
    """The filler's reservations, their holds, the GPUs it may reserve and the live allocations on them."""

    async def load(self, *, session: AsyncSession, reservation_id: str, lock: bool = False) -> Reservation | None:
        stmt = select(RESERVATIONS.c.body).where(RESERVATIONS.c.reservation_id == reservation_id)
        if lock:
            stmt = stmt.with_for_update()
        body = (await session.execute(stmt)).scalar_one_or_none()
        return None if body is None else _reservation(body)

    async def load_by_request(self, *, session: AsyncSession, tenant: str, request_id: str) -> Reservation | None:
        stmt = select(RESERVATIONS.c.body).where(
            RESERVATIONS.c.tenant == tenant, RESERVATIONS.c.request_id == request_id
        )
        body = (await session.execute(stmt)).scalar_one_or_none()
        return None if body is None else _reservation(body)

    async def load_many(
        self,
        *,
        session: AsyncSession,
        tenant: str | None = None,
        ids: Iterable[str] | None = None,
        active_only: bool = True,
        lock: bool = False,
    ) -> list[Reservation]:
        """Reservations (of ``tenant``, or with these ``ids``), in id order (the lock order)."""
        stmt = select(RESERVATIONS.c.body).order_by(RESERVATIONS.c.reservation_id)
        if tenant is not None:
            stmt = stmt.where(RESERVATIONS.c.tenant == tenant)
        if ids is not None:
            stmt = stmt.where(RESERVATIONS.c.reservation_id.in_(sorted(set(ids))))
        if active_only:
            stmt = stmt.where(RESERVATIONS.c.state == "active")
        if lock:
            stmt = stmt.with_for_update()
        return [_reservation(body) for body in (await session.execute(stmt)).scalars()]

    async def load_ticking(self, *, session: AsyncSession) -> list[Reservation]:
        """The active reservations the tick has something to do for: preemptions or backoff in their state
        (most have neither, and are not read every second)."""
        body = RESERVATIONS.c.body
        stmt = (
            select(body)
            .where(RESERVATIONS.c.state == "active")
            .where((func.jsonb_array_length(body["preemptions"]) > 0) | (func.jsonb_array_length(body["backoff"]) > 0))
            .order_by(RESERVATIONS.c.reservation_id)
        )
        return [_reservation(b) for b in (await session.execute(stmt)).scalars()]

    async def add(
        self, *, session: AsyncSession, reservation: Reservation, request_id: str | None, now: datetime
    ) -> None:
        """A new reservation and its holds; ``HeldElsewhere`` when another reservation holds one of them."""
        taken = (
            await session.execute(
                insert(HOLDS)
                .values([{"accelerator": acc, "reservation_id": reservation.id} for acc in reservation.accelerators])
                .on_conflict_do_nothing(index_elements=[HOLDS.c.accelerator])
                .returning(HOLDS.c.accelerator)
            )
        ).scalars()
        got = set(taken)
        if len(got) != len(reservation.accelerators):
            raise HeldElsewhere([acc for acc in reservation.accelerators if acc not in got])
        await session.execute(
            insert(RESERVATIONS).values(
                reservation_id=reservation.id,
                tenant=reservation.tenant,
                request_id=request_id,
                state=reservation.state,
                version=reservation.version,
                body=state_of(reservation).model_dump(mode="json"),
                updated_at=now,
            )
        )

    async def save(self, *, session: AsyncSession, reservation: Reservation, now: datetime) -> None:
        await session.execute(
            update(RESERVATIONS)
            .where(RESERVATIONS.c.reservation_id == reservation.id)
            .values(
                state=reservation.state,
                version=reservation.version,
                body=state_of(reservation).model_dump(mode="json"),
                updated_at=now,
            )
        )
        if not reservation.active:
            await session.execute(delete(HOLDS).where(HOLDS.c.reservation_id == reservation.id))

    async def held(self, *, session: AsyncSession) -> set[str]:
        return set((await session.execute(select(HOLDS.c.accelerator))).scalars())

    async def reserved_by(self, *, session: AsyncSession, tenant: str) -> int:
        """The accelerators ``tenant``'s active reservations hold, counted under a lock per tenant held to the
        end of the transaction (an ended reservation has no holds)."""
        await session.execute(_LOCK_TENANT, {"tenant": tenant})
        counted = await session.execute(
            select(func.count())
            .select_from(HOLDS.join(RESERVATIONS, HOLDS.c.reservation_id == RESERVATIONS.c.reservation_id))
            .where(RESERVATIONS.c.tenant == tenant)
        )
        return int(counted.scalar_one())

    # -- inventory (from TOPOLOGY events) ---------------------------------------------------------

    async def set_node(self, *, session: AsyncSession, node: str, slots: Sequence[Slot]) -> None:
        await session.execute(delete(INVENTORY).where(INVENTORY.c.node == node))
        if slots:
            await session.execute(
                insert(INVENTORY).values(
                    [
                        {"accelerator": s.id, "node": s.node, "sku": s.sku, "region": s.region, "cluster": s.cluster}
                        for s in slots
                    ]
                )
            )

    async def inventory(self, *, session: AsyncSession, ids: Iterable[str] | None = None) -> dict[str, Slot]:
        stmt = select(INVENTORY)
        if ids is not None:
            stmt = stmt.where(INVENTORY.c.accelerator.in_(sorted(set(ids))))
        return {
            r.accelerator: Slot(id=r.accelerator, node=r.node, sku=r.sku, region=r.region, cluster=r.cluster)
            for r in await session.execute(stmt)
        }

    # -- uses (from LEDGER events) ------------------------------------------------------------------

    async def add_use(self, *, session: AsyncSession, use: Use) -> tuple[str, ...] | None:
        """Record a live allocation; the reservations holding any of its accelerators (ids, sorted), or None
        when it was recorded before. One statement: one round trip per allocation event."""
        row = (
            await session.execute(
                _ADD_USE,
                {
                    "allocation_id": use.allocation_id,
                    "tenant": use.tenant,
                    "preemptible": use.preemptible,
                    "bytes": json.dumps(dict(use.bytes)),
                    "since": use.since,
                    "accelerators": sorted(use.accelerators),
                },
            )
        ).first()
        return None if row is None else tuple(row.reservations)

    async def remove_use(self, *, session: AsyncSession, allocation_id: str) -> tuple[Use, tuple[str, ...]] | None:
        """Forget a live allocation: it and the reservations holding any of its accelerators (ids, sorted), or
        None when it was not recorded. One statement."""
        row = (await session.execute(_REMOVE_USE, {"allocation_id": allocation_id})).first()
        return None if row is None else (_use(row), tuple(row.reservations))

    async def uses_on(self, *, session: AsyncSession, accelerators: Iterable[str]) -> list[Use]:
        """The live allocations holding bytes on any of ``accelerators``."""
        keys = sorted(set(accelerators))
        if not keys:
            return []
        stmt = select(USES).where(USES.c.bytes.has_any(array(keys)))
        return [_use(row) for row in await session.execute(stmt)]

    async def used_by_others(self, *, session: AsyncSession, tenant: str) -> set[str]:
        """Accelerators on which another tenant holds an allocation."""
        stmt = select(func.jsonb_object_keys(USES.c.bytes)).where(USES.c.tenant != tenant)
        return set((await session.execute(stmt)).scalars())

    # -- the outbox (read-your-writes) --------------------------------------------------------------

    async def unsent_tail(self, *, session: AsyncSession) -> int | None:
        """The newest outbox row the relay has not published yet (None: it has published every row)."""
        tail = (await session.execute(select(func.max(OUTBOX.c.seq)).where(*_unsent()))).scalar_one_or_none()
        return None if tail is None else int(tail)

    async def unsent_through(self, *, session: AsyncSession, seq: int) -> bool:
        """Some outbox row up to ``seq`` is still waiting for the relay (for JetStream's ack)."""
        stmt = select(OUTBOX.c.seq).where(*_unsent(), OUTBOX.c.seq <= seq).limit(1)
        return (await session.execute(stmt)).first() is not None
