"""Imports every table module so that ``SQLModel.metadata`` is complete (for Alembic and tests)."""

from __future__ import annotations


def register_models() -> None:
    from shared.infra import tables

    tables.register_all()
