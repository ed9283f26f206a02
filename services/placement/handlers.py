"""Placement's handlers: place / explain / release / renew over the pure pipeline.

``place`` reads like the DESIGN §4 pipeline: decide on the view -> reserve through the ledger
(optimistic: the reserved bytes it decided on travel with the commit, and a ``conflict`` decides again
on the fresher figures the ledger sent back) -> record the decision and its event -> reply. While a
commit is in flight its bytes are assumed in the view (so concurrent decisions do not all pick the
same GPUs); whatever the ledger answers, or if it does not answer, the assumption is confirmed or
forgotten, never left behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from opentelemetry.metrics import Counter, Histogram, Meter
from pydantic import BaseModel

from services.placement.mapping import balance_to_domain, held_bytes, ledger_key, to_commit, to_domain, to_reply
from services.placement.store import DecisionStore
from shared.contracts.base import ErrorBody, ErrorCode, Rejected, rejected
from shared.contracts.ledger import (
    CommitReply,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    LedgerRenewReply,
    LedgerRenewRequest,
)
from shared.contracts.placement import (
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
)
from shared.contracts.placement_events import PlacementEvent, PlacementEventName, PlacementReleasedEvent
from shared.contracts.subjects import Context, Rpc
from shared.domain.placement import decide
from shared.domain.placement.types import Decision, FleetSnapshot
from shared.domain.placement.view import AssumeKey, LedgerAccelerator, overlay
from shared.infra.clock import MonotonicMs
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

MAX_ATTEMPTS = 4
"""Commits tried per placement: each conflict decides again on fresher figures."""


class View(Protocol):
    """What the handlers need of the read model."""

    @property
    def snapshot(self) -> FleetSnapshot: ...

    def assume(self, key: AssumeKey, held: Mapping[str, int]) -> int: ...

    def confirm(self, token: int, allocation_id: str) -> None: ...

    def forget(self, token: int) -> None: ...


@dataclass(frozen=True)
class PlacementMetrics:
    decision_ms: Histogram
    tp_degree: Counter
    nvlink_groups: Counter
    rejections: Counter

    @classmethod
    def create(cls, meter: Meter) -> PlacementMetrics:
        return cls(
            decision_ms=meter.create_histogram(
                "hetsched.placement.decision_ms", unit="ms", description="Pure decision time"
            ),
            tp_degree=meter.create_counter("hetsched.placement.tp_degree", description="Placed replicas by TP degree"),
            nvlink_groups=meter.create_counter(
                "hetsched.placement.tp_groups", description="TP>1 groups placed, by whether every pair is NVLinked"
            ),
            rejections=meter.create_counter("hetsched.placement.rejections", description="Rejections by reason"),
        )

    def count(self, decision: Decision) -> None:
        if decision.placed and decision.tp:
            self.tp_degree.add(1, {"tp": decision.tp})
            if decision.tp > 1 and decision.tpu is None:
                self.nvlink_groups.add(1, {"nvlinked": decision.domain is not None})
        elif not decision.placed:
            self.rejections.add(1, {"reason": decision.error_code or ErrorCode.NO_CAPACITY})


def _ledger_error(reply: CommitReply | Rejected) -> ErrorBody:
    return reply.error or ErrorBody(code=ErrorCode.INTERNAL, message="the ledger refused without a reason")


class PlacementHandlers:
    def __init__(
        self,
        *,
        view: View,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        timer: MonotonicMs,
        default_lease_s: int,
        metrics: PlacementMetrics,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self._view = view
        self._store = store
        self._uow = uow
        self._rpc = rpc
        self._timer = timer
        self._default_lease_s = default_lease_s
        self._metrics = metrics
        self._max_attempts = max_attempts

    # -- routes ----------------------------------------------------------------------------------

    async def place(self, request: PlaceRequest) -> BaseModel:
        stored = await self._uow.read(
            lambda session: self._store.find(session=session, tenant=request.tenant, request_id=request.request_id)
        )
        if stored is not None:
            return stored  # same request id: the same decision, reserved once
        fresher: dict[str, LedgerAccelerator] = {}
        decision_ms = 0.0
        for attempt in range(1, self._max_attempts + 1):
            snapshot = overlay(self._view.snapshot, fresher)
            decision, elapsed_ms = self._decide(snapshot, request)
            decision_ms += elapsed_ms
            if not decision.placed:
                self._metrics.count(decision)
                reply = to_reply(decision)
                await self._record(request, reply, PlacementEventName.PLACEMENT_REJECTED, decision_ms, attempt)
                return reply
            committed = await self._reserve(request, decision, snapshot)
            if isinstance(committed, CommitReply) and committed.status == "committed" and committed.allocation_id:
                self._metrics.count(decision)
                reply = to_reply(decision, allocation_id=committed.allocation_id)
                note = f"reserved in the ledger after {attempt} attempt(s)"
                if committed.duplicate:
                    note = "the ledger already held this request id (an earlier attempt's answer was lost)"
                reply = reply.model_copy(update={"explanation": [*reply.explanation, note]})
                await self._record(request, reply, PlacementEventName.PLACEMENT_DECIDED, decision_ms, attempt)
                return reply
            error = _ledger_error(committed)
            if error.code not in (ErrorCode.CONFLICT, ErrorCode.NO_CAPACITY):
                return rejected(error.code, f"ledger: {error.message}")
            # The view was stale: decide again with the ledger's figures for the GPUs it refused.
            for balance in committed.view if isinstance(committed, CommitReply) else ():
                fresher[balance.id] = balance_to_domain(None, balance)
        return rejected(ErrorCode.CONFLICT, f"the fleet kept changing under {self._max_attempts} attempts; retry")

    async def explain(self, request: PlaceRequest) -> BaseModel:
        decision, _elapsed_ms = self._decide(self._view.snapshot, request)
        reply = to_reply(decision)
        return reply.model_copy(update={"explanation": ["dry run: nothing was reserved", *reply.explanation]})

    async def release(self, request: ReleaseRequest) -> BaseModel:
        try:
            released = await self._rpc.ask(
                Rpc.LEDGER_RELEASE,
                LedgerReleaseRequest(allocation_id=request.allocation_id, tenant=request.tenant),
                LedgerReleaseReply,
            )
        except RpcError as exc:
            return ReleaseReply(status="rejected", error=ErrorBody(code=ErrorCode.INTERNAL, message=str(exc)))
        if isinstance(released, Rejected) or released.status != "released":
            return ReleaseReply(status="rejected", error=released.error)

        async def work(uow: UnitOfWork) -> None:
            await self._store.mark_released(session=uow.session, allocation_id=request.allocation_id)
            uow.emit(
                Context.PLACEMENT,
                PlacementEventName.PLACEMENT_RELEASED,
                PlacementReleasedEvent(allocation_id=request.allocation_id, tenant=request.tenant),
                tenant=request.tenant,
            )

        await self._uow.run(work)
        return ReleaseReply(status="released")

    async def renew(self, request: RenewRequest) -> BaseModel:
        try:
            renewed = await self._rpc.ask(
                Rpc.LEDGER_RENEW,
                LedgerRenewRequest(allocation_id=request.allocation_id, tenant=request.tenant, lease_s=request.lease_s),
                LedgerRenewReply,
            )
        except RpcError as exc:
            return RenewReply(status="rejected", error=ErrorBody(code=ErrorCode.INTERNAL, message=str(exc)))
        if isinstance(renewed, Rejected) or renewed.status != "renewed":
            return RenewReply(status="rejected", error=renewed.error)
        return RenewReply(status="renewed", lease_expires_at=renewed.lease_expires_at)

    # -- steps -----------------------------------------------------------------------------------

    def _decide(self, snapshot: FleetSnapshot, request: PlaceRequest) -> tuple[Decision, float]:
        started = self._timer()
        decision = decide(snapshot, to_domain(request))
        elapsed_ms = self._timer() - started
        self._metrics.decision_ms.record(elapsed_ms)
        return decision, elapsed_ms

    async def _reserve(
        self, request: PlaceRequest, decision: Decision, snapshot: FleetSnapshot
    ) -> CommitReply | Rejected:
        """Reserve (commit to the ledger) with the decision assumed in the view meanwhile; unreserve
        (forget the assumption) on any outcome but a new allocation, the ledger's silence included."""
        commit = to_commit(request, decision, snapshot, lease_s=request.lease_s or self._default_lease_s)
        token = self._view.assume(ledger_key(request), held_bytes(snapshot, decision))
        kept = False
        try:
            reply = await self._rpc.ask(Rpc.LEDGER_COMMIT, commit, CommitReply)
            # A duplicate holds what an earlier commit of this request id reserved: nothing new to count.
            if isinstance(reply, CommitReply) and reply.status == "committed" and reply.allocation_id:
                if not reply.duplicate:
                    self._view.confirm(token, reply.allocation_id)
                    kept = True
            return reply
        except RpcError as exc:
            return rejected(ErrorCode.INTERNAL, f"the ledger did not answer: {exc.reason}")
        finally:
            if not kept:
                self._view.forget(token)

    async def _record(
        self, request: PlaceRequest, reply: PlaceReply, event: PlacementEventName, decision_ms: float, attempts: int
    ) -> None:
        """Keep a placed reply (for the same request id) and announce the decision, in one transaction."""

        async def work(uow: UnitOfWork) -> None:
            if reply.status == "placed":
                await self._store.record_placed(session=uow.session, reply=reply, tenant=request.tenant)
            uow.emit(
                Context.PLACEMENT,
                event,
                PlacementEvent(
                    request_id=request.request_id,
                    tenant=request.tenant,
                    model=request.model,
                    reply=reply,
                    decision_ms=round(decision_ms, 3),
                    attempts=attempts,
                ),
                tenant=request.tenant,
                correlation_id=request.request_id,
            )

        await self._uow.run(work)
