"""`hetsched reserve` and `hetsched reservations`: options refused before anything is asked, one call on
the right subject with the right body, and what is printed (no servers: the client is a fake)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel
from typer.testing import Result

from shared.contracts.base import ErrorBody, Rejected
from shared.contracts.reservation import (
    PreemptionView,
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationReportReply,
    ReservationReportRequest,
    ReservationStatusReply,
    ReservationStatusRequest,
    ReservationStatusView,
)
from shared.contracts.subjects import Rpc
from tests.unit.cli_fake import FakeClient, run_cli

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def _cli(monkeypatch: pytest.MonkeyPatch, reply: BaseModel, *args: str) -> tuple[Result, FakeClient]:
    return run_cli(monkeypatch, reply, *args)


CREATED = ReservationCreateReply(
    status="created", reservation_id="res-1", accelerators=["dgx-h100-01/gpu0", "dgx-h100-01/gpu1"]
)
RESERVE = ["reserve", "--tenant", "acme", "--policy", "soft"]


# -- reserve: refused before any call -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--count", "8"], "--sku, --region missing"),
        (["--count", "8", "--sku", "H100-SXM-80GB"], "--region missing"),
        (["--sku", "H100-SXM-80GB", "--region", "us-west-1"], "--count missing"),
        ([], "give --count with --sku and --region, or --accelerator"),
        (["--accelerator", "dgx-h100-01/gpu0", "--count", "1"], "not both"),
        (["--accelerator", "dgx-h100-01/gpu0", "--region", "us-west-1"], "not both"),
        (["--accelerator", "a", "--accelerator", "a"], "names an accelerator twice"),  # the contract's rule
        (["--count", "0", "--sku", "H100-SXM-80GB", "--region", "us-west-1"], "count"),  # the contract's gt=0
        (["--accelerator", "a", "--spot-eviction-s", "10"], "only with --policy spot"),
    ],
)
def test_reserve_refuses_bad_options_before_asking(monkeypatch: pytest.MonkeyPatch, args: list[str], says: str) -> None:
    result, client = _cli(monkeypatch, CREATED, *RESERVE, *args)
    assert result.exit_code == 2, result.output
    assert says in result.stderr
    assert client.calls == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--policy", "premium"], "'premium' is not one of 'soft', 'hard', 'spot'"),  # Typer checks the Enum
        (
            ["--policy", "spot", "--spot-eviction-s", "60"],
            "--spot-eviction-s: Input should be less than or equal to 30",
        ),
        (
            ["--policy", "spot", "--spot-eviction-s", "4"],
            "--spot-eviction-s: Input should be greater than or equal to 5",
        ),
    ],
)
def test_reserve_refuses_a_bad_policy_or_notice(monkeypatch: pytest.MonkeyPatch, args: list[str], says: str) -> None:
    result, client = _cli(monkeypatch, CREATED, "reserve", "--tenant", "acme", "--accelerator", "a", *args)
    assert result.exit_code == 2, result.output
    assert says in result.stderr
    assert len(result.stderr.splitlines()) == 1  # one line, whoever refused it (Typer, the CLI, the contract)
    assert client.calls == []


# -- reserve: one reservation.create call ---------------------------------------------------------------------


def test_reserve_by_count_asks_once_and_prints_the_id_and_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    result, client = _cli(
        monkeypatch,
        CREATED,
        *RESERVE,
        *["--count", "2", "--sku", "H100-SXM-80GB", "--region", "us-west-1", "--request-id", "r-1"],
    )
    assert result.exit_code == 0, result.output
    ((rpc, request, options),) = client.calls
    assert rpc is Rpc.RESERVATION_CREATE
    assert options == {}  # a refusal comes back as the Rejected the service sent
    assert request == ReservationCreateRequest(
        request_id="r-1", tenant="acme", policy="soft", count=2, sku="H100-SXM-80GB", region="us-west-1"
    )
    assert result.stdout.splitlines() == [
        "reservation res-1: soft, 2 accelerators",
        "  dgx-h100-01/gpu0",
        "  dgx-h100-01/gpu1",
    ]


def test_reserve_explicit_spot_accelerators_with_their_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    result, client = _cli(
        monkeypatch,
        CREATED.model_copy(update={"duplicate": True}),
        *["reserve", "--tenant", "acme", "--policy", "spot", "--spot-eviction-s", "10"],
        *["--accelerator", "dgx-h100-01/gpu0", "--accelerator", "dgx-h100-01/gpu1", "--json"],
    )
    assert result.exit_code == 0, result.output
    ((_rpc, request, _options),) = client.calls
    assert isinstance(request, ReservationCreateRequest)
    assert request.accelerators == ["dgx-h100-01/gpu0", "dgx-h100-01/gpu1"]
    assert (request.count, request.policy, request.spot_eviction_s) == (None, "spot", 10)
    assert request.request_id is not None and request.request_id.startswith("cli-")  # random when not given
    assert json.loads(result.stdout)["duplicate"] is True


@pytest.mark.parametrize(
    "reply",
    [
        ReservationCreateReply(status="rejected", error=ErrorBody(code="no_capacity", message="only 3 free")),
        Rejected(error=ErrorBody(code="not_implemented", message="not built yet")),
    ],
)
def test_reserve_rejected_exits_1_with_the_code_and_message(monkeypatch: pytest.MonkeyPatch, reply: Any) -> None:
    result, _client = _cli(monkeypatch, reply, *RESERVE, "--accelerator", "a")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert f"rejected: {reply.error.code}: {reply.error.message}" in result.stderr


def test_reserve_rejected_with_json_prints_the_reply_too(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReservationCreateReply(status="rejected", error=ErrorBody(code="forbidden", message="not yours"))
    result, _client = _cli(monkeypatch, reply, *RESERVE, "--accelerator", "a", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["error"]["code"] == "forbidden"


# -- reservations: status, cancel, report ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "--tenant is required"),
        (["--cancel", "res-1"], "--tenant is required"),
        (["--report", "--tenant", "acme"], "not with --tenant or --cancel"),
        (["--report", "--cancel", "res-1"], "not with --tenant or --cancel"),
    ],
)
def test_reservations_refuses_bad_options_before_asking(
    monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    result, client = _cli(monkeypatch, ReservationStatusReply(), "reservations", *args)
    assert result.exit_code == 2, result.output
    assert says in result.stderr
    assert client.calls == []


def _cells(out: str) -> list[list[str]]:
    """Each printed line as its whitespace-separated cells."""
    return [line.split() for line in out.splitlines()]


def _view(**changes: Any) -> ReservationStatusView:
    fields: dict[str, Any] = {
        "reservation_id": "res-1",
        "tenant": "acme",
        "policy": "soft",
        "sku": "H100-SXM-80GB",
        "region": "us-west-1",
        "accelerators": [f"n/gpu{i}" for i in range(10)],
        "owner_used": 6,
        "lent": 3,
        "idle": 1,
        "offered": 1,
        "fill_rate": 0.9,
        "idle_cost_usd_per_hour": 4.4,
    }
    return ReservationStatusView.model_validate({**fields, **changes})


def test_status_prints_a_row_per_reservation_and_the_tenant_fill_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    spot = _view(
        reservation_id="res-2",
        policy="spot",
        sku=None,
        region=None,
        accelerators=["a", "b"],
        owner_used=0,
        lent=0,
        idle=2,
        offered=0,
        fill_rate=0.0,
        idle_cost_usd_per_hour=8.8,
        preemptions=[
            PreemptionView(allocation_id="al-9", tenant="globex", reservation_id="res-2", deadline_at=T0, issued_at=T0)
        ],
    )
    long_id = "res-0123456789abcdef"  # the filler's form: the table is wider than the runner's 80 columns
    reply = ReservationStatusReply(
        reservations=[_view(reservation_id=long_id), spot], fill_rate=0.75, idle_cost_usd_per_hour=13.2
    )
    result, client = _cli(monkeypatch, reply, "reservations", "--tenant", "acme")
    assert result.exit_code == 0, result.output
    ((rpc, request, options),) = client.calls
    assert (rpc, request, options) == (Rpc.RESERVATION_STATUS, ReservationStatusRequest(tenant="acme"), {})
    lines = _cells(result.stdout)
    assert lines[0] == [*"id policy sku region reserved owner_used lent idle offered fill_rate".split(), "idle", "$/h"]
    rows = {cells[0]: cells for cells in lines[1:3]}
    assert rows[long_id] == [long_id, "soft", "H100-SXM-80GB", "us-west-1", "10", "6", "3", "1", "1", "0.90", "4.40"]
    assert rows["res-2"] == ["res-2", "spot", "-", "-", "2", "0", "0", "2", "0", "0.00", "8.80"]
    assert "res-2: borrower globex (al-9) leaves by 2025-01-01T12:00:00+00:00" in result.stdout
    assert "acme: fill rate 0.75, idle $13.20/h over 2 reservation(s)" in result.stdout


def test_status_without_reservations_has_no_fill_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _client = _cli(monkeypatch, ReservationStatusReply(), "reservations", "--tenant", "acme")
    assert result.exit_code == 0, result.output
    assert "acme: fill rate -, idle $0.00/h over 0 reservation(s)" in result.stdout


def test_status_json_is_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReservationStatusReply(reservations=[_view()], fill_rate=0.9, idle_cost_usd_per_hour=4.4)
    result, _client = _cli(monkeypatch, reply, "reservations", "--tenant", "acme", "--json")
    assert result.exit_code == 0, result.output
    assert ReservationStatusReply.model_validate_json(result.stdout) == reply


def test_status_refused_exits_1_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = Rejected(error=ErrorBody(code="forbidden", message="res-9 is another tenant's"))
    result, _client = _cli(monkeypatch, refused, "reservations", "--tenant", "acme")
    assert result.exit_code == 1
    assert "rejected: forbidden: res-9 is another tenant's" in result.stderr


def test_cancel_asks_reservation_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReservationCancelReply(status="cancelled", reservation_id="res-1", already=True)
    result, client = _cli(monkeypatch, reply, "reservations", "--cancel", "res-1", "--tenant", "acme")
    assert result.exit_code == 0, result.output
    ((rpc, request, _options),) = client.calls
    assert (rpc, request) == (Rpc.RESERVATION_CANCEL, ReservationCancelRequest(reservation_id="res-1", tenant="acme"))
    assert result.stdout.strip() == "cancelled res-1 (it had been cancelled before)"


def test_cancel_of_another_tenants_reservation_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReservationCancelReply(status="rejected", error=ErrorBody(code="forbidden", message="not yours"))
    result, _client = _cli(monkeypatch, reply, "reservations", "--cancel", "res-1", "--tenant", "globex")
    assert result.exit_code == 1
    assert "rejected: forbidden: not yours" in result.stderr


def test_report_prints_overall_by_tenant_and_by_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReservationReportReply(
        fill_rate=0.9,
        by_tenant={"acme": 0.9, "globex": 0.5},
        by_cluster={"us-west-1/c1": 0.8},
        reserved=100,
        owner_used=60,
        lent=30,
        idle_cost_usd_per_hour=44.0,
    )
    result, client = _cli(monkeypatch, reply, "reservations", "--report")
    assert result.exit_code == 0, result.output
    ((rpc, request, _options),) = client.calls
    assert (rpc, request) == (Rpc.RESERVATION_REPORT, ReservationReportRequest())
    out = result.stdout
    assert "fill rate 0.90: 100 reserved, 60 used by their owners, 30 lent; idle $44.00/h" in out
    rows = {tuple(cells) for cells in _cells(out)}
    assert {("acme", "0.90"), ("globex", "0.50"), ("us-west-1/c1", "0.80")} <= rows


def test_report_json_is_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = ReservationReportReply(fill_rate=None)
    result, _client = _cli(monkeypatch, reply, "reservations", "--report", "--json")
    assert result.exit_code == 0, result.output
    assert ReservationReportReply.model_validate_json(result.stdout) == reply
