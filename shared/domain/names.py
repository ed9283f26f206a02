"""A name nobody knows (a model, a SKU, a region): the refusal says which names are known, closest first,
so the caller can fix the request from the message alone."""

from __future__ import annotations

from collections.abc import Iterable
from difflib import get_close_matches

ECHO = 80  # characters of the caller's name repeated in a message
LISTED = 30  # names listed before "and N more"
CLOSE = 0.6  # difflib's similarity ratio from which a name is offered as "did you mean"


def closest_first(given: str, names: Iterable[str]) -> list[str]:
    """Every name in ``names``: those close to ``given`` (case-insensitive, closest first), then the rest
    in sorted order."""
    known = sorted(set(names))
    by_lower = {name.lower(): name for name in known}
    close = [by_lower[m] for m in get_close_matches(given.lower(), list(by_lower), n=len(known), cutoff=CLOSE)]
    return close + [name for name in known if name not in close]


def unknown_name(kind: str, given: str, names: Iterable[str], *, prefix: str | None = None) -> str:
    """``unknown model 'llama3-70' (did you mean 'llama3-70b'?); known: llama3-70b, llama3.1-70b, ...``:
    the names closest to ``given`` first, at most ``LISTED`` of them. ``prefix`` replaces
    ``unknown <kind> '<given>'``; with no known name at all, the message says so."""
    head = prefix if prefix is not None else f"unknown {kind} {given[:ECHO]!r}"
    ordered = closest_first(given, names)
    if not ordered:
        return f"{head}; no {kind} is known yet"
    close = get_close_matches(given.lower(), [n.lower() for n in ordered], n=1, cutoff=CLOSE)
    hint = f" (did you mean {ordered[0]!r}?)" if close else ""
    listed = ", ".join(ordered[:LISTED])
    more = f" and {len(ordered) - LISTED} more" if len(ordered) > LISTED else ""
    return f"{head}{hint}; known: {listed}{more}"
