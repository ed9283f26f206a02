"""The fault suite's stack and load driver.

``FaultStack``: topology-discovery, capacity-ledger and placement as real processes (each can be
SIGKILLed and started again) on a fresh database and their own subject/stream prefix, on any NATS URL
(one server, or a cluster's comma-separated nodes). ``LoadDriver``: placements at a fixed rate (open
loop: a slow reply does not slow the offered load), half of them released again so capacity lasts;
every request either answered or kept for a retry with the same id. ``check_*``: what must hold after
the fault, read with superuser SQL and from the LEDGER stream.

Placement runs with a short reconcile period, intent grace and first lease (``RECONCILE_PERIOD_S``,
``INTENT_GRACE_S``, ``FIRST_LEASE_S``), so ``check_no_unowned_allocations`` can wait for its reconciler and
for the first leases of placements no caller learnt of within a test."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
import yaml
from nats.aio.client import Client
from pydantic import SecretStr

from services.placement.mapping import LEDGER_REQUEST_PREFIX
from shared.contracts.streams import stream_name, stream_specs
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.domain.ledger import replay_reserved
from shared.infra import deadline
from shared.infra.bus import ensure_streams
from shared.infra.db import plain_url
from shared.infra.migrate import upgrade
from shared.infra.settings import nats_servers
from tests.bench.ledger_harness import INVARIANT_SQL, inventory
from tests.bench.ledger_stress import allocation_events
from tests.jetstream import read_all
from tests.servers import ROLE_PASSWORD, RealServers
from tests.waiting import wait_for

SERVICES = ("topology_discovery", "capacity_ledger", "placement")
GPUS_PER_NODE = 8
# Placement's reconciler, fast enough to watch in a test (defaults: every 30 s, a 300 s grace).
RECONCILE_PERIOD_S = 1.0
INTENT_GRACE_S = 3.0
# A new replica's first lease (default 60 s): one whose caller never learnt of it (answered `internal` or
# not at all, and not retried) ends this soon; the driver renews every replica it keeps at once.
FIRST_LEASE_S = 5
# How long after the load an allocation no placed reply owns may stay active: the grace, a few reconciler
# periods, and the durable LEDGER consumer's ack wait (30 s), after which a LEDGER event that a killed
# placement had taken but not acknowledged comes again (placement learns of the allocation only then).
UNOWNED_DEADLINE_S = 45.0
# How long the LEDGER stream may trail the ledger's tables when they are compared (an expiry's event on
# its way through the outbox).
REPLAY_SETTLE_S = 10.0


class FaultStack:
    def __init__(
        self,
        servers: RealServers,
        workdir: Path,
        *,
        nats_url: str | None = None,
        nodes: int = 16,
        replicas: int = 1,
        **env: str,
    ) -> None:
        self.servers = dataclasses.replace(servers, run_id=uuid.uuid4().hex[:10], started=[])
        if nats_url is not None:
            self.servers = dataclasses.replace(self.servers, nats_url=nats_url)
        self.workdir = workdir
        self.nodes = nodes
        self.replicas = replicas
        self.extra_env = {
            "HETSCHED_STREAM_REPLICAS": str(replicas),
            "HETSCHED_PLACEMENT_RECONCILE_PERIOD_S": str(RECONCILE_PERIOD_S),
            "HETSCHED_PLACEMENT_INTENT_GRACE_S": str(INTENT_GRACE_S),
            "HETSCHED_PLACEMENT_FIRST_LEASE_S": str(FIRST_LEASE_S),
            **env,
        }
        self.database = f"hetsched_faults_{self.servers.run_id}"
        self.database_url = ""
        self.subjects = Subjects(self.servers.subject_prefix)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.nc: Client | None = None

    # -- processes ---------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
        env.update(
            HETSCHED_NATS_URL=self.servers.nats_url,
            HETSCHED_DATABASE_URL=self.database_url,
            HETSCHED_DATABASE_ROLE_PASSWORD=ROLE_PASSWORD,
            HETSCHED_SUBJECT_PREFIX=self.servers.subject_prefix,
            HETSCHED_STREAM_PREFIX=self.servers.stream_prefix,
            HETSCHED_DATA_DIR=str(self.workdir),
            HETSCHED_TOPOLOGY_INVENTORY=str(self.workdir / "fleet.yaml"),
            HETSCHED_LOG_LEVEL="WARNING",
            HETSCHED_DB_POOL_SIZE="20",
            **self.extra_env,
        )
        return env

    def start(self, package: str, **env: str) -> subprocess.Popen[bytes]:
        """Start ``package`` (``env``: settings for this process only); a dead one it replaces is reaped."""
        if (old := self.procs.get(package)) is not None:
            assert old.poll() is not None, f"{package} is still running"
        log = open(self.workdir / f"{package}.log", "ab")
        self.procs[package] = subprocess.Popen(
            [sys.executable, "-m", f"services.{package}"], env=self.env() | env, stdout=log, stderr=subprocess.STDOUT
        )
        return self.procs[package]

    def kill(self, package: str) -> None:
        """SIGKILL: no shutdown hook runs; reaped."""
        proc = self.procs.pop(package)
        proc.kill()
        proc.wait(timeout=30)

    def log(self, package: str) -> str:
        return (self.workdir / f"{package}.log").read_text(errors="replace")

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> FaultStack:
        try:
            return await self._start()
        except BaseException:
            await self.__aexit__()
            raise

    async def _start(self) -> FaultStack:
        self.database_url = await self.servers.create_database(self.database)
        await asyncio.to_thread(upgrade, self.database_url, role_password=SecretStr(ROLE_PASSWORD))
        (self.workdir / "fleet.yaml").write_text(yaml.safe_dump(inventory(self.nodes)))
        self.nc = await nats.connect(
            nats_servers(self.servers.nats_url), max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        # Streams first, as an operator provisions a cluster: R3 streams take a raft election each, and
        # three services creating them at once on a busy machine time out their JetStream API calls.
        specs = stream_specs(subjects=self.subjects, stream_prefix=self.servers.stream_prefix, replicas=self.replicas)
        await ensure_streams(self.nc.jetstream(timeout=30), specs)
        for package in SERVICES:
            self.start(package)
        await self.wait_ready()
        return self

    async def wait_ready(self, deadline_s: float = 90) -> None:
        """The ledger knows the whole fleet and placement can place on it (an explain succeeds)."""
        want = self.nodes * GPUS_PER_NODE

        async def ledger_knows_the_fleet() -> bool:
            with contextlib.suppress(Exception):
                page = await self.call(Rpc.LEDGER_SNAPSHOT, {"limit": 20_000}, timeout=2)
                return len(page.get("accelerators", [])) >= want
            return False

        async def placement_sees_it() -> bool:
            with contextlib.suppress(Exception):
                reply = await self.call(Rpc.PLACEMENT_EXPLAIN, place_body("probe"), timeout=2)
                return bool(reply.get("status") == "placed")
            return False

        await wait_for(ledger_knows_the_fleet, deadline_s, interval_s=0.2, what="the ledger knows the fleet")
        await wait_for(placement_sees_it, deadline_s, interval_s=0.2, what="placement sees the fleet")

    async def wait_healthy(self, package: str, deadline_s: float = 60) -> None:
        health = {
            "capacity_ledger": Rpc.LEDGER_HEALTH,
            "placement": Rpc.PLACEMENT_HEALTH,
            "topology_discovery": Rpc.TOPOLOGY_HEALTH,
        }[package]

        async def ok() -> bool:
            with contextlib.suppress(Exception):
                return bool((await self.call(health, {}, timeout=1)).get("status") == "ok")
            return False

        await wait_for(ok, deadline_s, interval_s=0.1, what=f"{package} healthy")

    async def __aexit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
        if self.nc is not None:
            await self.nc.close()
        with contextlib.suppress(Exception):
            await self.servers.drop_database(self.database)
        with contextlib.suppress(Exception):
            await self.servers.delete_streams()

    # -- talking to it -----------------------------------------------------------------------
    async def call(self, rpc: Rpc, body: dict[str, Any], *, timeout: float = 5) -> dict[str, Any]:
        """One request with its deadline (``Hetsched-Deadline``) = when this caller stops waiting."""
        assert self.nc is not None
        headers = {deadline.HEADER: str(int(deadline.now_ms() + timeout * 1000))}
        msg = await self.nc.request(self.subjects.rpc(rpc), json.dumps(body).encode(), timeout=timeout, headers=headers)
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    async def db(self) -> asyncpg.Connection:
        return await asyncpg.connect(plain_url(self.database_url))

    async def ledger_events(self) -> list[dict[str, Any]]:
        """The LEDGER stream read back. After a NATS node is killed the cluster may still be electing
        leaders: a JetStream API call that times out is asked again (for up to a minute)."""
        assert self.nc is not None
        for attempt in range(12):
            try:
                return await read_all(
                    self.nc.jetstream(),
                    stream=stream_name(Context.LEDGER, stream_prefix=self.servers.stream_prefix),
                    subject=f"{self.servers.subject_prefix}.events.ledger.>",
                )
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
                if attempt == 11:
                    raise
                await asyncio.sleep(5)
        raise AssertionError("unreachable")


def place_body(request_id: str) -> dict[str, Any]:
    """A small replica (llama3-8b, one GPU): a 16-node fleet holds hundreds at once."""
    return {
        "request_id": request_id,
        "tenant": "faults",
        "model": "llama3-8b",
        "dtype": "fp8",
        "context_tokens": 4096,
        "concurrency": 4,
        "backend": "gpu",
        # Exact: the fault tests account for every reply's allocation; a queued request placed later
        # would be owned by placement but unknown to this client.
        "fallbacks": [],
    }


# -- load ------------------------------------------------------------------------------------
@dataclass
class LoadResult:
    offered: int = 0
    replies: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> its (last) reply
    unanswered: set[str] = field(default_factory=set)  # timed out / no responder: to retry by id
    left: set[str] = field(default_factory=set)  # unanswered, and its caller went away: never retried
    gave_up_at: dict[str, float] = field(default_factory=dict)  # request id -> epoch s its caller gave up
    retried: int = 0
    released: set[str] = field(default_factory=set)  # allocation ids whose release was acknowledged
    release_unknown: set[str] = field(default_factory=set)  # released, or not: a reply was lost
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def placed(self) -> dict[str, str]:
        """Request id -> allocation id, for every `placed` reply."""
        return {rid: r["allocation_id"] for rid, r in self.replies.items() if r.get("status") == "placed"}

    @property
    def refused_valid(self) -> dict[str, str]:
        """Request id -> code, for a valid request refused as malformed or failed (``invalid_request``,
        ``internal``): what a retry by id must never get (issue 10: the ledger's idempotency)."""
        return {
            rid: r["error"]["code"]
            for rid, r in self.replies.items()
            if r.get("status") == "rejected" and r["error"]["code"] in ("invalid_request", "internal")
        }

    def summary(self) -> str:
        codes = Counter(
            r.get("status") if r.get("status") != "rejected" else f"rejected:{r['error']['code']}"
            for r in self.replies.values()
        )
        return (
            f"offered {self.offered}, answered {len(self.replies)} ({dict(codes)}), "
            f"unanswered {len(self.unanswered)}, callers left {len(self.left)}, retried {self.retried}, "
            f"released {len(self.released)} (+{len(self.release_unknown)} unacknowledged), "
            f"refused as invalid {len(self.refused_valid)}, errors {dict(self.errors)}"
        )


class LoadDriver:
    """Placements at ``rate`` per second for ``duration_s``; each placed one released with probability
    ``release_share``. A request with no answer within ``timeout_s`` is kept for ``retry_unanswered``,
    unless it was sent while ``callers_leave`` was set: its caller went away for good (``result.left``)."""

    def __init__(
        self,
        stack: FaultStack,
        *,
        rate: float,
        duration_s: float,
        release_share: float = 0.5,
        timeout_s: float = 5.0,
        seed: int = 10,
    ) -> None:
        self.stack = stack
        self.rate = rate
        self.duration_s = duration_s
        self.release_share = release_share
        self.timeout_s = timeout_s
        self.random = random.Random(seed)
        self.result = LoadResult()
        self.prefix = uuid.uuid4().hex[:6]
        self.callers_leave = False

    async def _one(self, rid: str, *, release: bool, leave: bool = False) -> None:
        try:
            reply = await self.stack.call(Rpc.PLACEMENT_PLACE, place_body(rid), timeout=self.timeout_s)
        except Exception as exc:  # timeout, no responders, a connection being re-established
            self.result.errors[type(exc).__name__] += 1
            (self.result.left if leave else self.result.unanswered).add(rid)
            self.result.gave_up_at.setdefault(rid, time.time())
            return
        self.result.unanswered.discard(rid)
        self.result.replies[rid] = reply
        if not release and reply.get("status") == "placed":
            await self._confirm(reply["allocation_id"])
        if release and reply.get("status") == "placed":
            body = {"allocation_id": reply["allocation_id"], "tenant": "faults"}
            try:
                answer = await self.stack.call(Rpc.PLACEMENT_RELEASE, body, timeout=self.timeout_s)
            except Exception:  # no reply: it may or may not have been released
                self.result.release_unknown.add(reply["allocation_id"])
                return
            if answer.get("status") == "released":
                self.result.released.add(reply["allocation_id"])
                return
            code = str(answer.get("error", {}).get("code"))
            self.result.errors[f"release:{code}"] += 1
            if code == "internal":  # placement lost the ledger's reply: the ledger may have released it
                self.result.release_unknown.add(reply["allocation_id"])

    async def _confirm(self, allocation_id: str) -> None:
        """A kept replica's first renew, as a caller that uses its placement sends it: the lease it asked for
        instead of the short first lease (``FIRST_LEASE_S``). Unanswered or refused, its lease is unknown:
        it may end with its first lease (counted with ``release_unknown``)."""
        body = {"allocation_id": allocation_id, "tenant": "faults", "lease_s": 3600}
        try:
            answer = await self.stack.call(Rpc.PLACEMENT_RENEW, body, timeout=self.timeout_s)
        except Exception:
            self.result.release_unknown.add(allocation_id)
            return
        if answer.get("status") != "renewed":
            self.result.errors[f"renew:{answer.get('error', {}).get('code')}"] += 1
            self.result.release_unknown.add(allocation_id)

    async def run(self) -> LoadResult:
        started = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        total = int(self.rate * self.duration_s)
        for k in range(total):
            delay = started + k / self.rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rid = f"f-{self.prefix}-{k}"
            self.result.offered += 1
            release = self.random.random() < self.release_share
            tasks.append(asyncio.create_task(self._one(rid, release=release, leave=self.callers_leave)))
        await asyncio.gather(*tasks)
        return self.result

    async def retry_unanswered(self, deadline_s: float = 60) -> None:
        """Each unanswered request again, with its own id, until it is answered (placed or rejected)."""
        deadline = time.monotonic() + deadline_s
        while self.result.unanswered and time.monotonic() < deadline:
            pending = sorted(self.result.unanswered)
            self.result.retried += len(pending)
            await asyncio.gather(*(self._one(rid, release=False) for rid in pending))
            if self.result.unanswered:
                await asyncio.sleep(0.5)


# -- what must hold --------------------------------------------------------------------------
async def check_outbox_drained(stack: FaultStack, deadline_s: float = 60) -> int:
    """Wait until the ledger's outbox has nothing left to publish; the rows it set aside as
    unpublishable (``quarantined_at``, where the schema has it): an event a fault must never cost."""
    conn = await stack.db()
    try:
        has_quarantine = bool(
            await conn.fetchval(
                "SELECT count(*) FROM information_schema.columns "
                "WHERE table_schema = 'ledger' AND table_name = 'outbox' AND column_name = 'quarantined_at'"
            )
        )
        pending = "sent_at IS NULL" + (" AND quarantined_at IS NULL" if has_quarantine else "")

        async def drained() -> bool:
            return not await conn.fetchval(f"SELECT count(*) FROM ledger.outbox WHERE {pending}")

        await wait_for(drained, deadline_s, interval_s=0.2, what="the ledger's outbox drains")
        if not has_quarantine:
            return 0
        return int(await conn.fetchval("SELECT count(*) FROM ledger.outbox WHERE quarantined_at IS NOT NULL"))
    finally:
        await conn.close()


async def late_commits(stack: FaultStack, result: LoadResult) -> list[str]:
    """Request ids whose allocation the ledger created after their caller had given up: work done for
    nobody (call before ``retry_unanswered``, whose retries carry new deadlines). ``created_at`` is the
    transaction's start, so a row counted here was certainly committed late."""
    if not result.gave_up_at:
        return []
    conn = await stack.db()
    try:
        rows = await conn.fetch(
            "SELECT request_id, extract(epoch FROM created_at) AS at FROM ledger.allocations WHERE parent_id IS NULL"
        )
    finally:
        await conn.close()
    late = []
    for row in rows:
        rid = str(row["request_id"]).removeprefix(LEDGER_REQUEST_PREFIX)
        if rid in result.gave_up_at and float(row["at"]) > result.gave_up_at[rid]:
            late.append(rid)
    return late


async def check_after_fault(stack: FaultStack, result: LoadResult) -> list[str]:
    """The ledger invariant (reserved = sum of active counted shares <= usable), replay of the LEDGER
    stream equals the tables, every `placed` reply's allocation exists (and is active unless released),
    one ledger allocation per placed request id, one allocation_committed event per allocation."""
    problems: list[str] = []
    if quarantined := await check_outbox_drained(stack):
        problems.append(f"{quarantined} ledger events quarantined by the outbox relay instead of published")
    conn = await stack.db()
    try:
        if violations := int(await conn.fetchval(INVARIANT_SQL)):
            problems.append(f"ledger invariant broken on {violations} accelerator(s)")
        rows = await conn.fetch("SELECT id, request_id, state FROM ledger.allocations WHERE parent_id IS NULL")
        tables = {r["id"]: r["reserved"] for r in await conn.fetch("SELECT id, reserved FROM ledger.accelerators")}
    finally:
        await conn.close()
    state = {r["id"]: r["state"] for r in rows}
    placed = result.placed
    missing = [a for a in placed.values() if a not in state]
    if missing:
        problems.append(f"{len(missing)} placed replies name an allocation the ledger lacks: {missing[:3]}")
    kept = set(placed.values()) - result.released - result.release_unknown
    not_active = [a for a in kept if a in state and state[a] != "active"]
    if not_active:
        problems.append(f"{len(not_active)} placed, unreleased allocations are not active: {not_active[:3]}")
    per_request = Counter(str(r["request_id"]).removeprefix(LEDGER_REQUEST_PREFIX) for r in rows)
    doubled = [rid for rid in placed if per_request[rid] != 1]
    if doubled:
        problems.append(f"{len(doubled)} placed ids without exactly one ledger allocation: {doubled[:3]}")
    events = await stack.ledger_events()
    committed = Counter(e["payload"]["allocation_id"] for e in events if e["type"] == "ledger.allocation_committed")
    all_ids = {r["id"] for r in rows}
    if lost := all_ids - set(committed):
        problems.append(f"{len(lost)} committed allocations have no allocation_committed event: {sorted(lost)[:3]}")
    if twice := [a for a, n in committed.items() if n > 1]:
        problems.append(f"{len(twice)} allocations have more than one allocation_committed event")
    # First leases keep running out (the ledger's sweep ends them): the stream may be an event behind the
    # tables for a moment, so the replay is compared again until the outbox has caught up.
    deadline_at = time.monotonic() + REPLAY_SETTLE_S
    while (rebuilt := replay_reserved(allocation_events(events))) != (
        current := {k: v for k, v in tables.items() if v}
    ) and time.monotonic() < deadline_at:
        await asyncio.sleep(0.5)
        await check_outbox_drained(stack)
        conn = await stack.db()
        try:
            tables = {r["id"]: r["reserved"] for r in await conn.fetch("SELECT id, reserved FROM ledger.accelerators")}
        finally:
            await conn.close()
        events = await stack.ledger_events()
    if rebuilt != current:
        problems.append("replay of the LEDGER stream differs from the tables")
    return problems


async def unowned_allocations(stack: FaultStack, result: LoadResult) -> dict[str, str]:
    """Active ledger allocations of placement's (request id ``placement/<id>``) that no `placed` reply the
    driver holds names: allocation id -> placement request id."""
    conn = await stack.db()
    try:
        rows = await conn.fetch(
            "SELECT id, request_id FROM ledger.allocations "
            "WHERE parent_id IS NULL AND state = 'active' AND starts_with(request_id, $1)",
            LEDGER_REQUEST_PREFIX,
        )
    finally:
        await conn.close()
    placed = result.placed
    unowned = {}
    for row in rows:
        rid = str(row["request_id"]).removeprefix(LEDGER_REQUEST_PREFIX)
        if placed.get(rid) != row["id"]:
            unowned[row["id"]] = rid
    return unowned


async def reconciled(stack: FaultStack, result: LoadResult, state: str = "released") -> int:
    """Placement's allocations the ledger ended that the driver never released (nor may have): what the
    reconciler released, or (``state="expired"``) what ended with its first lease because no caller
    learnt of it."""
    conn = await stack.db()
    try:
        rows = await conn.fetch(
            "SELECT id FROM ledger.allocations WHERE parent_id IS NULL AND state = $2 AND starts_with(request_id, $1)",
            LEDGER_REQUEST_PREFIX,
            state,
        )
    finally:
        await conn.close()
    return len({r["id"] for r in rows} - result.released - result.release_unknown)


async def check_no_unowned_allocations(
    stack: FaultStack, result: LoadResult, deadline_s: float = UNOWNED_DEADLINE_S
) -> list[str]:
    """After the load (and its retries): wait until every active allocation of placement's belongs to a
    request the driver holds as placed, with that allocation; one the reconciler never releases (an
    orphan of a placement killed mid-commit whose caller left, or got no `placed`) is a problem."""
    deadline_at = time.monotonic() + deadline_s
    while unowned := await unowned_allocations(stack, result):
        if time.monotonic() >= deadline_at:
            sample = sorted(unowned.items())[:3]
            return [f"{len(unowned)} active allocations no placed reply owns after {deadline_s:.0f}s: {sample}"]
        await asyncio.sleep(0.5)
    return []
