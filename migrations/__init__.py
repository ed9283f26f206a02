"""Alembic migrations for every service schema (shipped in the package so `hetsched up` can migrate)."""
