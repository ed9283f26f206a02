"""Does a commit fit the accelerators it asks for? All or nothing, with a reason per accelerator."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.memory import MemoryShare

Shares = Sequence[tuple[str, MemoryShare]]
"""What one allocation holds: (accelerator id, bytes on it) pairs."""


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

    def describe(self) -> str:
        if self.reason is Refusal.SHORT:
            return f"{self.accelerator_id}: HBM short by {self.short_bytes / 1e9:.2f} GB"
        return f"{self.accelerator_id}: {self.reason.value.replace('_', ' ')}"


@dataclass(frozen=True, slots=True)
class FitResult:
    refusals: tuple[ShareRefusal, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.refusals

    def describe(self) -> str:
        return "; ".join(r.describe() for r in self.refusals)


def check_fit(view: Mapping[str, AcceleratorCapacity], shares: Shares) -> FitResult:
    """Whether every share fits its accelerator in ``view`` (all-or-nothing: any refusal refuses all).

    An unavailable accelerator is refused as ``unavailable`` before its bytes are looked at (its
    ``free`` is 0, which would otherwise read as "short")."""
    refusals: list[ShareRefusal] = []
    seen: set[str] = set()
    for accelerator_id, share in shares:
        if accelerator_id in seen:
            refusals.append(ShareRefusal(accelerator_id, Refusal.DUPLICATE))
            continue
        seen.add(accelerator_id)
        state = view.get(accelerator_id)
        if state is None:
            refusals.append(ShareRefusal(accelerator_id, Refusal.UNKNOWN))
        elif not state.available:
            refusals.append(ShareRefusal(accelerator_id, Refusal.UNAVAILABLE))
        elif share.total > state.free:
            refusals.append(ShareRefusal(accelerator_id, Refusal.SHORT, share.total - state.free))
    return FitResult(tuple(refusals))


def apply_shares(
    view: Mapping[str, AcceleratorCapacity], shares: Iterable[tuple[str, MemoryShare]], *, sign: int = 1
) -> dict[str, AcceleratorCapacity]:
    """The view after reserving (sign=1) or returning (sign=-1) the shares; an accelerator left with
    nothing reserved is idle, no longer ``shared``."""
    out = dict(view)
    for accelerator_id, share in shares:
        state = out[accelerator_id]
        reserved = state.reserved + sign * share.total
        out[accelerator_id] = replace(state, reserved=reserved, shared=state.shared and reserved > 0)
    return out
