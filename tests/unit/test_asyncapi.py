"""The AsyncAPI document in the repository is the one the contracts generate, and it covers every
request subject and every event."""

from __future__ import annotations

import json
from pathlib import Path

from shared.contracts.asyncapi import asyncapi_document
from shared.contracts.registry import EVENTS, RPCS
from shared.contracts.subjects import Rpc
from shared.infra.service import hetsched_version

REPO = Path(__file__).resolve().parents[2]


def test_committed_document_is_up_to_date() -> None:
    committed = json.loads((REPO / "docs" / "asyncapi.json").read_text())
    generated = json.loads(json.dumps(asyncapi_document(version=hetsched_version())))
    assert committed == generated, "run `hetsched asyncapi --out docs/asyncapi.json`"


def test_every_subject_and_event_is_documented() -> None:
    doc = asyncapi_document(version="test")
    addresses = {c["address"] for c in doc["channels"].values()}
    assert {f"hetsched.{rpc.value}" for rpc in Rpc} <= addresses
    assert set(RPCS) == set(Rpc)
    for (context, event), model in EVENTS.items():
        subject = f"hetsched.events.{context.value}.{event}"
        assert subject in addresses or f"{subject}.{{node}}" in addresses  # node-scoped: one subject per node
        assert model.__name__ in doc["components"]["schemas"]
    assert "EventEnvelope" in doc["components"]["schemas"]
