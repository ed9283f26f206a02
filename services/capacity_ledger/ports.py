"""What the ledger's handlers are given: the unit of work, the store and the commit batcher, each as the
interface the handlers use (the real ones in ``app.wire``, fakes in the handler tests)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Protocol, TypeVar

from sqlalchemy.ext.asyncio import AsyncSession

from services.capacity_ledger import store
from shared.contracts.ledger import CommitReply, CommitRequest
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.ledger import (
    AllocationRecord,
    AllocationState,
    EndedAllocation,
    ExistingAllocation,
)
from shared.infra.uow import UnitOfWork

T = TypeVar("T")


class Batcher(Protocol):
    async def submit(self, request: CommitRequest) -> CommitReply: ...


class Units(Protocol):
    """Opens units of work (``shared.infra.uow.UnitOfWorkFactory``, or a fake in tests)."""

    async def run(self, work: Callable[[UnitOfWork], Awaitable[T]]) -> T: ...
    async def read(self, work: Callable[[AsyncSession], Awaitable[T]]) -> T: ...


class Store(Protocol):
    """The ledger's repository (the ``store`` module, or a fake in tests)."""

    async def existing_allocations(
        self, *, session: AsyncSession, keys: Iterable[tuple[str, str]]
    ) -> dict[tuple[str, str], ExistingAllocation]: ...
    async def lock_accelerators(
        self, *, session: AsyncSession, ids: Iterable[str]
    ) -> dict[str, AcceleratorCapacity]: ...
    async def accelerator_clusters(self, *, session: AsyncSession, ids: Iterable[str]) -> dict[str, str | None]: ...

    async def lock_crossing(self, *, session: AsyncSession, clusters: Iterable[str]) -> dict[str, int]: ...
    async def insert_allocations(
        self, *, session: AsyncSession, allocations: Sequence[store.NewAllocation]
    ) -> None: ...
    async def lock_allocation(self, *, session: AsyncSession, allocation_id: str) -> AllocationRecord | None: ...
    async def lock_allocations(self, *, session: AsyncSession, ids: Sequence[str]) -> dict[str, AllocationRecord]: ...
    async def end_allocations(
        self,
        *,
        session: AsyncSession,
        allocations: Sequence[AllocationRecord],
        state: AllocationState,
        now: datetime,
    ) -> list[EndedAllocation]: ...
    async def set_lease(self, *, session: AsyncSession, allocation_id: str, expires_at: datetime) -> None: ...
    async def expired_ids(self, *, session: AsyncSession, now: datetime, limit: int) -> list[str]: ...
    async def snapshot(
        self, *, session: AsyncSession, node: str | None, after: str | None, limit: int
    ) -> store.SnapshotPage: ...
    async def upsert_capacity(
        self, *, session: AsyncSession, node: str, accelerators: Sequence[store.AcceleratorSpec]
    ) -> dict[str, AcceleratorCapacity]: ...
    async def held_above_reported(self, *, session: AsyncSession, ids: Sequence[str]) -> dict[str, tuple[int, int]]: ...
    async def set_node_available(
        self, *, session: AsyncSession, node: str, available: bool
    ) -> store.NodeAvailability: ...
    async def node_accelerators(self, *, session: AsyncSession, node: str) -> list[AcceleratorCapacity]: ...
    async def newest_replica_commits(self, *, session: AsyncSession, node: str) -> dict[str, datetime]: ...
