"""Tables of the reservation-filler service: everything it owns lives in schema `reservation` (its outbox and
inbox so far; its own tables land with the reservations issue (15))."""

from __future__ import annotations

SCHEMA = "reservation"
