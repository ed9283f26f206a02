"""Admission's in-memory view of the replicas placement made: each replica's model, engine, accelerators and
KV pool (from placement's own decisions), its engine's latest status (TELEMETRY `engine_status`), the
requests admission granted into it (``shared.domain.admission.account``: an estimate of the pool's use, the
engine's reported use plus the grants made since that report), and the per-node KV pools with each engine's
guaranteed share (``shared.domain.admission.pool``).

Nothing here is durable and nothing here asks another service: a replica's KV pool was reserved in the
ledger when it was placed, and which request uses which part of it is the engine's business. After a
restart the book is seeded from placement's decisions and each replica's use comes back with its engine's
next report; requests admitted before the restart are counted in that report."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shared.contracts.placement import PlaceReply
from shared.contracts.topology import EngineStatusEvent
from shared.domain.admission import (
    Engine,
    EngineReport,
    Grant,
    InFlight,
    KvPool,
    ReplicaAccount,
    ReplicaStatus,
    Tenancy,
    engine_of,
)
from shared.domain.models import ModelSpec
from shared.domain.placement.types import chip_id


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
    nodes: tuple[str, ...] = ()  # every node it spans (the head first); a TPU replica's pod
    sku: str | None = None  # its accelerators' SKU, as placement chose them

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
        nodes: tuple[str, ...] = (tpu.pod,)
    else:
        stages = reply.stages or [reply.placements]
        for stage in stages:
            for placement in stage:
                accelerators.extend(placement.accelerators)
        if not accelerators:
            return None
        node = stages[0][0].node
        nodes = tuple(dict.fromkeys([node, *(p.node for stage in stages for p in stage)]))
    return Replica(
        replica_id=reply.allocation_id,
        owner=owner,
        model=reply.model,
        engine=engine_of(spec),
        node=node,
        region=reply.region,
        tp=reply.tp or 1,
        kv_pool=dict.fromkeys(accelerators, share.kv_bytes),
        nodes=nodes,
        sku=reply.sku,
    )


@dataclass
class Hold:
    """One admitted request's KV inside its replica (in memory only): ``allocation_id`` is its admission id."""

    allocation_id: str
    replica_id: str
    requester: str
    request_id: str
    kv_bytes: int
    grant: Grant | None = None
    expires_at_ms: float = float("inf")
    granted_at_ms: float = 0.0


@dataclass
class _Report:
    status: EngineStatusEvent
    at_ms: float


@dataclass
class ReplicaBook:
    """What admission knows of replicas, their engines' reports and the requests in flight on them."""

    models: Mapping[str, ModelSpec]
    kv_shares: Mapping[Engine, float] | None = None
    replicas: dict[str, Replica] = field(default_factory=dict)
    holds: dict[str, Hold] = field(default_factory=dict)  # admission id -> the request in flight
    _reports: dict[str, _Report] = field(default_factory=dict)
    _accounts: dict[str, ReplicaAccount] = field(default_factory=dict)  # replica -> its in-flight estimate
    _failed: dict[str, float] = field(default_factory=dict)  # replica -> when a caller said it failed (ms)
    _pools: dict[str, KvPool] = field(default_factory=dict)
    _statuses: dict[str, ReplicaStatus] = field(default_factory=dict)  # until the replica's figures change
    preempted: dict[str, int] = field(default_factory=dict)  # model -> requests its engines reported preempted

    # -- replicas -----------------------------------------------------------------------------------

    def add(self, replica: Replica) -> None:
        self.replicas[replica.replica_id] = replica
        account = self._accounts.get(replica.replica_id)
        if account is None or account.pool_bytes != replica.kv_total:
            self._accounts[replica.replica_id] = ReplicaAccount(
                replica.kv_total,
                grants=dict(account.grants) if account else {},
                last_report=account.last_report if account else None,
                unreported=set(account.unreported) if account else set(),
            )
        self._statuses.pop(replica.replica_id, None)
        self._rebuild_pool(replica.node)

    def remove(self, replica_id: str) -> None:
        replica = self.replicas.pop(replica_id, None)
        if replica is None:
            return
        for allocation_id in [a for a, hold in self.holds.items() if hold.replica_id == replica_id]:
            self.holds.pop(allocation_id)
        self._accounts.pop(replica_id, None)
        self._reports.pop(replica_id, None)
        self._failed.pop(replica_id, None)
        self._statuses.pop(replica_id, None)
        self._rebuild_pool(replica.node)

    def nodes_of(self, replica_id: str) -> frozenset[str] | None:
        """The nodes a replica spans (its agents' names); None when the book does not hold it."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            return None
        return frozenset(replica.nodes or (replica.node,))

    def serving(self, models: Iterable[str], region: str | None, *, tenant: str, tenancy: Tenancy) -> list[Replica]:
        """The replicas of ``models`` in ``region`` that ``tenant``'s requests may use (``tenancy``): another
        tenant's replica is not there at all, so no reply to this tenant can name it."""
        wanted = set(models)
        return [
            r
            for r in self.replicas.values()
            if r.model in wanted
            and (region is None or r.region is None or r.region == region)
            and tenancy.allows(tenant, r.owner)
        ]

    # -- engine reports and failures -----------------------------------------------------------------

    def report(self, status: EngineStatusEvent, *, now_ms: float) -> bool:
        """Keep the latest report of a replica's engine; True when it is one of ours and on its node. The
        requests admitted before it count as part of the engine's figures from now on."""
        replica = self.replicas.get(status.replica_id)
        if replica is None:
            return False  # not one of ours (or not yet: its engine reports again within seconds)
        if replica.node != status.node:
            return False  # another node's agent speaking for this replica (names compare exactly)
        self._reports[status.replica_id] = _Report(status, now_ms)
        if status.preemptions:
            self.preempted[replica.model] = self.preempted.get(replica.model, 0) + status.preemptions
        self._account(replica).report(
            EngineReport(kv_used_bytes=self._scaled_use(replica, status), queue_depth=status.queue_depth, at_ms=now_ms)
        )
        self._statuses.pop(status.replica_id, None)
        self._failed.pop(status.replica_id, None)  # a report after a failure puts it back in rotation
        return True

    def kv_usage(self, *, now_ms: float, stale_ms: float) -> dict[str, tuple[str, float]]:
        """Each replica whose engine reported within ``stale_ms``: its model and the share of its KV cache in
        use (the engine's own ``kv_usage``, else its used over total bytes)."""
        out: dict[str, tuple[str, float]] = {}
        for replica_id, report in self._reports.items():
            replica = self.replicas.get(replica_id)
            if replica is None or now_ms - report.at_ms > stale_ms:
                continue
            status = report.status
            usage = status.kv_usage
            if usage is None:
                usage = status.kv_used_bytes / status.kv_total_bytes if status.kv_total_bytes > 0 else 0.0
            out[replica_id] = (replica.model, min(1.0, usage))
        return out

    @staticmethod
    def _scaled_use(replica: Replica, status: EngineStatusEvent) -> int:
        """The engine's KV use as the same fraction of the replica's pool (the engine sizes its cache itself,
        so its own total may differ from the bytes placement reserved)."""
        if status.kv_total_bytes <= 0:
            return 0
        return round(replica.kv_total * min(1.0, status.kv_used_bytes / status.kv_total_bytes))

    def _account(self, replica: Replica) -> ReplicaAccount:
        account = self._accounts.get(replica.replica_id)
        if account is None:
            account = self._accounts[replica.replica_id] = ReplicaAccount(replica.kv_total)
        return account

    def account(self, replica_id: str) -> ReplicaAccount | None:
        """The replica's in-flight account (read it, do not change it)."""
        return self._accounts.get(replica_id)

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
        """Whether ``tenant`` has a request in flight (an admission not released) on the replica now."""
        account = self._accounts.get(replica_id)
        return account is not None and account.holders(tenant) > 0

    def status(self, replica: Replica) -> ReplicaStatus:
        """The replica as the selection rules see it (never reported: not healthy, not fresh); kept until
        a report, a grant or a failure changes it (freshness is judged by the caller against its clock)."""
        cached = self._statuses.get(replica.replica_id)
        if cached is not None:
            return cached
        status = self._status(replica)
        self._statuses[replica.replica_id] = status
        return status

    def _status(self, replica: Replica) -> ReplicaStatus:
        report = self._reports.get(replica.replica_id)
        account = self._account(replica)
        total = replica.kv_total
        if report is None:
            healthy, queue, used, p50, p99, at = False, 0, 0, 0.0, 0.0, None
        else:
            s = report.status
            healthy = s.healthy and replica.replica_id not in self._failed
            # What admission sent since the report waits in the engine too (until the next report says).
            queue = s.queue_depth + account.unreported_count
            used = account.reported_bytes
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
            held_bytes=account.unreported_bytes,  # grants the engine's figure does not show yet
        )

    # -- requests in flight ------------------------------------------------------------------------------

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

    def admit(self, replica: Replica, hold: Hold) -> bool:
        """Count a request in flight on ``replica`` when its estimate leaves room, and the node's pool
        grants its engine the bytes; False, with nothing counted, when not."""
        account = self._account(replica)
        if not account.fits(hold.kv_bytes):
            return False
        granted = self.grant(replica, hold.kv_bytes)
        if granted is None:
            return False  # the engine's guaranteed KV share and what it may borrow are used up on this node
        inflight = InFlight(
            admission_id=hold.allocation_id,
            tenant=hold.requester,
            request_id=hold.request_id,
            nbytes=hold.kv_bytes,
            granted_at_ms=hold.granted_at_ms,
            expires_at_ms=hold.expires_at_ms,
        )
        if not account.grant(inflight):
            self.ungrant(replica, granted)
            return False
        hold.grant = granted if isinstance(granted, Grant) else None
        self.holds[hold.allocation_id] = hold
        self._statuses.pop(replica.replica_id, None)
        return True

    def renew(self, allocation_id: str, expires_at_ms: float) -> Hold | None:
        hold = self.holds.get(allocation_id)
        account = self._accounts.get(hold.replica_id) if hold is not None else None
        if hold is None or account is None or account.renew(allocation_id, expires_at_ms) is None:
            return None
        hold.expires_at_ms = expires_at_ms
        return hold

    def ended(self, allocation_id: str) -> Hold | None:
        """A request released (or its lease ended): the hold, or None when it was not one (idempotent)."""
        hold = self.holds.pop(allocation_id, None)
        if hold is None:
            return None
        account = self._accounts.get(hold.replica_id)
        if account is not None:
            account.release(allocation_id)
        self._statuses.pop(hold.replica_id, None)
        replica = self.replicas.get(hold.replica_id)
        if replica is not None:
            self.ungrant(replica, hold.grant)
        return hold

    def expire(self, now_ms: float) -> list[Hold]:
        """End the requests whose lease passed without a release; those ended."""
        gone = [a for a, hold in self.holds.items() if hold.expires_at_ms <= now_ms]
        return [hold for a in gone if (hold := self.ended(a)) is not None]

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
