"""What the ledger follows of the fleet: topology's events register, resize and (un)make available the
accelerators it counts on (``capacity_changed``, ``allocations_flagged``); telemetry's GPU samples are
held against what is reserved (``drift_detected``, once per episode, and the drift gauge)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial

from services.capacity_ledger import mapping, store
from services.capacity_ledger.metrics import LedgerMetrics
from services.capacity_ledger.ports import Store
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import AllocationsFlaggedEvent, CapacityChangedEvent, DriftEvent, LedgerEventName
from shared.contracts.subjects import Context
from shared.contracts.topology import GpuTelemetryEvent, NodeProfileEvent, NodeStateEvent, TpuPodEvent
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import AcceleratorId, TpuPod, cluster_key, tpu_chip_ids
from shared.domain.ledger import DriftDetector
from shared.domain.memory import usable_hbm
from shared.domain.topology.tpu import TpuType
from shared.infra.uow import UnitOfWork


class FleetEventHandlers:
    """The consumers of topology's and telemetry's events."""

    def __init__(
        self,
        *,
        ceiling: float,
        drift: DriftDetector,
        store: Store = store,
        log: logging.Logger | None = None,
        metrics: LedgerMetrics | None = None,
    ) -> None:
        self._ceiling = ceiling
        self._drift = drift
        self._store = store
        self._log = log or logging.getLogger("hetsched.capacity-ledger")
        self._metrics = metrics
        self._drifting: set[str] = set()  # accelerators in a drift episode (their gauge shows the difference)

    # -- TOPOLOGY events -----------------------------------------------------------------------

    async def on_node_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        """A node's GPUs become ledger accelerators (usable = HBM x ceiling), in the node's cluster (its
        ``<region>/<cluster>`` key: names repeat across regions)."""
        profile = payload.profile
        cluster = cluster_key(profile.region, profile.cluster) if profile.cluster else None
        accelerators = [
            self._spec(AcceleratorId.gpu(payload.node, a.index), a.sku, a.hbm_bytes, cluster=cluster)
            for a in payload.profile.accelerators
        ]
        view = await self._store.upsert_capacity(session=uow.session, node=payload.node, accelerators=accelerators)
        await self._held_above_reported(uow, node=payload.node, ids=[a.id for a in accelerators])
        self._capacity_changed(uow, event, node=payload.node, reason="profiled", view=view.values())
        if self._metrics is not None:  # the TP-group gauge judges NVLink by the node's current domains
            uow.after_commit(partial(self._metrics.profiled, payload.node, [d.members for d in payload.domains]))

    async def _held_above_reported(self, uow: UnitOfWork, *, node: str, ids: list[str]) -> None:
        """A device reported smaller than what is reserved on it keeps its reservations: the database holds
        its usable HBM at what is reserved (nothing new fits) and lets it shrink with each release, down to
        the new figure (migration 0015, docs/LEDGER.md). Said once per report, with the figures."""
        held = await self._store.held_above_reported(session=uow.session, ids=ids)
        for accelerator_id, (usable, reported) in held.items():
            self._log.warning(
                "an accelerator reports less HBM than is reserved on it; it takes nothing new until releases "
                "bring it down to the new figure",
                extra={
                    "node": node,
                    "accelerator_id": accelerator_id,
                    "usable_bytes": usable,
                    "reported_bytes": reported,
                },
            )

    async def on_node_changed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        """A re-profiled node resizes its accelerators; what is reserved on them stays."""
        await self.on_node_profiled(uow=uow, event=event, payload=payload)

    async def on_tpu_pod_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: TpuPodEvent) -> None:
        """A TPU chip is an accelerator of its own; a slice reserves its chips whole."""
        pod = TpuPod(name=payload.pod, region=payload.region, type=TpuType(payload.type), shape=tuple(payload.shape))
        accelerators = [self._spec(chip, payload.sku, payload.hbm_per_chip) for chip in tpu_chip_ids(pod)]
        view = await self._store.upsert_capacity(session=uow.session, node=pod.name, accelerators=accelerators)
        await self._held_above_reported(uow, node=pod.name, ids=[a.id for a in accelerators])
        self._capacity_changed(uow, event, node=pod.name, reason="profiled", view=view.values())

    async def on_node_lost(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await self._availability(uow, event, node=payload.node, available=False, reason="lost")

    async def on_node_removed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await self._availability(uow, event, node=payload.node, available=False, reason="removed")
        if self._metrics is not None:
            uow.after_commit(partial(self._metrics.forget, payload.node))

    async def on_node_recovered(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await self._availability(uow, event, node=payload.node, available=True, reason="recovered")

    def _spec(
        self, accelerator_id: str, sku: str, hbm_bytes: int, *, cluster: str | None = None
    ) -> store.AcceleratorSpec:
        return store.AcceleratorSpec(
            id=accelerator_id,
            sku=sku,
            hbm_total=hbm_bytes,
            ceiling=self._ceiling,
            usable=usable_hbm(hbm_bytes, self._ceiling),
            cluster=cluster,
        )

    async def _availability(
        self, uow: UnitOfWork, event: EventEnvelope, *, node: str, available: bool, reason: str
    ) -> None:
        """Lost / removed: the node's accelerators take nothing more and the allocations on them are
        flagged; recovered: they take commits again."""
        changed = await self._store.set_node_available(session=uow.session, node=node, available=available)
        if changed.flagged:
            uow.emit(
                Context.LEDGER,
                LedgerEventName.ALLOCATIONS_FLAGGED,
                AllocationsFlaggedEvent(node=node, reason=f"node_{reason}", allocation_ids=changed.flagged),
                causation_id=event.event_id,
            )
        self._capacity_changed(uow, event, node=node, reason=reason, view=changed.view.values())

    def _capacity_changed(
        self,
        uow: UnitOfWork,
        event: EventEnvelope,
        *,
        node: str,
        reason: str,
        view: Iterable[AcceleratorCapacity],
    ) -> None:
        accelerators = sorted(view, key=lambda c: c.id)
        if not accelerators:
            return  # a node the ledger never knew
        uow.emit(
            Context.LEDGER,
            LedgerEventName.CAPACITY_CHANGED,
            CapacityChangedEvent(node=node, reason=reason, accelerators=mapping.balances(accelerators)),
            causation_id=event.event_id,
        )

    # -- TELEMETRY events ----------------------------------------------------------------------

    async def on_gpu_telemetry(self, *, uow: UnitOfWork, event: EventEnvelope, payload: GpuTelemetryEvent) -> None:
        """Observed HBM use against what the ledger reserved; drift is reported once per episode. An
        accelerator whose newest replica was committed within the detector's grace is not checked."""
        used = {g.index: g.memory_used_bytes for g in payload.gpus if g.memory_used_bytes is not None}
        if not used:
            return
        newest = await self._store.newest_replica_commits(session=uow.session, node=payload.node)
        for acc in await self._store.node_accelerators(session=uow.session, node=payload.node):
            observed = used.get(acc.index) if acc.index >= 0 else None  # a TPU chip has no GPU index
            if observed is None:
                continue
            if self._drift.settling(newest.get(acc.id), uow.now):  # its engine may still be loading
                uow.after_commit(partial(self._settling, acc))
                continue
            drift, streak = self._drift.judge(
                accelerator_id=acc.id, observed_bytes=observed, reserved_bytes=acc.reserved, usable_bytes=acc.usable
            )
            # The detector and the gauge move once the report of this sample (if any) has committed.
            uow.after_commit(partial(self._observed, acc, observed, streak=streak, reported=drift is not None))
            if drift is not None:
                uow.emit(
                    Context.LEDGER,
                    LedgerEventName.DRIFT_DETECTED,
                    DriftEvent(
                        accelerator_id=drift.accelerator_id,
                        observed_bytes=drift.observed_bytes,
                        reserved_bytes=drift.reserved_bytes,
                        usable_bytes=drift.usable_bytes,
                        difference_bytes=drift.difference,
                    ),
                    causation_id=event.event_id,
                )

    def _settling(self, acc: AcceleratorCapacity) -> None:
        """A sample within the grace after a placement: no streak, and no drift shown."""
        self._drift.record(acc.id, 0)
        if self._metrics is not None and acc.id in self._drifting:
            self._drifting.discard(acc.id)
            self._metrics.drift(acc.id, 0)

    def _observed(self, acc: AcceleratorCapacity, observed: int, *, streak: int, reported: bool) -> None:
        self._drift.record(acc.id, streak)
        self._show_drift(acc, observed, reported=reported)

    def _show_drift(self, acc: AcceleratorCapacity, observed: int, *, reported: bool) -> None:
        """The drift gauge: observed - reserved from the sample that reports an episode while the samples
        stay outside the detector's band, back to 0 with the first one inside it (the episode ends)."""
        if self._metrics is None or not (reported or acc.id in self._drifting):
            return
        if reported or _outside_band(self._drift, acc, observed):
            self._drifting.add(acc.id)
            self._metrics.drift(acc.id, observed - acc.reserved)
        else:
            self._drifting.discard(acc.id)
            self._metrics.drift(acc.id, 0)


def _outside_band(detector: DriftDetector, acc: AcceleratorCapacity, observed: int) -> bool:
    """Whether ``detector``'s rule calls this one sample a difference (a fresh detector that needs one
    sample answers it, so the rule stays the domain's)."""
    probe = DriftDetector(threshold=detector.threshold, consecutive=1)
    drift = probe.observe(
        accelerator_id=acc.id, observed_bytes=observed, reserved_bytes=acc.reserved, usable_bytes=acc.usable
    )
    return drift is not None
