"""The deliberate breaks. Each names the exact code it changes (found once in its file) and the tests
that must catch it; keep them in step with the code (``run.py`` reports a mutant whose code moved
as ``stale``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]


LEDGER_IT = "tests/integration/test_ledger.py"
LEDGER_UNIT = "tests/unit/services/capacity_ledger"
LEDGER_DOMAIN = "tests/unit/domain/ledger"
PLACEMENT_UNIT = "tests/unit/services/placement"
PLACEMENT_IT = "tests/integration/test_placement.py"
_CROSS_SCHEMA_READ = '        await session.execute(__import__("sqlalchemy").text("SELECT 1 FROM ledger.shares"))\n'
_LOCK_DOC = (
    '        """The intent of this (tenant, request id), locked for this transaction; None if there is none."""\n'
)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="hbm_trigger_disabled",
        what="the HBM over-commit trigger no longer raises",
        file="migrations/versions/0003_ledger.py",
        find="        IF delta > 0 AND over THEN\n",
        replace="        IF false AND over THEN\n",
        tests=(LEDGER_IT,),
    ),
    Mutant(
        name="journal_guard_removed",
        what="the journal's append-only guard lets updates and deletes through",
        file="migrations/versions/0003_ledger.py",
        find="    RAISE EXCEPTION 'ledger.journal is append-only' USING ERRCODE = 'insufficient_privilege';\n",
        replace="    RETURN NEW;\n",
        tests=(LEDGER_IT,),
    ),
    Mutant(
        name="conflict_retry_once",
        what="placement's conflict retry cut to one attempt",
        file="services/placement/handlers.py",
        find="MAX_ATTEMPTS = 4\n",
        replace="MAX_ATTEMPTS = 1\n",
        tests=(PLACEMENT_UNIT,),
    ),
    Mutant(
        name="renew_ignores_lease",
        what="placement.renew ignores the requested lease",
        file="services/placement/handlers.py",
        find="lease_s=request.lease_s),",
        replace="lease_s=self._default_lease_s),",
        tests=(PLACEMENT_UNIT,),
    ),
    Mutant(
        name="node_removed_ignored",
        what="the ledger ignores node_removed",
        file="services/capacity_ledger/handlers.py",
        find='await self._availability(uow, event, node=payload.node, available=False, reason="removed")',
        replace="return None",
        tests=(LEDGER_UNIT, LEDGER_IT),
    ),
    Mutant(
        name="capacity_changed_not_published",
        what="the ledger stops publishing capacity_changed",
        file="services/capacity_ledger/handlers.py",
        find="        if not accelerators:\n            return  # a node the ledger never knew\n",
        replace="        return\n",
        tests=(LEDGER_UNIT, LEDGER_IT),
    ),
    Mutant(
        name="snapshot_paging_broken",
        what="ledger.snapshot ignores its cursor",
        file="services/capacity_ledger/store.py",
        find='"AND (CAST(:after AS text) IS NULL OR a.id > :after) "',
        replace='"AND (CAST(:after AS text) IS NULL OR a.id IS NOT NULL) "',
        tests=(LEDGER_IT,),
    ),
    Mutant(
        name="commit_batch_reordered",
        what="commit_batch answers its results in another order",
        file="services/capacity_ledger/handlers.py",
        find="return CommitBatchReply(results=await self.apply_commits(request.commits, deadlines=until))",
        replace="return CommitBatchReply(results=list(reversed(await self.apply_commits(request.commits, "
        "deadlines=until))))",
        tests=(LEDGER_UNIT, LEDGER_IT),
    ),
    Mutant(
        name="tpu_wrong_chips",
        what="a TPU placement reserves chips other than the slice it reports",
        file="shared/domain/placement/view.py",
        find="return dict.fromkeys(decision.tpu.chips, whole)",
        replace="return dict.fromkeys(tpu_chip_ids(snapshot.tpu_pods[decision.tpu.pod].pod)"
        "[-len(decision.tpu.chips) :], whole)",
        tests=(PLACEMENT_UNIT, "tests/unit/placement/test_view.py", PLACEMENT_IT),
    ),
    Mutant(
        name="drift_every_sample",
        what="drift reported on every sample of an episode instead of once",
        file="shared/domain/ledger/drift.py",
        find="            if streak == self.consecutive:\n",
        replace="            if streak >= self.consecutive:\n",
        tests=(LEDGER_DOMAIN, LEDGER_UNIT, LEDGER_IT),
    ),
    Mutant(
        name="view_counts_twice",
        what="placement's view counts an allocation again when its commit is seen twice",
        file="shared/domain/placement/view.py",
        find="            if (nbytes > 0) == held or not nbytes:\n",
        replace="            if not nbytes:\n",
        tests=("tests/unit/placement/test_view.py", PLACEMENT_IT),
    ),
    Mutant(
        name="cross_schema_read",
        what="placement reads the ledger's table instead of learning from its events",
        file="services/placement/store.py",
        find=_LOCK_DOC,
        replace=_LOCK_DOC
        + '        await session.execute(__import__("sqlalchemy").text("SELECT count(*) FROM ledger.allocations"))\n',
        tests=("tests/unit/test_schema_ownership.py", PLACEMENT_IT),
    ),
)
