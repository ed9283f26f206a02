"""Admission: which replica takes a request, in what order to fail over, whose request goes next, and
how one node's KV pool is shared between engines. Pure: time is ``now_ms`` from the caller.

* ``engines``: the engine of a model, what admission knows of a replica, a request's peak KV on it;
* ``groups``: model groups, one API name for several catalog models;
* ``select``: candidates, the rule that picks among them, the failover order;
* ``fair``: per-tenant weighted fair queueing shaped by token buckets;
* ``pool``: a node's KV pool with a guarantee per engine and borrowing from idle engines;
* ``account``: one replica's in-flight requests, estimated against its engine's reports;
* ``tenancy``: whose replicas a tenant's requests may use.
"""

from shared.domain.admission.account import EngineReport, InFlight, ReplicaAccount
from shared.domain.admission.engines import Engine, ReplicaStatus, engine_of, request_kv_bytes
from shared.domain.admission.fair import FairQueue, TokenBucket
from shared.domain.admission.groups import members, parse_model_groups, unknown_model
from shared.domain.admission.pool import DONOR_ORDER, Grant, KvPool
from shared.domain.admission.select import (
    FAILOVER_ORDER,
    AdmitAsk,
    AdmitPolicy,
    Candidate,
    Exclusion,
    Hint,
    Rule,
    Selection,
    failover_order,
    least_cost,
    select,
)
from shared.domain.admission.tenancy import Tenancy, TenancyMode

__all__ = [
    "DONOR_ORDER",
    "FAILOVER_ORDER",
    "AdmitAsk",
    "AdmitPolicy",
    "Candidate",
    "Engine",
    "EngineReport",
    "Exclusion",
    "FairQueue",
    "Grant",
    "Hint",
    "InFlight",
    "KvPool",
    "ReplicaAccount",
    "ReplicaStatus",
    "Rule",
    "Selection",
    "Tenancy",
    "TenancyMode",
    "TokenBucket",
    "engine_of",
    "failover_order",
    "least_cost",
    "members",
    "parse_model_groups",
    "request_kv_bytes",
    "select",
    "unknown_model",
]
