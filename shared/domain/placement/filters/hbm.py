"""Filter ``hbm``: the host needs ``tp`` available GPUs whose free HBM (usable - reserved) holds the
per-GPU share. The reason carries the figure: how many bytes the ``tp``-th roomiest GPU misses by.

Which GPUs count depends on the request's ``sharing`` (``GpuLoad.room``): an exclusive TP group (the
default) takes idle GPUs only, so a GPU another replica holds is never shared with it; a ``shared``
(TP=1) replica may also join a GPU held by shared replicas only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Final, cast

from shared.domain.memory import MemoryShare
from shared.domain.placement.framework import (
    SUCCESS,
    Candidate,
    Code,
    CycleState,
    Scope,
    Status,
    no_config,
    sharing_of,
)
from shared.domain.placement.hosts import GpuHost, GpuLoad, Host, LoadClass

NAME: Final = "hbm"


def with_room(load: GpuLoad, need: int, sharing: str = "exclusive") -> list[int]:
    """Positions of the GPUs a replica of ``sharing`` may use with at least ``need`` bytes free."""
    free, _ = load.room(sharing)
    return [p for p, (f, up) in enumerate(zip(free, load.available, strict=True)) if up and f >= need]


class HbmFilter:
    name: Final = NAME
    scope: Final = Scope.PLACEMENT
    capacity: Final = True  # bulk outcome: a function of TP, the share's total, sharing and the classes

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        load = candidate.load
        if not isinstance(candidate.host, GpuHost) or not isinstance(load, GpuLoad) or candidate.share is None:
            return SUCCESS
        tp, need = candidate.tp, candidate.share.total
        _, free = load.room(sharing_of(state))
        if len(free) < tp:
            return Status(Code.TOO_FEW_ACCELERATORS, plugin=NAME, tp=tp, available=len(free))
        if free[tp - 1] >= need:  # the tp-th roomiest GPU has room, so tp GPUs do
            return SUCCESS
        return Status(Code.HBM_SHORT, plugin=NAME, tp=tp, hbm_short_bytes=need - free[tp - 1])

    def filter_bulk(
        self, state: CycleState, host: Host, tp: int, share: MemoryShare, classes: Sequence[LoadClass]
    ) -> tuple[list[LoadClass], list[tuple[Status, int]]]:
        if not isinstance(host, GpuHost):
            return list(classes), []
        need = share.total
        sharing = sharing_of(state)
        keep: list[LoadClass] = []
        # Rejections grouped as the rejection tally groups them (tenths of a GB): one status per group.
        groups: dict[int, list[int]] = {}
        for cls in classes:
            _, free = cast(GpuLoad, cls.load).room(sharing)  # a GPU host's loads are GpuLoads
            if len(free) < tp:
                key = -1 - len(free)
                short = len(free)
            elif free[tp - 1] >= need:
                keep.append(cls)
                continue
            else:
                short = need - free[tp - 1]
                key = (short + 50_000_000) // 100_000_000  # tenths_of_gb, inlined on this hot loop
            group = groups.get(key)
            if group is None:
                groups[key] = [len(cls.hosts), short]
            else:
                group[0] += len(cls.hosts)
        rejected = [
            (_short(tp, figure) if key >= 0 else _too_few(tp, figure), count) for key, (count, figure) in groups.items()
        ]
        return keep, rejected


@lru_cache(maxsize=4096)
def _short(tp: int, short_bytes: int) -> Status:
    # Statuses are immutable and a fleet's screens reject with the same few figures again and again.
    return Status(Code.HBM_SHORT, plugin=NAME, tp=tp, hbm_short_bytes=short_bytes)


@lru_cache(maxsize=256)
def _too_few(tp: int, available: int) -> Status:
    return Status(Code.TOO_FEW_ACCELERATORS, plugin=NAME, tp=tp, available=available)


def factory(config: Mapping[str, object] | None = None) -> HbmFilter:
    no_config(NAME, config)
    return HbmFilter()
