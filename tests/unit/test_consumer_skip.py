"""``Consumer.skip``: an event a consumer has nothing to do with (told by its payload) is done with before
any transaction: no session, no inbox row."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from shared.contracts.envelope import new_event
from shared.contracts.ledger import AllocationEvent, LedgerEventName
from shared.contracts.subjects import Context
from shared.infra.bus import consume


class NoDatabase:
    """A unit-of-work factory that fails the test if anything opens a transaction."""

    schema = "probe"

    def sessions(self) -> Any:
        raise AssertionError("a skipped event opened a transaction")


def _event(kind: str) -> bytes:
    payload = AllocationEvent(allocation_id="al-1", request_id="r-1", tenant="acme", kind=kind, shares=[])
    return (
        new_event(
            type=f"{Context.LEDGER.value}.{LedgerEventName.ALLOCATION_COMMITTED.value}",
            source="capacity-ledger",
            payload=payload.model_dump(mode="json"),
            occurred_at=datetime(2026, 11, 30, tzinfo=UTC),
        )
        .model_dump_json()
        .encode()
    )


async def test_a_skipped_event_opens_no_transaction_and_reaches_no_handler() -> None:
    seen: list[str] = []

    async def handler(**kwargs: Any) -> None:
        seen.append(kwargs["payload"].kind)

    apply = consume(
        uow=NoDatabase(),  # type: ignore[arg-type]
        schema="probe",
        consumer="probe",
        context=Context.LEDGER,
        handlers={LedgerEventName.ALLOCATION_COMMITTED.value: handler},
        skip=lambda payload: payload.kind != "replica",
    )
    await apply(_event("request"))  # skipped: no transaction, no handler
    assert seen == []
    with pytest.raises(AssertionError, match="opened a transaction"):
        await apply(_event("replica"))  # not skipped: it goes to the transaction (this fake refuses it)
