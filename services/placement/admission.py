"""``placement.admit``: one inference request onto a running replica, engine-aware (API.md "Request path").

``admit`` reads like the request path: resolve the model or model group -> the replicas serving it in the
region that the tenant may use (placement's own, ``replicas.ReplicaBook``; by default only the tenant's
own replicas and the shared owners', ``HETSCHED_ADMIT_TENANCY``) -> the pure selection (``shared.domain.admission``:
long context to SSM, strict SLO to the fastest engine, otherwise least cost; a failover order) -> fair
queueing between tenants (weighted fair queueing with token buckets: in-profile tenants first, by
virtual finish time) -> count the request's peak KV against the replica's in-memory account (its engine's
last reported KV use plus the grants made since that report; ``shared.domain.admission.account``) and the
node's engine pools -> reply with an admission id (``allocation_id``).

All of it is in memory: no ledger call, no Postgres write, no event per request. The replica's KV pool was
reserved in the ledger when the replica was placed; which request uses which part of it is the engine's
business, and the engine's reports correct the estimate every interval.

A replica whose estimate has no room for the request passes it to the next replica in the selection's
order. Nothing fits now: ``queued`` with a position; the request waits in the fair queue
(``HETSCHED_ADMIT_QUEUE_TTL_S``) and is admitted as capacity frees; asking again with the same request id
answers its state. No replica can serve it at all (none healthy, none fresh, the context too long):
``no_capacity``. ``failed_replica_id`` takes a replica that just failed the request out of rotation
until its engine reports again, and the request fails over past it; only a tenant with an admission in
flight on that replica is heard (the reply says when it was ignored: ``failed_replica_ignored``).

Only the requesting tenant may release (``placement.release``) or renew (``placement.renew``) its
admission; another tenant is answered as for an unknown allocation. An admission not released within its
``lease_s`` is dropped from the account (the engine's reports count what it still runs). After a restart
the accounts start empty and fill from the engines' next reports; an admission id from before the restart
is unknown.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel

from services.placement.replicas import Hold, Replica, ReplicaBook, replica_of
from shared.contracts.base import ErrorCode, Rejected, rejected
from shared.contracts.ledger import no_allocation
from shared.contracts.placement import AdmitReply, AdmitRequest, PlaceReply, ReleaseReply, RenewReply
from shared.contracts.topology import EngineStatusEvent
from shared.domain.admission import (
    AdmitAsk,
    AdmitPolicy,
    Candidate,
    FairQueue,
    Selection,
    Tenancy,
    members,
    select,
    unknown_model,
)
from shared.domain.models import ModelSpec
from shared.domain.names import unknown_name
from shared.infra.clock import MonotonicMs
from shared.infra.rpc import RpcClient

DRAIN_PERIOD_S = 0.1
"""How often the fair queue is retried while it holds requests (besides on every release and report)."""
DONE_KEPT = 50_000
"""Answers kept for requests admitted from the queue (or already answered) for a repeat of the request id."""
_RELEASED = ReleaseReply(status="released")  # frozen: one reply for every release
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
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        admissible: Callable[[str], bool] = lambda _replica_id: True,
        endpoint: Callable[[str], str | None] = lambda _replica_id: None,
        tenancy: Tenancy = Tenancy(),
    ) -> None:
        """``rpc`` is kept for callers that pass it; admission itself calls no other service.
        ``admissible``: whether a replica's agents let it take requests (ready, or not reporting lifecycle
        states at all); ``endpoint``: the replica's endpoint, once ready (``engines.EngineStates``);
        ``tenancy``: whose replicas a tenant's requests may use (by default its own only)."""
        self._tenancy = tenancy
        self._admissible = admissible
        self._endpoint = endpoint
        self._load_placed = load_placed
        self._regions = regions  # the fleet's regions (placement's view): a request may name only these
        self._moving = draining  # replicas the rebalancer is moving: no new request goes to them
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
        self._wall = wall
        self._next_expiry_ms = 0.0

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
        self._expire(now_ms)
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
        # Nothing waits: served at once, charged to its tenant's share and bucket as if queued and popped.
        if not self._queue.serve_now(request.tenant, now_ms):
            # Others wait: it takes its turn in the fair order (in-profile tenants first).
            self._queue.offer(key, waiting, tenant=request.tenant, now_ms=now_ms)
            await self.drain()
            done = self._done.get(key)
            if done is not None:
                return done
            return self._queued(key, "waiting its turn (fair queueing between tenants)", ignored)
        reply = await self._hold(waiting, selection)
        if reply is None:  # every replica refused the hold: wait for one to free
            return self._enqueue(key, waiting, now_ms, "every replica's KV pool is full")
        return reply

    def _select(self, request: AdmitRequest, names: tuple[str, ...], now_ms: float) -> Selection:
        # Only ready replicas take requests: starting, loading, draining, stopped or failed ones never.
        # Only the replicas this tenant may use (tenancy) are candidates: no reply names another's.
        serving = self._book.serving(names, request.region, tenant=request.tenant, tenancy=self._tenancy)
        replicas = [r for r in serving if self._admissible(r.replica_id)]
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
        """Count the request on the first replica of the order whose estimate has room; None when none has."""
        request = waiting.request
        now_ms = self._timer()
        for index, candidate in enumerate(selection.order):
            replica = self._book.replicas.get(candidate.replica.replica_id)
            if replica is None:
                continue
            hold = Hold(
                allocation_id=f"adm-{secrets.token_hex(16)}",  # 128 random bits, as a uuid4 has
                replica_id=replica.replica_id,
                requester=request.tenant,
                request_id=request.request_id,
                kv_bytes=candidate.need_bytes,
                granted_at_ms=now_ms,
                expires_at_ms=now_ms + request.lease_s * 1000,
            )
            if not self._book.admit(replica, hold):
                continue  # its estimate, or the engine's share of the node's pool, has no room
            return self._admitted(waiting, replica, candidate, selection, hold, index)
        return None

    def _admitted(
        self,
        waiting: _Waiting,
        replica: Replica,
        candidate: Candidate,
        selection: Selection,
        hold: Hold,
        index: int,
    ) -> AdmitReply:
        request = waiting.request
        explanation = selection.explanation
        if index:
            explanation += f"; {index} replica(s) before it had no KV room left"
        if waiting.failure_ignored:
            explanation += _IGNORED
        reply = AdmitReply(
            status="admitted",
            allocation_id=hold.allocation_id,
            replica_id=replica.replica_id,
            node=replica.node,
            engine=replica.engine.value,
            model=replica.model,
            region=replica.region,
            sku=replica.sku,
            kv_bytes=candidate.need_bytes,
            lease_expires_at=self._wall() + timedelta(seconds=request.lease_s),
            explanation=explanation,
            failover=[c.replica.replica_id for c in selection.order[index + 1 :]][:8],
            failed_replica_ignored=waiting.failure_ignored,
            endpoint=self._endpoint(replica.replica_id),
        )
        self._remember(_key(request.tenant, request.request_id), reply)
        return reply

    def _expire(self, now_ms: float) -> None:
        """Drop admissions whose lease ended without a release (checked at most once a second)."""
        if now_ms < self._next_expiry_ms:
            return
        self._next_expiry_ms = now_ms + 1000
        for hold in self._book.expire(now_ms):
            self._done.pop(_key(hold.requester, hold.request_id), None)

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
            self._expire(now_ms)
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

    def lifecycle_changed(self) -> None:
        """A replica's agents reported its lifecycle: one that became ready may take waiting requests."""
        if len(self._queue):
            self._wake.set()

    def on_allocation_ended(self, allocation_id: str) -> None:
        """A replica's allocation released or expired in the ledger: it leaves rotation (its requests with it)."""
        if allocation_id in self._book.replicas:
            for hold in [h for h in self._book.holds.values() if h.replica_id == allocation_id]:
                self._done.pop(_key(hold.requester, hold.request_id), None)
            self._book.remove(allocation_id)
            self._wake.set()

    # -- placement.release / placement.renew of an admission ----------------------------------------------

    def is_admission(self, allocation_id: str) -> bool:
        """Whether the id names an admission (this process's, or one from before a restart: ``adm-``)."""
        return allocation_id in self._book.holds or allocation_id.startswith("adm-")

    def release_hold(self, allocation_id: str, tenant: str) -> ReleaseReply | Rejected:
        """End an admission in memory: its KV leaves the replica's account. Unknown, already released, or
        another tenant's: the same ``not_found`` as for an unknown allocation (an id tells no one whether
        it exists)."""
        hold = self._book.holds.get(allocation_id)
        if hold is None or hold.requester != tenant:
            return no_allocation(allocation_id)
        self._book.ended(allocation_id)
        self._done.pop(_key(hold.requester, hold.request_id), None)
        if len(self._queue):  # capacity freed for those waiting (nobody waits: the queue's loop sleeps on)
            self._wake.set()
        return _RELEASED

    def renew_hold(self, allocation_id: str, tenant: str, lease_s: int) -> RenewReply | Rejected:
        """Extend an admission's lease in memory (a long generation); refused as ``release_hold`` is."""
        hold = self._book.holds.get(allocation_id)
        if hold is None or hold.requester != tenant:
            return no_allocation(allocation_id)
        self._book.renew(allocation_id, self._timer() + lease_s * 1000)
        return RenewReply(status="renewed", lease_expires_at=self._wall() + timedelta(seconds=lease_s))
