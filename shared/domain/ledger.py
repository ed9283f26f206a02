"""The HBM ledger's pure rules: does a commit fit the view, replay of ledger events, drift.

The database enforces the invariant (a trigger keeps per-accelerator reserved bytes and refuses a
commit that would exceed usable HBM); these functions decide *before* writing, explain refusals and
rebuild totals from the event stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any


@dataclass(frozen=True, slots=True)
class ShareRequest:
    """Bytes one allocation asks for on one accelerator."""

    accelerator_id: str
    weights: int = 0
    kv: int = 0
    activation: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.activation + self.workspace


@dataclass(frozen=True, slots=True)
class AcceleratorState:
    id: str
    usable: int
    reserved: int
    available: bool = True

    @property
    def free(self) -> int:
        return max(0, self.usable - self.reserved)


class Refusal(StrEnum):
    UNKNOWN = "unknown_accelerator"
    UNAVAILABLE = "unavailable"
    SHORT = "hbm_short"
    DUPLICATE = "duplicate_accelerator"


@dataclass(frozen=True, slots=True)
class ShareRefusal:
    accelerator_id: str
    reason: Refusal
    short_bytes: int = 0


@dataclass(frozen=True, slots=True)
class FitResult:
    refusals: tuple[ShareRefusal, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.refusals

    def describe(self) -> str:
        parts = []
        for r in self.refusals:
            if r.reason is Refusal.SHORT:
                parts.append(f"{r.accelerator_id}: HBM short by {r.short_bytes / 1e9:.2f} GB")
            else:
                parts.append(f"{r.accelerator_id}: {r.reason.value.replace('_', ' ')}")
        return "; ".join(parts)


def check_fit(view: Mapping[str, AcceleratorState], shares: Sequence[ShareRequest]) -> FitResult:
    """Whether every share fits its accelerator in ``view`` (all-or-nothing: any refusal refuses all)."""
    refusals: list[ShareRefusal] = []
    seen: set[str] = set()
    for share in shares:
        if share.accelerator_id in seen:
            refusals.append(ShareRefusal(share.accelerator_id, Refusal.DUPLICATE))
            continue
        seen.add(share.accelerator_id)
        state = view.get(share.accelerator_id)
        if state is None:
            refusals.append(ShareRefusal(share.accelerator_id, Refusal.UNKNOWN))
        elif not state.available:
            refusals.append(ShareRefusal(share.accelerator_id, Refusal.UNAVAILABLE))
        elif share.total > state.free:
            refusals.append(ShareRefusal(share.accelerator_id, Refusal.SHORT, share.total - state.free))
    return FitResult(tuple(refusals))


def apply_shares(
    view: Mapping[str, AcceleratorState], shares: Iterable[ShareRequest], *, sign: int = 1
) -> dict[str, AcceleratorState]:
    """The view after reserving (sign=1) or returning (sign=-1) the shares."""
    out = dict(view)
    for share in shares:
        state = out[share.accelerator_id]
        out[share.accelerator_id] = replace(state, reserved=state.reserved + sign * share.total)
    return out


# -- replay -----------------------------------------------------------------------------------

COMMITTED = "allocation_committed"
RELEASED = "allocation_released"
EXPIRED = "allocation_expired"


def replay_reserved(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Per-accelerator reserved bytes rebuilt from LEDGER envelopes in stream order.

    ``allocation_committed`` adds its shares; ``allocation_released`` / ``allocation_expired`` remove
    the shares of that allocation (once, whatever redeliveries happen). Request allocations live inside
    their replica's KV pool and carry no accelerator bytes of their own.
    """
    live: dict[str, dict[str, int]] = {}
    reserved: dict[str, int] = {}
    for event in events:
        kind = str(event.get("type", "")).rsplit(".", 1)[-1]
        payload = event.get("payload") or {}
        allocation = str(payload.get("allocation_id"))
        if kind == COMMITTED:
            if allocation in live or not payload.get("counts_against_hbm", True):
                continue
            shares = {str(s["accelerator_id"]): int(s["total"]) for s in payload.get("shares", [])}
            live[allocation] = shares
            for acc, total in shares.items():
                reserved[acc] = reserved.get(acc, 0) + total
        elif kind in (RELEASED, EXPIRED):
            for acc, total in live.pop(allocation, {}).items():
                reserved[acc] -= total
    return {acc: total for acc, total in reserved.items() if total}


# -- drift --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Drift:
    accelerator_id: str
    observed_bytes: int
    reserved_bytes: int
    usable_bytes: int

    @property
    def difference(self) -> int:
        return self.observed_bytes - self.reserved_bytes


@dataclass
class DriftDetector:
    """Observed HBM use vs the ledger: a difference over ``threshold`` x usable HBM in ``consecutive``
    samples in a row is drift. Reported once per episode; a sample back inside the band ends it."""

    threshold: float = 0.10
    consecutive: int = 2
    _streak: dict[str, int] = field(default_factory=dict)

    def observe(
        self, *, accelerator_id: str, observed_bytes: int, reserved_bytes: int, usable_bytes: int
    ) -> Drift | None:
        if abs(observed_bytes - reserved_bytes) > self.threshold * usable_bytes:
            streak = self._streak.get(accelerator_id, 0) + 1
            self._streak[accelerator_id] = streak
            if streak == self.consecutive:
                return Drift(accelerator_id, observed_bytes, reserved_bytes, usable_bytes)
            return None
        self._streak.pop(accelerator_id, None)
        return None
