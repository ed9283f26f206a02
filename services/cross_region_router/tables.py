"""Tables of the cross-region-router service: everything it owns lives in schema `routing` (its outbox and
inbox so far; its own tables land with the request-path issue (14))."""

from __future__ import annotations

SCHEMA = "routing"
