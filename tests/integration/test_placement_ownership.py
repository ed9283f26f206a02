"""No orphaned HBM, one outcome per request id (issue 10, rows 6, 10, 11, 12): placement on real NATS
and Postgres with topology and the ledger, killed between the ledger's commit and its decision row
(``HETSCHED_PLACEMENT_FAULT_AFTER_COMMIT=exit``: it exits the way a SIGKILL would, at exactly that
point), restarted and retried; an owner that never retries; identical requests at once; a reused id
with another body; the same id after its lease expired."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.jetstream import read_all
from tests.waiting import wait_for, wait_for_sync

pytestmark = pytest.mark.asyncio(loop_scope="session")

PLACEMENT = "po_placement"
PROBE = {"request_id": "po-probe", "tenant": "t", "model": "llama3-8b", "context_tokens": 4096, "backend": "gpu"}


async def call(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any], timeout: float = 15) -> dict[str, Any]:
    msg = await nc.request(Subjects(settings.kit.subject_prefix).rpc(rpc), json.dumps(body).encode(), timeout=timeout)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


def body(rid: str, **extra: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "tenant": "acme",
        "model": "llama3-8b",
        "dtype": "bf16",
        "context_tokens": 4096,
        "concurrency": 4,
        "backend": "gpu",
        **extra,
    }


class Stack:
    def __init__(self, nc: Client, settings: Settings, processes: ServiceProcesses) -> None:
        self.nc = nc
        self.settings = settings
        self.processes = processes

    async def place(self, rid: str, timeout: float = 15, **extra: Any) -> dict[str, Any]:
        return await call(self.nc, self.settings, Rpc.PLACEMENT_PLACE, body(rid, **extra), timeout=timeout)

    async def start_placement(self, **env: str) -> subprocess.Popen[bytes]:
        """A placement process (``env``: its HETSCHED_ settings), once it sees the fleet."""
        proc = self.processes.start("placement", name=PLACEMENT, **env)

        async def sees_the_fleet() -> bool:
            try:
                reply = await call(self.nc, self.settings, Rpc.PLACEMENT_EXPLAIN, PROBE, timeout=2)
            except (TimeoutError, nats.errors.NoRespondersError):
                return False
            return reply.get("status") == "placed"

        await wait_for(sees_the_fleet, 60, interval_s=0.2, what="placement sees the demo fleet")
        return proc

    def stop_placement(self) -> None:
        if PLACEMENT in self.processes.procs:
            self.processes.stop(PLACEMENT)

    async def ledger_events(self, name: str, request_id: str) -> list[dict[str, Any]]:
        """The LEDGER stream's ``name`` events of the ledger request id ``request_id``."""
        events = await read_all(
            self.nc.jetstream(),
            stream=stream_name(Context.LEDGER, stream_prefix=self.settings.kit.stream_prefix),
            subject=Subjects(self.settings.kit.subject_prefix).event(Context.LEDGER, name),
        )
        return [e for e in events if e.get("payload", {}).get("request_id") == request_id]

    async def active_allocations(self) -> set[str]:
        snapshot = await call(self.nc, self.settings, Rpc.LEDGER_SNAPSHOT, {})
        return {a for acc in snapshot["accelerators"] for a in acc["allocations"]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Stack]:
    await service_processes.start_demo_ledger(prefix="po_", sweep_ms=200)
    nc = await nats.connect(settings.kit.nats_url or "")
    yield Stack(nc, settings, service_processes)
    await nc.close()
    for name in (PLACEMENT, "po_ledger", "po_topology"):
        if name in service_processes.procs:
            service_processes.stop(name)


# Large enough that a second decision cannot land on the same GPUs (where the orphan's bytes are).
LARGE = {"model": "llama3-70b", "dtype": "fp8", "context_tokens": 8192, "concurrency": 16}


async def crash_after_commit(stack: Stack, rid: str, **env: str) -> str:
    """Place ``rid`` with a placement that exits right after the ledger's commit; the allocation id the
    ledger committed (that no decision row knows of)."""
    proc = await stack.start_placement(HETSCHED_PLACEMENT_FAULT_AFTER_COMMIT="exit", **env)
    with pytest.raises((TimeoutError, nats.errors.NoRespondersError)):
        await stack.place(rid, timeout=5, **LARGE)
    wait_for_sync(lambda: proc.poll() is not None, 30)
    stack.processes.procs.pop(PLACEMENT)
    committed = await wait_for(
        lambda: stack.ledger_events("allocation_committed", f"placement/{rid}"), 10, what="the ledger's commit"
    )
    assert len(committed) == 1, committed
    allocation_id: str = committed[0]["payload"]["allocation_id"]
    assert allocation_id in await stack.active_allocations()
    return allocation_id


# -- row 6: killed between the ledger's commit and the decision row -----------------------------------


async def test_a_retry_after_placement_died_mid_commit_answers_the_same_allocation(stack: Stack) -> None:
    # The dead process held the request id for one ledger round trip (HETSCHED_RPC_TIMEOUT_MS + 1 s).
    orphan = await crash_after_commit(stack, "po-kill-1", HETSCHED_RPC_TIMEOUT_MS="2000")
    await stack.start_placement(HETSCHED_RPC_TIMEOUT_MS="2000")
    try:
        reply = await stack.place("po-kill-1", **LARGE)
        assert reply["status"] == "placed" and reply["allocation_id"] == orphan, reply
        assert await stack.place("po-kill-1", **LARGE) == reply  # and the same answer again
        # One allocation for the request id: the retry reserved nothing more.
        assert len(await stack.ledger_events("allocation_committed", "placement/po-kill-1")) == 1
    finally:
        stack.stop_placement()


async def test_an_allocation_whose_owner_never_retries_ends_with_its_first_lease(stack: Stack) -> None:
    # The ledger's commit is the placement's only durable step, and it holds a short first lease: with no
    # retry, no renew and no engine report, the accelerators come back when it runs out.
    orphan = await crash_after_commit(
        stack, "po-orphan-1", HETSCHED_RPC_TIMEOUT_MS="2000", HETSCHED_PLACEMENT_FIRST_LEASE_S="12"
    )
    committed = await stack.ledger_events("allocation_committed", "placement/po-orphan-1")
    assert committed[0]["payload"]["record"]["lease_s"] == 3600  # what it asked for, kept with the commit
    expired = await wait_for(
        lambda: stack.ledger_events("allocation_expired", "placement/po-orphan-1"),
        30,
        what="the orphan's first lease ran out",
    )
    assert [e["payload"]["allocation_id"] for e in expired] == [orphan]
    assert orphan not in await stack.active_allocations()
    await stack.start_placement()
    try:
        # The owner that comes back too late gets a typed refusal, never the ended allocation.
        late = await stack.place("po-orphan-1", **LARGE)
        assert late["status"] == "rejected" and late["error"]["code"] == "conflict", late
    finally:
        stack.stop_placement()


async def test_killed_under_load_every_request_is_recovered_by_its_retry_or_freed(stack: Stack) -> None:
    """Placement SIGKILLed during 50 placements a second: a request retried with its id gets the one
    allocation the ledger holds for it (or a new one, if its commit never landed); one never retried leaves
    nothing held once its first lease ran out. No request id ever has two allocations."""
    # A first lease long enough for the retries to come after the restart, short enough to wait out.
    env = {"HETSCHED_PLACEMENT_FIRST_LEASE_S": "20", "HETSCHED_RPC_TIMEOUT_MS": "2000"}
    proc = await stack.start_placement(**env)
    ids = [f"po-load-{n}" for n in range(100)]
    answers: dict[str, dict[str, Any]] = {}

    async def one(rid: str) -> None:
        try:  # no queue: a request that does not fit is refused, never left queued for a later placement
            answers[rid] = await stack.place(rid, timeout=3, fallbacks=[])
        except (TimeoutError, nats.errors.NoRespondersError):
            pass

    tasks = []
    for n, rid in enumerate(ids):
        tasks.append(asyncio.create_task(one(rid)))
        if n == 40:
            proc.kill()  # SIGKILL, mid-stream
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    stack.processes.procs.pop(PLACEMENT)
    proc.wait()
    unanswered = [rid for rid in ids if answers.get(rid, {}).get("status") != "placed"]
    assert answers and unanswered, "the kill should have left some requests without an answer"
    retried, abandoned = unanswered[::2], unanswered[1::2]
    await stack.start_placement(**env)
    try:
        again = {rid: await stack.place(rid, fallbacks=[]) for rid in retried}
    finally:
        stack.stop_placement()
    events = {rid: await stack.ledger_events("allocation_committed", f"placement/{rid}") for rid in ids}
    for rid in ids:
        assert len(events[rid]) <= 1, (rid, events[rid])  # never two allocations for one request id
    for rid, reply in again.items():
        if events[rid] or reply["status"] == "placed":  # its commit landed before the kill, or on the retry
            assert reply["status"] == "placed", reply
            assert [e["payload"]["allocation_id"] for e in events[rid]] == [reply["allocation_id"]], (rid, reply)
        else:  # nothing was reserved for it and the demo fleet is full now: refused, holding nothing
            assert reply["status"] == "rejected", reply
    assert any(events[rid] for rid in retried), "no retried request had a commit to recover"
    for rid, reply in answers.items():
        if reply.get("status") == "placed":
            assert [e["payload"]["allocation_id"] for e in events[rid]] == [reply["allocation_id"]]
    # Nothing is held for the requests no one retried once their first lease has run out (20 s, swept).
    held_by_abandoned = {e["payload"]["allocation_id"] for rid in abandoned for e in events[rid]}

    async def freed() -> bool:
        return not held_by_abandoned & await stack.active_allocations()

    await wait_for(freed, 45, what="the abandoned requests' allocations ended with their first lease")
    # No one renews any of them: the whole run's replicas end with their first lease (the fleet is shared).
    mine = {e["payload"]["allocation_id"] for rid in ids for e in events[rid]}

    async def all_freed() -> bool:
        return not mine & await stack.active_allocations()

    await wait_for(all_freed, 45, what="every replica of the run ended with its first lease")


# -- rows 10, 11, 12: one request id, one outcome ----------------------------------------------------------


async def test_identical_concurrent_requests_get_identical_answers(stack: Stack) -> None:
    await stack.start_placement()
    try:
        for run in range(3):
            replies = await asyncio.gather(*(stack.place(f"po-same-{run}") for _ in range(4)))
            assert all(r["status"] == "placed" for r in replies), replies
            assert all(r == replies[0] for r in replies), replies
            assert len(await stack.ledger_events("allocation_committed", f"placement/po-same-{run}")) == 1
    finally:
        stack.stop_placement()


async def test_a_reused_id_with_another_body_is_a_conflict(stack: Stack) -> None:
    await stack.start_placement()
    try:
        first = await stack.place("po-body-1")
        assert first["status"] == "placed", first
        other = await stack.place("po-body-1", concurrency=8)
        assert other["status"] == "rejected" and other["error"]["code"] == "conflict", other
        assert await stack.place("po-body-1") == first  # the first body still gets its answer
    finally:
        stack.stop_placement()


async def test_the_same_id_after_its_lease_expired_is_not_the_expired_allocation(stack: Stack) -> None:
    await stack.start_placement()
    try:
        first = await stack.place("po-lease-1", lease_s=1)
        assert first["status"] == "placed", first
        expired = await wait_for(
            lambda: stack.ledger_events("allocation_expired", "placement/po-lease-1"), 30, what="the lease expired"
        )
        assert expired[0]["payload"]["allocation_id"] == first["allocation_id"]

        async def refused() -> dict[str, Any] | None:
            again = await stack.place("po-lease-1", lease_s=1)
            return again if again["status"] == "rejected" else None

        again = await wait_for(refused, 10, what="placement learnt of the expiry")
        assert again["error"]["code"] == "conflict" and "expired" in again["error"]["message"], again
    finally:
        stack.stop_placement()
