"""Adapters: settings, logging, database, bus, outbox/inbox, telemetry."""
