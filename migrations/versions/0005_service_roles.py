"""One Postgres role per service, with rights on its own schema only (DESIGN §4, §6).

A service connects as ``hetsched_<schema>`` (``shared.infra.db.service_database_url``): it can read
and write its own tables, outbox and inbox, and nothing else, so code or SQL that reaches into
another service's schema fails with ``permission denied`` instead of coupling silently. Roles are
cluster-wide in Postgres; grants are per database, so several databases (test runs, deployments)
share the roles safely. ``HETSCHED_DATABASE_ROLE_PASSWORD`` sets their password (none with trust auth);
``config.attributes["role_passwords"]`` (``{role: password}``) gives a role its own. ``shared.infra.migrate.upgrade``
sets the passwords after every migration run instead (``hetsched up``: one generated password per role).
Migration 0009 narrows these rights (owner roles, no TRUNCATE, an append-only journal).

Revision ID: 0005_service_roles
Revises: 0004_placement
Create Date: 2026-11-30
"""

import os
from collections.abc import Sequence

from alembic import context, op

from shared.infra.db import password_sql

revision: str = "0005_service_roles"
down_revision: str | None = "0004_placement"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")


def _role(schema: str) -> str:
    return f"hetsched_{schema}"


def upgrade() -> None:
    # From a caller's Alembic config, else the environment (alembic CLI); shared.infra.migrate sets them after.
    password = context.config.attributes.get("role_password") or os.environ.get("HETSCHED_DATABASE_ROLE_PASSWORD")
    per_role: dict[str, str] = context.config.attributes.get("role_passwords") or {}
    for schema in SCHEMAS:
        role = _role(schema)
        # Concurrent migrations of two databases may both try to create the role: either wins.
        op.execute(
            f"""
            DO $$ BEGIN
              CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
            EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
            END $$;
            """
        )
        if own := per_role.get(role) or password:
            # The SCRAM verifier, not the password, goes to the server (statement logs, pg_stat_activity).
            op.execute(f"ALTER ROLE {role} PASSWORD {password_sql(own)}")
        op.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        op.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}")
        op.execute(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}")
        op.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role}")
        # Tables later migrations add (created by the migrating user) get the same rights.
        op.execute(
            f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {role}"
        )
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT EXECUTE ON FUNCTIONS TO {role}")


def downgrade() -> None:
    for schema in reversed(SCHEMAS):
        role = _role(schema)
        op.execute(
            f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE SELECT, INSERT, UPDATE, DELETE ON TABLES FROM {role}"
        )
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE USAGE, SELECT, UPDATE ON SEQUENCES FROM {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE EXECUTE ON FUNCTIONS FROM {role}")
        op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}")
        op.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}")
        op.execute(f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM {role}")
        op.execute(f"REVOKE ALL ON SCHEMA {schema} FROM {role}")
        # The role itself stays: roles are cluster-wide and other databases may still use it.
