"""Node liveness from heartbeats: lost after N missed beats, recovered on the next beat.

Pure and clock-free: every call takes ``now_ms`` from the caller, so the rule is tested with a fake
clock in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Liveness(StrEnum):
    UP = "up"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class Transition:
    node: str
    to: Liveness
    silent_ms: float  # time since the last beat when the transition was decided


@dataclass
class LivenessTracker:
    """Tracks the nodes it is told to watch.

    A node is lost when ``now - last_beat > missed_beats x interval_ms``; a lost node that beats
    again is recovered. A node starts with a grace period: watching it counts as a beat.
    """

    interval_ms: float
    missed_beats: int = 3
    _last_beat_ms: dict[str, float] = field(default_factory=dict)
    _state: dict[str, Liveness] = field(default_factory=dict)

    @property
    def deadline_ms(self) -> float:
        return self.interval_ms * self.missed_beats

    def watch(self, node: str, *, now_ms: float, state: Liveness = Liveness.UP) -> None:
        self._last_beat_ms.setdefault(node, now_ms)
        self._state.setdefault(node, state)

    def forget(self, node: str) -> None:
        """Stop watching a node (it left the fleet): it is never declared lost again."""
        self._last_beat_ms.pop(node, None)
        self._state.pop(node, None)

    def revert(self, transition: Transition) -> None:
        """Undo a transition that could not be recorded, so that it is decided again: a lost node is
        found lost by the next ``evaluate``, a recovered one recovers on its next beat."""
        if transition.node in self._state:
            self._state[transition.node] = Liveness.LOST if transition.to is Liveness.UP else Liveness.UP

    def state(self, node: str) -> Liveness | None:
        return self._state.get(node)

    def counts(self) -> dict[Liveness, int]:
        """How many watched nodes are in each state (every state present, 0 when none is)."""
        out = dict.fromkeys(Liveness, 0)
        for state in self._state.values():
            out[state] += 1
        return out

    def beat(self, node: str, *, now_ms: float) -> Transition | None:
        """Record a heartbeat; returns the recovery when the node was lost."""
        previous = self._last_beat_ms.get(node, now_ms)
        self._last_beat_ms[node] = now_ms
        if self._state.get(node) is Liveness.LOST:
            self._state[node] = Liveness.UP
            return Transition(node=node, to=Liveness.UP, silent_ms=now_ms - previous)
        self._state.setdefault(node, Liveness.UP)
        return None

    def evaluate(self, *, now_ms: float) -> list[Transition]:
        """Nodes that just crossed the deadline, in name order."""
        lost = []
        for node in sorted(self._state):
            if self._state[node] is Liveness.UP:
                silent = now_ms - self._last_beat_ms[node]
                if silent > self.deadline_ms:
                    self._state[node] = Liveness.LOST
                    lost.append(Transition(node=node, to=Liveness.LOST, silent_ms=silent))
        return lost
