"""Model groups: one name for several catalog models that answer the same API.

A request names a catalog model or a group; admission then chooses among the replicas of every member.
The document (``shared/catalog/model_groups.yaml``) is parsed here, purely; reading it is the caller's job::

    groups:
      chat-long:
        description: "..."          # optional
        models: [llama3.1-8b, jamba-v0.1, mamba2-2.7b]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.domain.hardware import CatalogError
from shared.domain.models import ModelSpec
from shared.domain.names import ECHO, unknown_name

_FIELDS = frozenset({"models", "description"})


def _group(name: Any, entry: Any, models: Mapping[str, ModelSpec]) -> tuple[str, ...]:
    where = f"groups.{name}"
    if not isinstance(name, str) or not name:
        raise CatalogError(f"groups.{name!r}: expected a non-empty name")
    if name in models:
        # A request's name must mean one thing: a model or a group, never both.
        raise CatalogError(f"{where}: the name of a catalog model; a group needs a name of its own")
    if not isinstance(entry, Mapping):
        raise CatalogError(f"{where}: expected a mapping with `models`")
    for key in entry:
        if key not in _FIELDS:
            raise CatalogError(f"{where}.{key}: unknown field")
    if not isinstance(entry.get("description", ""), str):
        raise CatalogError(f"{where}.description: expected a string")
    names = entry.get("models")
    if not isinstance(names, list | tuple) or not names or not all(isinstance(m, str) for m in names):
        raise CatalogError(f"{where}.models: expected a non-empty list of catalog model names, got {names!r}")
    unknown = [m for m in names if m not in models]
    if unknown:
        raise CatalogError(f"{where}.models: unknown model {', '.join(unknown)}")
    if len(set(names)) != len(names):
        duplicates = sorted({m for m in names if names.count(m) > 1})
        raise CatalogError(f"{where}.models: listed twice: {', '.join(duplicates)}")
    return tuple(names)


def parse_model_groups(doc: Any, models: Mapping[str, ModelSpec]) -> dict[str, tuple[str, ...]]:
    """Groups from a document (``{"groups": {NAME: {"models": [...]}}}``), members in the order written.

    Raises CatalogError naming the field: not a mapping, an unknown field, an empty group, a member that
    is not in ``models``, a member listed twice, or a group named like a catalog model.
    """
    if not isinstance(doc, Mapping):
        raise CatalogError("model groups: expected a mapping at the top level")
    entries = doc.get("groups")
    if not isinstance(entries, Mapping):
        raise CatalogError("model groups: expected a mapping under `groups`")
    return {name: _group(name, entry, models) for name, entry in entries.items()}


def members(
    name: str, groups: Mapping[str, tuple[str, ...]], models: Mapping[str, ModelSpec]
) -> tuple[str, ...] | None:
    """The catalog models a request for ``name`` may go to: a group's members, ``(name,)`` for a catalog
    model, None for a name that is neither."""
    if name in groups:
        return groups[name]
    if name in models:
        return (name,)
    return None


def unknown_model(name: str, groups: Mapping[str, tuple[str, ...]], models: Mapping[str, ModelSpec]) -> str:
    """The refusal of a name that is neither a catalog model nor a group: the known ones, closest first."""
    return unknown_name("model", name, [*models, *groups], prefix=f"no model or model group {name[:ECHO]!r}")
