"""Contract <-> domain for the ledger: requests to commit intents, capacities and allocations to the
replies and event payloads (every byte field under both its names)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from shared.contracts.base import ErrorBody, ErrorCode, Rejected
from shared.contracts.ledger import (
    AcceleratorBalance,
    AcceleratorLedgerView,
    AllocationEvent,
    CommitReply,
    CommitRequest,
    CrossDomainAllocation,
    ShareIn,
    ShareOut,
)
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.ledger import CommitIntent, CrossDomainUse, Duplicate, EndedAllocation, Refused
from shared.domain.memory import MemoryShare


def share(s: ShareIn) -> tuple[str, MemoryShare]:
    return s.accelerator_id, MemoryShare(
        weights=s.weights_bytes, kv=s.kv_bytes, activation=s.activation_bytes, workspace=s.workspace_bytes
    )


def intent(request: CommitRequest) -> CommitIntent:
    return CommitIntent(
        request_id=request.request_id,
        tenant=request.tenant,
        shares=tuple(share(s) for s in request.shares),
        kind=request.kind,
        parent_id=request.parent_id,
        preemptible=request.preemptible,
        priority=request.priority,
        lease_s=request.lease_s,
        lease_expires_at=request.lease_expires_at,
        expected=request.expected,
        sharing=request.sharing,
        cross_domain_bytes_per_s=request.cross_domain_bytes_per_s,
        body_hash=request.body_hash,
        record=request.record,
    )


def balance(c: AcceleratorCapacity) -> AcceleratorBalance:
    return AcceleratorBalance(
        id=c.id,
        usable_bytes=c.usable,
        reserved_bytes=c.reserved,
        available=c.available,
    )


def balances(view: Iterable[AcceleratorCapacity]) -> list[AcceleratorBalance]:
    return [balance(c) for c in view]


def ledger_view(c: AcceleratorCapacity, allocations: Iterable[str]) -> AcceleratorLedgerView:
    return AcceleratorLedgerView(
        id=c.id,
        node=c.node,
        hbm_usable_bytes=c.usable,
        hbm_reserved_bytes=c.reserved,
        available=c.available,
        allocations=list(allocations),
        shared=c.shared,
    )


def cross_domain(use: CrossDomainUse) -> CrossDomainAllocation:
    return CrossDomainAllocation(allocation_id=use.allocation_id, cluster=use.cluster, bytes_per_s=use.bytes_per_s)


def share_out(accelerator_id: str, s: MemoryShare) -> ShareOut:
    return ShareOut(
        accelerator_id=accelerator_id,
        weights_bytes=s.weights,
        kv_bytes=s.kv,
        activation_bytes=s.activation,
        workspace_bytes=s.workspace,
        total_bytes=s.total,
    )


def committed_event(
    *,
    allocation_id: str,
    intent: CommitIntent,
    lease_expires_at: datetime,
    cluster: str | None,
) -> AllocationEvent:
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id=intent.request_id,
        tenant=intent.tenant,
        kind=intent.kind,
        parent_id=intent.parent_id,
        preemptible=intent.preemptible,
        priority=intent.priority,
        lease_expires_at=lease_expires_at,
        counts_against_hbm=intent.counts_against_hbm,
        shares=[share_out(a, s) for a, s in intent.shares],
        sharing=intent.sharing,
        cross_domain_bytes_per_s=intent.cross_domain_bytes_per_s,
        cluster=cluster,
        record=dict(intent.record) if intent.record is not None else None,
    )


def ended_event(ended: EndedAllocation) -> AllocationEvent:
    a = ended.allocation
    return AllocationEvent(
        allocation_id=a.id,
        request_id=a.request_id,
        tenant=a.tenant,
        kind=a.kind,
        parent_id=a.parent_id,
        preemptible=a.preemptible,
        priority=a.priority,
        lease_expires_at=a.lease_expires_at,
        counts_against_hbm=a.counts_against_hbm,
        shares=[share_out(acc, s) for acc, s in ended.shares],
        sharing=a.sharing,
        cross_domain_bytes_per_s=a.cross_domain_bytes_per_s,
        cluster=a.cluster,
    )


def abandoned_reply(request_id: str) -> CommitReply:
    """A commit left out because its caller's deadline passed (it reserved nothing; a retry is safe)."""
    return CommitReply(
        status="rejected",
        request_id=request_id,
        error=ErrorBody(
            code=ErrorCode.DEADLINE_EXCEEDED, message="the caller's deadline passed before the commit; nothing reserved"
        ),
    )


def refused_reply(request_id: str, outcome: Refused) -> CommitReply:
    view = balances(outcome.view) if outcome.view is not None else []
    details = {"view": [b.model_dump() for b in view]} if outcome.view is not None else None
    return CommitReply(
        status="rejected",
        request_id=request_id,
        error=ErrorBody(code=ErrorCode(outcome.code), message=outcome.message, details=details),
        view=view,
    )


def as_rejected(reply: CommitReply) -> CommitReply | Rejected:
    """A single commit's answer: refused, the one refusal shape (a batch's results keep theirs, one per
    commit, inside ``CommitBatchReply``)."""
    if reply.status != "rejected":
        return reply
    error = reply.error or ErrorBody(code=ErrorCode.INTERNAL, message="refused without a reason")
    return Rejected(error=error, request_id=reply.request_id)


def committed_reply(
    allocation_id: str, lease_expires_at: datetime, intent: CommitIntent, view: Iterable[AcceleratorCapacity]
) -> CommitReply:
    return CommitReply(
        status="committed",
        request_id=intent.request_id,
        allocation_id=allocation_id,
        lease_expires_at=lease_expires_at,
        view=balances(view),
    )


def duplicate_reply(request_id: str, outcome: Duplicate) -> CommitReply:
    return CommitReply(
        status="committed",
        request_id=request_id,
        allocation_id=outcome.allocation_id,
        duplicate=True,
        lease_expires_at=outcome.lease_expires_at,
        view=balances(outcome.view),
        record=dict(outcome.record) if outcome.record is not None else None,
    )
