"""Retention settings and stream limits as data (issue 23 row 7; real streams: tests/integration/test_retention.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.contracts.streams import RESTATED, restate_every_s, stream_specs
from shared.contracts.subjects import Context, Subjects
from shared.infra.retention import stream_specs_for
from shared.infra.settings import Settings

DAY = 86_400.0
CONTEXT_STREAMS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")


def test_every_stream_has_a_max_age_and_a_size_cap_from_the_settings(tmp_path: Path) -> None:
    settings = Settings(kit={"data_dir": tmp_path, "stream_placement_max_age_s": DAY, "stream_max_bytes": 5 * 1024**3})
    specs = {s.name: s for s in stream_specs_for(settings)}
    assert {name: s.max_age_s for name, s in specs.items()} == {
        "TOPOLOGY": 7 * DAY,
        "LEDGER": 7 * DAY,
        "PLACEMENT": DAY,
        "RESERVATION": 7 * DAY,
        "ROUTING": 7 * DAY,
        "REBALANCE": 7 * DAY,
        "TELEMETRY": 3600.0,
        "GATEWAY": 7 * DAY,
        "DEADLETTER": 14 * DAY,
    }
    assert {s.max_bytes for s in specs.values()} == {5 * 1024**3}
    assert Settings(kit={"data_dir": tmp_path, "stream_max_bytes": 0}).kit.stream_max_bytes == 0
    assert {s.max_bytes for s in stream_specs_for(Settings(kit={"data_dir": tmp_path, "stream_max_bytes": 0}))} == {
        None
    }


def test_the_duplicate_window_never_outlasts_the_max_age() -> None:
    """JetStream refuses a duplicate window longer than the max age: a short stream gets a short window."""
    specs = {
        s.name: s
        for s in stream_specs(
            subjects=Subjects(), duplicate_window_s=120, telemetry_max_age_s=30, max_age_s={Context.ROUTING: 60}
        )
    }
    assert specs["TELEMETRY"].duplicate_window_s == 30 and specs["ROUTING"].duplicate_window_s == 60
    assert specs["LEDGER"].duplicate_window_s == 120


def test_streams_folded_from_their_first_sequence_are_restated_well_inside_their_max_age() -> None:
    assert {Context.RESERVATION, Context.REBALANCE} == RESTATED
    assert restate_every_s(7 * DAY) == 7 * DAY / 4


def test_settings_refuse_an_inbox_that_forgets_before_a_copy_can_come_back(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="inbox_retention_s"):
        Settings(
            kit={"data_dir": tmp_path, "inbox_retention_s": DAY}
        )  # under the 7-day streams and 14-day dead letters
    with pytest.raises(ValueError, match="inbox_retention_s"):
        Settings(kit={"data_dir": tmp_path, "stream_ledger_max_age_s": 30 * DAY})  # a stream would outlive the inbox
    short = {f"stream_{c}_max_age_s": DAY for c in CONTEXT_STREAMS}
    settings = Settings(
        kit={"data_dir": tmp_path, "inbox_retention_s": 2 * DAY, "deadletter_retention_s": DAY, **short}
    )
    assert settings.kit.inbox_retention_s == 2 * DAY
