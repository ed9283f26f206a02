"""Base classes for every contract: frozen pydantic models, versioned requests, typed errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StringConstraints, field_validator

from shared.domain.errors import ErrorCode

CONTRACT_MAJOR_VERSION = 1

# Length limits of free-form strings (API.md "Limits"): names and ids, and free text.
NAME_MAX = 200
ID_MAX = 300  # ids built from names (an accelerator id is its node's name plus `/gpu<i>`)
TEXT_MAX = 1000
ECHO_MAX = 80  # how much of a caller's value an error message repeats
MAX_LEASE_S = 30 * 86400  # the longest lease (the ledger's rule: shared.domain.ledger.MAX_LEASE_S)

# Numbers on the wire. Pydantic's lax mode reads `true` as 1 (and "5" or 5.0 as 5): every integer and
# number field of a contract is one of these instead, so a boolean (or a numeric string) is
# `invalid_request`. A whole JSON number still reads as a `Float` (`"ttft_ms": 500`).
Int = Annotated[int, Strict()]
"""A JSON integer: not a boolean, a string or a float (not even a whole one)."""
Float = Annotated[float, Strict()]
"""A JSON number (an integer reads as a float): not a boolean or a string."""

__all__ = [
    "CONTRACT_MAJOR_VERSION",
    "ECHO_MAX",
    "ID_MAX",
    "MAX_LEASE_S",
    "NAME_MAX",
    "TEXT_MAX",
    "Contract",
    "ErrorBody",
    "ErrorCode",
    "Float",
    "Int",
    "Rejected",
    "Request",
    "deprecated",
    "echo",
    "rejected",
    "unit_names",
]


class Contract(BaseModel):
    """A frozen wire model. Unknown fields are ignored so that added fields never break old readers."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class Request(Contract):
    """Every request may carry ``version``; an unknown major version is rejected."""

    version: Int | Annotated[str, StringConstraints(max_length=20)] = Field(
        default=CONTRACT_MAJOR_VERSION,
        description="Contract version the caller speaks; only the major part is checked.",
        examples=[1, "1.0"],
    )


class ErrorBody(Contract):
    code: ErrorCode = Field(description="Machine-readable error code.", examples=["invalid_request"])
    message: str = Field(description="What went wrong, for a human.", examples=["field 'tenant': missing"])
    details: dict[str, Any] | None = Field(
        default=None, description="Structured context, e.g. the fresh view on a conflict.", examples=[None]
    )

    @field_validator("message", mode="before")
    @classmethod
    def _short(cls, message: Any) -> Any:
        # A message never grows a reply past what NATS can carry: cut, not refused.
        return message[:TEXT_MAX] if isinstance(message, str) else message


class Rejected(Contract):
    """The reply to any request that could not be served."""

    status: Literal["rejected"] = Field(default="rejected", description="Always `rejected`.")
    error: ErrorBody = Field(description="Why.")
    request_id: str | None = Field(default=None, description="Echo of the request id, when known.")


def rejected(code: ErrorCode, message: str, **details: Any) -> Rejected:
    """A typed rejection reply."""
    return Rejected(error=ErrorBody(code=code, message=message, details=details or None))


def echo(value: object, *, limit: int = ECHO_MAX) -> str:
    """A caller's value for an error message: its repr, cut to ``limit`` characters (never the whole of
    a huge value, which could make the reply too large to send)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (Python's int/str digit limit)
        return "<a number too long to print>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def unit_names(data: Any, pairs: tuple[tuple[str, str], ...]) -> Any:
    """For a ``mode="before"`` validator: read a byte figure given under its deprecated unit-less name
    (``usable``) as its ``_bytes`` name (``usable_bytes``), so the model holds and sends it once.
    A body giving both names with different values is refused (``invalid_request``); the same value
    under both is what the previous release sent, and is read as one."""
    if not isinstance(data, dict) or not any(old in data for old, _new in pairs):
        return data
    out = dict(data)
    for old, new in pairs:
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and not _same(out[new], value):
            raise ValueError(f"`{old}` (deprecated) and `{new}` differ: give `{new}` only")
        out.setdefault(new, value)
    return out


def _same(a: object, b: object) -> bool:
    # `True == 1` in Python: a boolean under one name is not the number under the other.
    return type(a) is type(b) and a == b


def deprecated(old: str) -> str:
    """The sentence a field's description ends with when its unit-less name is still read."""
    return f" Deprecated input name: `{old}` (accepted until the next release, never sent)."


def major_version(version: object) -> int | None:
    """The major part of a version field (``1``, ``"1"``, ``"1.2"``), or None when unreadable."""
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version
    if isinstance(version, str):
        head = version[:20].split(".", 1)[0].strip()
        if head.isdigit() and len(head) <= 9:  # int() of a 5,000-digit string raises; no major is that long
            return int(head)
    return None
