"""What the hot, cold and drift detectors read of a replica, and when they may read it at all.

A GPU's HBM use says little about an inference engine's load: vLLM and SGLang preallocate their KV cache
(``--gpu-memory-utilization`` / ``--mem-fraction-static`` set to the replica's ledger share), so a tightly
packed replica reads near full whatever it serves, and an engine still loading its weights reads near
empty. So:

- once a replica's engine reports itself (``engine_status``), its load is the engine's own figure
  (``load_figure``): the share of its KV cache in use, 1.0 while requests wait in its queue, 0 while it
  has nothing running and nothing queued; raw HBM is read only for replicas whose engine never reported;
- a replica is judged only once it serves (``judged``): where its node's agent reports the engines'
  lifecycle (``replica_state``), every rank ``ready`` and ``grace_s`` past the last state change; a
  replica on a node whose agent reports no lifecycle at all is judged as before, from its placement on;
- a copy made for a hot replica is not itself judged hot before it has carried load (``carried``).

Pure: the time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from shared.domain.rebalance.ready import EngineRanks

CARRIED_KV = 0.05
"""A copy has carried load once an engine report made after it became ready shows a request running or
waiting, or at least this share of its KV cache in use."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A replica's engine as it last reported itself, at ``at``: the share of its KV cache in use (None when
    it gave neither a share nor a capacity), requests waiting, requests running (None: not reported)."""

    kv: float | None
    queue_depth: int
    running: int | None
    at: datetime


def engine_load(
    *,
    kv_usage: float | None,
    kv_used_bytes: int,
    kv_total_bytes: int,
    queue_depth: int,
    running: int | None,
    at: datetime,
) -> EngineLoad:
    """An ``engine_status`` report as a load: the engine's own KV share, else used / total bytes."""
    kv = kv_usage
    if kv is None and kv_total_bytes > 0:
        kv = min(1.0, kv_used_bytes / kv_total_bytes)
    return EngineLoad(kv=kv, queue_depth=queue_depth, running=running, at=at)


def load_figure(load: EngineLoad) -> float:
    """The figure the hot (above 0.85) and cold (below 0.30) thresholds are held against: 1.0 while requests
    wait (the engine cannot take them: it is full), 0.0 while nothing runs and nothing waits (an idle
    engine is not loaded, whatever its cache still holds), else its KV share (0 when unknown)."""
    if load.queue_depth > 0:
        return 1.0
    if load.running == 0:
        return 0.0
    return load.kv if load.kv is not None else 0.0


def carried(load: EngineLoad, ranks: EngineRanks | None) -> bool:
    """Whether this report shows the replica carrying load: made while every rank is ready and after the
    last one became so (``ranks``; None: no lifecycle known, any report counts), with a request running or
    waiting, or ``CARRIED_KV`` of its KV cache in use."""
    if ranks is not None:
        changed = ranks.changed_at
        if not ranks.ready or (changed is not None and load.at < changed):
            return False
    busy = load.queue_depth > 0 or (load.running is not None and load.running > 0)
    return busy or (load.kv is not None and load.kv >= CARRIED_KV)


def judged(ranks: EngineRanks | None, *, agent_runs_engines: bool, now: datetime, grace_s: float) -> bool:
    """May the replica's load (and drift) be judged at ``now``? ``ranks``: its ranks' lifecycle as reported
    (None: none seen). ``agent_runs_engines``: an agent on its nodes reported some replica's lifecycle
    lately.

    With reports: only once every rank is ``ready`` and ``grace_s`` has passed since the last rank changed
    state (an engine just up still warms its caches; one that restarted reloads). No report of its own
    while its node's agent runs engines: not yet (the engine has not started). Neither: the fleet runs its
    engines by other means, judged as soon as it is placed."""
    if ranks is None:
        return not agent_runs_engines
    if not ranks.ready:
        return False
    changed = ranks.changed_at
    return changed is None or (now - changed).total_seconds() >= grace_s
