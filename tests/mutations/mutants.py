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
RETENTION_IT = "tests/integration/test_retention.py"
LEDGER_UNIT = "tests/unit/services/capacity_ledger"
LEDGER_DOMAIN = "tests/unit/domain/ledger"
PLACEMENT_UNIT = "tests/unit/services/placement"
REBALANCER_UNIT = "tests/unit/services/rebalancer"
FILLER_UNIT = "tests/unit/services/reservation_filler"
RESERVATIONS_DOMAIN = "tests/unit/domain/reservations"
PLACEMENT_IT = "tests/integration/test_placement.py"
RESERVATION_PROBE_IT = "tests/integration/test_reservation_probe.py"
ROW_10_IT = f"{RESERVATION_PROBE_IT}::test_row_10_a_filler_killed_mid_reclaim_holds_no_answer_and_health_recovers"
ROW_11_IT = f"{RESERVATION_PROBE_IT}::test_row_11_a_reservation_answered_created_is_in_force_for_the_next_placement"
QUEUE_QUOTAS_IT = "tests/integration/test_queue_quotas.py"
FOLLOW_UNIT = "tests/unit/test_follow.py"
READ_SIDE_IT = "tests/integration/test_read_side.py"
HTTP_EXPOSURE_IT = "tests/integration/test_http_exposure.py"
ROUTER_UNIT = "tests/unit/services/cross_region_router"
GROUPING_UNIT = "tests/unit/test_grouping.py"
_CROSS_SCHEMA_READ = '        await session.execute(__import__("sqlalchemy").text("SELECT 1 FROM ledger.shares"))\n'
_LOCK_DOC = (
    '        """The intent of this (tenant, request id), locked for this transaction; None if there is none."""\n'
)

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="foreign_durables_not_denied",
        what="a service that follows a stream may create (update) another service's durable on it",
        file="shared/contracts/permissions.py",
        find="            if consumed is context and (consumed, durable) not in own\n",
        replace="            if False\n",
        tests=("tests/unit/test_consumer_ownership.py",),
    ),
    Mutant(
        name="deleted_consumer_not_recreated",
        what="an event loop whose durable was deleted notices it but never re-creates it",
        file="shared/infra/consumers.py",
        find="                await subscription.unsubscribe()\n            return await self._subscribe(runtime)\n",
        replace="                await subscription.unsubscribe()\n            return subscription\n",
        tests=("tests/integration/test_consumer_ownership.py",),
    ),
    Mutant(
        name="ordered_consumer_reset_keeps_its_name",
        what="an ordered consumer reset after a gap re-uses the name of the consumer still there",
        file="shared/infra/bus.py",
        find="        state._ccreq.name = ordered_name()\n",
        replace="        pass\n",
        tests=("tests/integration/test_consumer_ownership.py",),
    ),
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
        file="services/placement/place.py",
        find="MAX_ATTEMPTS = 4\n",
        replace="MAX_ATTEMPTS = 1\n",
        tests=(PLACEMENT_UNIT,),
    ),
    Mutant(
        name="conflict_view_ignored",
        what="placement drops the fresher figures a ledger conflict carries in its Rejected details",
        file="services/placement/commit.py",
        find='        return _BALANCES.validate_python((details or {}).get("view") or [])\n',
        replace="        return []\n",
        tests=(PLACEMENT_UNIT,),
    ),
    Mutant(
        name="renew_ignores_lease",
        what="placement.renew ignores the requested lease",
        file="services/placement/lifecycle.py",
        find="lease_s=request.lease_s),",
        replace="lease_s=3600),",
        tests=(PLACEMENT_UNIT,),
    ),
    # Issue 23 (a hostile probe after the hardening): rows 2, 3, 9 and the two information leaks.
    Mutant(
        name="failed_replica_from_anyone",
        what="admission takes a replica out of rotation on any tenant's failed_replica_id",
        file="services/placement/replicas.py",
        find="        if replica_id not in self.replicas or not self.holds_on(replica_id, tenant):\n",
        replace="        if replica_id not in self.replicas:\n",
        tests=("tests/unit/services/placement/test_admission.py",),
    ),
    Mutant(
        name="engine_status_node_prefix",
        what="an engine report is taken from an agent whose node name is a prefix of the replica's node",
        file="services/placement/replicas.py",
        find="        if replica.node != status.node:\n",
        replace="        if replica.node != status.node and not replica.node.startswith(status.node):\n",
        tests=("tests/unit/services/placement/test_admission.py",),
    ),
    Mutant(
        name="node_scope_suffix",
        what="a node-scoped subject is matched by suffix, not by whole token",
        file="shared/contracts/subjects.py",
        find='    return subject.rpartition(".")[2] == token(name)\n',
        replace="    return subject.endswith(token(name))\n",
        tests=("tests/unit/test_dispatch.py::test_a_node_scoped_subject_names_exactly_one_node",),
    ),
    Mutant(
        name="booleans_are_integers",
        what="contract integers read a JSON boolean as 1 again",
        file="shared/contracts/base.py",
        find="Int = Annotated[int, Strict()]\n",
        replace="Int = int\n",
        tests=("tests/unit/test_contracts.py::test_a_boolean_is_never_a_number",),
    ),
    Mutant(
        name="release_tells_forbidden",
        what="ledger.release tells another tenant's allocation (forbidden) from an unknown one",
        file="services/capacity_ledger/lifecycle.py",
        find="        access = await self._end(request.allocation_id, tenant=request.tenant, "
        "state=AllocationState.RELEASED)\n",
        replace="        access = await self._end(request.allocation_id, tenant=request.tenant, "
        "state=AllocationState.RELEASED)\n"
        "        if access is Access.FORBIDDEN:\n"
        '            return rejected(ErrorCode.FORBIDDEN, "the allocation belongs to another tenant")\n',
        tests=("tests/unit/services/capacity_ledger/test_handlers.py",),
    ),
    Mutant(
        name="node_removed_ignored",
        what="the ledger ignores node_removed",
        file="services/capacity_ledger/fleet.py",
        find='await self._availability(uow, event, node=payload.node, available=False, reason="removed")',
        replace="return None",
        tests=(LEDGER_UNIT, LEDGER_IT),
    ),
    Mutant(
        name="capacity_changed_not_published",
        what="the ledger stops publishing capacity_changed",
        file="services/capacity_ledger/fleet.py",
        find="        if not accelerators:\n            return  # a node the ledger never knew\n",
        replace="        return\n",
        tests=(LEDGER_UNIT, LEDGER_IT),
    ),
    Mutant(
        name="snapshot_paging_broken",
        what="ledger.snapshot ignores its cursor",
        file="services/capacity_ledger/store/reads.py",
        find='"AND (CAST(:after AS text) IS NULL OR a.id > :after) "',
        replace='"AND (CAST(:after AS text) IS NULL OR a.id IS NOT NULL) "',
        tests=(LEDGER_IT,),
    ),
    Mutant(
        name="ledger_accepts_request_holds",
        what="the ledger takes a `request` commit again instead of refusing it (admissions are placement's)",
        file="shared/domain/ledger/commits.py",
        find="            outcomes.append(Refused(ErrorCode.INVALID_REQUEST, REQUEST_RETIRED))\n            continue\n",
        replace="            pass\n",
        tests=(LEDGER_DOMAIN, LEDGER_UNIT),
    ),
    Mutant(
        name="commit_batch_reordered",
        what="commit_batch answers its results in another order",
        file="services/capacity_ledger/commits.py",
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
        find="            return (drift if streak == self.consecutive else None), streak\n",
        replace="            return (drift if streak >= self.consecutive else None), streak\n",
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
    # Hostile probe, round 3, findings 10 and 11 (docs/SECURITY.md).
    Mutant(
        name="reclaim_waits_the_whole_deadline",
        what="an owner's placement waits for reservation.reclaim as long as the caller's deadline allows",
        file="services/placement/reclaim.py",
        find="                timeout_s=share_of_deadline(min(RECLAIM_TIMEOUT_S, self._rpc.timeout_s)),\n",
        replace="                timeout_s=None,\n",
        tests=(ROW_10_IT,),
    ),
    Mutant(
        name="reclaim_unanswered_not_refused",
        what="an owner's placement that may not queue, whose reclaim got no answer, is decided as if none was needed",
        file="services/placement/reclaim.py",
        find="            return self._unanswered(request, exc)\n",
        replace="            return ORDINARY\n",
        tests=(ROW_10_IT,),
    ),
    Mutant(
        name="health_never_probes",
        what="health waits for the next real call (or a minute) to say a dependency that failed is back",
        file="shared/infra/health.py",
        find="        if probes:\n            await _probe(runtime, probes)\n",
        replace="        if False:\n            await _probe(runtime, probes)\n",
        tests=(
            "tests/unit/test_call_stats.py",
            ROW_10_IT,
        ),
    ),
    Mutant(
        name="timeouts_in_the_median",
        what="a call that got no answer counts its timeout in the median answer (slow for a minute)",
        file="shared/infra/rpc.py",
        find="            answered = [seconds for seconds, ok in recent if ok]\n",
        replace="            answered = [seconds for seconds, _ok in recent]\n",
        tests=("tests/unit/test_call_stats.py",),
    ),
    Mutant(
        name="placement_ignores_the_reservation_stream_end",
        what="placement decides without waiting for its reservation view to reach the RESERVATION stream's end",
        file="services/placement/place.py",
        find="        unsure = await self._reclaimer.known()\n",
        replace="        unsure = None\n",
        tests=("tests/unit/services/placement/test_read_your_writes.py", ROW_11_IT),
    ),
    Mutant(
        name="queue_pass_ignores_the_reservation_view",
        what="a queue pass decides queued requests without its reservation view being known to be current",
        file="services/placement/queue.py",
        find="                elif behind is not None or (shape := entry.shape) in unfit:\n",
        replace="                elif (shape := entry.shape) in unfit:\n",
        tests=("tests/unit/services/placement/test_queue.py",),
    ),
    Mutant(
        name="size_cap_refused_stops_the_stack",
        what="a stream whose size cap the server cannot reserve is not created at all (the stack cannot start)",
        file="shared/infra/bus.py",
        find="        if exc.err_code != INSUFFICIENT_STORAGE or not config.max_bytes or config.max_bytes <= 0:\n",
        replace="        if True:\n",
        tests=(
            RETENTION_IT + "::test_a_size_cap_the_servers_store_cannot_reserve_leaves_the_stream_uncapped_and_says_so",
        ),
    ),
    Mutant(
        name="created_before_announced",
        what="reservation.create answers `created` before its event is in the RESERVATION stream",
        file="services/reservation_filler/requests.py",
        find="        return await self._announced(created)\n",
        replace="        return created\n",
        tests=(ROW_11_IT,),
    ),
    Mutant(
        name="console_host_unchecked",
        what="the console answers any Host (a page that rebinds its DNS name to 127.0.0.1 reads it)",
        file="hetsched/console/server.py",
        find='        if not access.host_allowed(request.headers.get("host"), self._allowed):\n',
        replace="        if False:\n",
        tests=(HTTP_EXPOSURE_IT,),
    ),
    Mutant(
        name="console_token_unchecked",
        what="the console serves its state without the token",
        file="hetsched/console/server.py",
        find="        if not access.authorised(request.headers, token=self._token, cookie=self._cookie):\n",
        replace="        if False:\n",
        tests=(HTTP_EXPOSURE_IT,),
    ),
    Mutant(
        name="console_reserved_shown_free",
        what="the console counts and draws a reserved GPU with no replica on it as free",
        file="hetsched/console/fleetview.py",
        find="    if reserved is not None:\n        return RESERVED_HARD",
        replace="    if False:\n        return RESERVED_HARD",
        tests=("tests/unit/test_console_fleetview.py",),
    ),
    Mutant(
        name="http_no_read_timeout",
        what="the metrics and console servers wait for a request forever",
        file="shared/infra/httpserver.py",
        find="                request = await asyncio.wait_for(self._read(reader), timeout_s)\n",
        replace="                request = await self._read(reader)\n",
        tests=(HTTP_EXPOSURE_IT,),
    ),
    Mutant(
        name="http_no_connection_cap",
        what="the metrics and console servers hold every connection they accept",
        file="shared/infra/httpserver.py",
        find="        if len(self._open) >= self.limits.max_connections:\n",
        replace="        if False:\n",
        tests=(HTTP_EXPOSURE_IT,),
    ),
    # Issue 23 rows 7 (retention) and 8 (the ledger's usable HBM).
    Mutant(
        name="usable_hbm_as_written",
        what="the capacity trigger keeps whatever a statement wrote into hbm_usable",
        file="migrations/versions/0015_retention_capacity.py",
        find="        NEW.hbm_usable := GREATEST(computed, LEAST(OLD.hbm_usable, NEW.reserved));\n",
        replace="        NULL;\n",
        tests=("tests/integration/test_ledger_capacity.py",),
    ),
    Mutant(
        name="usable_hbm_below_reserved",
        what="a device reported smaller takes its new figure at once, under what is reserved on it",
        file="migrations/versions/0015_retention_capacity.py",
        find="        NEW.hbm_usable := GREATEST(computed, LEAST(OLD.hbm_usable, NEW.reserved));\n",
        replace="        NEW.hbm_usable := computed;\n",
        tests=("tests/integration/test_ledger_capacity.py",),
    ),
    Mutant(
        name="usable_hbm_column_writable",
        what="the ledger role keeps INSERT and UPDATE on hbm_usable",
        file="migrations/versions/0015_retention_capacity.py",
        find='    op.execute(f"REVOKE INSERT (hbm_usable), UPDATE (hbm_usable) ON ledger.accelerators '
        'FROM {LEDGER_ROLE}")\n',
        replace="",
        tests=("tests/integration/test_ledger_capacity.py",),
    ),
    Mutant(
        name="stream_without_size_cap",
        what="streams are created without their size cap",
        file="shared/infra/bus.py",
        find="        max_bytes=spec.max_bytes,\n",
        replace="",
        tests=(RETENTION_IT,),
    ),
    Mutant(
        name="pruner_not_started",
        what="services do not run the pruning loop",
        file="shared/infra/service.py",
        find='            runtime.spawn(runtime.pruner.run(), name="retention-prune")\n',
        replace="",
        tests=(RETENTION_IT,),
    ),
    Mutant(
        name="prune_unsent_rows",
        what="pruning deletes old unsent outbox rows (events still owed to the bus)",
        file="shared/infra/retention.py",
        find='        "WHERE created_at < :before AND sent_at IS NULL AND quarantined_at < :before LIMIT :batch)"\n',
        replace='        "WHERE created_at < :before AND sent_at IS NULL LIMIT :batch)"\n',
        tests=(RETENTION_IT,),
    ),
    Mutant(
        name="prune_one_batch",
        what="a pruning pass stops after its first batch",
        file="shared/infra/retention.py",
        find="        if count < batch:\n            return deleted\n",
        replace="        return deleted\n",
        tests=(RETENTION_IT,),
    ),
    Mutant(
        name="reservations_not_restated",
        what="the filler never restates its active reservations",
        file="services/reservation_filler/app.py",
        find="        restate_s=restate_every_s(settings.kit.stream_reservation_max_age_s),\n",
        replace="        restate_s=None,\n",
        tests=("tests/integration/test_restatement.py",),
    ),
    Mutant(
        name="throttles_not_restated",
        what="the rebalancer never restates its throttles",
        file="services/rebalancer/app.py",
        find="        restate_s=restate_every_s(settings.kit.stream_rebalance_max_age_s),  # docs/RETENTION.md\n",
        replace="        restate_s=None,\n",
        tests=("tests/integration/test_restatement.py",),
    ),
    # Issue 23 row 4 (the queue) and row 7 (quotas).
    Mutant(
        name="queue_first_page_only",
        what="a pass of placement's queue reads only its first page",
        file="services/placement/queue.py",
        find="            if len(rows) < page:\n                return entries\n",
        replace="            return entries\n",
        tests=(PLACEMENT_UNIT, QUEUE_QUOTAS_IT),
    ),
    Mutant(
        name="queue_fifo_not_round_robin",
        what="the queue is visited in arrival order only (one tenant's backlog goes first)",
        file="services/placement/queue.py",
        find="        entries = round_robin(await self._queued(), tenant=lambda entry: entry.tenant)\n",
        replace="        entries = await self._queued()\n",
        tests=(PLACEMENT_UNIT,),
    ),
    Mutant(
        name="quota_placed_unchecked",
        what="placement checks a tenant's placed GPUs against the wrong (unset) quota",
        file="services/placement/tally.py",
        find="            Quota.GPUS_PLACED,\n",
        replace="            Quota.GPUS_RESERVED,\n",
        tests=(PLACEMENT_UNIT, QUEUE_QUOTAS_IT),
    ),
    Mutant(
        name="quota_in_flight_uncounted",
        what="a commit in flight does not count for its tenant's quota",
        file="services/placement/tally.py",
        find="        self.holdings.hold(token, key[0], held)\n",
        replace="        pass\n",
        tests=(PLACEMENT_UNIT,),
    ),
    Mutant(
        name="quota_queued_unchecked",
        what="the enqueue ignores the tenant's quota of queued requests",
        file="services/placement/intents.py",
        find="                over = exceeded(quotas, request.tenant, Quota.QUEUED_REQUESTS, used=waiting, asked=1)\n",
        replace="                over = None\n",
        tests=(PLACEMENT_UNIT, QUEUE_QUOTAS_IT),
    ),
    Mutant(
        name="quota_reserved_unchecked",
        what="reservation.create ignores the tenant's quota of reserved GPUs",
        file="services/reservation_filler/requests.py",
        find="            over = await self._over_quota(uow, request)\n",
        replace="            over = None\n",
        tests=(FILLER_UNIT, QUEUE_QUOTAS_IT),
    ),
    Mutant(
        name="reservation_clash_ignores_other_tenants_use",
        what="reservation.create takes named GPUs another tenant's allocation is using",
        file="shared/domain/reservations/claim.py",
        find="    clash = [acc for acc in accelerators if acc in taken or acc in used_by_others]\n",
        replace="    clash = [acc for acc in accelerators if acc in taken]\n",
        tests=(RESERVATIONS_DOMAIN, FILLER_UNIT),
    ),
    Mutant(
        name="reservation_status_shows_another_tenants",
        what="reservation.status answers another tenant's reservation by its id",
        file="services/reservation_filler/requests.py",
        find="                if one is None or not one.active or one.tenant != request.tenant:",
        replace="                if one is None or not one.active:",
        tests=(FILLER_UNIT,),
    ),
    Mutant(
        name="preemption_acknowledgement_not_recorded",
        what="the filler never records that the ledger acknowledged a preemption (it asks again forever)",
        file="services/reservation_filler/reclaim.py",
        find="        if acknowledged:\n            # Recorded after the answer goes back",
        replace="        if False:\n            # Recorded after the answer goes back",
        tests=(FILLER_UNIT,),
    ),
    Mutant(
        name="after_commit_runs_inside_the_transaction",
        what="a change meant for after the commit runs at once, so a batch that rolls back and runs again folds twice",
        file="shared/infra/uow.py",
        find="        self.committed.append(change)\n",
        replace="        change()\n",
        tests=(
            f"{READ_SIDE_IT}::test_a_consumer_batch_that_rolls_back_leaves_the_fold_unchanged_and_each_event_folds_once",
        ),
    ),
    Mutant(
        name="follower_applies_a_sequence_twice",
        what="a follower applies again the events a re-created consumer delivers again",
        file="shared/infra/follow.py",
        find="        if sequence <= feed.progress.sequence:  # a re-created consumer delivers again: applied\n",
        replace="        if False:\n",
        tests=(FOLLOW_UNIT,),
    ),
    Mutant(
        name="follower_applies_before_its_seed",
        what="a seeded follower's feed applies its events before the seed is in (they would land on the old view)",
        file="shared/infra/follow.py",
        find="        if feed.buffer is not None and not (live is not None and live(name, payload)):\n",
        replace="        if False:\n",
        tests=(FOLLOW_UNIT,),
    ),
    Mutant(
        name="replaced_feed_keeps_applying",
        what="a feed replaced by a new seed's keeps applying its consumer's events",
        file="shared/infra/follow.py",
        find="            old.closed = True\n",
        replace="            pass\n",
        tests=(FOLLOW_UNIT,),
    ),
    Mutant(
        name="event_source_not_checked",
        what="an event from another identity than its context's publisher is trusted (by followers and consumers)",
        file="shared/infra/trust.py",
        find="        if event.source != self.publisher:\n",
        replace="        if False:\n",
        tests=(FOLLOW_UNIT,),
    ),
    # Issue 24: the rebalancer's handlers and read model.
    Mutant(
        name="rebalancer_folds_before_commit",
        what="the rebalancer folds a committed allocation into its view inside the consumer's transaction",
        file="services/rebalancer/handlers.py",
        find="        uow.after_commit(lambda: self.view.allocated(allocation))\n",
        replace="        self.view.allocated(allocation)\n",
        tests=(REBALANCER_UNIT,),
    ),
    Mutant(
        name="rebalancer_engine_report_never_folds",
        what="an engine's report never reaches the rebalancer's view (a busy draining replica counts as unreported)",
        file="services/rebalancer/readmodel.py",
        find="        self.engines[event.replica_id] = EngineReport(event.queue_depth, event.kv_used_bytes, at)\n",
        replace="        pass\n",
        tests=(REBALANCER_UNIT,),
    ),
    Mutant(
        name="rebalancer_releases_with_messages_in_flight",
        what="a plan releases a replica while its engine still reports requests in flight",
        file="services/rebalancer/runner.py",
        find="                if not self._drained(plan, step.allocation_id):\n",
        replace="                if False:\n",
        tests=(REBALANCER_UNIT,),
    ),
    Mutant(
        name="rebalancer_failed_plan_keeps_its_copies",
        what="a plan whose copy cannot be placed keeps the copies it already placed",
        file="services/rebalancer/runner.py",
        find="                    await self._release_copies(failed, copies)\n",
        replace="                    pass\n",
        tests=(REBALANCER_UNIT,),
    ),
    Mutant(
        name="router_replica_fold_in_transaction",
        what="the router's replica fold changes inside the consumer's transaction (a rolled-back batch still "
        "adds capacity)",
        file="services/cross_region_router/handlers.py",
        find=(
            "        uow.after_commit(lambda: self._replicas.add(replica.allocation_id, replica.region, "
            "replica.model, replica.sku))\n"
        ),
        replace="        self._replicas.add(replica.allocation_id, replica.region, replica.model, replica.sku)\n",
        tests=(ROUTER_UNIT,),
    ),
    Mutant(
        name="router_released_replica_still_serves",
        what="a released replica still counts as capacity in its region",
        file="services/cross_region_router/readmodel.py",
        find="        self._serving[model][region] -= 1\n",
        replace="        pass\n",
        tests=(ROUTER_UNIT,),
    ),
    Mutant(
        name="router_route_remembered_before_commit",
        what="the router remembers a tenant's and a session's region even when writing them rolled back",
        file="services/cross_region_router/handlers.py",
        find=(
            "                uow.after_commit(partial(self._routed, w.tenant, w.tenant_route, w.session_key, "
            "w.region))\n"
        ),
        replace="                self._routed(w.tenant, w.tenant_route, w.session_key, w.region)\n",
        tests=(ROUTER_UNIT,),
    ),
    Mutant(
        name="router_full_region_not_passed_over",
        what="a region whose admission answers no_capacity ends the route instead of trying the next tier",
        file="services/cross_region_router/handlers.py",
        find="                full.add(decision.region)  # full there for this request: the next tier decides\n",
        replace="                break\n",
        tests=(ROUTER_UNIT,),
    ),
    Mutant(
        name="group_failure_fails_all",
        what="a group whose apply raised hands its exception to every caller instead of applying each alone",
        file="shared/infra/grouping.py",
        find=(
            "            except Exception:  # the group failed as a whole: "
            "each item runs alone and meets its own outcome\n"
            "                pass\n"
        ),
        replace=(
            "            except Exception as exc:\n"
            "                for _, future in group:\n"
            "                    future.set_exception(exc)\n"
            "                return\n"
        ),
        tests=(GROUPING_UNIT,),
    ),
    Mutant(
        name="group_cancelled_callers_applied",
        what="an item whose caller was cancelled before its turn is still applied",
        file="shared/infra/grouping.py",
        find="live = [(item, future) for item, future in group if not future.cancelled()]",
        replace="live = group",
        tests=(GROUPING_UNIT,),
    ),
    Mutant(
        name="group_commit_changes_before_commit",
        what="run_grouped runs each work's after_commit changes before its group commits (a failed group's too)",
        file="shared/infra/uow.py",
        find="                committed.extend(unit.committed)\n",
        replace="                run_committed(unit.committed)\n",
        tests=(
            "tests/integration/test_outbox.py::"
            "test_grouped_units_of_work_share_transactions_and_one_failure_fails_only_its_caller",
        ),
    ),
    Mutant(
        name="ledger_drift_counts_before_commit",
        what="the ledger's drift detector counts a sample whose report rolls back (the episode is then never told)",
        file="services/capacity_ledger/fleet.py",
        find=(
            "            uow.after_commit(partial(self._observed, acc, observed, streak=streak, "
            "reported=drift is not None))\n"
        ),
        replace="            self._observed(acc, observed, streak=streak, reported=drift is not None)\n",
        tests=(LEDGER_UNIT,),
    ),
    Mutant(
        name="replicas_listing_ignores_tenant",
        what="placement.replicas lists every tenant's replicas whatever tenant the request (and its subject) names",
        file="services/placement/store.py",
        find="        clauses.append(DECISIONS.c.tenant == where.tenant)\n",
        replace="        pass\n",
        tests=("tests/integration/test_replica_listing.py",),
    ),
    Mutant(
        name="renew_keeps_the_listed_lease",
        what="placement.renew renews in the ledger but the replica's recorded lease end stays the old one",
        file="services/placement/lifecycle.py",
        find="        if lease is not None:  # the replica's lease end as `placement.replicas` lists it",
        replace="        if False:  # the replica's lease end as `placement.replicas` lists it",
        tests=(PLACEMENT_UNIT, "tests/integration/test_replica_listing.py"),
    ),
    Mutant(
        name="rebalancer_judges_engines_not_serving",
        what="the rebalancer judges a replica whose engine starts or loads (drift alarms, hot and cold on it)",
        file="shared/domain/rebalance/signals.py",
        find="    if not ranks.ready:\n        return False\n    changed = ranks.changed_at\n",
        replace="    changed = ranks.changed_at\n",
        tests=(REBALANCER_UNIT, "tests/unit/domain/rebalance/test_signals.py"),
    ),
    Mutant(
        name="rebalancer_hot_on_hbm_despite_engine_reports",
        what="a replica whose engine reports its load is still judged hot on its GPUs' HBM use",
        file="services/rebalancer/detectors.py",
        find="            if key in loads:\n                continue",
        replace="            if False:\n                continue",
        tests=(REBALANCER_UNIT,),
    ),
    Mutant(
        name="ledger_drift_without_grace",
        what="the ledger checks drift on a GPU whose replica was just committed (its engine still loading)",
        file="services/capacity_ledger/fleet.py",
        find="            if self._drift.settling(newest.get(acc.id), uow.now):",
        replace="            if False:",
        tests=(LEDGER_UNIT,),
    ),
)
