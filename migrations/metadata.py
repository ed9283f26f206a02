"""Imports every service's table module so that ``SQLModel.metadata`` is complete (Alembic's env calls
this). The one place that sees every schema: migrations, not services."""

from __future__ import annotations


def register_all_tables() -> None:
    import services.capacity_ledger.tables
    import services.cross_region_router.tables
    import services.gateway.tables
    import services.placement.tables
    import services.rebalancer.tables
    import services.reservation_filler.tables
    import services.topology_discovery.tables  # noqa: F401
    from shared.infra import tables

    tables.register_all()
