"""Placement's repository over its own table (`placement.decisions`): SQL only, keyword-only parameters."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.placement.tables import DecisionRow
from shared.contracts.placement import PlaceReply

DECISIONS = DecisionRow.__table__  # type: ignore[attr-defined]


class DecisionStore:
    """Every placed reply, by (tenant, request id), so that a request id answers the same way twice."""

    async def find(self, *, session: AsyncSession, tenant: str, request_id: str) -> PlaceReply | None:
        """The reply a placed request got, if this (tenant, request id) was placed before."""
        reply = (
            await session.execute(
                select(DECISIONS.c.reply).where(DECISIONS.c.tenant == tenant, DECISIONS.c.request_id == request_id)
            )
        ).scalar_one_or_none()
        return PlaceReply.model_validate(reply) if reply is not None else None

    async def record_placed(self, *, session: AsyncSession, tenant: str, reply: PlaceReply) -> None:
        """Keep a placed reply; the first one recorded for its request id stays."""
        await session.execute(
            insert(DECISIONS)
            .values(
                tenant=tenant,
                request_id=reply.request_id,
                status="placed",
                allocation_id=reply.allocation_id,
                reply=reply.model_dump(mode="json"),
            )
            .on_conflict_do_nothing()
        )

    async def mark_released(self, *, session: AsyncSession, allocation_id: str) -> None:
        await session.execute(
            update(DECISIONS).where(DECISIONS.c.allocation_id == allocation_id).values(status="released")
        )
