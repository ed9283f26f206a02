"""`hetsched rebalance`: the rebalancer now, for operators (its detectors, plans and recent actions)."""

from __future__ import annotations

import typer

from hetsched.cli.common import DataDirOption, JsonOption, columns, say, shown
from shared.contracts.rebalance import RebalanceStatusReply, RebalanceStatusRequest
from shared.contracts.subjects import Rpc

app = typer.Typer()


@app.command()
def rebalance(as_json: JsonOption = False, data_dir: DataDirOption = None) -> None:
    """Operators: the rebalancer now (`rebalance.status`): each detector and its targets pending or firing,
    the plans open or running (and the last finished) and the recent actions, newest first."""
    request = RebalanceStatusRequest()
    answer = shown(data_dir, Rpc.REBALANCE_STATUS, request, RebalanceStatusReply, as_json)
    if answer is None:
        return
    # The direction is part of the threshold (`>0.85` fires above it), so each cell is one word for `awk`.
    columns(
        ["detector", "threshold", "window_s", "state", "targets"],
        [
            [d.name, f"{'>' if d.above else '<'}{d.threshold:g}", f"{d.window_s:g}", d.state, str(len(d.targets))]
            for d in answer.detectors
        ],
    )
    targets = [
        [d.name, t.key, t.phase, f"{t.value:.3f}", t.since.isoformat()] for d in answer.detectors for t in d.targets
    ]
    say("")
    if targets:
        columns(["detector", "target", "phase", "value", "since"], targets)
    else:
        say("no target pending or firing")
    say("")
    if answer.plans:
        # The reason is free text with spaces: last, so the columns before it stay one word each.
        columns(
            ["plan", "kind", "state", "cluster", "target", "steps", "reason"],
            [
                [
                    p.plan_id,
                    p.kind,
                    p.state,
                    p.cluster or "-",
                    p.target or "-",
                    f"{sum(s.state == 'done' for s in p.steps)}/{len(p.steps)}",
                    p.reason,
                ]
                for p in answer.plans
            ],
        )
    else:
        say("no plan")
    say("")
    if answer.recent:
        columns(["at", "plan", "what"], [[a.at.isoformat(), a.plan_id or "-", a.what] for a in answer.recent])
    else:
        say("no action yet")
