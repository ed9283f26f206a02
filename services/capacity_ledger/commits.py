"""The commit path: ``ledger.commit`` (grouped with the commits that arrive meanwhile) and
``ledger.commit_batch``, each commit all-or-nothing on its own in one transaction for the batch:
load (store) -> plan (``shared.domain.ledger.plan_commits``) -> write + events -> one reply per commit."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from pydantic import BaseModel

from services.capacity_ledger import mapping, store
from services.capacity_ledger.metrics import LedgerMetrics
from services.capacity_ledger.ports import Batcher, Store, Units
from shared.contracts.ledger import (
    CommitBatchReply,
    CommitBatchRequest,
    CommitReply,
    CommitRequest,
    LedgerEventName,
)
from shared.contracts.subjects import Context
from shared.domain.ledger import CommitPlan, Duplicate, Refused, allocation_cluster, plan_commits, view_of
from shared.infra import deadline
from shared.infra.uow import UnitOfWork


def new_allocation_id() -> str:
    return f"al-{uuid.uuid4().hex}"


def _live_commits(
    requests: Sequence[CommitRequest], deadlines: Sequence[float | None] | None
) -> Callable[[], list[bool]]:
    """Asked now, which commits' callers are still waiting (no deadline: always)."""
    until = list(deadlines) if deadlines is not None else [None] * len(requests)
    return lambda: [d is None or deadline.now_ms() < d for d in until]


class CommitHandlers:
    """``ledger.commit`` and ``ledger.commit_batch``; ``apply_commits`` is what the batcher applies."""

    def __init__(
        self,
        *,
        uow: Units,
        batcher: Batcher,
        default_lease_s: int,
        store: Store = store,
        new_id: Callable[[], str] = new_allocation_id,
        crossing_budget: int = 0,
        metrics: LedgerMetrics | None = None,
    ) -> None:
        self._uow = uow
        self._batcher = batcher
        self._default_lease_s = default_lease_s
        self._store = store
        self._new_id = new_id
        self._crossing_budget = crossing_budget  # bytes/s of cross-domain TP traffic per cluster; 0: none
        self._metrics = metrics

    async def commit(self, request: CommitRequest) -> BaseModel:
        """One commit, applied together with the commits that arrive meanwhile (group commit); a
        refusal answers ``Rejected`` (the fresh view of a conflict in ``error.details["view"]``)."""
        if deadline.expired():  # the caller has gone: reserve nothing it would never learn of
            return mapping.as_rejected(mapping.abandoned_reply(request.request_id))
        return mapping.as_rejected(await self._batcher.submit(request))

    async def commit_batch(self, request: CommitBatchRequest) -> BaseModel:
        until = [deadline.current()] * len(request.commits)
        return CommitBatchReply(results=await self.apply_commits(request.commits, deadlines=until))

    async def apply_commits(
        self, requests: Sequence[CommitRequest], *, deadlines: Sequence[float | None] | None = None
    ) -> list[CommitReply]:
        """Commits in one transaction, each all-or-nothing on its own; one reply per commit, in order.
        A commit whose caller's deadline (``deadlines``, epoch ms, per commit) has passed once the
        accelerators are locked is left out: nothing is reserved for a caller who gave up."""
        live = _live_commits(requests, deadlines)
        if not any(live()):
            return [mapping.abandoned_reply(r.request_id) for r in requests]
        intents = [mapping.intent(r) for r in requests]
        gone: set[int] = set()

        async def work(uow: UnitOfWork) -> tuple[CommitPlan, list[store.NewAllocation]]:
            existing = await self._store.existing_allocations(session=uow.session, keys=[i.key for i in intents])
            view = await self._store.lock_accelerators(
                session=uow.session, ids=[a for i in intents for a in i.accelerator_ids]
            )
            clusters = await self._store.accelerator_clusters(session=uow.session, ids=view.keys())
            charged = {
                c
                for i in intents
                if i.cross_domain_bytes_per_s > 0 and (c := allocation_cluster(i.accelerator_ids, clusters))
            }
            crossing = (
                await self._store.lock_crossing(session=uow.session, clusters=charged)
                if charged and self._crossing_budget > 0
                else {}
            )
            gone.clear()
            gone.update(i for i, alive in enumerate(live()) if not alive)  # re-checked after the locks
            planned = [i for n, i in enumerate(intents) if n not in gone]
            plan = plan_commits(
                planned,
                view=view,
                existing=existing,
                now=uow.now,
                default_lease_s=self._default_lease_s,
                clusters=clusters,
                crossing=crossing,
                crossing_budget=self._crossing_budget,
            )
            new = [
                store.NewAllocation(
                    id=self._new_id(),
                    intent=planned[i],
                    lease_expires_at=o.lease_expires_at,
                    created_at=uow.now,
                    cluster=o.cluster,
                )
                for i, o in plan.accepted
            ]
            await self._store.insert_allocations(session=uow.session, allocations=new)
            for a in new:
                uow.emit(
                    Context.LEDGER,
                    LedgerEventName.ALLOCATION_COMMITTED,
                    mapping.committed_event(
                        allocation_id=a.id, intent=a.intent, lease_expires_at=a.lease_expires_at, cluster=a.cluster
                    ),
                    tenant=a.intent.tenant,
                    correlation_id=a.intent.request_id,
                )
            return plan, new

        plan, new = await self._uow.run(work)
        if self._metrics is not None:
            self._metrics.committed(len(new))
        written = iter(new)
        outcomes = iter(plan.outcomes)
        replies: list[CommitReply] = []
        for n, intent in enumerate(intents):
            if n in gone:
                replies.append(mapping.abandoned_reply(intent.request_id))
                continue
            outcome = next(outcomes)
            if isinstance(outcome, Refused):
                replies.append(mapping.refused_reply(intent.request_id, outcome))
            elif isinstance(outcome, Duplicate):
                replies.append(mapping.duplicate_reply(intent.request_id, outcome))
            else:
                allocation = next(written)
                after = view_of(plan.view, intent.accelerator_ids)
                replies.append(mapping.committed_reply(allocation.id, allocation.lease_expires_at, intent, after))
        return replies
