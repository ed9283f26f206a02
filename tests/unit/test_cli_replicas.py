"""`hetsched replicas` and `hetsched renew` with no servers (a fake client answers, tests/unit/cli_fake.py),
and `--credential`: who the CLI acts as, the subject it asks on and the bad input it refuses."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from shared.contracts.base import rejected
from shared.contracts.permissions import gateway_identity, inbox_prefix
from shared.contracts.placement import (
    RenewReply,
    RenewRequest,
    ReplicaPlacement,
    ReplicasReply,
    ReplicasRequest,
    ReplicaView,
    TpuSlice,
)
from shared.contracts.subjects import Rpc
from shared.domain.errors import ErrorCode
from shared.domain.placement.listing import Position, encode_cursor
from shared.infra.identity import Registry, ensure_operator, issue, new_seed, write_secret
from shared.infra.identity import nats_dir as identity_dir
from tests.unit.cli_fake import run_cli

LEASE = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
GPU_REPLICA = ReplicaView(
    replica_id="al-1",
    tenant="acme",
    request_id="req-1",
    model="llama3-70b",
    tp=4,
    pp=2,
    placements=[
        ReplicaPlacement(node="dgx-01", accelerators=[f"dgx-01/gpu{i}" for i in range(4)], gpus=[0, 1, 2, 3]),
        ReplicaPlacement(node="dgx-02", accelerators=["dgx-02/gpu4", "dgx-02/gpu6"], gpus=[4, 6]),
    ],
    state="ready",
    lease_expires_at=LEASE,
    region="us-west-1",
    sku="H100-SXM-80GB",
    endpoint="http://dgx-01:8100",
)
TPU_REPLICA = ReplicaView(
    replica_id="al-2",
    tenant="globex",
    request_id="req-2",
    model="llama3-8b",
    tp=4,
    pp=1,
    tpu_slice=TpuSlice(pod="v5e-pod-1", origin=[2, 0], shape=[2, 2]),
    state="placed",
)
CURSOR = encode_cursor(Position("acme", "req-1"))


def test_the_table_shows_where_each_replica_runs_and_until_when(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReplicasReply(replicas=[GPU_REPLICA, TPU_REPLICA], total=2)
    result, client = run_cli(monkeypatch, reply, "replicas")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["id", "tenant", "model", "nodes", "gpus", "tp/pp", "lease", "end", "state"]
    assert lines[1].split() == [
        "al-1",
        "acme",
        "llama3-70b",
        "dgx-01,dgx-02",
        "0-3;4,6",  # per node, in the nodes' order
        "4/2",
        "2026-01-01T12:05:00Z",
        "ready",
    ]
    assert lines[2].split() == ["al-2", "globex", "llama3-8b", "v5e-pod-1", "2x2@2,0", "4/1", "-", "placed"]
    assert lines[3] == "2 of 2 replica(s)"
    assert client.calls == [(Rpc.PLACEMENT_REPLICAS, ReplicasRequest(), {})]
    assert client.acting is None  # the operator's credential


def test_every_page_is_followed_over_one_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = [
        ReplicasReply(replicas=[GPU_REPLICA], next_cursor=CURSOR, total=2),
        ReplicasReply(replicas=[TPU_REPLICA], total=2),
    ]
    result, client = run_cli(monkeypatch, pages, "replicas", "--json", "--model", "llama3-70b")
    assert result.exit_code == 0, result.output
    merged = json.loads(result.output)
    assert [r["replica_id"] for r in merged["replicas"]] == ["al-1", "al-2"]
    assert merged["next_cursor"] is None and merged["total"] == 2
    assert [request for _rpc, request, _options in client.calls] == [
        ReplicasRequest(model="llama3-70b"),
        ReplicasRequest(model="llama3-70b", cursor=CURSOR),
    ]


def test_limit_or_cursor_asks_one_page(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReplicasReply(replicas=[GPU_REPLICA], next_cursor=CURSOR, total=2)
    result, client = run_cli(monkeypatch, reply, "replicas", "--limit", "1", "--wide", "--state", "ready")
    assert result.exit_code == 0, result.output
    assert len(client.calls) == 1
    assert client.calls[0][1] == ReplicasRequest(limit=1, state="ready")
    assert "req-1" in result.output and "H100-SXM-80GB" in result.output  # --wide
    assert "http://dgx-01:8100" in result.output  # the endpoint, once ready
    assert result.output.splitlines()[-2:] == ["1 of 2 replica(s)", f"more: --cursor {CURSOR}"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "0"], "--limit"),
        (["--limit", "501"], "--limit"),
        (["--cursor", "garbage"], "--cursor"),
        (["--state", "running"], "--state"),
        (["--tenant", ""], "--tenant"),
    ],
)
def test_bad_filters_exit_2_before_anything_is_asked(
    monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), "replicas", *args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and message in result.output
    assert client.calls == []


@pytest.mark.parametrize(
    ("reply", "exit_code", "shown"),
    [
        (rejected(ErrorCode.UNKNOWN_MODEL, "no model 'nope' in the catalog"), 1, "rejected: unknown_model"),
        (rejected(ErrorCode.FORBIDDEN, "this subject acts for 'acme' only"), 1, "rejected: forbidden"),
        (rejected(ErrorCode.INVALID_REQUEST, "field 'cursor': ..."), 2, "error: invalid_request"),
    ],
)
def test_a_refusal_is_one_line_and_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, reply: object, exit_code: int, shown: str
) -> None:
    result, _client = run_cli(monkeypatch, reply, "replicas", "--model", "nope")  # type: ignore[arg-type]
    assert result.exit_code == exit_code, result.output
    assert shown in result.output


def test_renew_prints_the_new_lease_end(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = RenewReply(status="renewed", lease_expires_at=LEASE)
    result, client = run_cli(monkeypatch, reply, "renew", "al-1", "--tenant", "acme", "--lease-s", "600")
    assert result.exit_code == 0, result.output
    assert "renewed al-1 for acme: the lease ends 2026-01-01T12:05:00Z (in 600 s)" in result.output
    assert client.calls == [(Rpc.PLACEMENT_RENEW, RenewRequest(allocation_id="al-1", tenant="acme", lease_s=600), {})]
    result, client = run_cli(monkeypatch, reply, "renew", "al-1", "--tenant", "acme")
    assert client.calls[0][1].lease_s == 3600  # type: ignore[attr-defined]  # HETSCHED_PLACEMENT_DEFAULT_LEASE_S


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["al-1"], "--tenant is required"),
        (["al-1", "--tenant", "acme", "--lease-s", "0"], "--lease-s"),
        (["al-1", "--tenant", "acme", "--lease-s", str(31 * 86400)], "--lease-s"),
    ],
)
def test_renew_refuses_bad_input_with_exit_2(monkeypatch: pytest.MonkeyPatch, args: list[str], message: str) -> None:
    result, client = run_cli(monkeypatch, RenewReply(status="renewed"), "renew", *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert client.calls == []


def test_renew_of_another_tenants_replica_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = rejected(ErrorCode.NOT_FOUND, "no allocation 'al-9' for this tenant")
    result, _client = run_cli(monkeypatch, refused, "renew", "al-9", "--tenant", "acme")
    assert result.exit_code == 1 and "rejected: not_found" in result.output


# -- --credential: acting as a tenant's gateway -----------------------------------------------------------------


@pytest.fixture
def stack(tmp_path: Path) -> Path:
    """A data dir whose registry lists a gateway for acme, one for acme and globex, and the operator."""
    data = tmp_path / "data"
    directory = identity_dir(data)
    registry = Registry()
    ensure_operator(directory, registry)
    issue(registry, kind="gateway", name="acme-gw", out=tmp_path / "acme.nk", tenants=["acme"])
    issue(registry, kind="gateway", name="both-gw", out=tmp_path / "both.nk", tenants=["acme", "globex"])
    issue(registry, kind="agent", name="dgx-01", out=tmp_path / "agent.nk")
    registry.save(directory)
    return data


def test_a_gateway_credential_lists_its_tenants_replicas_on_its_subject(
    monkeypatch: pytest.MonkeyPatch, stack: Path
) -> None:
    credential = stack.parent / "acme.nk"
    reply = ReplicasReply(replicas=[GPU_REPLICA], total=1)
    result, client = run_cli(monkeypatch, reply, "replicas", "--credential", str(credential), "--data-dir", str(stack))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "1 of 1 replica(s) of acme"
    # The credential's only tenant is the one asked for, on its subject, with its inbox.
    assert client.calls == [(Rpc.PLACEMENT_REPLICAS, ReplicasRequest(tenant="acme"), {"scope": "acme"})]
    assert client.acting.inbox_prefix == inbox_prefix(gateway_identity("acme-gw"))
    assert client.acting.seed == credential and client.acting.tenants == ("acme",)


def test_a_gateway_naming_another_tenant_asks_on_its_own_subject(monkeypatch: pytest.MonkeyPatch, stack: Path) -> None:
    """The subject's tenant wins: the service answers `forbidden` (the server would drop a request on
    another tenant's subject, and the CLI would only time out)."""
    args = ["--credential", str(stack.parent / "acme.nk"), "--data-dir", str(stack)]
    forbidden = rejected(ErrorCode.FORBIDDEN, "this subject acts for 'acme' only; the request names 'globex'")
    result, client = run_cli(monkeypatch, forbidden, "replicas", "--tenant", "globex", *args)
    assert result.exit_code == 1 and "rejected: forbidden" in result.output
    assert client.calls == [(Rpc.PLACEMENT_REPLICAS, ReplicasRequest(tenant="globex"), {"scope": "acme"})]
    result, client = run_cli(monkeypatch, forbidden, "renew", "al-2", "--tenant", "globex", "--lease-s", "60", *args)
    assert result.exit_code == 1
    assert client.calls[0][0] == Rpc.PLACEMENT_RENEW and client.calls[0][2] == {"scope": "acme"}


def test_a_gateway_of_several_tenants_names_one(monkeypatch: pytest.MonkeyPatch, stack: Path) -> None:
    args = ["--credential", str(stack.parent / "both.nk"), "--data-dir", str(stack)]
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), "replicas", *args)
    assert result.exit_code == 2 and "--tenant is required: the credential acts for acme, globex" in result.output
    assert client.calls == []
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), "replicas", "--tenant", "globex", *args)
    assert result.exit_code == 0 and client.calls[0][2] == {"scope": "globex"}
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), "replicas", "--tenant", "initech", *args)
    assert client.calls[0][2] == {"scope": "acme"}  # one of its own: the service answers `forbidden`


def test_the_credential_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, stack: Path) -> None:
    env = {"HETSCHED_CLI_CREDENTIAL": str(stack.parent / "acme.nk")}
    reply = RenewReply(status="renewed", lease_expires_at=LEASE)
    result, client = run_cli(monkeypatch, reply, "renew", "al-1", "--data-dir", str(stack), env=env)
    assert result.exit_code == 0, result.output
    assert client.calls == [
        (Rpc.PLACEMENT_RENEW, RenewRequest(allocation_id="al-1", tenant="acme", lease_s=3600), {"scope": "acme"})
    ]


def test_a_credential_the_registry_does_not_list_needs_its_inbox_prefix(
    monkeypatch: pytest.MonkeyPatch, stack: Path
) -> None:
    elsewhere = stack.parent / "elsewhere.nk"
    write_secret(elsewhere, new_seed())
    args = ["replicas", "--tenant", "acme", "--credential", str(elsewhere), "--data-dir", str(stack)]
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), *args)
    assert result.exit_code == 2 and "HETSCHED_NATS_INBOX_PREFIX" in result.output
    assert client.calls == []
    env = {"HETSCHED_NATS_INBOX_PREFIX": "_INBOX_gw_elsewhere"}
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), *args, env=env)
    assert result.exit_code == 0, result.output
    assert client.acting.inbox_prefix == "_INBOX_gw_elsewhere" and client.calls[0][2] == {"scope": "acme"}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("agent.nk", "the agent credential agent_dgx-01, not a gateway's"),
        ("missing.nk", "not a readable NKey seed file"),
        ("garbage.nk", "not a readable NKey seed file"),
    ],
)
def test_a_credential_that_is_no_gateways_is_bad_input(
    monkeypatch: pytest.MonkeyPatch, stack: Path, name: str, message: str
) -> None:
    (stack.parent / "garbage.nk").write_text("not a seed\n")
    args = ["replicas", "--credential", str(stack.parent / name), "--data-dir", str(stack)]
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert client.calls == []


def test_the_operators_own_seed_as_a_credential_acts_unscoped(monkeypatch: pytest.MonkeyPatch, stack: Path) -> None:
    operator = identity_dir(stack) / "admin.nk"
    args = ["replicas", "--credential", str(operator), "--data-dir", str(stack)]
    result, client = run_cli(monkeypatch, ReplicasReply(total=0), *args)
    assert result.exit_code == 0, result.output
    assert client.calls == [(Rpc.PLACEMENT_REPLICAS, ReplicasRequest(), {})]
    assert client.acting.scoped is False
