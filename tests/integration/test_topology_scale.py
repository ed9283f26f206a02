"""A 1,024-node inventory: after a restart without the inventory, fleet.get answers from Postgres."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.fleet_get import measure
from tests.servers import ROLE_PASSWORD, RealServers

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_fleet_get_for_1024_nodes_after_restart_without_rescan(servers: RealServers, tmp_path: Path) -> None:
    from pydantic import SecretStr

    from shared.infra.migrate import upgrade

    name = f"hetsched_scale_{servers.run_id}"
    url = await servers.create_database(name)
    try:
        import asyncio

        await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
        figures = await measure(servers, url, nodes=1024, calls=5, workdir=tmp_path)
    finally:
        await servers.drop_database(name)
    print("\n" + figures.report())  # figures are reported, not asserted (see tests/bench)
    assert figures.nodes == 1024
    assert figures.accelerators > 5000
