"""Placement's view of the fleet as a fold: what it learns from the topology and the ledger, and the
``FleetSnapshot`` each decision reads.

The service seeds a ``FleetView`` from ``fleet.get`` and ``ledger.snapshot`` and then feeds it TOPOLOGY
and LEDGER events; nothing here does IO. The ledger's part (``LedgerMirror``) counts every allocation
once per accelerator, so an event that the snapshot already holds, a redelivery, or the end of an
allocation the view never saw changes nothing. On top sit the placement's own *assumptions*
(decisions sent to the ledger whose outcome is not known yet, the Kubernetes scheduler's "assume"):
counted at once so concurrent decisions do not all pick the same GPUs, then confirmed (they become the
allocation) or forgotten (the commit failed), each idempotently.

Besides bytes the fold keeps what the exclusivity and budget rules read: which GPUs are held only by
``shared`` replicas (``AcceleratorCapacity.shared``), the TP traffic crossing NVLink domains per
cluster (``FleetSnapshot.cross_domain_used``: added when an allocation that crosses is counted, given
back when it ends), and each node's PCIe utilisation from GPU telemetry (``FleetSnapshot.pcie_util``,
see ``PcieWindow``).

A stale view costs a retry, never an over-commit: the ledger checks every commit against its own rows.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import NodeProfile, Rack, TpuPod, tpu_chip_ids
from shared.domain.hardware import Sku
from shared.domain.memory import MemoryShare
from shared.domain.models import ModelSpec
from shared.domain.placement.filters.pcie_budget import GB_PER_S_PER_LANE
from shared.domain.placement.types import Decision, FleetSnapshot, RackKey, TpuPodState, tpu_sku_name
from shared.domain.topology.tpu import TpuGrid

AssumeKey = tuple[str, str]
"""(tenant, request id the ledger is asked with): what ties a commit's event to the decision assumed for it."""

Crossing = tuple[str, float]
"""(cluster, bytes/s): the TP traffic an allocation sends across NVLink domains, and the cluster it counts in."""

DEFAULT_PCIE_WINDOW_S = 60.0
"""The brief: a node whose PCIe stays over the threshold for 60 s takes no cold loads."""


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


def overlay(snapshot: FleetSnapshot, fresher: Mapping[str, AcceleratorCapacity]) -> FleetSnapshot:
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
            # Bytes the view did not know of belong to a holder it did not see: taken as exclusive.
            shared=cap.shared and fresh.reserved <= cap.reserved,
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


# -- PCIe utilisation from GPU telemetry ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PcieSample:
    """One GPU's PCIe traffic in a telemetry sample, bytes/s each way (None: not reported)."""

    index: int
    tx_bytes_per_s: float | None = None
    rx_bytes_per_s: float | None = None


def link_bytes_per_s(gen: int, lanes: int) -> float:
    """One direction of a PCIe link (``pcie_budget.GB_PER_S_PER_LANE``; a newer gen than the table
    knows counts as the newest it knows)."""
    per_lane = GB_PER_S_PER_LANE.get(gen, GB_PER_S_PER_LANE[max(GB_PER_S_PER_LANE)])
    return per_lane * lanes * 1e9


def pcie_utilisation(profile: NodeProfile, skus: Mapping[str, Sku], samples: Iterable[PcieSample]) -> float | None:
    """A node's PCIe utilisation in one telemetry sample: the busiest GPU's (tx + rx) over its link's
    bandwidth in one direction, capped at 1. Both directions count against one direction's bandwidth
    on purpose: a cold load is one-way traffic, and a link moving 70% of a direction's bandwidth in
    any mix of directions is what the brief's 0.7 is about. The link is the SKU's (``pcie_gen`` x
    ``pcie_lanes``), else what the device reported. None when no GPU of the sample can be figured
    (no traffic reported, or no link known)."""
    by_index = {a.index: a for a in profile.accelerators}
    busiest: float | None = None
    for sample in samples:
        if sample.tx_bytes_per_s is None and sample.rx_bytes_per_s is None:
            continue
        acc = by_index.get(sample.index)
        if acc is None:
            continue
        sku = skus.get(acc.sku)
        gen = (sku.pcie_gen if sku else None) or acc.pcie_gen_max
        lanes = (sku.pcie_lanes if sku else None) or acc.pcie_width_max or 16
        if not gen:
            continue
        traffic = max(0.0, sample.tx_bytes_per_s or 0.0) + max(0.0, sample.rx_bytes_per_s or 0.0)
        utilisation = min(1.0, traffic / link_bytes_per_s(gen, lanes))
        busiest = utilisation if busiest is None else max(busiest, utilisation)
    return busiest


class PcieWindow:
    """Each node's PCIe utilisation as placement judges it: the *lowest* sample over the last
    ``window_s`` seconds (by the samples' own times), so a node reads over 0.7 only when it stayed
    over 0.7 for the whole window, and one quiet sample clears it. A node is absent (unknown, taken as
    idle) until its samples cover a whole window: the newest sample at or before ``now - window_s``
    counts as the value at the window's start. ``window_s`` 0: the latest sample. A sample older than
    the node's latest is ignored (a replayed one)."""

    def __init__(self, window_s: float = DEFAULT_PCIE_WINDOW_S) -> None:
        self.window_s = max(0.0, window_s)
        self.util: dict[str, float] = {}
        self._samples: dict[str, deque[tuple[float, float]]] = {}

    def observe(self, node: str, at: datetime, utilisation: float) -> bool:
        """Fold one sample in; True when the node's figure changed."""
        t = at.timestamp()
        samples = self._samples.setdefault(node, deque())
        if samples and t <= samples[-1][0]:
            return False
        samples.append((t, utilisation))
        start = t - self.window_s
        while len(samples) >= 2 and samples[1][0] <= start:
            samples.popleft()
        before = self.util.get(node)
        if samples[0][0] <= start:
            self.util[node] = min(u for _t, u in samples)
        else:
            self.util.pop(node, None)
        return self.util.get(node) != before

    def forget(self, node: str) -> bool:
        self._samples.pop(node, None)
        return self.util.pop(node, None) is not None

    def copy(self) -> PcieWindow:
        return copy.deepcopy(self)


# -- the ledger's figures -------------------------------------------------------------------------


class LedgerMirror:
    """Reserved bytes per accelerator as the ledger's events tell them, each (allocation, accelerator)
    counted once, with who holds each accelerator (for ``shared``) and the cross-domain traffic per
    cluster of the allocations counted. Mutable for speed (one event touches a few accelerators of
    thousands); every method returns the accelerator ids it changed."""

    def __init__(
        self,
        accelerators: Iterable[AcceleratorCapacity] = (),
        *,
        cross_domain_used: Mapping[str, float] | None = None,
        crossing: Mapping[str, Crossing] | None = None,
    ) -> None:
        """Seeded from ``ledger.snapshot``: its accelerators, its cross-domain totals per cluster and the
        allocations behind them (``crossing``: allocation id -> (cluster, bytes/s))."""
        self.node: dict[str, str] = {}
        self.usable: dict[str, int] = {}
        self.available: dict[str, bool] = {}
        self.reserved: dict[str, int] = {}
        self._holders: dict[str, set[str]] = {}
        self._shared: set[str] = set()  # allocations held as `shared`
        self._shared_seed: set[str] = set()  # accelerators the snapshot called shared without naming holders
        # Traffic across NVLink domains per cluster (the snapshot's totals, then the events'), and the
        # allocations counted in it since.
        self.cross_domain: dict[str, float] = {c: float(b) for c, b in (cross_domain_used or {}).items() if b}
        self._crossing: dict[str, Crossing] = dict(crossing or {})
        self.cross_domain_version = 0
        for acc in accelerators:
            self._describe(acc)
            self.reserved[acc.id] = acc.reserved
            if acc.allocations:
                self._holders[acc.id] = set(acc.allocations)
            if acc.shared:
                self._shared.update(acc.allocations)
                self._shared_seed.add(acc.id)

    def _describe(self, acc: AcceleratorCapacity) -> None:
        self.node[acc.id] = acc.node
        self.usable[acc.id] = acc.usable
        self.available[acc.id] = acc.available

    def known(self, accelerator_id: str) -> bool:
        return accelerator_id in self.usable

    def move(
        self, allocation_id: str, delta: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> set[str]:
        """Apply an allocation event's signed bytes per accelerator (``ledger.replay.allocation_delta``):
        a positive figure is counted unless that (allocation, accelerator) already is; a negative one
        is given back only where it was counted. ``shared`` and ``crossing`` (the event's sharing and
        cross-domain traffic) are counted with the bytes, so once as well: a commit adds its traffic
        to its cluster when it adds bytes; an end gives back the traffic counted for the allocation
        (at the seed or by its commit), whatever the end event says."""
        changed: set[str] = set()
        added = ended = False
        for acc, nbytes in delta.items():
            holders = self._holders.get(acc)
            held = holders is not None and allocation_id in holders
            if (nbytes > 0) == held or not nbytes:
                continue  # counted already, or never counted
            if nbytes > 0:
                self._holders.setdefault(acc, set()).add(allocation_id)
                added = True
            else:
                assert holders is not None
                holders.discard(allocation_id)
                if not holders:
                    del self._holders[acc]
                ended = True
            self.reserved[acc] = max(0, self.reserved.get(acc, 0) + nbytes)
            if not self.reserved[acc]:
                self._shared_seed.discard(acc)
            changed.add(acc)
        if added:
            if shared:
                self._shared.add(allocation_id)
            if crossing is not None and crossing[1] > 0 and allocation_id not in self._crossing:
                self._crossing[allocation_id] = crossing
                self._cross(crossing[0], crossing[1])
        if ended:  # an allocation ends whole (release or expiry)
            self._shared.discard(allocation_id)
            # Only what was counted is given back: the snapshot's allocations (``crossing`` at the seed)
            # and the commits counted since; an allocation the snapshot no longer held changes nothing.
            counted = self._crossing.pop(allocation_id, None)
            if counted is not None:
                self._cross(counted[0], -counted[1])
        return changed

    def _cross(self, cluster: str, nbytes: float) -> None:
        total = self.cross_domain.get(cluster, 0.0) + nbytes
        if total > 0:
            self.cross_domain[cluster] = total
        else:
            self.cross_domain.pop(cluster, None)
        self.cross_domain_version += 1

    def holds(self, allocation_id: str) -> bool:
        """Some accelerator still counts bytes of this allocation (O(accelerators held); for rare checks)."""
        return any(allocation_id in holders for holders in self._holders.values())

    def is_shared(self, accelerator_id: str) -> bool:
        """Something is reserved on it and every holder is a `shared` replica."""
        holders = self._holders.get(accelerator_id)
        if holders:
            return all(holder in self._shared for holder in holders)
        return accelerator_id in self._shared_seed and self.reserved.get(accelerator_id, 0) > 0

    def capacity(self, accelerators: Iterable[AcceleratorCapacity]) -> set[str]:
        """Accelerators registered, resized, lost or recovered. Reserved bytes stay as the allocations
        say; only an accelerator never seen takes the reported figure."""
        changed: set[str] = set()
        for acc in accelerators:
            if acc.id not in self.reserved:
                self.reserved[acc.id] = acc.reserved
                if acc.shared:
                    self._shared_seed.add(acc.id)
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
    shared: bool = False
    crossing: Crossing | None = None


class FleetView:
    """The topology and the ledger as placement follows them, and the snapshot decisions read.

    The snapshot is derived lazily: a change to the ledger's figures updates only the accelerators,
    racks and pods it touched (the placement index follows incrementally); a topology change rebuilds
    it. A node appears in the snapshot while it is up and the ledger knows every one of its GPUs; a TPU
    pod once the ledger knows all its chips. PCIe utilisation (``gpu_telemetry``) and cross-domain
    traffic travel with the snapshot as they change.
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
        pcie_window_s: float = DEFAULT_PCIE_WINDOW_S,
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
        self._extra_exclusive: dict[str, int] = {}  # exclusive assumptions per accelerator
        self._extra_cross: dict[str, float] = {}  # assumed cross-domain bytes/s per cluster
        self.pcie = PcieWindow(pcie_window_s)
        self._pcie_dirty = False
        self._cross_dirty = False
        self._cross_version = self.ledger.cross_domain_version
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
        self._pcie_dirty |= self.pcie.forget(name)

    # -- telemetry ---------------------------------------------------------------------------

    def gpu_telemetry(self, node: str, at: datetime, samples: Iterable[PcieSample]) -> None:
        """One GPU telemetry sample of ``node`` taken at ``at``: its PCIe utilisation enters the window
        (``PcieWindow``). A node without a profile yet, or a sample without PCIe figures, is ignored."""
        profile = self.profiles.get(node)
        if profile is None:
            return
        utilisation = pcie_utilisation(profile, self.skus, samples)
        if utilisation is not None:
            self._pcie_dirty |= self.pcie.observe(node, at, utilisation)

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

    def allocation_moved(
        self,
        allocation_id: str,
        *,
        key: AssumeKey,
        delta: Mapping[str, int],
        shared: bool = False,
        crossing: Crossing | None = None,
    ) -> None:
        """An allocation event's signed bytes per accelerator (``ledger.replay.allocation_delta``), with
        its sharing and cross-domain traffic; a commit that a decision of ours assumed ends that
        assumption."""
        if any(nbytes > 0 for nbytes in delta.values()):
            for token in list(self._by_key.get(key, ())):
                self.forget(token)
        self._touch(self.ledger.move(allocation_id, delta, shared=shared, crossing=crossing))

    def capacity_changed(self, accelerators: Iterable[AcceleratorCapacity]) -> None:
        changed = self.ledger.capacity(accelerators)
        if any(acc not in self._gpu_rack and acc not in self._chip_pod for acc in changed):
            self._snapshot = None  # an accelerator the snapshot lacks: a node or pod may now be complete
        self._touch(changed)

    def _touch(self, accelerators: set[str]) -> None:
        self._touched |= accelerators

    # -- the decisions' own optimism ---------------------------------------------------------

    def assume(
        self, key: AssumeKey, held: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> int:
        """Count ``held`` bytes per accelerator now (held ``shared`` or exclusively, with ``crossing``
        traffic across NVLink domains), before the ledger answers the commit for ``key``; returns the
        assumption's token for ``confirm`` / ``forget``."""
        self._tokens += 1
        self._hold(self._tokens, _Assumed(key, dict(held), shared, crossing if crossing and crossing[1] > 0 else None))
        return self._tokens

    def _hold(self, token: int, assumed: _Assumed) -> None:
        self._assumed[token] = assumed
        self._by_key.setdefault(assumed.key, set()).add(token)
        for acc, total in assumed.held.items():
            self._extra[acc] = self._extra.get(acc, 0) + total
            if not assumed.shared:
                self._extra_exclusive[acc] = self._extra_exclusive.get(acc, 0) + 1
        if assumed.crossing is not None:
            cluster, nbytes = assumed.crossing
            self._extra_cross[cluster] = self._extra_cross.get(cluster, 0.0) + nbytes
            self._cross_dirty = True
        self._touch(set(assumed.held))

    def confirm(self, token: int, allocation_id: str) -> None:
        """The ledger committed the assumption as ``allocation_id``: its bytes become the allocation's
        (unless the allocation's event came first, which already did that)."""
        assumed = self._assumed.get(token)
        if assumed is None:
            return
        self.forget(token)
        self._touch(self.ledger.move(allocation_id, assumed.held, shared=assumed.shared, crossing=assumed.crossing))

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
            if not assumed.shared:
                exclusive = self._extra_exclusive.get(acc, 0) - 1
                if exclusive > 0:
                    self._extra_exclusive[acc] = exclusive
                else:
                    self._extra_exclusive.pop(acc, None)
        if assumed.crossing is not None:
            cluster, nbytes = assumed.crossing
            rest = self._extra_cross.get(cluster, 0.0) - nbytes
            if rest > 0:
                self._extra_cross[cluster] = rest
            else:
                self._extra_cross.pop(cluster, None)
            self._cross_dirty = True
        self._touch(set(assumed.held))

    def adopt(self, other: FleetView) -> None:
        """Carry ``other``'s open assumptions over, tokens kept (a fresh view replacing it while commits
        are in flight), and its PCIe windows (telemetry replayed into this view adds only newer samples)."""
        for token, assumed in other._assumed.items():
            self._hold(token, assumed)
        self._tokens = max(self._tokens, other._tokens)
        window_s = self.pcie.window_s
        self.pcie = other.pcie.copy()
        self.pcie.window_s = window_s
        self._pcie_dirty = True

    @property
    def assumed(self) -> int:
        """Decisions sent to the ledger whose outcome this view does not know yet."""
        return len(self._assumed)

    # -- the snapshot --------------------------------------------------------------------------

    @property
    def snapshot(self) -> FleetSnapshot:
        """The fleet as the next decision sees it (a new object whenever something changed)."""
        if self.ledger.cross_domain_version != self._cross_version:
            self._cross_version = self.ledger.cross_domain_version
            self._cross_dirty = True
        if self._snapshot is None:
            self._snapshot = self._build()
            self._touched.clear()
        elif self._touched or self._pcie_dirty or self._cross_dirty:
            self._snapshot = self._update(self._snapshot, self._touched)
            self._touched = set()
        self._pcie_dirty = self._cross_dirty = False
        return self._snapshot

    def _reserved(self, acc: str) -> int:
        return self.ledger.reserved.get(acc, 0) + self._extra.get(acc, 0)

    def _shared(self, acc: str) -> bool:
        """Held, and only by `shared` replicas (the ledger's holders and the assumptions alike)."""
        booked = self.ledger.reserved.get(acc, 0)
        if booked + self._extra.get(acc, 0) <= 0 or self._extra_exclusive.get(acc):
            return False
        return booked <= 0 or self.ledger.is_shared(acc)

    def cross_domain_used(self) -> dict[str, float]:
        """Cross-domain TP traffic per cluster: the ledger's allocations plus the assumed commits."""
        used = dict(self.ledger.cross_domain)
        for cluster, nbytes in self._extra_cross.items():
            used[cluster] = used.get(cluster, 0.0) + nbytes
        return used

    def _capacity(self, acc: str, node: str, index: int, sku: str) -> AcceleratorCapacity:
        return AcceleratorCapacity(
            id=acc,
            node=node,
            index=index,
            sku=sku,
            usable=self.ledger.usable[acc],
            reserved=self._reserved(acc),
            available=self.ledger.available[acc],
            shared=self._shared(acc),
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
            pcie_util=dict(self.pcie.util),
            cross_domain_used=self.cross_domain_used(),
            known_regions=frozenset(p.region for p in self.profiles.values()) | {p.region for p in self.pods.values()},
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
        pcie = dict(self.pcie.util) if self._pcie_dirty else None
        cross = self.cross_domain_used() if self._cross_dirty else None
        if pcie == before.pcie_util:
            pcie = None
        if cross == before.cross_domain_used:
            cross = None
        if not accelerators and not changed_pods and pcie is None and cross is None:
            return before
        return before.evolve(
            capacity=capacity,
            rack_power_used_w=power,
            tpu_pods=pods,
            changed=(frozenset(accelerators), frozenset(racks), frozenset(changed_pods)),
            pcie_util=pcie,
            cross_domain_used=cross,
        )

    # -- what the view believes, to compare with the ledger ------------------------------------

    def ledger_balances(self) -> dict[str, tuple[int, int, bool]]:
        """(usable, reserved, available) per accelerator as the ledger's events told it (assumptions
        not counted): once the events are all applied, equal to ``ledger.snapshot``."""
        return self.ledger.balances()
