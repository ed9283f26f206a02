"""Admission's in-memory view of the replicas placement made: each replica's model, engine, accelerators and
KV pool (from placement's own decisions), its engine's latest status (TELEMETRY `engine_status`), the KV
holds admission committed into it (its own, and the ledger's `request` allocations it hears of), and the
per-node KV pools with each engine's guaranteed share (``shared.domain.admission.pool``).

It is a cache, never the authority: the ledger checks every hold against the replica's KV pool, so a
book that missed something costs a failover to the next replica, never an over-commit. After a restart
it is seeded from placement's decisions; the holds made before the restart are known again as the
ledger's events tell them (or when their lease ends)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shared.contracts.placement import PlaceReply
from shared.contracts.subjects import token, untoken
from shared.contracts.topology import EngineStatusEvent
from shared.domain.admission import Engine, Grant, KvPool, ReplicaStatus, engine_of
from shared.domain.models import ModelSpec
from shared.domain.placement.types import chip_id

HOLD_PREFIX = "admit/"
"""The ledger request id of an admission hold: ``admit/<requesting tenant token>/<request id>``."""


def hold_request_id(tenant: str, request_id: str) -> str:
    return f"{HOLD_PREFIX}{token(tenant)}/{request_id}"


def hold_requester(ledger_request_id: str) -> tuple[str, str] | None:
    """(requesting tenant, request id) of an admission hold's ledger request id; None for anything else."""
    if not ledger_request_id.startswith(HOLD_PREFIX):
        return None
    scoped, _, request_id = ledger_request_id[len(HOLD_PREFIX) :].partition("/")
    try:
        return untoken(scoped), request_id
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Replica:
    """One placed replica, as admission serves it."""

    replica_id: str
    owner: str
    model: str
    engine: Engine
    node: str
    region: str | None
    tp: int
    kv_pool: Mapping[str, int]  # accelerator id -> KV bytes of the replica there

    @property
    def accelerators(self) -> tuple[str, ...]:
        return tuple(self.kv_pool)

    @property
    def kv_total(self) -> int:
        return sum(self.kv_pool.values())


def replica_of(owner: str, reply: PlaceReply, models: Mapping[str, ModelSpec]) -> Replica | None:
    """The replica a placed reply describes; None when it cannot serve requests (no model named, a model
    the catalog no longer has, or no KV)."""
    if reply.status != "placed" or reply.allocation_id is None or reply.model is None:
        return None
    spec = models.get(reply.model)
    share = reply.hbm_per_accelerator
    if spec is None or share is None or share.kv_bytes <= 0:
        return None
    accelerators: list[str] = []
    if reply.tpu_slice is not None:
        tpu = reply.tpu_slice
        ranges = [range(o, o + s) for o, s in zip(tpu.origin, tpu.shape, strict=False)]
        accelerators = [chip_id(tpu.pod, coord) for coord in itertools.product(*ranges)]
        node = tpu.pod
    else:
        stages = reply.stages or [reply.placements]
        for stage in stages:
            for placement in stage:
                accelerators.extend(placement.accelerators)
        if not accelerators:
            return None
        node = stages[0][0].node
    return Replica(
        replica_id=reply.allocation_id,
        owner=owner,
        model=reply.model,
        engine=engine_of(spec),
        node=node,
        region=reply.region,
        tp=reply.tp or 1,
        kv_pool=dict.fromkeys(accelerators, share.kv_bytes),
    )


@dataclass
class Hold:
    """One admitted request's KV inside its replica."""

    allocation_id: str
    replica_id: str
    requester: str
    request_id: str
    kv_bytes: int
    grant: Grant | None = None


@dataclass
class _Report:
    status: EngineStatusEvent
    at_ms: float


@dataclass
class ReplicaBook:
    """What admission knows of replicas, their engines' reports and the holds in them."""

    models: Mapping[str, ModelSpec]
    kv_shares: Mapping[Engine, float] | None = None
    replicas: dict[str, Replica] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)
    _reports: dict[str, _Report] = field(default_factory=dict)
    _held: dict[str, int] = field(default_factory=dict)
    _since: dict[str, int] = field(default_factory=dict)  # replica -> admitted since its engine last reported
    _failed: dict[str, float] = field(default_factory=dict)  # replica -> when a caller said it failed (ms)
    _holders: dict[tuple[str, str], int] = field(default_factory=dict)  # (replica, requester) -> holds there
    _pools: dict[str, KvPool] = field(default_factory=dict)
    _statuses: dict[str, ReplicaStatus] = field(default_factory=dict)  # until the replica's figures change

    # -- replicas -----------------------------------------------------------------------------------

    def add(self, replica: Replica) -> None:
        self.replicas[replica.replica_id] = replica
        self._rebuild_pool(replica.node)

    def remove(self, replica_id: str) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is None:
            return
        for allocation_id in [a for a, hold in self.holds.items() if hold.replica_id == replica_id]:
            self._unhold(self.holds.pop(allocation_id))
        self._held.pop(replica_id, None)
        self._since.pop(replica_id, None)
        self._reports.pop(replica_id, None)
        self._failed.pop(replica_id, None)
        self._statuses.pop(replica_id, None)
        self._rebuild_pool(replica.node)

    def serving(self, models: Iterable[str], region: str | None) -> list[Replica]:
        wanted = set(models)
        return [
            r
            for r in self.replicas.values()
            if r.model in wanted and (region is None or r.region is None or r.region == region)
        ]

    # -- engine reports and failures -----------------------------------------------------------------

    def report(self, status: EngineStatusEvent, *, now_ms: float) -> bool:
        """Keep the latest report of a replica's engine; True when it is one of ours and on its node."""
        replica = self.replicas.get(status.replica_id)
        if replica is None:
            return False  # not one of ours (or not yet: its engine reports again within seconds)
        if replica.node != status.node:
            return False  # another node's agent speaking for this replica (names compare exactly)
        self._reports[status.replica_id] = _Report(status, now_ms)
        self._statuses.pop(status.replica_id, None)
        self._since.pop(status.replica_id, None)  # the engine's queue now counts what was admitted before
        self._failed.pop(status.replica_id, None)  # a report after a failure puts it back in rotation
        return True

    def failed(self, replica_id: str, *, tenant: str, now_ms: float) -> bool:
        """``tenant`` says this replica failed or timed out its request: out of rotation until it reports
        again. Only a tenant holding an admission on the replica is heard (another could take any replica
        out of everyone's rotation; a replica the book does not know never grows it); False when ignored."""
        if replica_id not in self.replicas or not self.holds_on(replica_id, tenant):
            return False
        self._failed[replica_id] = now_ms
        self._statuses.pop(replica_id, None)
        return True

    def holds_on(self, replica_id: str, tenant: str) -> bool:
        """Whether ``tenant`` holds an admission (a KV hold) on the replica now."""
        return self._holders.get((replica_id, tenant), 0) > 0

    def status(self, replica: Replica) -> ReplicaStatus:
        """The replica as the selection rules see it (never reported: not healthy, not fresh); kept until
        a report, a hold or a failure changes it (freshness is judged by the caller against its clock)."""
        cached = self._statuses.get(replica.replica_id)
        if cached is not None:
            return cached
        status = self._status(replica)
        self._statuses[replica.replica_id] = status
        return status

    def _status(self, replica: Replica) -> ReplicaStatus:
        report = self._reports.get(replica.replica_id)
        held = self._held.get(replica.replica_id, 0)
        total = replica.kv_total
        if report is None:
            healthy, queue, used, p50, p99, at = False, 0, 0, 0.0, 0.0, None
        else:
            s = report.status
            healthy = s.healthy and replica.replica_id not in self._failed
            # What admission sent since the report waits in the engine too (until the next report says).
            queue = s.queue_depth + self._since.get(replica.replica_id, 0)
            # Holds are checked against the replica's pool in the ledger; the engine's own total may differ
            # (it sizes its cache itself), so its use counts as the same fraction of the pool.
            used = round(total * min(1.0, s.kv_used_bytes / s.kv_total_bytes)) if s.kv_total_bytes > 0 else 0
            p50, p99, at = s.latency_p50_ms, s.latency_p99_ms, report.at_ms
        return ReplicaStatus(
            replica_id=replica.replica_id,
            model=replica.model,
            engine=replica.engine,
            node=replica.node,
            region=replica.region,
            tp=replica.tp,
            healthy=healthy,
            queue_depth=queue,
            kv_used_bytes=used,
            kv_total_bytes=total,
            latency_p50_ms=p50,
            latency_p99_ms=p99,
            reported_at_ms=at,
            held_bytes=max(0, held - used),  # holds the engine's figure may not show yet
        )

    # -- holds -----------------------------------------------------------------------------------------

    def grant(self, replica: Replica, nbytes: int) -> Grant | bool | None:
        """The node pool's grant for ``nbytes`` more of this replica's engine; None when the engine's
        guaranteed share and what it may borrow are used up; True when the node has no pool to check."""
        pool = self._pools.get(replica.node)
        if pool is None:
            return True
        return pool.grant(replica.engine, nbytes)

    def ungrant(self, replica: Replica, grant: Grant | bool | None) -> None:
        pool = self._pools.get(replica.node)
        if pool is not None and isinstance(grant, Grant):
            pool.release(grant)

    def tentative(self, replica_id: str, nbytes: int, *, undo: bool = False) -> None:
        """Count a hold on its way to the ledger (so concurrent admissions see it), or take it back."""
        sign = -1 if undo else 1
        self._statuses.pop(replica_id, None)
        self._held[replica_id] = self._held.get(replica_id, 0) + sign * nbytes
        self._since[replica_id] = self._since.get(replica_id, 0) + sign
        if self._held[replica_id] <= 0:
            self._held.pop(replica_id)
        if self._since[replica_id] <= 0:
            self._since.pop(replica_id)

    def held(self, hold: Hold, *, counted: bool = False) -> None:
        """A hold the ledger accepted (idempotent: the same allocation twice counts once); ``counted``:
        its bytes are already counted (``tentative``)."""
        if hold.allocation_id in self.holds:
            if counted:
                self.tentative(hold.replica_id, hold.kv_bytes, undo=True)
            return
        replica = self.replicas.get(hold.replica_id)
        if hold.grant is None and replica is not None:
            granted = self.grant(replica, hold.kv_bytes)
            hold.grant = granted if isinstance(granted, Grant) else None
        self.holds[hold.allocation_id] = hold
        key = (hold.replica_id, hold.requester)
        self._holders[key] = self._holders.get(key, 0) + 1
        if not counted:
            self.tentative(hold.replica_id, hold.kv_bytes)

    def ended(self, allocation_id: str) -> Hold | None:
        """A hold released or expired; the hold, or None when it was not one."""
        hold = self.holds.pop(allocation_id, None)
        if hold is None:
            return None
        self._unhold(hold)
        self._statuses.pop(hold.replica_id, None)
        left = self._held.get(hold.replica_id, 0) - hold.kv_bytes
        if left > 0:
            self._held[hold.replica_id] = left
        else:
            self._held.pop(hold.replica_id, None)
        replica = self.replicas.get(hold.replica_id)
        if replica is not None:
            self.ungrant(replica, hold.grant)
        return hold

    def _unhold(self, hold: Hold) -> None:
        key = (hold.replica_id, hold.requester)
        left = self._holders.get(key, 0) - 1
        if left > 0:
            self._holders[key] = left
        else:
            self._holders.pop(key, None)

    def _rebuild_pool(self, node: str) -> None:
        """The node's KV pool over the replicas on it, with the grants of the holds in them again."""
        on_node = [r for r in self.replicas.values() if r.node == node]
        engines = {r.engine for r in on_node}
        if len(engines) < 2:  # one engine alone: its replicas' own pools are the only limit
            self._pools.pop(node, None)
            for hold in self.holds.values():
                if hold.replica_id in {r.replica_id for r in on_node}:
                    hold.grant = None
            return
        pool = KvPool.split(sum(r.kv_total for r in on_node), sorted(engines), self.kv_shares)
        for hold in self.holds.values():
            replica = self.replicas.get(hold.replica_id)
            if replica is not None and replica.node == node:
                hold.grant = pool.grant(replica.engine, hold.kv_bytes)  # best effort: existing holds stay
        self._pools[node] = pool
