"""One call to the ledger as the use cases make it (release, renew): its reply, or its refusal as it came."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from shared.contracts.base import ErrorCode, Rejected, rejected
from shared.contracts.subjects import Rpc
from shared.infra.rpc import RpcClient, RpcError

ReplyT = TypeVar("ReplyT", bound=BaseModel)


async def ask_ledger(rpc: RpcClient, subject: Rpc, request: BaseModel, reply: type[ReplyT]) -> ReplyT | Rejected:
    """The ledger's reply or its ``Rejected``; no answer is an ``internal`` refusal (the caller may ask again)."""
    try:
        return await rpc.ask(subject, request, reply)
    except RpcError as exc:
        return rejected(ErrorCode.INTERNAL, str(exc))
