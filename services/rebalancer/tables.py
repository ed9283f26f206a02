"""Tables of the rebalancer service: everything it owns lives in schema `rebalance` (its outbox and
inbox so far; its own tables land with the rebalancer issue (16))."""

from __future__ import annotations

SCHEMA = "rebalance"
