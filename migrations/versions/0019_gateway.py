"""gateway: the OpenAI-compatible gateway's schema, with its roles, outbox and inbox, API keys and usage

A seventh schema, in the end state the six others reached through 0001, 0005, 0007, 0009 and 0015:

* ``hetsched_gateway_owner`` (NOLOGIN) owns the schema and everything in it; a migrating user that is not a
  superuser is made a member (0009).
* ``hetsched_gateway`` (LOGIN; NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOBYPASSRLS NOREPLICATION, member
  of no role) has CONNECT, USAGE on ``gateway``, SELECT, INSERT, UPDATE, DELETE on its tables and USAGE, SELECT
  on its sequences, through the owner's default privileges (0005, 0009); its password as 0005 sets one.
* ``gateway.outbox`` and ``gateway.inbox`` as ``shared.infra.tables`` defines them: the quarantine columns and
  the unsent index of 0007, the BRIN indexes of 0015.
* ``gateway.api_keys``: one row per API key (``shared.domain.gateway.keys``), only the SHA-256 of its secret;
  never deleted, ``revoked_at`` set on revocation. ``gateway.usage``: requests and tokens per tenant, day,
  model and key, added to by the gateway.

Everything in the schema is created as the owner role, so the default privileges give the service its DML.

Revision ID: 0019_gateway
Revises: 0018_ledger_records
Create Date: 2027-01-26
"""

import os
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql

from shared.infra.db import password_sql

revision: str = "0019_gateway"
down_revision: str | None = "0018_ledger_records"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMA = "gateway"
ROLE = "hetsched_gateway"
OWNER = "hetsched_gateway_owner"
DML = "SELECT, INSERT, UPDATE, DELETE"


def _roles() -> None:
    # Roles are cluster-wide: concurrent migrations of two databases may both create one; either wins.
    op.execute(
        f"""
        DO $$ BEGIN
          CREATE ROLE {OWNER} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOBYPASSRLS;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
        END $$;
        """
    )
    # A migrating user that is not a superuser must be a member to create objects as the owner.
    op.execute(
        f"""
        DO $$ BEGIN
          IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
             AND NOT pg_has_role(current_user, '{OWNER}', 'MEMBER') THEN
            EXECUTE format('GRANT {OWNER} TO %I', current_user);
          END IF;
        EXCEPTION WHEN unique_violation THEN NULL;
        END $$;
        """
    )
    op.execute(
        f"""
        DO $$ BEGIN
          CREATE ROLE {ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOBYPASSRLS NOREPLICATION;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
        END $$;
        """
    )
    # A role left by an older run: its attributes changed only where they differ, memberships revoked (0009).
    op.execute(
        f"""
        DO $$
        DECLARE r record;
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}' AND (rolsuper OR rolcreatedb OR rolcreaterole
                     OR rolinherit OR rolbypassrls OR rolreplication OR NOT rolcanlogin)) THEN
            ALTER ROLE {ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOBYPASSRLS NOREPLICATION;
          END IF;
          FOR r IN SELECT m.roleid::regrole AS granted FROM pg_auth_members m
                   WHERE m.member = '{ROLE}'::regrole LOOP
            BEGIN
              EXECUTE format('REVOKE %s FROM {ROLE}', r.granted);
            EXCEPTION WHEN insufficient_privilege THEN
              RAISE WARNING 'cannot revoke % from {ROLE}: do it as a superuser', r.granted;
            END;
          END LOOP;
          EXECUTE format('GRANT CONNECT ON DATABASE %I TO {ROLE}', current_database());
        END $$;
        """
    )
    # From a caller's Alembic config, else the environment (alembic CLI); shared.infra.migrate sets it after (0005).
    password = context.config.attributes.get("role_password") or os.environ.get("HETSCHED_DATABASE_ROLE_PASSWORD")
    per_role: dict[str, str] = context.config.attributes.get("role_passwords") or {}
    if own := per_role.get(ROLE) or password:
        op.execute(f"ALTER ROLE {ROLE} PASSWORD {password_sql(own)}")


def _outbox_and_inbox() -> None:
    op.create_table(
        "outbox",
        sa.Column("seq", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("event_id"),
        schema=SCHEMA,
    )
    op.create_index(
        f"ix_{SCHEMA}_outbox_unsent",
        "outbox",
        ["seq"],
        schema=SCHEMA,
        postgresql_where=sa.text("sent_at IS NULL AND quarantined_at IS NULL"),
    )
    op.create_index(f"ix_{SCHEMA}_outbox_created", "outbox", ["created_at"], schema=SCHEMA, postgresql_using="brin")
    op.create_table(
        "inbox",
        sa.Column("consumer", sa.Text(), nullable=False),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("processed_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "event_id"),
        schema=SCHEMA,
    )
    op.create_index(f"ix_{SCHEMA}_inbox_processed", "inbox", ["processed_at"], schema=SCHEMA, postgresql_using="brin")


def _keys_and_usage() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.Integer(), nullable=True),
        sa.Column("models", postgresql.JSONB(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("key_id"),
        sa.CheckConstraint("rpm > 0", name="api_keys_rpm"),
        sa.CheckConstraint("tpm > 0", name="api_keys_tpm"),
        schema=SCHEMA,
    )
    op.create_table(
        "usage",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "day", "model", "key_id", name="usage_pkey"),
        schema=SCHEMA,
    )


def upgrade() -> None:
    _roles()
    op.execute(f"REVOKE ALL ON SCHEMA public FROM {ROLE}")
    op.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA} AUTHORIZATION {OWNER}")
    op.execute(f"ALTER SCHEMA {SCHEMA} OWNER TO {OWNER}")
    op.execute(f"GRANT USAGE ON SCHEMA {SCHEMA} TO {ROLE}")
    owners_defaults = f"ALTER DEFAULT PRIVILEGES FOR ROLE {OWNER} IN SCHEMA {SCHEMA}"
    op.execute(f"{owners_defaults} GRANT {DML} ON TABLES TO {ROLE}")
    op.execute(f"{owners_defaults} GRANT USAGE, SELECT ON SEQUENCES TO {ROLE}")
    op.execute(f"ALTER DEFAULT PRIVILEGES FOR ROLE {OWNER} REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC")
    op.execute(f"SET LOCAL ROLE {OWNER}")
    _outbox_and_inbox()
    _keys_and_usage()
    op.execute("RESET ROLE")


def downgrade() -> None:
    # The roles stay (cluster-wide: other databases may use them), as 0005 and 0009 leave theirs.
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.drop_table("usage", schema=SCHEMA)
    op.drop_table("api_keys", schema=SCHEMA)
    op.drop_index(f"ix_{SCHEMA}_inbox_processed", table_name="inbox", schema=SCHEMA)
    op.drop_table("inbox", schema=SCHEMA)
    op.drop_index(f"ix_{SCHEMA}_outbox_created", table_name="outbox", schema=SCHEMA)
    op.drop_index(f"ix_{SCHEMA}_outbox_unsent", table_name="outbox", schema=SCHEMA)
    op.drop_table("outbox", schema=SCHEMA)
    op.execute("RESET ROLE")
    op.execute(f"ALTER DEFAULT PRIVILEGES FOR ROLE {OWNER} GRANT EXECUTE ON FUNCTIONS TO PUBLIC")
    op.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    op.execute(f"DO $$ BEGIN EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {ROLE}', current_database()); END $$")
