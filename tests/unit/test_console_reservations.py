"""The console asks `reservation.status` of every tenant the report names, not only the first ones (a
reserved GPU of the 40th tenant must not show as free), and never more than a bounded number at once."""

from __future__ import annotations

import asyncio

from hetsched.console import state
from shared.contracts.reservation import ReservationReportReply, ReservationStatusReply, ReservationStatusRequest
from shared.contracts.subjects import Rpc
from tests.fakes import FakeRpc


async def test_every_tenant_of_the_report_is_asked_a_bounded_number_at_once() -> None:
    tenants = [f"tenant-{i:03d}" for i in range(state.TENANTS_IN_FLIGHT * 3 + 5)]
    running = peak = 0

    async def status(request: ReservationStatusRequest) -> ReservationStatusReply:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.001)
        running -= 1
        return ReservationStatusReply(fill_rate=0.5)

    class SlowRpc(FakeRpc):
        async def call(self, rpc: Rpc, request, **kwargs):  # type: ignore[no-untyped-def, override]
            if rpc is Rpc.RESERVATION_STATUS:
                self.sent.append((rpc, request))
                return await status(request)
            return await super().call(rpc, request, **kwargs)

    rpc = SlowRpc(reservation_report=[ReservationReportReply(by_tenant=dict.fromkeys(tenants, 0.5))])
    errors: dict[str, str] = {}
    report, statuses = await state.reservations_of(rpc, errors)
    assert report is not None and not errors
    assert sorted(r.tenant for r in rpc.requests(Rpc.RESERVATION_STATUS)) == tenants
    assert len(statuses) == len(tenants)
    assert 1 < peak <= state.TENANTS_IN_FLIGHT, peak
