"""Builds a valid request body for any contract model from its fields' declared examples."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def example_body(model: type[BaseModel]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.examples:
            body[name] = info.examples[0]
    return body
