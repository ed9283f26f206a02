"""Ledger contracts: `hetsched.ledger.snapshot` (API.md) and the internal commit/release/renew API
(docs/LEDGER.md), plus the payloads of the LEDGER stream's events."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from shared.contracts.base import (
    ID_MAX,
    MAX_LEASE_S,
    NAME_MAX,
    Contract,
    ErrorBody,
    ErrorCode,
    Int,
    Rejected,
    Request,
    deprecated,
    echo,
    rejected,
    unit_names,
)


class LedgerEventName(StrEnum):
    """Event names of the LEDGER stream (subject `<prefix>.events.ledger.<name>`)."""

    ALLOCATION_COMMITTED = "allocation_committed"
    ALLOCATION_RELEASED = "allocation_released"
    ALLOCATION_EXPIRED = "allocation_expired"
    ALLOCATIONS_FLAGGED = "allocations_flagged"
    CAPACITY_CHANGED = "capacity_changed"
    DRIFT_DETECTED = "drift_detected"


ALLOCATION_COMMITTED = LedgerEventName.ALLOCATION_COMMITTED
ALLOCATION_RELEASED = LedgerEventName.ALLOCATION_RELEASED
ALLOCATION_EXPIRED = LedgerEventName.ALLOCATION_EXPIRED
ALLOCATIONS_FLAGGED = LedgerEventName.ALLOCATIONS_FLAGGED
CAPACITY_CHANGED = LedgerEventName.CAPACITY_CHANGED
DRIFT_DETECTED = LedgerEventName.DRIFT_DETECTED

RECORD_MAX_BYTES = 32_768
"""The largest `CommitRequest.record` (compact JSON) the ledger keeps with an allocation."""

LedgerEvent = LedgerEventName  # deprecated alias (issue 24): use LedgerEventName (for one release)


def as_utc(value: datetime | None) -> datetime | None:
    """A time without a zone is read as UTC (comparing it with an aware one would fail)."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


class SnapshotRequest(Request):
    """`{}` for everything; large fleets come in pages (`cursor` / `limit`, as `fleet.get`)."""

    node: str | None = Field(
        default=None, max_length=NAME_MAX, description="Only this node's accelerators.", examples=[None]
    )
    cursor: str | None = Field(
        default=None, max_length=ID_MAX, description="`next_cursor` of the previous page.", examples=[None]
    )
    limit: Int | None = Field(default=None, gt=0, le=20_000, description="Most accelerators per page.", examples=[2048])


class AcceleratorLedgerView(Contract):
    id: str = Field(description="Accelerator id.", examples=["dgx-h100-01/gpu0"])
    node: str = Field(description="Node.", examples=["dgx-h100-01"])
    hbm_usable_bytes: Int = Field(
        description="Usable HBM bytes (total x ceiling)." + deprecated("hbm_usable"), examples=[79_027_398_246]
    )
    hbm_reserved_bytes: Int = Field(description="Reserved bytes." + deprecated("hbm_reserved"), examples=[0])
    available: bool = Field(default=True, description="False while its node is lost.", examples=[True])
    allocations: list[str] = Field(default_factory=list, description="Allocation ids.", examples=[["a-1"]])
    shared: bool = Field(
        default=False,
        description="True when the replica allocations holding it are all `shared` (another shared replica may "
        "join; an exclusive group may not). False when idle or held by an exclusive replica.",
        examples=[False],
    )

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return unit_names(data, (("hbm_usable", "hbm_usable_bytes"), ("hbm_reserved", "hbm_reserved_bytes")))


class CrossDomainAllocation(Contract):
    """An active replica allocation whose TP traffic crosses NVLink domains."""

    allocation_id: str = Field(description="Allocation.", examples=["al-..."])
    cluster: str | None = Field(
        description="Cluster of its accelerators (null when the ledger does not know it).", examples=["c1"]
    )
    bytes_per_s: Int = Field(description="Its cross-domain traffic, bytes/s.", examples=[40_000_000_000])


class SnapshotReply(Contract):
    status: str = Field(default="ok", description="`ok`.", examples=["ok"])
    accelerators: list[AcceleratorLedgerView] = Field(default_factory=list, description="Per accelerator.")
    next_cursor: str | None = Field(default=None, description="Set when more accelerators follow.", examples=[None])
    cross_domain_used: dict[str, Int] = Field(
        default_factory=dict,
        description="Per cluster: bytes/s of TP traffic across NVLink domains, summed over the active replica "
        "allocations (the whole fleet, whatever `node` or page; as when this page was read).",
        examples=[{"c1": 40_000_000_000}],
    )
    cross_domain: list[CrossDomainAllocation] = Field(
        default_factory=list,
        description="The active allocations behind `cross_domain_used`, one each (the whole fleet, every page): "
        "a reader that follows the events counts each allocation once.",
    )


SHARE_BYTE_FIELDS = (
    ("weights", "weights_bytes"),
    ("kv", "kv_bytes"),
    ("activation", "activation_bytes"),
    ("workspace", "workspace_bytes"),
)
"""The byte figures of a share: (deprecated unit-less name, name)."""


class ShareIn(Contract):
    """Bytes asked for on one accelerator."""

    accelerator_id: str = Field(
        min_length=1, max_length=ID_MAX, description="Accelerator id.", examples=["dgx-h100-01/gpu0"]
    )
    weights_bytes: Int = Field(
        default=0, ge=0, description="Weight bytes." + deprecated("weights"), examples=[17_641_000_000]
    )
    kv_bytes: Int = Field(default=0, ge=0, description="KV cache bytes." + deprecated("kv"), examples=[10_737_418_240])
    activation_bytes: Int = Field(
        default=0, ge=0, description="Activation peak bytes." + deprecated("activation"), examples=[1_000_000_000]
    )
    workspace_bytes: Int = Field(
        default=0, ge=0, description="Workspace reserve bytes." + deprecated("workspace"), examples=[1_073_741_824]
    )

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return unit_names(data, SHARE_BYTE_FIELDS)

    @model_validator(mode="after")
    def _something(self) -> ShareIn:
        if self.weights_bytes + self.kv_bytes + self.activation_bytes + self.workspace_bytes <= 0:
            raise ValueError("a share must reserve some bytes")
        return self


class CommitRequest(Request):
    """Reserve HBM on one or more accelerators, all or nothing."""

    request_id: str = Field(
        min_length=1, max_length=NAME_MAX, description="Idempotency key (per tenant).", examples=["r-1"]
    )
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Owner.", examples=["acme"])
    kind: Literal["replica", "request"] = Field(
        default="replica",
        description="What is held: `replica`, the only kind the ledger accepts. `request` is refused as "
        "`invalid_request`: admissions are counted by placement in memory (`placement.admit`), and the ledger holds "
        "replicas only.",
        examples=["replica"],
    )
    parent_id: str | None = Field(
        default=None,
        max_length=ID_MAX,
        description="Unused: it named the replica of a `request` allocation, a kind now refused. A `replica` has none.",
        examples=[None],
    )
    sharing: Literal["exclusive", "shared"] = Field(
        default="exclusive",
        description="For `replica`: `exclusive` takes only accelerators no replica holds; `shared` may join "
        "accelerators held by `shared` replicas only. Refused as `no_capacity` (or `conflict` on a stale "
        "`expected`) otherwise.",
        examples=["exclusive"],
    )
    cross_domain_bytes_per_s: Int = Field(
        default=0,
        ge=0,
        description="For `replica`: bytes/s of its TP traffic that crosses NVLink domains, charged to the cluster "
        "of its accelerators while it is active.",
        examples=[0],
    )
    preemptible: bool = Field(default=False, description="May be preempted.", examples=[False])
    priority: Int = Field(default=0, ge=-1000, le=1000, description="Higher wins under contention.", examples=[0])
    lease_s: Int | None = Field(default=None, gt=0, le=MAX_LEASE_S, description="Lease from now.", examples=[300])
    lease_expires_at: datetime | None = Field(
        default=None,
        description="Absolute lease end (UTC; a time without zone is read as UTC); in the future, at most 30 days "
        "away.",
        examples=[None],
    )
    shares: list[ShareIn] = Field(min_length=1, max_length=512, description="Bytes per accelerator.")
    expected: dict[Annotated[str, StringConstraints(max_length=ID_MAX)], Int] | None = Field(
        default=None,
        max_length=512,
        description="The reserved bytes per accelerator the caller decided on; a commit that no longer fits "
        "because they changed is a `conflict` (retry with the fresh view in `error.details`).",
        examples=[{"dgx-h100-01/gpu0": 0}],
    )
    body_hash: str | None = Field(
        default=None,
        max_length=128,
        description="The caller's hash of the request this commit serves. A repeat of the `request_id` with the same "
        "`body_hash` is answered with the first allocation (`duplicate`) whatever shares it asks for (the caller "
        "decided again); with another `body_hash` it is refused `conflict`. Without one, a repeat must ask for the "
        "same shares.",
        examples=["9f2c..."],
    )
    record: dict[str, Any] | None = Field(
        default=None,
        max_length=64,
        description="What the caller decided, kept with the allocation: carried by `allocation_committed` and "
        f"returned by a repeat of this commit (`CommitReply.record`). A JSON object of at most 64 keys and "
        f"{RECORD_MAX_BYTES} bytes. "
        "Placement keeps its request and reply here, so this commit is the placement's only durable step.",
        examples=[None],
    )

    @field_validator("lease_expires_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return as_utc(value)

    @field_validator("record")
    @classmethod
    def _small(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and len(json.dumps(value, separators=(",", ":"))) > RECORD_MAX_BYTES:
            raise ValueError(f"record is larger than {RECORD_MAX_BYTES} bytes")
        return value

    @model_validator(mode="after")
    def _no_parent(self) -> CommitRequest:
        # A `request` (refused by the ledger, whatever its fields) is answered with why, not with a field error.
        if self.kind == "replica" and self.parent_id:
            raise ValueError("a `replica` allocation has no parent")
        return self


class AcceleratorBalance(Contract):
    id: str = Field(description="Accelerator id.", examples=["dgx-h100-01/gpu0"])
    usable_bytes: Int = Field(description="Usable bytes." + deprecated("usable"), examples=[79_027_398_246])
    reserved_bytes: Int = Field(description="Reserved bytes." + deprecated("reserved"), examples=[30_000_000_000])
    available: bool = Field(description="Node up.", examples=[True])

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return unit_names(data, (("usable", "usable_bytes"), ("reserved", "reserved_bytes")))


class CommitReply(Contract):
    # "rejected": only in `ledger.commit_batch` results; `ledger.commit` refuses with `Rejected` (the
    # variant there is deprecated, accepted for one release).
    status: Literal["committed", "rejected"] = Field(description="Outcome.", examples=["committed"])
    request_id: str | None = Field(default=None, description="Echo.", examples=["r-1"])
    allocation_id: str | None = Field(default=None, description="The allocation.", examples=["al-..."])
    duplicate: bool = Field(default=False, description="True when this request id was committed before.")
    lease_expires_at: datetime | None = Field(default=None, description="Lease end (UTC).")
    view: list[AcceleratorBalance] = Field(default_factory=list, description="The accelerators after the commit.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")
    record: dict[str, Any] | None = Field(
        default=None, description="A `duplicate`'s: the `record` its first commit kept (null when it kept none)."
    )


class CommitBatchRequest(Request):
    """Several independent commits in one database transaction (each still all-or-nothing)."""

    commits: list[CommitRequest] = Field(min_length=1, max_length=1000, description="The commits.")


class CommitBatchReply(Contract):
    status: str = Field(default="ok", description="`ok` (see each result).", examples=["ok"])
    results: list[CommitReply] = Field(description="One per commit, in order.")


class LedgerReleaseRequest(Request):
    allocation_id: str = Field(min_length=1, max_length=ID_MAX, description="Allocation.", examples=["al-..."])
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Owner.", examples=["acme"])


class LedgerReleaseReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["released", "rejected"] = Field(description="Outcome.", examples=["released"])
    already: bool = Field(default=False, description="It had been released or had expired before.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


def no_allocation(allocation_id: str) -> Rejected:
    """The answer to a release or renewal naming an allocation the tenant does not hold: one code and one
    message whether it does not exist or is another tenant's, so an id tells no one whether it exists."""
    return rejected(ErrorCode.NOT_FOUND, f"no allocation {echo(allocation_id)} for this tenant")


class LedgerPreemptRequest(Request):
    """The reservation filler, for an owner taking its capacity back: end a preemptible allocation at
    ``deadline_at`` (at once when it has passed). Only a preemptible allocation may be preempted; a
    deadline after its lease changes nothing; a repeat is harmless."""

    allocation_id: str = Field(min_length=1, max_length=ID_MAX, description="Allocation.", examples=["al-..."])
    deadline_at: datetime = Field(description="End it then at the latest (UTC).")
    reservation_id: str | None = Field(
        default=None, max_length=ID_MAX, description="For the record: whose reservation.", examples=["res-1"]
    )

    @field_validator("deadline_at")
    @classmethod
    def _aware(cls, value: datetime) -> datetime:
        return as_utc(value) or value


class LedgerPreemptReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["ended", "scheduled", "rejected"] = Field(
        description="`ended` (freed now), `scheduled` (its lease now ends at `lease_expires_at`).", examples=["ended"]
    )
    already: bool = Field(default=False, description="It had ended before.")
    lease_expires_at: datetime | None = Field(default=None, description="When it ends, if scheduled.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class LedgerRenewRequest(Request):
    allocation_id: str = Field(min_length=1, max_length=ID_MAX, description="Allocation.", examples=["al-..."])
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Owner.", examples=["acme"])
    lease_s: Int | None = Field(default=None, gt=0, le=MAX_LEASE_S, description="New lease from now.", examples=[300])
    lease_expires_at: datetime | None = Field(
        default=None, description="New absolute lease end (UTC): in the future, at most 30 days away."
    )

    @field_validator("lease_expires_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return as_utc(value)

    @model_validator(mode="after")
    def _one(self) -> LedgerRenewRequest:
        if (self.lease_s is None) == (self.lease_expires_at is None):
            raise ValueError("give exactly one of `lease_s` and `lease_expires_at`")
        return self


class LedgerRenewReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["renewed", "rejected"] = Field(description="Outcome.", examples=["renewed"])
    lease_expires_at: datetime | None = Field(default=None, description="New lease end (UTC).")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


# -- event payloads --------------------------------------------------------------------------


class ShareOut(Contract):
    accelerator_id: str = Field(description="Accelerator id.", examples=["dgx-h100-01/gpu0"])
    weights_bytes: Int = Field(description="Weight bytes." + deprecated("weights"), examples=[0])
    kv_bytes: Int = Field(description="KV bytes." + deprecated("kv"), examples=[0])
    activation_bytes: Int = Field(description="Activation bytes." + deprecated("activation"), examples=[0])
    workspace_bytes: Int = Field(description="Workspace bytes." + deprecated("workspace"), examples=[0])
    total_bytes: Int = Field(description="Their sum." + deprecated("total"), examples=[0])

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return unit_names(data, (*SHARE_BYTE_FIELDS, ("total", "total_bytes")))


class AllocationEvent(Contract):
    """Payload of `allocation_committed`, `allocation_released` and `allocation_expired`."""

    allocation_id: str = Field(description="Allocation.", examples=["al-..."])
    request_id: str = Field(description="Its request id.", examples=["r-1"])
    tenant: str = Field(description="Owner.", examples=["acme"])
    kind: str = Field(
        description="`replica`; `request` only for allocations written before the ledger held replicas only "
        "(admissions are counted by placement in memory).",
        examples=["replica"],
    )
    parent_id: str | None = Field(default=None, description="Replica of a (retired) request allocation.")
    preemptible: bool = Field(default=False, description="Preemptible.")
    priority: Int = Field(default=0, description="Priority.")
    lease_expires_at: datetime | None = Field(default=None, description="Lease end.")
    counts_against_hbm: bool = Field(
        default=True, description="False for `request` allocations (they live in their replica's KV pool)."
    )
    shares: list[ShareOut] = Field(description="Bytes per accelerator.")
    sharing: str = Field(default="exclusive", description="`exclusive` or `shared` (see the commit).")
    cross_domain_bytes_per_s: Int = Field(
        default=0,
        description="Its TP traffic across NVLink domains (bytes/s): added to `cluster`'s use by "
        "`allocation_committed`, taken back by `allocation_released` / `allocation_expired`.",
        examples=[0],
    )
    cluster: str | None = Field(
        default=None, description="Cluster of its accelerators (null when unknown, e.g. a TPU pod).", examples=["c1"]
    )
    record: dict[str, Any] | None = Field(
        default=None,
        description="`allocation_committed`: the caller's record kept with the commit (`CommitRequest.record`; "
        "placement's request and reply); null otherwise.",
    )


class CapacityChangedEvent(Contract):
    node: str = Field(description="Node.", examples=["dgx-h100-01"])
    reason: str = Field(description="`profiled`, `lost`, `recovered`, `removed`.", examples=["lost"])
    accelerators: list[AcceleratorBalance] = Field(description="Their state now.")


class AllocationsFlaggedEvent(Contract):
    node: str = Field(description="Node whose accelerators became unavailable.", examples=["dgx-h100-01"])
    reason: str = Field(description="Why.", examples=["node_lost"])
    allocation_ids: list[str] = Field(description="Active allocations on them.", examples=[["al-..."]])


class DriftEvent(Contract):
    accelerator_id: str = Field(description="Accelerator.", examples=["dgx-h100-01/gpu0"])
    observed_bytes: Int = Field(description="HBM in use per telemetry.", examples=[40_000_000_000])
    reserved_bytes: Int = Field(description="HBM reserved per the ledger.", examples=[20_000_000_000])
    usable_bytes: Int = Field(description="Usable HBM.", examples=[79_027_398_246])
    difference_bytes: Int = Field(description="observed - reserved.", examples=[20_000_000_000])
