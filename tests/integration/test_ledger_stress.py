"""The ledger under 8 concurrent clients x 1,000 commit/release operations on 64 accelerators, over the
real bus, with the invariant checked throughout and the ledger killed with SIGKILL mid-run.

HETSCHED_STRESS_OPS shrinks the run (operations per client) on a slow machine; the default is the
issue's 1,000."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.bench.ledger_harness import LedgerHarness
from tests.bench.ledger_stress import stress
from tests.servers import RealServers

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_stress_with_a_sigkill_loses_nothing_and_never_overcommits(servers: RealServers, tmp_path: Path) -> None:
    ops = int(os.environ.get("HETSCHED_STRESS_OPS", "1000"))
    async with LedgerHarness(servers, tmp_path) as h:
        result = await stress(h, clients=8, ops=ops, kill=True)
    print("\n" + result.report())
    assert result.ops == 8 * ops
    assert result.kills == 1
    assert result.checks > 0 and result.violations == 0
    assert result.commits_acked > 0 and result.releases_acked > 0
    # verify(): DB active set == acknowledged live set; every acknowledged allocation present; exactly one
    # committed / released event per allocation in JetStream; no duplicate event ids; replay == tables.
    assert result.problems == []
