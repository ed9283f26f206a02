"""`hetsched rebalance`: one `rebalance.status` call, and what is printed of the detectors, the plans and
the recent actions (no servers: the client is a fake, as in test_cli_reservations.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner, Result

import hetsched.cli as cli
from shared.contracts.base import ErrorBody, Rejected
from shared.contracts.rebalance import (
    ActionView,
    DetectorView,
    PlanView,
    RebalanceStatusReply,
    RebalanceStatusRequest,
    StepView,
    TargetView,
)
from shared.contracts.subjects import Rpc
from shared.infra.rpc import RpcClient
from tests.unit.cli_fake import FakeClient, run_cli

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def _cli(monkeypatch: pytest.MonkeyPatch, reply: BaseModel, *args: str) -> tuple[Result, FakeClient]:
    return run_cli(monkeypatch, reply, "rebalance", *args)


def _cells(out: str) -> list[list[str]]:
    """Each printed line as its whitespace-separated cells."""
    return [line.split() for line in out.splitlines()]


def _step(action: str, allocation_id: str, state: str, new: str | None = None) -> StepView:
    return StepView.model_validate(
        {"action": action, "allocation_id": allocation_id, "state": state, "new_allocation_id": new}
    )


LONG_PLAN = "rb-0123456789ab"  # the service's form: with the reason, the row is wider than the runner's 80 columns
REASON = "hbm_cold < 0.3 for 300 s: dgx-h100-02 0.12"
CONSOLIDATE = PlanView(
    plan_id=LONG_PLAN,
    kind="consolidate",
    state="running",
    cluster="us-west-1/c1",
    target="dgx-h100-02",
    reason=REASON,
    created_at=T0,
    steps=[
        _step("place", "al-1", "done", "al-3"),
        _step("place", "al-2", "done", "al-4"),
        _step("release", "al-1", "done"),
        _step("release", "al-2", "pending"),
    ],
)
THROTTLE = PlanView(  # a throttle has no steps, and no cluster when the node's profile is unknown
    plan_id="throttle-n1",
    kind="throttle",
    state="running",
    cluster="",
    target="n1",
    reason="cold starts throttled on n1 (PCIe 0.82)",
    created_at=T0,
)
REPLY = RebalanceStatusReply(
    detectors=[
        DetectorView(
            name="hbm_hot",
            threshold=0.85,
            window_s=60,
            state="firing",
            targets=[
                TargetView(key="al-0123456789abcdef", phase="firing", since=T0, value=0.912),
                TargetView(key="al-2", phase="pending", since=T0 + timedelta(seconds=5), value=0.86),
            ],
        ),
        DetectorView(name="hbm_cold", threshold=0.3, window_s=300, above=False, state="ok"),
        DetectorView(name="hbm_drift_alarm", threshold=0.1, window_s=0, state="ok"),
    ],
    plans=[CONSOLIDATE, THROTTLE],
    recent=[
        ActionView(at=T0 + timedelta(seconds=2), plan_id=LONG_PLAN, what="released al-1"),
        ActionView(at=T0 + timedelta(seconds=1), plan_id=None, what="hbm_hot fired on al-0123456789abcdef (0.912)"),
    ],
)


def test_asks_rebalance_status_once_with_an_empty_body(monkeypatch: pytest.MonkeyPatch) -> None:
    result, client = _cli(monkeypatch, REPLY)
    assert result.exit_code == 0, result.output
    # A refusal comes back as Rejected.
    assert client.calls == [(Rpc.REBALANCE_STATUS, RebalanceStatusRequest(), {})]


def test_prints_each_detector_with_its_direction_and_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _client = _cli(monkeypatch, REPLY)
    assert result.exit_code == 0, result.output
    lines = _cells(result.stdout)
    assert lines[:4] == [
        ["detector", "threshold", "window_s", "state", "targets"],
        ["hbm_hot", ">0.85", "60", "firing", "2"],
        ["hbm_cold", "<0.3", "300", "ok", "0"],  # a below-rule fires under its threshold
        ["hbm_drift_alarm", ">0.1", "0", "ok", "0"],
    ]
    assert ["detector", "target", "phase", "value", "since"] in lines
    assert ["hbm_hot", "al-0123456789abcdef", "firing", "0.912", "2025-01-01T12:00:00+00:00"] in lines
    assert ["hbm_hot", "al-2", "pending", "0.860", "2025-01-01T12:00:05+00:00"] in lines


def test_prints_each_plan_whole_with_its_steps_done_of_all(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _client = _cli(monkeypatch, REPLY)
    assert result.exit_code == 0, result.output
    lines = _cells(result.stdout)
    assert ["plan", "kind", "state", "cluster", "target", "steps", "reason"] in lines
    rows = {cells[0]: cells for cells in lines if cells and cells[0] in (LONG_PLAN, "throttle-n1")}
    # 3 of its 4 steps are done (two places, one release); the reason's words follow, one line uncut.
    cells = [LONG_PLAN, "consolidate", "running", "us-west-1/c1", "dgx-h100-02", "3/4"]
    assert rows[LONG_PLAN] == [*cells, *REASON.split()]
    assert rows["throttle-n1"][:6] == ["throttle-n1", "throttle", "running", "-", "n1", "0/0"]


def test_prints_the_recent_actions_newest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _client = _cli(monkeypatch, REPLY)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["at", "plan", "what"])
    assert [line.split() for line in lines[start + 1 :]] == [
        ["2025-01-01T12:00:02+00:00", LONG_PLAN, "released", "al-1"],
        ["2025-01-01T12:00:01+00:00", "-", *"hbm_hot fired on al-0123456789abcdef (0.912)".split()],
    ]


def test_nothing_going_on_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = RebalanceStatusReply(detectors=[DetectorView(name="pcie_hot", threshold=0.7, window_s=60, state="ok")])
    result, _client = _cli(monkeypatch, reply)
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if line] == [
        "detector  threshold  window_s  state  targets",
        "pcie_hot  >0.7       60        ok     0",
        "no target pending or firing",
        "no plan",
        "no action yet",
    ]


def test_json_is_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    result, _client = _cli(monkeypatch, REPLY, "--json")
    assert result.exit_code == 0, result.output
    assert RebalanceStatusReply.model_validate_json(result.stdout) == REPLY


@pytest.mark.parametrize("as_json", [False, True])
def test_a_refusal_exits_1_with_its_code_and_message(monkeypatch: pytest.MonkeyPatch, as_json: bool) -> None:
    refused = Rejected(error=ErrorBody(code="not_implemented", message="rebalance.status is not built yet"))
    result, _client = _cli(monkeypatch, refused, *(["--json"] if as_json else []))
    assert result.exit_code == 1
    assert "rejected: not_implemented: rebalance.status is not built yet" in result.stderr
    if as_json:
        assert json.loads(result.stdout)["error"]["code"] == "not_implemented"
    else:
        assert result.stdout == ""


def test_no_answer_exits_2_saying_where_it_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    async def unreachable(*_args: Any, **_options: Any) -> Any:
        raise ConnectionRefusedError("nobody there")

    monkeypatch.setenv("HETSCHED_NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setattr(RpcClient, "connect", unreachable)
    result = CliRunner().invoke(cli.app, ["rebalance", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "no answer from rebalance.status at nats://127.0.0.1:1" in result.stderr
    assert result.stdout == ""
