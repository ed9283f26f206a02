"""A name nobody knows (a model, a SKU, a region): the refusal says which names are known, closest first,
so the caller can fix the request from the message alone."""

from __future__ import annotations

from collections.abc import Iterable
from difflib import SequenceMatcher

ECHO = 80  # characters of the caller's name repeated in a message
LISTED = 30  # names listed before "and N more"
CLOSE = 0.6  # difflib's similarity ratio from which a name counts as close (its own default cutoff)


def _closeness(given: str, name: str) -> tuple[int, float]:
    """How close ``name`` is to ``given`` (case-insensitive), smaller first: names it begins (``H200`` ->
    ``H200-SXM-141GB``), then names holding it, then names difflib finds similar (``llama3-7b`` ->
    ``llama3-70b``), by similarity; tier 3: not close."""
    wanted, candidate = given.lower(), name.lower()
    ratio = SequenceMatcher(None, wanted, candidate).ratio()
    if not wanted:
        return 3, -ratio
    if candidate.startswith(wanted):
        return 0, -ratio
    if wanted in candidate:
        return 1, -ratio
    return (2 if ratio >= CLOSE else 3), -ratio


def closest_first(given: str, names: Iterable[str]) -> tuple[list[str], list[str]]:
    """The names close to ``given``, closest first, and the others, sorted."""
    scored = sorted((_closeness(given, name), name) for name in set(names))
    close = [name for (tier, _ratio), name in scored if tier < 3]
    return close, sorted(name for (tier, _ratio), name in scored if tier == 3)


def unknown_name(kind: str, given: str, names: Iterable[str], *, prefix: str | None = None) -> str:
    """``unknown model 'llama3-70' (did you mean 'llama3-70b'?); known: llama3-70b, llama3.1-70b, ...``:
    the names closest to ``given`` first, at most ``LISTED`` of them. ``prefix`` replaces
    ``unknown <kind> '<given>'``; with no known name at all, the message says so."""
    head = prefix if prefix is not None else f"unknown {kind} {given[:ECHO]!r}"
    close, rest = closest_first(given, names)
    ordered = close + rest
    if not ordered:
        return f"{head}; no {kind} is known yet"
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    listed = ", ".join(ordered[:LISTED])
    more = f" and {len(ordered) - LISTED} more" if len(ordered) > LISTED else ""
    return f"{head}{hint}; known: {listed}{more}"
