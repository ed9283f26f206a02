"""The capacity ledger's handlers, one module per use case: ``commits`` (commit, commit_batch),
``lifecycle`` (release, renew, preempt, the lease sweeper), ``snapshots`` and ``fleet`` (topology and
telemetry events). Each reads like a sentence: load (store) -> decide (``shared.domain.ledger``) ->
write (store) + events (unit of work) -> reply. ``LedgerHandlers`` builds them from one set of
dependencies and names their methods in one place for the service's routes and consumers."""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.capacity_ledger import store
from services.capacity_ledger.commits import CommitHandlers, new_allocation_id
from services.capacity_ledger.fleet import FleetEventHandlers
from services.capacity_ledger.lifecycle import LifecycleHandlers
from services.capacity_ledger.metrics import LedgerMetrics
from services.capacity_ledger.ports import Batcher, Store, Units
from services.capacity_ledger.snapshots import SnapshotHandlers
from shared.domain.ledger import DriftDetector
from shared.infra.clock import Clock


class LedgerHandlers:
    """Commit / release / renew / preempt / snapshot, the lease sweeper, and the topology and telemetry events."""

    def __init__(
        self,
        *,
        uow: Units,
        clock: Clock,
        batcher: Batcher,
        ceiling: float,
        default_lease_s: int,
        sweep_period_s: float,
        drift: DriftDetector,
        snapshot_limit: int = 2048,
        max_payload: Callable[[], int] = lambda: 1 << 20,
        sweep_batch: int = 500,
        store: Store = store,
        new_id: Callable[[], str] = new_allocation_id,
        log: logging.Logger | None = None,
        crossing_budget: int = 0,
        metrics: LedgerMetrics | None = None,
    ) -> None:
        log = log or logging.getLogger("hetsched.capacity-ledger")
        self.commits = CommitHandlers(
            uow=uow,
            batcher=batcher,
            default_lease_s=default_lease_s,
            store=store,
            new_id=new_id,
            crossing_budget=crossing_budget,
            metrics=metrics,
        )
        self.lifecycle = LifecycleHandlers(
            uow=uow, clock=clock, sweep_period_s=sweep_period_s, sweep_batch=sweep_batch, store=store, log=log
        )
        self.snapshots = SnapshotHandlers(uow=uow, snapshot_limit=snapshot_limit, max_payload=max_payload, store=store)
        self.fleet = FleetEventHandlers(ceiling=ceiling, drift=drift, store=store, log=log, metrics=metrics)
        # requests
        self.commit = self.commits.commit
        self.commit_batch = self.commits.commit_batch
        self.apply_commits = self.commits.apply_commits  # what the commit batcher applies
        self.release = self.lifecycle.release
        self.renew = self.lifecycle.renew
        self.preempt = self.lifecycle.preempt
        self.snapshot = self.snapshots.snapshot
        # the lease sweeper
        self.sweep_leases = self.lifecycle.sweep_leases
        self.sweep_once = self.lifecycle.sweep_once
        # topology and telemetry events
        self.on_node_profiled = self.fleet.on_node_profiled
        self.on_node_changed = self.fleet.on_node_changed
        self.on_tpu_pod_profiled = self.fleet.on_tpu_pod_profiled
        self.on_node_lost = self.fleet.on_node_lost
        self.on_node_removed = self.fleet.on_node_removed
        self.on_node_recovered = self.fleet.on_node_recovered
        self.on_gpu_telemetry = self.fleet.on_gpu_telemetry
