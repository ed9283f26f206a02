"""Builds a valid request body for any contract model from its fields' declared examples, and the same
body with a JSON ``true`` in each of its integer and number fields (issue 23 row 9)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel

_DEPTH = 4  # nested models followed this deep (no contract nests deeper)


def example_body(model: type[BaseModel]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.examples:
            body[name] = info.examples[0]
    return body


def boolean_bodies(model: type[BaseModel]) -> list[tuple[str, dict[str, Any]]]:
    """``(path, body)`` for every integer or number field of ``model``, its nested models' and its lists'
    and maps' items included: the example body with ``true`` at that path (``shares.0.kv_bytes``)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for value, path in _model_probes(model, _DEPTH):
        out.append((path, value))
    return out


def _model_probes(model: type[BaseModel], depth: int) -> list[tuple[dict[str, Any], str]]:
    if depth <= 0:
        return []
    base = example_body(model)
    probes: list[tuple[dict[str, Any], str]] = []
    for name, info in model.model_fields.items():
        for value, path in _probes(info.annotation, depth):
            probes.append(({**base, name: value}, f"{name}{path}"))
    return probes


def _probes(annotation: Any, depth: int) -> list[tuple[Any, str]]:
    """Values of ``annotation``'s type with ``true`` where a number goes, each with its path below it."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _probes(args[0], depth)
    if origin is typing.Union or origin is types.UnionType:
        return [probe for arg in args for probe in _probes(arg, depth)]
    if annotation is int or annotation is float:
        return [(True, "")]
    if origin in (list, tuple, set, frozenset) and args:
        return [([value], f".0{path}") for value, path in _probes(args[0], depth)]
    if origin is dict and len(args) == 2:
        return [({"k": value}, f".k{path}") for value, path in _probes(args[1], depth)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(value, f".{path}") for value, path in _model_probes(annotation, depth - 1)]
    return []
