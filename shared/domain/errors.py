"""The one error-code vocabulary (API.md): what a refusal is called, in the domain and on the wire.

``shared.contracts.base`` re-exports it for replies; domain code returns these codes in its outcomes
so no service translates between vocabularies.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """The closed list of error codes. ``not_implemented`` marks a subject not built yet;
    ``deadline_exceeded``: the caller's deadline passed before the work was done (nothing was done);
    ``quota_exceeded``: the request would take its tenant past a quota (``shared.domain.quotas``; nothing
    was recorded)."""

    INVALID_REQUEST = "invalid_request"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_SKU = "unknown_sku"
    NO_CAPACITY = "no_capacity"
    NOT_FOUND = "not_found"
    FORBIDDEN = "forbidden"
    CONFLICT = "conflict"
    UNSUPPORTED_VERSION = "unsupported_version"
    NOT_IMPLEMENTED = "not_implemented"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    QUOTA_EXCEEDED = "quota_exceeded"
    INTERNAL = "internal"
