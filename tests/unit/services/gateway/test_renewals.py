"""A running request's admission is renewed every half lease until the request ends (``Renewals``)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.server import ROUTED_LEASE_S, Renewals


@pytest.mark.asyncio
async def test_renewed_on_a_timer_until_cancelled() -> None:
    calls: list[float] = []
    loop = asyncio.get_running_loop()
    renewals = Renewals(loop, 0.05, lambda: calls.append(loop.time()))
    await asyncio.sleep(0.18)
    renewals.cancel()
    seen = len(calls)
    assert seen >= 2
    await asyncio.sleep(0.12)
    assert len(calls) == seen  # none after the request ended


def test_the_routed_admission_lease_is_admissions_default() -> None:
    assert ROUTED_LEASE_S == 300
