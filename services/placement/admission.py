"""``placement.admit``: one inference request onto a running replica, engine-aware (API.md "Request path").

``admit`` reads like the request path: resolve the model or model group -> the replicas serving it in the
region (placement's own, ``replicas.ReplicaBook``) -> the pure selection (``shared.domain.admission``:
long context to SSM, strict SLO to the fastest engine, otherwise least cost; a failover order) -> fair
queueing between tenants (weighted fair queueing with token buckets: in-profile tenants first, by
virtual finish time) -> hold the request's peak KV inside the replica through the ledger (a ``request``
allocation in the replica's KV pool, leased) -> reply with the hold's ``allocation_id``.

A hold the ledger refuses (the pool is fuller than the book knew) fails over to the next replica in the
selection's order. Nothing fits now: ``queued`` with a position; the request waits in the fair queue
(``HETSCHED_ADMIT_QUEUE_TTL_S``) and is admitted as capacity frees; asking again with the same request id
answers its state. No replica can serve it at all (none healthy, none fresh, the context too long):
``no_capacity``. ``failed_replica_id`` takes a replica that just failed the request out of rotation
until its engine reports again, and the request fails over past it; only a tenant holding an admission on
that replica is heard (the reply says when it was ignored: ``failed_replica_ignored``).

Holds are committed under the replica owner's tenant (the ledger keeps a replica's pool to its owner);
the requesting tenant is in the hold's ledger request id (``admit/<tenant>/<request id>``), and only it
may release the hold (``placement.release``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel

from services.placement.ledger_calls import ask_ledger
from services.placement.replicas import Hold, Replica, ReplicaBook, hold_request_id, hold_requester, replica_of
from shared.contracts.base import ErrorCode, Rejected, rejected
from shared.contracts.ledger import (
    AllocationEvent,
    CommitBatchReply,
    CommitBatchRequest,
    CommitReply,
    CommitRequest,
    LedgerEventName,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    ShareIn,
    no_allocation,
)
from shared.contracts.placement import AdmitReply, AdmitRequest, PlaceReply, ReleaseReply
from shared.contracts.subjects import Rpc
from shared.contracts.topology import EngineStatusEvent
from shared.domain.admission import (
    AdmitAsk,
    AdmitPolicy,
    Candidate,
    FairQueue,
    Grant,
    Selection,
    members,
    select,
    unknown_model,
)
from shared.domain.models import ModelSpec
from shared.domain.names import unknown_name
from shared.infra.clock import MonotonicMs
from shared.infra.grouping import Grouped
from shared.infra.rpc import RpcClient, RpcError

DRAIN_PERIOD_S = 0.1
"""How often the fair queue is retried while it holds requests (besides on every release and report)."""
DONE_KEPT = 50_000
"""Answers kept for requests admitted from the queue (or already answered) for a repeat of the request id."""
_IGNORED = "; failed_replica_id ignored: this tenant holds no admission on that replica"


@dataclass(frozen=True)
class Fairness:
    rate_per_s: float = 200.0
    burst: float = 400.0
    ttl_s: float = 30.0
    weights: Mapping[str, float] | None = None


@dataclass
class _Waiting:
    request: AdmitRequest
    models: tuple[str, ...]  # the model, or its group's members
    failure_ignored: bool | None = None  # its failed_replica_id was not heard (None: it named none)


async def _ask_ledger(rpc: RpcClient, commits: list[CommitRequest]) -> list[CommitReply | Rejected | None]:
    """Holds to the ledger: one `ledger.commit` for one, one `ledger.commit_batch` for several (each still
    all-or-nothing on its own); ``None`` for each when the ledger did not answer."""
    try:
        if len(commits) == 1:
            return [await rpc.ask(Rpc.LEDGER_COMMIT, commits[0], CommitReply)]
        reply = await rpc.ask(Rpc.LEDGER_COMMIT_BATCH, CommitBatchRequest(commits=commits), CommitBatchReply)
    except RpcError:
        return [None] * len(commits)
    if isinstance(reply, Rejected):
        return [reply] * len(commits)
    return list(reply.results)


def _key(tenant: str, request_id: str) -> str:
    return f"{tenant}\x00{request_id}"


def _tenant_of(key: str) -> str:
    return key.partition("\x00")[0]


class AdmissionHandlers:
    def __init__(
        self,
        *,
        book: ReplicaBook,
        rpc: RpcClient,
        models: Mapping[str, ModelSpec],
        groups: Mapping[str, tuple[str, ...]],
        policy: AdmitPolicy,
        fairness: Fairness,
        timer: MonotonicMs,
        log: logging.Logger,
        load_placed: Callable[[], Awaitable[list[tuple[str, PlaceReply]]]] | None = None,
        draining: Callable[[], set[str]] = set,
        regions: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self._load_placed = load_placed
        self._regions = regions  # the fleet's regions (placement's view): a request may name only these
        self._moving = draining  # replicas the rebalancer is moving: no new request goes to them
        # The holds of concurrent admissions go to the ledger together.
        self._holds: Grouped[CommitRequest, CommitReply | Rejected | None] = Grouped(
            lambda commits: _ask_ledger(rpc, commits), max_group=64, lanes=4
        )
        self._book = book
        self._rpc = rpc
        self._models = models
        self._groups = groups
        self._policy = policy
        self._timer = timer
        self._log = log
        self._queue: FairQueue[_Waiting] = FairQueue(
            rate_per_s=fairness.rate_per_s,
            burst=fairness.burst,
            ttl_ms=fairness.ttl_s * 1000,
            weights=fairness.weights,
        )
        self._done: dict[str, AdmitReply] = {}
        self._draining = asyncio.Lock()
        self._wake = asyncio.Event()

    # -- placement.admit ---------------------------------------------------------------------------

    async def admit(self, request: AdmitRequest) -> BaseModel:
        names = members(request.model, self._groups, self._models)
        if names is None:
            return rejected(ErrorCode.UNKNOWN_MODEL, unknown_model(request.model, self._groups, self._models))
        if request.region is not None:
            regions = self._regions()
            if regions and request.region not in regions:  # an empty view (not synced yet) knows no region
                return rejected(ErrorCode.INVALID_REQUEST, unknown_name("region", request.region, regions))
        key = _key(request.tenant, request.request_id)
        done = self._done.get(key)
        if done is not None:
            return done
        now_ms = self._timer()
        ignored: bool | None = None
        if request.failed_replica_id is not None:  # heard only from a tenant with an admission on it
            ignored = not self._book.failed(request.failed_replica_id, tenant=request.tenant, now_ms=now_ms)
        if key in self._queue:
            return self._queued(key, "still waiting for capacity", ignored)
        selection = self._select(request, names, now_ms)
        waiting = _Waiting(request, names, ignored)
        if not selection.order:
            if not self._could_fit(selection):
                return self._no_capacity(request, selection, ignored)
            return self._enqueue(key, waiting, now_ms, "every replica is full")
        self._queue.offer(key, waiting, tenant=request.tenant, now_ms=now_ms)
        if len(self._queue) > 1:  # others wait: it takes its turn in the fair order (in-profile tenants first)
            await self.drain()
            done = self._done.get(key)
            if done is not None:
                return done
            return self._queued(key, "waiting its turn (fair queueing between tenants)", ignored)
        self._queue.pop(now_ms)  # alone: served at once, charged to its tenant's share and bucket
        reply = await self._hold(waiting, selection)
        if reply is None:  # every replica refused the hold: wait for one to free
            return self._enqueue(key, waiting, now_ms, "every replica's KV pool is full")
        return reply

    def _select(self, request: AdmitRequest, names: tuple[str, ...], now_ms: float) -> Selection:
        replicas = self._book.serving(names, request.region)
        draining = self._moving()
        if draining:  # their requests in flight finish on them; new ones go to the copies
            replicas = [r for r in replicas if r.replica_id not in draining]
        ask = AdmitAsk(
            input_tokens=request.input_tokens,
            output_tokens=request.output_tokens,
            ttft_ms=request.slo.ttft_ms if request.slo is not None else None,
            hint=request.hint,
        )
        statuses = [self._book.status(r) for r in replicas]
        return select(ask, statuses, self._models, now_ms=now_ms, policy=self._policy)

    @staticmethod
    def _could_fit(selection: Selection) -> bool:
        """Whether waiting can help: some replica is healthy and fresh but busy (queue or KV full)."""
        return any(why in ("queue_full", "kv_full") for why in selection.excluded.values())

    def _no_capacity(self, request: AdmitRequest, selection: Selection, ignored: bool | None) -> Rejected:
        details = {} if ignored is None else {"failed_replica_ignored": ignored}
        note = _IGNORED if ignored else ""
        if not selection.excluded:
            where = f" in {request.region}" if request.region else ""
            return rejected(ErrorCode.NO_CAPACITY, f"no replica serves {request.model}{where}{note}", **details)
        why = ", ".join(f"{replica}: {reason}" for replica, reason in sorted(selection.excluded.items())[:8])
        return rejected(ErrorCode.NO_CAPACITY, f"no replica can take it ({why}){note}", **details)

    def _enqueue(self, key: str, waiting: _Waiting, now_ms: float, why: str) -> AdmitReply:
        self._queue.offer(key, waiting, tenant=waiting.request.tenant, now_ms=now_ms)
        self._wake.set()
        return self._queued(key, why, waiting.failure_ignored)

    def _queued(self, key: str, why: str, ignored: bool | None) -> AdmitReply:
        return AdmitReply(
            status="queued",
            queue_position=self._queue.position(key),
            explanation=why + (_IGNORED if ignored else ""),
            failed_replica_ignored=ignored,
        )

    async def _hold(self, waiting: _Waiting, selection: Selection) -> AdmitReply | None:
        """Hold the request's KV in the first replica of the order that takes it; None when none does."""
        request = waiting.request
        for index, candidate in enumerate(selection.order):
            replica = self._book.replicas.get(candidate.replica.replica_id)
            if replica is None:
                continue
            granted = self._book.grant(replica, candidate.need_bytes)
            if granted is None:
                continue  # the engine's guaranteed KV share and what it may borrow are used up on this node
            self._book.tentative(replica.replica_id, candidate.need_bytes)  # concurrent admissions see it
            committed = await self._commit(request, replica, candidate)
            if not isinstance(committed, CommitReply) or committed.allocation_id is None:
                self._book.tentative(replica.replica_id, candidate.need_bytes, undo=True)
                self._book.ungrant(replica, granted)
                continue
            hold = Hold(
                allocation_id=committed.allocation_id,
                replica_id=replica.replica_id,
                requester=request.tenant,
                request_id=request.request_id,
                kv_bytes=candidate.need_bytes,
                grant=granted if isinstance(granted, Grant) else None,
            )
            self._book.held(hold, counted=True)
            return self._admitted(waiting, replica, candidate, selection, committed, index)
        return None

    async def _commit(
        self, request: AdmitRequest, replica: Replica, candidate: Candidate
    ) -> CommitReply | Rejected | None:
        per_rank = max(1, -(-candidate.need_bytes // max(1, len(replica.kv_pool))))
        commit = CommitRequest(
            request_id=hold_request_id(request.tenant, request.request_id),
            tenant=replica.owner,
            kind="request",
            parent_id=replica.replica_id,
            lease_s=request.lease_s,
            shares=[ShareIn(accelerator_id=acc, kv_bytes=per_rank) for acc in replica.accelerators],
        )
        answer = await self._holds.submit(commit)
        if answer is None:
            self._log.warning("the ledger did not answer an admission hold", extra={"replica": replica.replica_id})
        return answer

    def _admitted(
        self,
        waiting: _Waiting,
        replica: Replica,
        candidate: Candidate,
        selection: Selection,
        committed: CommitReply,
        index: int,
    ) -> AdmitReply:
        request = waiting.request
        explanation = selection.explanation
        if index:
            explanation += f"; {index} replica(s) before it refused the hold (KV pool full)"
        if waiting.failure_ignored:
            explanation += _IGNORED
        reply = AdmitReply(
            status="admitted",
            allocation_id=committed.allocation_id,
            replica_id=replica.replica_id,
            node=replica.node,
            engine=replica.engine.value,
            model=replica.model,
            region=replica.region,
            kv_bytes=candidate.need_bytes,
            lease_expires_at=committed.lease_expires_at,
            explanation=explanation,
            failover=[c.replica.replica_id for c in selection.order[index + 1 :]][:8],
            failed_replica_ignored=waiting.failure_ignored,
        )
        self._remember(_key(request.tenant, request.request_id), reply)
        return reply

    def _remember(self, key: str, reply: AdmitReply) -> None:
        if len(self._done) >= DONE_KEPT:
            for old in list(self._done)[: DONE_KEPT // 10]:
                del self._done[old]
        self._done[key] = reply

    # -- the fair queue ------------------------------------------------------------------------------

    def queue_depths(self) -> dict[str, int]:
        """Requests waiting in the fair queue, per tenant."""
        return dict(Counter(_tenant_of(key) for key in self._queue))

    async def drain(self) -> int:
        """Admit queued requests in fair order while replicas take them; how many were admitted."""
        if self._draining.locked():
            self._wake.set()  # the pass under way is followed by another
            return 0
        admitted = 0
        async with self._draining:
            now_ms = self._timer()
            for key, _waiting in self._queue.expire(now_ms):
                self._done.pop(key, None)
            selections: dict[int, Selection] = {}

            def can_serve(waiting: _Waiting) -> bool:
                selection = self._select(waiting.request, waiting.models, now_ms)
                selections[id(waiting)] = selection
                return bool(selection.order)

            while len(self._queue):
                popped = self._queue.pop(now_ms, can_serve)
                if popped is None:
                    break
                key, waiting = popped
                selection = selections.pop(id(waiting), None) or self._select(waiting.request, waiting.models, now_ms)
                reply = await self._hold(waiting, selection)
                if reply is None:
                    # Refused everywhere meanwhile: back in the queue (behind its tenant's others).
                    self._queue.offer(key, waiting, tenant=waiting.request.tenant, now_ms=now_ms)
                    break
                admitted += 1
        return admitted

    async def serve_queue(self) -> None:
        """Loop: retry the fair queue whenever capacity may have freed, and every ``DRAIN_PERIOD_S`` while
        it holds requests."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=DRAIN_PERIOD_S)
            except TimeoutError:
                pass
            self._wake.clear()
            if len(self._queue):
                try:
                    await self.drain()
                except Exception:  # keep serving; the next pass retries
                    self._log.exception("admission queue pass failed")

    def serving(self) -> set[str]:
        """The replicas whose engine reported healthy within ``HETSCHED_ENGINE_STALE_S`` (and that no caller
        said failed since): those admission may send requests to, draining ones included."""
        now_ms = self._timer()
        stale_ms = self._policy.stale_ms
        serving: set[str] = set()
        for replica in self._book.replicas.values():
            status = self._book.status(replica)
            if status.healthy and status.reported_at_ms is not None and now_ms - status.reported_at_ms <= stale_ms:
                serving.add(replica.replica_id)
        return serving

    # -- what frees capacity or changes rotation -------------------------------------------------------

    def on_placed(self, owner: str, reply: PlaceReply) -> None:
        """A replica placement just made (or found in its decisions at start): it joins the book."""
        replica = replica_of(owner, reply, self._models)
        if replica is not None:
            self._book.add(replica)

    async def start(self) -> None:
        """Seed the book with the replicas placement holds (a failure leaves it to fill as placements come)."""
        if self._load_placed is None:
            return
        try:
            count = self.seed(await self._load_placed())
        except Exception:
            self._log.exception("admission could not load placement's replicas; they join as they are placed")
            return
        self._log.info("admission knows its replicas", extra={"replicas": count})

    def seed(self, placed: Iterable[tuple[str, PlaceReply]]) -> int:
        """The replicas of placement's placed decisions, at start; how many can serve requests."""
        before = len(self._book.replicas)
        for owner, reply in placed:
            self.on_placed(owner, reply)
        return len(self._book.replicas) - before

    def on_engine_status(self, status: EngineStatusEvent) -> None:
        """An engine's report: the replica's figures now (a shorter queue may let waiting requests in)."""
        if self._book.report(status, now_ms=self._timer()) and len(self._queue):
            self._wake.set()

    def on_hold_event(self, name: str, payload: AllocationEvent) -> None:
        """A LEDGER event of a `request` allocation, from placement's view of the ledger (no transaction)."""
        if name == LedgerEventName.ALLOCATION_COMMITTED:
            self.on_hold_committed(payload)
        elif name in (LedgerEventName.ALLOCATION_RELEASED, LedgerEventName.ALLOCATION_EXPIRED):
            self.on_allocation_ended(payload.allocation_id)

    def on_hold_committed(self, payload: AllocationEvent) -> None:
        """A `request` allocation the ledger committed: a hold of ours (maybe another process's, or one made
        before a restart) that the book should count."""
        requester = hold_requester(payload.request_id)
        if payload.kind != "request" or payload.parent_id is None or requester is None:
            return
        if payload.parent_id not in self._book.replicas:
            return
        tenant, request_id = requester
        self._book.held(
            Hold(
                allocation_id=payload.allocation_id,
                replica_id=payload.parent_id,
                requester=tenant,
                request_id=request_id,
                kv_bytes=sum(share.total_bytes for share in payload.shares),
            )
        )

    def on_allocation_ended(self, allocation_id: str) -> None:
        """A hold released or expired frees KV; a replica released or expired leaves rotation."""
        hold = self._book.ended(allocation_id)
        if hold is not None:
            self._done.pop(_key(hold.requester, hold.request_id), None)
        self._book.remove(allocation_id)
        self._wake.set()

    # -- placement.release of a hold --------------------------------------------------------------------

    def owner_of_hold(self, allocation_id: str, tenant: str) -> str | Rejected | None:
        """The ledger tenant to release a hold under: None when it is not a hold this process knows;
        when another tenant asks, the ledger's answer to an unknown allocation (``not_found``, the same
        message: an id tells no one whether it exists)."""
        hold = self._book.holds.get(allocation_id)
        if hold is None:
            return None
        if hold.requester != tenant:
            return no_allocation(allocation_id)
        replica = self._book.replicas.get(hold.replica_id)
        return replica.owner if replica is not None else tenant

    async def release_hold(self, allocation_id: str, owner: str) -> ReleaseReply | Rejected:
        released = await ask_ledger(
            self._rpc,
            Rpc.LEDGER_RELEASE,
            LedgerReleaseRequest(allocation_id=allocation_id, tenant=owner),
            LedgerReleaseReply,
        )
        if isinstance(released, Rejected):
            return released
        if released.status != "released":
            return Rejected(error=released.error or rejected(ErrorCode.INTERNAL, "the ledger did not release").error)
        self.on_allocation_ended(allocation_id)
        return ReleaseReply(status="released")
