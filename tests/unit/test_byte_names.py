"""Each byte figure travels once, under its `_bytes` name; the unit-less names earlier releases sent
(`usable`, `hbm_reserved`, `weights`, ...) are still read, for one release (issue 24, deliverable 6)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from shared.contracts.base import Contract
from shared.contracts.envelope import EventEnvelope
from shared.contracts.fleet import AcceleratorView
from shared.contracts.ledger import (
    AcceleratorBalance,
    AcceleratorLedgerView,
    AllocationEvent,
    CapacityChangedEvent,
    CommitRequest,
    LedgerEventName,
    ShareIn,
    ShareOut,
)
from shared.contracts.placement import AcceleratorShare
from shared.contracts.registry import EVENTS
from shared.contracts.subjects import Context
from shared.domain.ledger import replay_reserved
from shared.infra.bus import dispatch

GB = 10**9
SHARE = (
    ("weights", "weights_bytes"),
    ("kv", "kv_bytes"),
    ("activation", "activation_bytes"),
    ("workspace", "workspace_bytes"),
)
TOTAL = ("total", "total_bytes")

# Per model: its fields besides the byte figures, and (deprecated name, name) of each figure.
RENAMED: list[tuple[type[BaseModel], dict[str, Any], tuple[tuple[str, str], ...]]] = [
    (
        AcceleratorLedgerView,
        {"id": "n/gpu0", "node": "n"},
        (("hbm_usable", "hbm_usable_bytes"), ("hbm_reserved", "hbm_reserved_bytes")),
    ),
    (
        AcceleratorBalance,
        {"id": "n/gpu0", "available": True},
        (("usable", "usable_bytes"), ("reserved", "reserved_bytes")),
    ),
    (
        AcceleratorView,
        {"id": "n/gpu0", "index": 0},
        (("hbm_total", "hbm_total_bytes"), ("hbm_reserved", "hbm_reserved_bytes")),
    ),
    (ShareIn, {"accelerator_id": "n/gpu0"}, SHARE),
    (ShareOut, {"accelerator_id": "n/gpu0"}, (*SHARE, TOTAL)),
    (AcceleratorShare, {}, (*SHARE, TOTAL)),
]
IDS = [model.__name__ for model, _rest, _pairs in RENAMED]


def figures(pairs: tuple[tuple[str, str], ...], *, old: bool) -> dict[str, int]:
    """A distinct value per figure, under its deprecated or its own name."""
    return {(o if old else new): (i + 1) * GB for i, (o, new) in enumerate(pairs)}


@pytest.mark.parametrize(("model", "rest", "pairs"), RENAMED, ids=IDS)
def test_the_deprecated_name_is_read_and_only_the_bytes_name_is_sent(
    model: type[BaseModel], rest: dict[str, Any], pairs: tuple[tuple[str, str], ...]
) -> None:
    read = model.model_validate({**rest, **figures(pairs, old=True)})
    assert read == model.model_validate({**rest, **figures(pairs, old=False)})
    for wire in (read.model_dump(), read.model_dump(mode="json"), json.loads(read.model_dump_json())):
        assert {new: wire[new] for _old, new in pairs} == figures(pairs, old=False)
        assert not {old for old, _new in pairs} & set(wire), "a figure sent twice"
    assert all(old not in model.model_fields for old, _new in pairs)


@pytest.mark.parametrize(("model", "rest", "pairs"), RENAMED, ids=IDS)
def test_both_names_with_one_value_read_as_one_and_with_two_values_are_refused(
    model: type[BaseModel], rest: dict[str, Any], pairs: tuple[tuple[str, str], ...]
) -> None:
    # What the previous release sent: every figure under both names, the same value.
    both = {**rest, **figures(pairs, old=True), **figures(pairs, old=False)}
    assert model.model_validate(both) == model.model_validate({**rest, **figures(pairs, old=False)})
    old, new = pairs[0]
    with pytest.raises(ValidationError, match=f"`{old}` \\(deprecated\\) and `{new}` differ"):
        model.model_validate({**both, old: both[new] + 1})
    with pytest.raises(ValidationError):  # `true` is not 1 under the other name either
        model.model_validate({**both, old: True, new: 1})


@pytest.mark.parametrize(("model", "_rest", "pairs"), RENAMED, ids=IDS)
def test_each_deprecated_name_is_documented_on_its_field(
    model: type[BaseModel], _rest: dict[str, Any], pairs: tuple[tuple[str, str], ...]
) -> None:
    for old, new in pairs:
        description = model.model_fields[new].description or ""
        assert f"Deprecated input name: `{old}`" in description and "never sent" in description


async def test_a_commit_giving_one_figure_two_values_is_an_invalid_request() -> None:
    async def never(_request: CommitRequest) -> Contract:
        raise AssertionError("a refused body reaches no handler")

    body = {"request_id": "r", "tenant": "t", "shares": [{"accelerator_id": "n/gpu0", "kv": GB, "kv_bytes": 2 * GB}]}
    reply = json.loads(await dispatch(json.dumps(body).encode(), CommitRequest, never))
    assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request"
    assert "`kv` (deprecated) and `kv_bytes` differ" in reply["error"]["message"]


def old_event(name: LedgerEventName, payload: dict[str, Any]) -> EventEnvelope:
    """An event as an earlier release wrote it to the LEDGER stream (kept for 7 days), read back."""
    raw = {
        "event_id": "0b8e2c4e-3f57-4c8e-a1a3-6d2f1b4c9e10",
        "type": f"ledger.{name}",
        "version": 1,
        "occurred_at": "2026-11-30T12:00:00Z",
        "source": "capacity-ledger",
        "payload": payload,
    }
    return EventEnvelope.model_validate_json(json.dumps(raw))


# The previous release: each figure twice; the one before it: unit-less names only.
OLD_SHARES = {
    "previous release": {
        "accelerator_id": "n/gpu0",
        **{"weights": 3 * GB, "kv": GB, "activation": 0, "workspace": 0, "total": 4 * GB},
        **{"weights_bytes": 3 * GB, "kv_bytes": GB, "activation_bytes": 0, "workspace_bytes": 0, "total_bytes": 4 * GB},
    },
    "unit-less only": {
        "accelerator_id": "n/gpu0",
        "weights": 3 * GB,
        "kv": GB,
        "activation": 0,
        "workspace": 0,
        "total": 4 * GB,
    },
}


@pytest.mark.parametrize("share", OLD_SHARES.values(), ids=OLD_SHARES.keys())
def test_an_old_allocation_event_still_in_the_stream_parses_and_folds(share: dict[str, Any]) -> None:
    name = LedgerEventName.ALLOCATION_COMMITTED
    payload = {"allocation_id": "al-1", "request_id": "r-1", "tenant": "acme", "kind": "replica", "shares": [share]}
    envelope = old_event(name, payload)
    event = EVENTS[(Context.LEDGER, name)].model_validate(envelope.payload)
    assert isinstance(event, AllocationEvent)
    (read,) = event.shares
    assert (read.weights_bytes, read.kv_bytes, read.total_bytes) == (3 * GB, GB, 4 * GB)
    assert replay_reserved([(name, event)]) == {"n/gpu0": 4 * GB}
    assert "total" not in event.model_dump(mode="json")["shares"][0]  # re-sent with each figure once


def test_an_old_capacity_changed_event_still_parses() -> None:
    name = LedgerEventName.CAPACITY_CHANGED
    accelerator = {"id": "n/gpu0", "usable": 79 * GB, "reserved": 10 * GB, "available": False}
    envelope = old_event(name, {"node": "n", "reason": "lost", "accelerators": [accelerator]})
    event = EVENTS[(Context.LEDGER, name)].model_validate(envelope.payload)
    assert isinstance(event, CapacityChangedEvent)
    (read,) = event.accelerators
    assert (read.usable_bytes, read.reserved_bytes, read.available) == (79 * GB, 10 * GB, False)
