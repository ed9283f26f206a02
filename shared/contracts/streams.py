"""JetStream stream definitions, as data. ``shared.infra.bus.ensure_streams`` creates them."""

from __future__ import annotations

from dataclasses import dataclass

from shared.contracts.subjects import Context, Subjects


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One stream: its name, the subjects it captures and its limits."""

    name: str
    subjects: tuple[str, ...]
    duplicate_window_s: float
    max_age_s: float | None = None
    file_storage: bool = True
    replicas: int = 1


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
    telemetry_max_age_s: float = 3600.0,
    deadletter_max_age_s: float = 14 * 24 * 3600.0,
    replicas: int = 1,
) -> tuple[StreamSpec, ...]:
    """Every stream of the system: one per context, file storage, a duplicate window, and DEADLETTER.

    TELEMETRY is limits-based with a short max age: samples are only useful while fresh. DEADLETTER
    keeps what consumers gave up on long enough for an operator to inspect and replay it. ``replicas``
    copies of each (3 on a JetStream cluster: an acknowledged event survives losing one server).
    """
    specs = []
    for context in Context:
        specs.append(
            StreamSpec(
                name=stream_name(context, stream_prefix=stream_prefix),
                subjects=(subjects.events_of(context),),
                duplicate_window_s=duplicate_window_s,
                max_age_s=telemetry_max_age_s if context is Context.TELEMETRY else None,
                replicas=replicas,
            )
        )
    specs.append(
        StreamSpec(
            name=deadletter_stream_name(stream_prefix=stream_prefix),
            subjects=(subjects.deadletters(),),
            duplicate_window_s=duplicate_window_s,
            max_age_s=deadletter_max_age_s,
            replicas=replicas,
        )
    )
    return tuple(specs)
