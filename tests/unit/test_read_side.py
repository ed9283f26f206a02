"""Every service follows other contexts through the kit's read side only (``shared.infra.follow``): this
lists each follower of each service, and fails when a service subscribes to NATS any other way (its own
ordered consumer, a core-NATS or FastStream subscriber): those belong in ``follows``, ``consumers`` or
``listens`` of its ``ServiceDefinition``, where the kit applies one trust check and derives permissions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from services.registry import SERVICES
from services.topology_discovery.app import AGENT
from shared.contracts.subjects import Context
from shared.infra.follow import Start

ROOT = Path(__file__).resolve().parents[2]

# service -> (context, where it starts, the seed it waits for) for each of its followers
FOLLOWERS: dict[str, set[tuple[Context, Start, str | None]]] = {
    "topology_discovery": set(),
    "capacity_ledger": set(),
    "placement": {
        (Context.TOPOLOGY, Start.NEW, "view"),
        (Context.LEDGER, Start.NEW, "view"),
        (Context.TELEMETRY, Start.NEW, "view"),
        (Context.RESERVATION, Start.FIRST, None),
        (Context.REBALANCE, Start.FIRST, None),
    },
    "reservation_filler": set(),
    "cross_region_router": set(),
    "rebalancer": {(Context.TELEMETRY, Start.NEW, None)},
    "gateway": set(),
}

# What subscribing outside the kit looks like: a call of one of these, or one of these imported.
SUBSCRIBING_CALLS = frozenset({"subscribe", "pull_subscribe", "subscriber", "follow"})
SUBSCRIBING_NAMES = frozenset({"DeliverPolicy", "ConsumerConfig", "NatsBroker", "Subscription"})


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_each_services_followers_are_the_ones_listed_here(service: str) -> None:
    definition = SERVICES[service]
    found = {(f.context, f.start, f.seed.name if f.seed else None) for f in definition.follows}
    assert found == FOLLOWERS[service]
    # Its NATS read permissions are exactly what it follows.
    assert set(definition.reads) == {context for context, _, _ in FOLLOWERS[service]}


def test_the_topology_agent_follows_nothing() -> None:
    assert AGENT.follows == () and AGENT.consumers == ()


def _subscribing(path: Path) -> list[str]:
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SUBSCRIBING_CALLS:
            found.append(f"{where}:{node.lineno} .{node.func.attr}(...)")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in SUBSCRIBING_NAMES or (node.module == "shared.infra.bus" and alias.name == "follow"):
                    found.append(f"{where}:{node.lineno} imports {alias.name}")
    return found


def test_no_service_subscribes_to_nats_outside_the_kit() -> None:
    found = [hit for path in sorted((ROOT / "services").rglob("*.py")) for hit in _subscribing(path)]
    assert found == [], "subscribe through ServiceDefinition.follows / consumers / listens instead"


def test_the_scan_finds_a_hand_written_follower(tmp_path: Path) -> None:
    probe = tmp_path / "follower.py"
    probe.write_text(
        "from shared.infra.bus import follow\n"
        "from nats.js.api import DeliverPolicy\n"
        "async def sneak(js):\n"
        "    await js.subscribe('x.>', cb=print)\n"
    )
    assert len(_subscribing(probe)) == 3
