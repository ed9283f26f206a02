"""Names renamed in issue 24 stay importable for one release, and nothing in the repository uses them."""

from __future__ import annotations

import re
from pathlib import Path

import shared.contracts.placement as placement
import shared.contracts.placement_events as placement_events
from shared.contracts.ledger import LedgerEvent, LedgerEventName
from shared.contracts.routing import RoutingEvent, RoutingEventName
from shared.contracts.topology import TelemetryEvent, TelemetryEventName, TopologyEvent, TopologyEventName

REPO = Path(__file__).resolve().parents[2]
OLD_NAMES = re.compile(r"\b(LedgerEvent|TopologyEvent|TelemetryEvent|RoutingEvent)\b|\bplacement_events\b")
ALIAS_MARKER = "deprecated alias (issue 24)"
THIS = Path(__file__).resolve()
SHIM = REPO / "shared" / "contracts" / "placement_events.py"


def test_the_old_event_name_enums_are_the_new_ones() -> None:
    assert LedgerEvent is LedgerEventName
    assert TopologyEvent is TopologyEventName
    assert TelemetryEvent is TelemetryEventName
    assert RoutingEvent is RoutingEventName


def test_placement_events_re_exports_the_placement_contracts() -> None:
    for name in placement_events.__all__:
        assert getattr(placement_events, name) is getattr(placement, name), name


def test_no_code_uses_the_old_names() -> None:
    found = []
    paths = [REPO / "README.md"]
    for folder in ("shared", "services", "hetsched", "migrations", "tests", "docs"):
        paths += sorted(p for p in (REPO / folder).rglob("*") if p.suffix in {".py", ".md"})
    for path in paths:
        if path.resolve() in {THIS, SHIM}:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if OLD_NAMES.search(line) and ALIAS_MARKER not in line:
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == [], "\n".join(found)
