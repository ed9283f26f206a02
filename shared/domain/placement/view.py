"""Placement's view of the fleet as a fold: what it learns from the topology and the ledger, and the
``FleetSnapshot`` each decision reads.

The service seeds a ``FleetView`` from ``fleet.get`` and ``ledger.snapshot`` and then feeds it TOPOLOGY
and LEDGER events; nothing here does IO. The ledger's part (``LedgerMirror``) counts every allocation
once per accelerator, so an event that the snapshot already holds, a redelivery, or the end of an
allocation the view never saw changes nothing. On top sit the placement's own *assumptions*
(decisions sent to the ledger whose outcome is not known yet, the Kubernetes scheduler's "assume"):
counted at once so concurrent decisions do not all pick the same GPUs, then confirmed (they become the
allocation) or forgotten (the commit failed), each idempotently.

A stale view costs a retry, never an over-commit: the ledger checks every commit against its own rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import NodeProfile, Rack, TpuPod, tpu_chip_ids
from shared.domain.hardware import Sku
from shared.domain.memory import MemoryShare
from shared.domain.models import ModelSpec
from shared.domain.placement.types import Decision, FleetSnapshot, RackKey, TpuPodState, tpu_sku_name
from shared.domain.topology.tpu import TpuGrid

AssumeKey = tuple[str, str]
"""(tenant, request id the ledger is asked with): what ties a commit's event to the decision assumed for it."""


@dataclass(frozen=True, slots=True)
class LedgerAccelerator:
    """One accelerator as the ledger reports it (a snapshot row or a ``capacity_changed`` balance);
    ``allocations`` are the allocations its reserved bytes belong to, when known."""

    id: str
    node: str
    usable: int
    reserved: int
    available: bool = True
    allocations: tuple[str, ...] = ()


def reservation(snapshot: FleetSnapshot, decision: Decision) -> dict[str, MemoryShare]:
    """What a placed decision asks the ledger to hold on each accelerator: its share on each GPU; on a
    TPU the slice's chips whole (a slice is exclusive), each chip's usable HBM counted as weights."""
    if not decision.placed or decision.share is None:
        return {}
    if decision.tpu is not None:
        whole = MemoryShare(
            weights=snapshot.tpu_pods[decision.tpu.pod].usable_per_chip, kv=0, activation=0, workspace=0
        )
        return dict.fromkeys(decision.tpu.chips, whole)
    return dict.fromkeys(decision.accelerators, decision.share)


def overlay(snapshot: FleetSnapshot, fresher: Mapping[str, LedgerAccelerator]) -> FleetSnapshot:
    """``snapshot`` with fresher ledger figures for some GPUs (the view a ``conflict`` answer carries):
    each takes the larger reserved figure of the two and is available only if both say so, so a retry
    does not pick what the ledger just refused. GPUs the snapshot lacks, and TPU chips, are left to the
    events."""
    capacity = dict(snapshot.capacity)
    power = dict(snapshot.rack_power_used_w)
    changed: set[str] = set()
    racks: set[RackKey] = set()
    for acc, fresh in fresher.items():
        cap = capacity.get(acc)
        if cap is None:
            continue
        new = replace(
            cap,
            usable=fresh.usable,
            reserved=max(cap.reserved, fresh.reserved),
            available=cap.available and fresh.available,
        )
        if new == cap:
            continue
        if cap.idle and not new.idle:
            key = snapshot.rack_key(cap.node)
            sku = snapshot.skus.get(cap.sku)
            power[key] = power.get(key, 0.0) + (sku.tdp_w if sku else 0.0)
            racks.add(key)
        capacity[acc] = new
        changed.add(acc)
    if not changed:
        return snapshot
    return snapshot.evolve(
        capacity=capacity, rack_power_used_w=power, changed=(frozenset(changed), frozenset(racks), frozenset())
    )


class LedgerMirror:
    """Reserved bytes per accelerator as the ledger's events tell them, each (allocation, accelerator)
    counted once. Mutable for speed (one event touches a few accelerators of thousands); every method
    returns the accelerator ids it changed."""

    def __init__(self, accelerators: Iterable[LedgerAccelerator] = ()) -> None:
        self.node: dict[str, str] = {}
        self.usable: dict[str, int] = {}
        self.available: dict[str, bool] = {}
        self.reserved: dict[str, int] = {}
        self._held: set[tuple[str, str]] = set()
        for acc in accelerators:
            self._describe(acc)
            self.reserved[acc.id] = acc.reserved
            self._held.update((allocation, acc.id) for allocation in acc.allocations)

    def _describe(self, acc: LedgerAccelerator) -> None:
        self.node[acc.id] = acc.node
        self.usable[acc.id] = acc.usable
        self.available[acc.id] = acc.available

    def known(self, accelerator_id: str) -> bool:
        return accelerator_id in self.usable

    def move(self, allocation_id: str, delta: Mapping[str, int]) -> set[str]:
        """Apply an allocation event's signed bytes per accelerator (``ledger.replay.allocation_delta``):
        a positive figure is counted unless that (allocation, accelerator) already is; a negative one
        is given back only where it was counted."""
        changed: set[str] = set()
        for acc, nbytes in delta.items():
            pair = (allocation_id, acc)
            if (nbytes > 0) == (pair in self._held) or not nbytes:
                continue  # counted already, or never counted
            if nbytes > 0:
                self._held.add(pair)
            else:
                self._held.discard(pair)
            self.reserved[acc] = max(0, self.reserved.get(acc, 0) + nbytes)
            changed.add(acc)
        return changed

    def capacity(self, accelerators: Iterable[LedgerAccelerator]) -> set[str]:
        """Accelerators registered, resized, lost or recovered. Reserved bytes stay as the allocations
        say; only an accelerator never seen takes the reported figure."""
        changed: set[str] = set()
        for acc in accelerators:
            if acc.id not in self.reserved:
                self.reserved[acc.id] = acc.reserved
            self._describe(acc)
            changed.add(acc.id)
        return changed

    def balances(self) -> dict[str, tuple[int, int, bool]]:
        """(usable, reserved, available) per accelerator: what ``ledger.snapshot`` should say."""
        return {acc: (usable, self.reserved.get(acc, 0), self.available[acc]) for acc, usable in self.usable.items()}


@dataclass(frozen=True, slots=True)
class _Assumed:
    key: AssumeKey
    held: Mapping[str, int]  # bytes per accelerator


class FleetView:
    """The topology and the ledger as placement follows them, and the snapshot decisions read.

    The snapshot is derived lazily: a change to the ledger's figures updates only the accelerators,
    racks and pods it touched (the placement index follows incrementally); a topology change rebuilds
    it. A node appears in the snapshot while it is up and the ledger knows every one of its GPUs; a TPU
    pod once the ledger knows all its chips.
    """

    def __init__(
        self,
        *,
        skus: Mapping[str, Sku],
        models: Mapping[str, ModelSpec],
        nodes: Iterable[tuple[NodeProfile, bool]] = (),
        racks: Iterable[Rack] = (),
        pods: Iterable[tuple[TpuPod, int | None]] = (),
        ledger: LedgerMirror | None = None,
    ) -> None:
        self.skus = dict(skus)
        self.models = dict(models)
        self.profiles: dict[str, NodeProfile] = {}
        self.up: dict[str, bool] = {}
        for profile, up in nodes:
            self.profiles[profile.name] = profile
            self.up[profile.name] = up
        self.racks: dict[RackKey, Rack] = {(r.region, r.cluster, r.name): r for r in racks}
        self.pods: dict[str, TpuPod] = {}
        self.hbm_per_chip: dict[str, int] = {}
        for pod, hbm in pods:
            self._add_pod(pod, hbm)
        self.ledger = ledger or LedgerMirror()
        self._assumed: dict[int, _Assumed] = {}
        self._by_key: dict[AssumeKey, set[int]] = {}
        self._tokens = 0
        self._extra: dict[str, int] = {}  # assumed bytes per accelerator
        self._snapshot: FleetSnapshot | None = None
        self._touched: set[str] = set()
        # Where each accelerator of the snapshot sits: GPU -> (node, rack), chip -> pod.
        self._gpu_rack: dict[str, RackKey] = {}
        self._rack_gpus: dict[RackKey, list[str]] = {}
        self._chip_pod: dict[str, str] = {}

    # -- topology ----------------------------------------------------------------------------

    def node_profiled(self, profile: NodeProfile) -> None:
        """A node's (new) profile; a profiled node is up."""
        self.profiles[profile.name] = profile
        self.up[profile.name] = True
        self._snapshot = None

    def node_up(self, name: str, up: bool) -> None:
        """A node lost (its heartbeats stopped) or recovered."""
        if name in self.profiles and self.up.get(name) != up:
            self.up[name] = up
            self._snapshot = None

    def node_removed(self, name: str) -> None:
        if self.profiles.pop(name, None) is not None:
            self.up.pop(name, None)
            self._snapshot = None

    def pod_profiled(self, pod: TpuPod, hbm_per_chip: int | None) -> None:
        known = self.pods.get(pod.name)
        if known is not None and pod.cluster is None:
            pod = TpuPod(pod.name, pod.region, pod.type, pod.shape, known.cluster)  # events may not carry it
        self._add_pod(pod, hbm_per_chip)
        self._snapshot = None

    def _add_pod(self, pod: TpuPod, hbm_per_chip: int | None) -> None:
        sku = self.skus.get(tpu_sku_name(pod.type))
        hbm = hbm_per_chip or (sku.hbm_bytes if sku else None)
        if hbm is None:
            return  # no HBM figure for its chips: it cannot be placed on
        self.pods[pod.name] = pod
        self.hbm_per_chip[pod.name] = hbm

    # -- ledger ------------------------------------------------------------------------------

    def allocation_moved(self, allocation_id: str, *, key: AssumeKey, delta: Mapping[str, int]) -> None:
        """An allocation event's signed bytes per accelerator (``ledger.replay.allocation_delta``); a
        commit that a decision of ours assumed ends that assumption."""
        if any(nbytes > 0 for nbytes in delta.values()):
            for token in list(self._by_key.get(key, ())):
                self.forget(token)
        self._touch(self.ledger.move(allocation_id, delta))

    def capacity_changed(self, accelerators: Iterable[LedgerAccelerator]) -> None:
        changed = self.ledger.capacity(accelerators)
        if any(acc not in self._gpu_rack and acc not in self._chip_pod for acc in changed):
            self._snapshot = None  # an accelerator the snapshot lacks: a node or pod may now be complete
        self._touch(changed)

    def _touch(self, accelerators: set[str]) -> None:
        self._touched |= accelerators

    # -- the decisions' own optimism ---------------------------------------------------------

    def assume(self, key: AssumeKey, held: Mapping[str, int]) -> int:
        """Count ``held`` bytes per accelerator now, before the ledger answers the commit for ``key``;
        returns the assumption's token for ``confirm`` / ``forget``."""
        self._tokens += 1
        self._hold(self._tokens, _Assumed(key, dict(held)))
        return self._tokens

    def _hold(self, token: int, assumed: _Assumed) -> None:
        self._assumed[token] = assumed
        self._by_key.setdefault(assumed.key, set()).add(token)
        for acc, total in assumed.held.items():
            self._extra[acc] = self._extra.get(acc, 0) + total
        self._touch(set(assumed.held))

    def confirm(self, token: int, allocation_id: str) -> None:
        """The ledger committed the assumption as ``allocation_id``: its bytes become the allocation's
        (unless the allocation's event came first, which already did that)."""
        assumed = self._assumed.get(token)
        if assumed is None:
            return
        self.forget(token)
        self._touch(self.ledger.move(allocation_id, assumed.held))

    def forget(self, token: int) -> None:
        """The commit failed, or was never answered, or its event arrived: drop the assumption (idempotent)."""
        assumed = self._assumed.pop(token, None)
        if assumed is None:
            return
        tokens = self._by_key.get(assumed.key, set())
        tokens.discard(token)
        if not tokens:
            self._by_key.pop(assumed.key, None)
        for acc, total in assumed.held.items():
            left = self._extra.get(acc, 0) - total
            if left > 0:
                self._extra[acc] = left
            else:
                self._extra.pop(acc, None)
        self._touch(set(assumed.held))

    def adopt(self, other: FleetView) -> None:
        """Carry ``other``'s open assumptions over, tokens kept (a fresh view replacing it while commits
        are in flight)."""
        for token, assumed in other._assumed.items():
            self._hold(token, assumed)
        self._tokens = max(self._tokens, other._tokens)

    @property
    def assumed(self) -> int:
        """Decisions sent to the ledger whose outcome this view does not know yet."""
        return len(self._assumed)

    # -- the snapshot --------------------------------------------------------------------------

    @property
    def snapshot(self) -> FleetSnapshot:
        """The fleet as the next decision sees it (a new object whenever something changed)."""
        if self._snapshot is None:
            self._snapshot = self._build()
            self._touched.clear()
        elif self._touched:
            self._snapshot = self._update(self._snapshot, self._touched)
            self._touched = set()
        return self._snapshot

    def _reserved(self, acc: str) -> int:
        return self.ledger.reserved.get(acc, 0) + self._extra.get(acc, 0)

    def _capacity(self, acc: str, node: str, index: int, sku: str) -> AcceleratorCapacity:
        return AcceleratorCapacity(
            id=acc,
            node=node,
            index=index,
            sku=sku,
            usable=self.ledger.usable[acc],
            reserved=self._reserved(acc),
            available=self.ledger.available[acc],
        )

    def _rack_power(self, capacity: Mapping[str, AcceleratorCapacity], key: RackKey) -> float:
        """Watts a rack draws: the TDP of each of its busy GPUs."""
        watts = 0.0
        for acc in self._rack_gpus.get(key, ()):
            cap = capacity[acc]
            if not cap.idle:
                sku = self.skus.get(cap.sku)
                watts += sku.tdp_w if sku else 0.0
        return watts

    def _pod_state(self, name: str) -> TpuPodState:
        """A TPU pod with a chip taken wherever bytes are reserved on it."""
        pod = self.pods[name]
        occupancy = bytes(1 if self._reserved(chip) > 0 else 0 for chip in tpu_chip_ids(pod))
        return TpuPodState(pod=pod, grid=TpuGrid(pod.type, pod.shape, occupancy), hbm_per_chip=self.hbm_per_chip[name])

    def _build(self) -> FleetSnapshot:
        known = self.ledger.known
        nodes = {
            name: profile
            for name, profile in self.profiles.items()
            if self.up.get(name, False) and all(known(profile.accelerator_id(a.index)) for a in profile.accelerators)
        }
        capacity: dict[str, AcceleratorCapacity] = {}
        self._gpu_rack = {}
        self._rack_gpus = {}
        for profile in nodes.values():
            key = (profile.region, profile.cluster, profile.rack)
            for a in profile.accelerators:
                acc = profile.accelerator_id(a.index)
                capacity[acc] = self._capacity(acc, profile.name, a.index, a.sku)
                self._gpu_rack[acc] = key
                self._rack_gpus.setdefault(key, []).append(acc)
        power = {key: w for key in self._rack_gpus if (w := self._rack_power(capacity, key))}
        self._chip_pod = {}
        pods: dict[str, TpuPodState] = {}
        for name, pod in self.pods.items():
            chips = tpu_chip_ids(pod)
            if not all(known(chip) for chip in chips):
                continue  # the ledger has not registered this pod's chips yet
            self._chip_pod.update(dict.fromkeys(chips, name))
            pods[name] = self._pod_state(name)
        return FleetSnapshot(
            nodes=nodes,
            capacity=capacity,
            racks=dict(self.racks),
            rack_power_used_w=power,
            tpu_pods=pods,
            skus=self.skus,
            models=self.models,
        )

    def _update(self, before: FleetSnapshot, touched: set[str]) -> FleetSnapshot:
        capacity = dict(before.capacity)
        accelerators: set[str] = set()
        racks: set[RackKey] = set()
        pod_names: set[str] = set()
        for acc in touched:
            if acc in self._gpu_rack:
                old = capacity[acc]
                new = self._capacity(acc, old.node, old.index, old.sku)
                if new != old:
                    capacity[acc] = new
                    accelerators.add(acc)
                    racks.add(self._gpu_rack[acc])
            elif acc in self._chip_pod:
                pod_names.add(self._chip_pod[acc])
        power = dict(before.rack_power_used_w)
        for key in racks:
            watts = self._rack_power(capacity, key)
            if watts:
                power[key] = watts
            else:
                power.pop(key, None)
        pods = dict(before.tpu_pods)
        changed_pods = set()
        for name in pod_names:
            state = self._pod_state(name)
            if state != pods[name]:
                pods[name] = state
                changed_pods.add(name)
        if not accelerators and not changed_pods:
            return before
        return before.evolve(
            capacity=capacity,
            rack_power_used_w=power,
            tpu_pods=pods,
            changed=(frozenset(accelerators), frozenset(racks), frozenset(changed_pods)),
        )

    # -- what the view believes, to compare with the ledger ------------------------------------

    def ledger_balances(self) -> dict[str, tuple[int, int, bool]]:
        """(usable, reserved, available) per accelerator as the ledger's events told it (assumptions
        not counted): once the events are all applied, equal to ``ledger.snapshot``."""
        return self.ledger.balances()
