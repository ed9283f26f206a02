"""Settings from the environment (prefix ``HETSCHED_``) or a ``.env``-style settings file."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME")
    return (Path(base) if base else Path.home() / ".local" / "share") / "hetsched"


class Settings(BaseSettings):
    """Every knob of hetsched. Each field is read from ``HETSCHED_<FIELD>`` (upper case)."""

    model_config = SettingsConfigDict(
        env_prefix="HETSCHED_",
        env_file=os.environ.get("HETSCHED_SETTINGS_FILE"),
        extra="ignore",
        frozen=True,
    )

    nats_url: str | None = Field(
        default=None,
        description="NATS server URL. Unset: `hetsched up` starts an embedded NATS with JetStream.",
        examples=["nats://127.0.0.1:4222"],
    )
    database_url: str | None = Field(
        default=None,
        description="Postgres URL. Unset: `hetsched up` starts an embedded Postgres.",
        examples=["postgresql://postgres@127.0.0.1:5432/hetsched"],
    )
    data_dir: Path = Field(
        default_factory=_default_data_dir,
        description="Where `hetsched up` keeps the embedded servers' data and its state file.",
    )
    subject_prefix: str = Field(
        default="hetsched",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="First token of every subject; a test run or a tenant-isolated deployment changes it.",
    )
    stream_prefix: str = Field(
        default="",
        pattern=r"^[A-Za-z0-9_-]*$",
        description="Prepended to every JetStream stream name (stream names are otherwise the context name).",
    )
    region: str = Field(default="local", description="Region this service instance serves.")
    log_level: str = Field(default="INFO", description="Python logging level.")
    log_format: str = Field(default="json", pattern=r"^(json|text)$", description="`json` or `text`.")
    request_timeout_ms: int = Field(default=5000, gt=0, description="Timeout of CLI requests over NATS.")
    outbox_poll_ms: int = Field(default=100, gt=0, description="Outbox relay poll interval.")
    outbox_batch: int = Field(default=256, gt=0, le=10_000, description="Rows the relay publishes per pass.")
    stream_duplicate_window_s: float = Field(
        default=120.0, gt=0, description="JetStream duplicate window: a re-sent event id inside it is dropped."
    )
    telemetry_max_age_s: float = Field(default=3600.0, gt=0, description="Max age of TELEMETRY messages.")
    otel_exporter: str = Field(
        default="none", pattern=r"^(none|console|otlp)$", description="OpenTelemetry exporter for traces."
    )
    db_pool_size: int = Field(default=10, gt=0, description="SQLAlchemy pool size per service.")


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides (used by tests and the launcher)."""
    return Settings(**overrides)  # type: ignore[arg-type]
