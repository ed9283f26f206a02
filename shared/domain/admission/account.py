"""One replica's in-flight requests, as admission counts them in memory (no IO; time is ``now_ms``).

A replica's KV pool is reserved with the replica; which request uses which part of it is the engine's
business. Admission only needs a good, fast estimate of how full the pool is:

    estimate = the engine's last reported KV use + the KV of the grants made since that report

A grant made before the report arrived is assumed to be reflected in it (the engine had the request when
it reported); a released or expired grant drops out at once. Before any report the estimate is the grants
alone. A grant that would take the estimate past the pool is refused. The estimate can be short by the
grants the engine had not yet counted when it reported, so admission never over-subscribes the pool by
more than one report interval's worth of grants.

After a restart an account starts empty and fills from the engine's next report.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class InFlight:
    """One admitted request: ``nbytes`` of KV on the replica for ``tenant``, granted at ``granted_at_ms``,
    dropped at ``expires_at_ms`` unless released or renewed first."""

    admission_id: str
    tenant: str
    request_id: str
    nbytes: int
    granted_at_ms: float
    expires_at_ms: float


@dataclass(frozen=True, slots=True)
class EngineReport:
    """The engine's own figures at ``at_ms``: KV bytes in use (scaled to the replica's pool) and its queue."""

    kv_used_bytes: int
    queue_depth: int
    at_ms: float


@dataclass
class ReplicaAccount:
    """The in-flight grants of one replica with ``pool_bytes`` of KV, reconciled with its engine's reports.

    ``grants`` and ``unreported`` are read-only to callers (the methods keep the unreported bytes as a
    running total, so a grant's check costs the same whatever the replica holds); a new account may be
    given them, and ``unreported`` is then cut to the ids ``grants`` holds."""

    pool_bytes: int
    grants: dict[str, InFlight] = field(default_factory=dict)
    last_report: EngineReport | None = None
    unreported: set[str] = field(default_factory=set)  # admission ids granted since the last report
    _unreported_bytes: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.pool_bytes < 0:
            raise ValueError(f"pool_bytes: expected >= 0, got {self.pool_bytes}")
        self.unreported = {a for a in self.unreported if a in self.grants}
        self._unreported_bytes = sum(self.grants[a].nbytes for a in self.unreported)

    @property
    def reported_bytes(self) -> int:
        return 0 if self.last_report is None else self.last_report.kv_used_bytes

    @property
    def unreported_bytes(self) -> int:
        """KV of the grants made since the last report (all of them before any report)."""
        return self._unreported_bytes

    @property
    def unreported_count(self) -> int:
        """Requests granted since the last report: they wait in the engine's queue too, until it reports."""
        return len(self.unreported)

    @property
    def estimate_bytes(self) -> int:
        return self.reported_bytes + self._unreported_bytes

    def fits(self, nbytes: int) -> bool:
        return self.estimate_bytes + nbytes <= self.pool_bytes

    def grant(self, grant: InFlight) -> bool:
        """Count ``grant`` when the estimate leaves room for it; False (nothing counted) when not. The same
        admission id twice counts once."""
        if grant.nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, got {grant.nbytes}")
        if grant.admission_id in self.grants:
            return True
        if not self.fits(grant.nbytes):
            return False
        self.grants[grant.admission_id] = grant
        self.unreported.add(grant.admission_id)
        self._unreported_bytes += grant.nbytes
        return True

    def release(self, admission_id: str) -> InFlight | None:
        """Drop a grant (idempotent): the grant, or None when it is not (or no longer) here."""
        grant = self.grants.pop(admission_id, None)
        if grant is not None and admission_id in self.unreported:
            self.unreported.discard(admission_id)
            self._unreported_bytes -= grant.nbytes
        return grant

    def renew(self, admission_id: str, expires_at_ms: float) -> InFlight | None:
        grant = self.grants.get(admission_id)
        if grant is None:
            return None
        renewed = InFlight(
            grant.admission_id, grant.tenant, grant.request_id, grant.nbytes, grant.granted_at_ms, expires_at_ms
        )
        self.grants[admission_id] = renewed
        return renewed

    def expire(self, now_ms: float) -> list[InFlight]:
        """Drop the grants whose lease ended (their requests ended without a release); those dropped."""
        gone = [g for g in self.grants.values() if g.expires_at_ms <= now_ms]
        for g in gone:
            self.release(g.admission_id)
        return gone

    def report(self, report: EngineReport) -> None:
        """The engine's figures: the grants made before it arrived count as part of its reported use from
        now on. A report older than the last one changes nothing."""
        if self.last_report is not None and report.at_ms < self.last_report.at_ms:
            return
        self.last_report = report
        self.unreported.clear()
        self._unreported_bytes = 0

    def holders(self, tenant: str) -> int:
        """How many of ``tenant``'s requests are in flight here."""
        return sum(1 for g in self.grants.values() if g.tenant == tenant)
