"""JetStream stream definitions, as data. ``shared.infra.bus.ensure_streams`` creates them.

Every stream has a max age and a size cap (docs/RETENTION.md says which and why): the events of a context
live for ``DEFAULT_MAX_AGE_S`` unless a setting says otherwise, TELEMETRY for an hour, DEADLETTER for
``DEFAULT_DEADLETTER_MAX_AGE_S``, none past ``DEFAULT_MAX_BYTES``. Streams that a reader folds from their
first sequence at every start (``RESTATED``) outlive their max age through their owner, which publishes
the current state of every live entity again every ``restate_every_s(max age)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.contracts.subjects import Context, Subjects

DAY_S = 24 * 3600.0
DEFAULT_MAX_AGE_S = 7 * DAY_S
DEFAULT_TELEMETRY_MAX_AGE_S = 3600.0
DEFAULT_DEADLETTER_MAX_AGE_S = 14 * DAY_S
DEFAULT_MAX_BYTES = 1024**3  # per stream; JetStream reserves it against the server's store at creation

# Folded from their first sequence by placement at each start (its reservation book, throttled and
# draining replicas): their owners restate what is live so the fold survives the max age.
RESTATED: frozenset[Context] = frozenset({Context.RESERVATION, Context.REBALANCE})


def restate_every_s(max_age_s: float) -> float:
    """How often the owner of a ``RESTATED`` stream publishes its live state again: a quarter of the max
    age, so the latest statement of anything live is always well inside the stream."""
    return max_age_s / 4


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One stream: its name, the subjects it captures and its limits (``None``: no limit)."""

    name: str
    subjects: tuple[str, ...]
    duplicate_window_s: float
    max_age_s: float | None = None
    file_storage: bool = True
    replicas: int = 1
    max_bytes: int | None = None


DEADLETTER = "DEADLETTER"


def stream_name(context: Context, *, stream_prefix: str = "") -> str:
    """Stream for a context: the context in upper case (``LEDGER``), after an optional prefix."""
    return f"{stream_prefix}{context.value.upper()}"


def deadletter_stream_name(*, stream_prefix: str = "") -> str:
    """The stream holding events consumers gave up on (``DEADLETTER``), after an optional prefix."""
    return f"{stream_prefix}{DEADLETTER}"


def stream_specs(
    *,
    subjects: Subjects,
    stream_prefix: str = "",
    duplicate_window_s: float = 120.0,
    telemetry_max_age_s: float = DEFAULT_TELEMETRY_MAX_AGE_S,
    deadletter_max_age_s: float = DEFAULT_DEADLETTER_MAX_AGE_S,
    max_age_s: Mapping[Context, float] | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    replicas: int = 1,
) -> tuple[StreamSpec, ...]:
    """Every stream of the system: one per context, file storage, a duplicate window, and DEADLETTER.

    Each context's stream keeps its events for ``max_age_s[context]`` (``DEFAULT_MAX_AGE_S`` when not
    given); TELEMETRY for ``telemetry_max_age_s`` (samples are only useful while fresh); DEADLETTER for
    ``deadletter_max_age_s`` (long enough for an operator to inspect and replay what consumers gave up on).
    None holds more than ``max_bytes`` (the oldest go first; ``None``: no cap). The duplicate window is cut
    to the max age where that is shorter (JetStream refuses a longer one). ``replicas`` copies of each (3 on
    a JetStream cluster: an acknowledged event survives losing one server).
    """
    ages = dict(max_age_s or {})
    ages[Context.TELEMETRY] = telemetry_max_age_s
    specs = []
    for context in Context:
        age = ages.get(context, DEFAULT_MAX_AGE_S)
        specs.append(
            StreamSpec(
                name=stream_name(context, stream_prefix=stream_prefix),
                subjects=(subjects.events_of(context),),
                duplicate_window_s=min(duplicate_window_s, age),
                max_age_s=age,
                replicas=replicas,
                max_bytes=max_bytes,
            )
        )
    specs.append(
        StreamSpec(
            name=deadletter_stream_name(stream_prefix=stream_prefix),
            subjects=(subjects.deadletters(),),
            duplicate_window_s=min(duplicate_window_s, deadletter_max_age_s),
            max_age_s=deadletter_max_age_s,
            replicas=replicas,
            max_bytes=max_bytes,
        )
    )
    return tuple(specs)
