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


def stream_name(context: Context, *, stream_prefix: str = "") -> str:
    """Stream for a context: the context in upper case (``LEDGER``), after an optional prefix."""
    return f"{stream_prefix}{context.value.upper()}"


def stream_specs(
    *,
    subjects: Subjects,
    stream_prefix: str = "",
    duplicate_window_s: float = 120.0,
    telemetry_max_age_s: float = 3600.0,
) -> tuple[StreamSpec, ...]:
    """Every stream of the system: one per context, file storage, a duplicate window.

    TELEMETRY is limits-based with a short max age: samples are only useful while fresh.
    """
    specs = []
    for context in Context:
        specs.append(
            StreamSpec(
                name=stream_name(context, stream_prefix=stream_prefix),
                subjects=(subjects.events_of(context),),
                duplicate_window_s=duplicate_window_s,
                max_age_s=telemetry_max_age_s if context is Context.TELEMETRY else None,
            )
        )
    return tuple(specs)
