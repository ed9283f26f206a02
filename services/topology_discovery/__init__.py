"""Topology discovery: discovers hardware and publishes node profiles, heartbeats and telemetry."""
