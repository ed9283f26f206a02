"""Base classes for every contract: frozen pydantic models, versioned requests, typed errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.domain.errors import ErrorCode

CONTRACT_MAJOR_VERSION = 1

__all__ = [
    "CONTRACT_MAJOR_VERSION",
    "Contract",
    "ErrorBody",
    "ErrorCode",
    "Rejected",
    "Request",
    "both_names",
    "rejected",
]


class Contract(BaseModel):
    """A frozen wire model. Unknown fields are ignored so that added fields never break old readers."""

    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class Request(Contract):
    """Every request may carry ``version``; an unknown major version is rejected."""

    version: int | str = Field(
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


class Rejected(Contract):
    """The reply to any request that could not be served."""

    status: Literal["rejected"] = Field(default="rejected", description="Always `rejected`.")
    error: ErrorBody = Field(description="Why.")
    request_id: str | None = Field(default=None, description="Echo of the request id, when known.")


def rejected(code: ErrorCode, message: str, **details: Any) -> Rejected:
    """A typed rejection reply."""
    return Rejected(error=ErrorBody(code=code, message=message, details=details or None))


def both_names(data: Any, pairs: tuple[tuple[str, str], ...]) -> Any:
    """For a ``mode="before"`` validator: fill a byte field's published name from its ``_bytes`` name or
    the other way round, so a reader accepts either and both are emitted (add, never rename)."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for old, new in pairs:
        if old not in out and new in out:
            out[old] = out[new]
        elif new not in out and old in out:
            out[new] = out[old]
    return out


def major_version(version: object) -> int | None:
    """The major part of a version field (``1``, ``"1"``, ``"1.2"``), or None when unreadable."""
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version
    if isinstance(version, str):
        head = version.split(".", 1)[0].strip()
        if head.isdigit():
            return int(head)
    return None
