"""Who may hold a GPU together: exclusive TP groups and shared replicas, and the TP traffic that crosses
NVLink domains, per cluster.

A replica allocation is ``exclusive`` (the default: a TP group that owns its GPUs, since two groups on
one card compete for its compute and its NVLink bandwidth) or ``shared`` (a TP=1 replica that may sit
with other shared replicas). The rule, per accelerator of a replica commit:

* an idle accelerator (nothing reserved) takes either;
* one held by shared replicas only (``AcceleratorCapacity.shared``) takes another shared replica, bytes
  permitting, and no exclusive group;
* one held by an exclusive replica takes no other replica.

``request`` allocations (KV holds inside a replica's pool) are not replicas and are not subject to it.
Only replicas count on accelerators, so "held" is "reserved > 0". The ledger's store gathers the facts
(reserved bytes and whether every holder is shared) under the accelerators' row locks; the rule is
here. That a shared replica is TP=1 is placement's policy: the ledger guards co-residence only.

Cross-domain traffic: a replica whose TP group spans NVLink domains declares the bytes per second it
sends across them; the ledger keeps it with the allocation and the cluster of its accelerators, and the
per-cluster sum over active allocations is what placement's cross-domain budget is charged against.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from shared.domain.capacity import AcceleratorCapacity

Sharing = Literal["exclusive", "shared"]
EXCLUSIVE: Final = "exclusive"
SHARED: Final = "shared"
SHARING_MODES: Final = (EXCLUSIVE, SHARED)


@dataclass(frozen=True, slots=True)
class SharingRefusal:
    """An accelerator a replica may not join, and the sharing of what holds it."""

    accelerator_id: str
    holder: Sharing

    def describe(self, sharing: Sharing) -> str:
        if self.holder == SHARED:
            why = "held by another replica, a shared one (an exclusive group takes only idle GPUs)"
        elif sharing == SHARED:
            why = "held by another replica, an exclusive one (a shared replica joins only shared ones)"
        else:
            why = "held by another replica (exclusive groups don't share a GPU)"
        return f"{self.accelerator_id}: {why}"


def holder_of(capacity: AcceleratorCapacity) -> Sharing | None:
    """What holds an accelerator: None when idle, ``shared`` when every holder is shared, else exclusive."""
    if capacity.reserved <= 0:
        return None
    return SHARED if capacity.shared else EXCLUSIVE


def may_join(capacity: AcceleratorCapacity, sharing: Sharing) -> bool:
    """Whether a replica with ``sharing`` may hold bytes on this accelerator (bytes aside)."""
    holder = holder_of(capacity)
    return holder is None or (holder == SHARED and sharing == SHARED)


def check_sharing(
    view: Mapping[str, AcceleratorCapacity], accelerator_ids: Iterable[str], sharing: Sharing
) -> tuple[SharingRefusal, ...]:
    """The accelerators of a replica commit it may not join, in the commit's order (each once; unknown
    ones are left to the caller's "not found")."""
    refusals: list[SharingRefusal] = []
    seen: set[str] = set()
    for accelerator_id in accelerator_ids:
        capacity = view.get(accelerator_id)
        if accelerator_id in seen or capacity is None:
            continue
        seen.add(accelerator_id)
        holder = holder_of(capacity)
        if not may_join(capacity, sharing) and holder is not None:
            refusals.append(SharingRefusal(accelerator_id, holder))
    return tuple(refusals)


def describe_sharing(refusals: Sequence[SharingRefusal], sharing: Sharing) -> str:
    return "; ".join(r.describe(sharing) for r in refusals)


def held_by(
    view: Mapping[str, AcceleratorCapacity], accelerator_ids: Iterable[str], sharing: Sharing
) -> dict[str, AcceleratorCapacity]:
    """The view after a replica with ``sharing`` was accepted on these accelerators (its bytes already
    applied): they are shared exactly when it is (the rule let it in only where that stays true)."""
    out = dict(view)
    for accelerator_id in accelerator_ids:
        out[accelerator_id] = replace(out[accelerator_id], shared=sharing == SHARED)
    return out


def allocation_cluster(accelerator_ids: Iterable[str], clusters: Mapping[str, str | None]) -> str | None:
    """The cluster an allocation's cross-domain traffic is charged to: that of its first accelerator (TP
    rank 0, in the commit's order) whose cluster the ledger knows; None if it knows none (a TPU pod)."""
    for accelerator_id in accelerator_ids:
        cluster = clusters.get(accelerator_id)
        if cluster:
            return cluster
    return None


@dataclass(frozen=True, slots=True)
class CrossDomainUse:
    """An active replica allocation whose TP traffic crosses NVLink domains."""

    allocation_id: str
    cluster: str | None
    bytes_per_s: int


def cross_domain_used(uses: Iterable[CrossDomainUse]) -> dict[str, int]:
    """Bytes/s per cluster (allocations of an unknown cluster are not charged to any)."""
    used: dict[str, int] = {}
    for use in uses:
        if use.cluster is not None and use.bytes_per_s > 0:
            used[use.cluster] = used.get(use.cluster, 0) + use.bytes_per_s
    return used
