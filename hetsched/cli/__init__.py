"""The `hetsched` command line (docs/API.md): one Typer module per noun, joined here into one app.

stack (up, status), replicas (place, release), routing (admit, route, route-region), reservations
(reserve, reservations), rebalance, engines (engine-sim), fleet (fleet, topo parse), webconsole
(console), sim, asyncapi, and the groups deadletter and credentials. Shared options, the RPC session and
the one way out for bad input are in ``common.py``; the fixed choices are Enums in ``choices.py``.
"""

from __future__ import annotations

import sys

from hetsched.lock import refuse_second_up

# `hetsched up` beside a running one refuses here, before the commands below load (seconds when busy).
refuse_second_up(sys.argv)

import typer  # noqa: E402

from hetsched.cli import (  # noqa: E402
    asyncapi,
    credentials,
    deadletter,
    engines,
    fleet,
    rebalance,
    replicas,
    reservations,
    routing,
    sim,
    stack,
    webconsole,
)
from hetsched.cli.common import OneLineErrors  # noqa: E402

app = typer.Typer(
    cls=OneLineErrors, help="hetsched: places LLM inference on heterogeneous GPU/TPU fleets.", no_args_is_help=True
)
# Registration order is the order `hetsched --help` lists the commands in.
for noun in (stack, replicas, routing, reservations, rebalance, engines, fleet, webconsole, sim, asyncapi):
    app.add_typer(noun.app)
app.add_typer(deadletter.app, name="deadletter")
app.add_typer(credentials.app, name="credentials")
app.add_typer(fleet.topo_app, name="topo")

__all__ = ["app"]
