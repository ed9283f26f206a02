"""The fakes every service's handler tests share (Cosmic Python's ``FakeUnitOfWork``): a unit of work with
no database and an RPC client that answers from a script. A handler test hands them to the handler class
with a fake store of its service (the store is the service's own; these are the kit's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel

from shared.contracts.envelope import EventEnvelope
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.rpc import RpcClient
from shared.infra.uow import DriverUnitOfWork, UnitOfWork, run_committed

T = TypeVar("T")
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)

Answer = BaseModel | Exception | Callable[[BaseModel], BaseModel]


class FakeUnitOfWork:
    """Runs work on a ``UnitOfWork`` with no session. Work that completes "commits": its events are kept
    (``events``, in order) and its ``after_commit`` changes run; work that raises is rolled back: neither.
    ``fail_next`` makes the next commit fail after the work ran (a transaction Postgres refused)."""

    def __init__(self, clock: Callable[[], datetime] = lambda: NOW, *, source: str = "test") -> None:
        self.clock = clock
        self.source = source
        self.events: list[EventEnvelope] = []
        self.runs = 0
        self.fail_next: Exception | None = None

    def unit(self) -> UnitOfWork:
        return UnitOfWork(session=None, now=self.clock(), subjects=Subjects("t"), source=self.source)  # type: ignore[arg-type]

    async def run(self, work: Callable[[UnitOfWork], Awaitable[T]], *, session: Any = None) -> T:
        self.runs += 1
        uow = self.unit()
        result = await work(uow)  # an exception discards the events and the changes, as a rollback does
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure
        self.events.extend(event for _subject, event in uow.events)
        run_committed(uow.committed)
        return result

    run_grouped = run  # a group shares a transaction; alone, each work is its own

    async def run_on_driver(self, work: Callable[[DriverUnitOfWork], Awaitable[T]], *, transaction: bool = True) -> T:
        """``run`` for a work on the asyncpg connection (there is none: ``uow.connection`` is None)."""
        self.runs += 1
        uow = DriverUnitOfWork(
            connection=None, transaction=transaction, now=self.clock(), subjects=Subjects("t"), source=self.source
        )
        result = await work(uow)
        if self.fail_next is not None:
            failure, self.fail_next = self.fail_next, None
            raise failure
        self.events.extend(event for _subject, event in uow.events)
        run_committed(uow.committed)
        return result

    async def read(self, work: Callable[[Any], Awaitable[T]]) -> T:
        return await work(None)

    def wake(self) -> None:
        """The relay's wake-up: nothing to wake here."""

    def names(self) -> list[str]:
        """The names of the events committed so far, in order (``allocation_committed``, ...)."""
        return [e.type.rsplit(".", 1)[-1] for e in self.events]

    def named(self, name: str) -> list[dict[str, Any]]:
        """The payloads of the committed events of one name."""
        return [e.payload for e in self.events if e.type.rsplit(".", 1)[-1] == name]


class FakeRpc(RpcClient):
    """Answers each subject from a script (a reply, an exception to raise, or a function of the request);
    the last answer repeats. Records every request. ``FakeRpc(ledger_commit=[reply])``."""

    def __init__(self, **script: list[Answer]) -> None:
        super().__init__(lambda: None, Subjects("t"))  # type: ignore[arg-type, return-value]
        self.script = {Rpc[name.upper()]: answers for name, answers in script.items()}
        self.sent: list[tuple[Rpc, BaseModel]] = []
        # Called with each request just before it is answered (a test's way to act "meanwhile").
        self.before_answer: dict[Rpc, Callable[[BaseModel], None]] = {}

    async def call(
        self,
        rpc: Rpc,
        request: BaseModel,
        *,
        timeout_s: float | None = None,
        rejection_as_reply: bool = False,
        scope: str | None = None,
    ) -> BaseModel:
        self.sent.append((rpc, request))
        if rpc in self.before_answer:
            self.before_answer[rpc](request)
        if rpc not in self.script:
            raise AssertionError(f"unexpected call to {rpc.value}")
        answers = self.script[rpc]
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, Exception):
            raise answer
        if callable(answer) and not isinstance(answer, BaseModel):
            return answer(request)
        return answer

    def requests(self, rpc: Rpc) -> list[Any]:
        return [request for sent, request in self.sent if sent is rpc]
