"""Least privilege (issue 11): owner roles own every schema, table and function; the services' login
roles own nothing and hold only the DML they use.

Before this, the migrating user (a superuser in `hetsched up`) owned everything and a service role
had full DML plus sequence ``setval`` and ``EXECUTE`` on every function of its schema. Now:

* ``hetsched_<schema>_owner`` (NOLOGIN, one per schema) owns the schema, its tables (their identity
  sequences and indexes with them) and functions. Only migrations act as it: a superuser can, any other
  migrating user is made a member here. Ownership is what ``ALTER TABLE``, ``DROP``, ``TRUNCATE`` (without
  the privilege), ``DISABLE TRIGGER`` and ``CREATE OR REPLACE FUNCTION`` need, so no service can do them.
* ``hetsched_<schema>`` (LOGIN; NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOBYPASSRLS NOREPLICATION,
  member of no role) has CONNECT on this database, USAGE (not CREATE) on its own schema, SELECT, INSERT,
  UPDATE, DELETE on its tables and USAGE, SELECT on its sequences. Never TRUNCATE, REFERENCES or TRIGGER,
  never ``setval``, no EXECUTE on the trigger functions (a trigger fires without it).
* The ledger's journal is SELECT, INSERT only for the ledger role (the append-only trigger stays, for the
  owner and superusers). ``ledger.accelerators.reserved`` is written only by the ``shares_apply``
  trigger: the ledger role may insert and update every other column of an accelerator, not that one,
  and may not delete an accelerator; ``ledger.apply_share()`` is SECURITY DEFINER (it runs as the
  ledger owner, with a fixed ``search_path``), so the totals follow the shares and the over-commit
  check cannot be skipped from a service connection.
* No role but the database owner creates objects in ``public`` (``REVOKE CREATE ... FROM PUBLIC``, the
  default since Postgres 15, said outright for databases made from an older template).

``SET session_replication_role`` (the way around triggers) is superuser-only: a login role gets
``permission denied to set parameter``. Tables a later migration adds must be created as the owner role
(``SET LOCAL ROLE hetsched_<schema>_owner``) so the default privileges below grant the service its DML;
tests/integration/test_postgres_privileges.py checks that every object is owned by its owner role.

Revision ID: 0009_least_privilege
Revises: 0008_placement_intents
Create Date: 2026-12-03
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009_least_privilege"
down_revision: str | None = "0008_placement_intents"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")
DML = "SELECT, INSERT, UPDATE, DELETE"
# ledger.accelerators without `reserved` (the shares trigger's) and `id` (a key is not renamed).
ACCELERATOR_INSERT = "id, node, sku, hbm_total, ceiling, hbm_usable, available, updated_at"
ACCELERATOR_UPDATE = "node, sku, hbm_total, ceiling, hbm_usable, available, updated_at"


def _role(schema: str) -> str:
    return f"hetsched_{schema}"


def _owner(schema: str) -> str:
    return f"hetsched_{schema}_owner"


def _give_objects(schema: str, to: str) -> str:
    """Tables (with their identity sequences and indexes), free-standing sequences and functions of
    ``schema`` to ``to`` (a role name or CURRENT_USER)."""
    return f"""
    DO $$
    DECLARE r record;
    BEGIN
      FOR r IN SELECT c.oid::regclass AS rel FROM pg_class c
               WHERE c.relnamespace = '{schema}'::regnamespace AND c.relkind IN ('r', 'p', 'v') LOOP
        EXECUTE format('ALTER TABLE %s OWNER TO {to}', r.rel);
      END LOOP;
      FOR r IN SELECT c.oid::regclass AS rel FROM pg_class c
               WHERE c.relnamespace = '{schema}'::regnamespace AND c.relkind = 'S'
                 AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                                 AND d.objid = c.oid AND d.deptype IN ('a', 'i')) LOOP
        EXECUTE format('ALTER SEQUENCE %s OWNER TO {to}', r.rel);
      END LOOP;
      FOR r IN SELECT p.oid::regprocedure AS fn FROM pg_proc p WHERE p.pronamespace = '{schema}'::regnamespace LOOP
        EXECUTE format('ALTER ROUTINE %s OWNER TO {to}', r.fn);
      END LOOP;
    END $$;
    """


def _owner_role(schema: str) -> None:
    owner = _owner(schema)
    # Roles are cluster-wide: concurrent migrations of two databases may both create it; either wins.
    op.execute(
        f"""
        DO $$ BEGIN
          CREATE ROLE {owner} NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOBYPASSRLS;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
        END $$;
        """
    )
    # A migrating user that is not a superuser must be a member to hand objects to the owner and to
    # alter or drop them in later migrations.
    op.execute(
        f"""
        DO $$ BEGIN
          IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
             AND NOT pg_has_role(current_user, '{owner}', 'MEMBER') THEN
            EXECUTE format('GRANT {owner} TO %I', current_user);
          END IF;
        EXCEPTION WHEN unique_violation THEN NULL;
        END $$;
        """
    )


def _login_role(schema: str) -> None:
    """The login role's attributes, changed only where they differ (changing an attribute a role already
    has can need superuser, and a no-op ALTER ROLE could race another migration's)."""
    role = _role(schema)
    op.execute(
        f"""
        DO $$
        DECLARE r record;
        BEGIN
          IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}' AND (rolsuper OR rolcreatedb OR rolcreaterole
                     OR rolinherit OR rolbypassrls OR rolreplication OR NOT rolcanlogin)) THEN
            ALTER ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOBYPASSRLS NOREPLICATION;
          END IF;
          -- A member of another role could SET ROLE to it (NOINHERIT does not stop that).
          FOR r IN SELECT m.roleid::regrole AS granted FROM pg_auth_members m
                   WHERE m.member = '{role}'::regrole LOOP
            BEGIN
              EXECUTE format('REVOKE %s FROM {role}', r.granted);
            EXCEPTION WHEN insufficient_privilege THEN
              RAISE WARNING 'cannot revoke % from {role}: do it as a superuser', r.granted;
            END;
          END LOOP;
          EXECUTE format('GRANT CONNECT ON DATABASE %I TO {role}', current_database());
        END $$;
        """
    )


def upgrade() -> None:
    op.execute(
        """
        DO $$ BEGIN
          REVOKE CREATE ON SCHEMA public FROM PUBLIC;
        EXCEPTION WHEN insufficient_privilege THEN
          RAISE WARNING 'cannot revoke CREATE on schema public from PUBLIC: do it as the database owner';
        END $$;
        """
    )
    for schema in SCHEMAS:
        role, owner = _role(schema), _owner(schema)
        _owner_role(schema)
        _login_role(schema)
        op.execute(f"REVOKE ALL ON SCHEMA public FROM {role}")
        op.execute(f"ALTER SCHEMA {schema} OWNER TO {owner}")
        op.execute(_give_objects(schema, owner))
        # What 0005 granted, and nothing more than the service uses.
        op.execute(f"REVOKE ALL ON SCHEMA {schema} FROM {role}")
        op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}")
        op.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {role}")
        op.execute(f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM {role}, PUBLIC")
        op.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        op.execute(f"GRANT {DML} ON ALL TABLES IN SCHEMA {schema} TO {role}")
        op.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {role}")
        # New objects: granted when the owner creates them, no longer when the migrating user does.
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE {DML} ON TABLES FROM {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE USAGE, SELECT, UPDATE ON SEQUENCES FROM {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} REVOKE EXECUTE ON FUNCTIONS FROM {role}")
        owners_defaults = f"ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema}"
        op.execute(f"{owners_defaults} GRANT {DML} ON TABLES TO {role}")
        op.execute(f"{owners_defaults} GRANT USAGE, SELECT ON SEQUENCES TO {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES FOR ROLE {owner} REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC")

    ledger = _role("ledger")
    op.execute(f"REVOKE UPDATE, DELETE ON ledger.journal FROM {ledger}")
    op.execute(f"REVOKE INSERT, UPDATE, DELETE ON ledger.accelerators FROM {ledger}")
    op.execute(f"GRANT INSERT ({ACCELERATOR_INSERT}), UPDATE ({ACCELERATOR_UPDATE}) ON ledger.accelerators TO {ledger}")
    # Runs as the ledger owner, so it may write `reserved`; a fixed search_path, as any SECURITY DEFINER must.
    op.execute("ALTER FUNCTION ledger.apply_share() SECURITY DEFINER SET search_path = pg_catalog, pg_temp")


def downgrade() -> None:
    # Back to 0005's grants, everything owned by the migrating user. The owner roles stay (cluster-wide:
    # other databases may use them); `public` keeps CREATE revoked (Postgres 15's default anyway).
    op.execute("ALTER FUNCTION ledger.apply_share() SECURITY INVOKER RESET search_path")
    for schema in reversed(SCHEMAS):
        role, owner = _role(schema), _owner(schema)
        owners_defaults = f"ALTER DEFAULT PRIVILEGES FOR ROLE {owner} IN SCHEMA {schema}"
        op.execute(f"{owners_defaults} REVOKE {DML} ON TABLES FROM {role}")
        op.execute(f"{owners_defaults} REVOKE USAGE, SELECT ON SEQUENCES FROM {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES FOR ROLE {owner} GRANT EXECUTE ON FUNCTIONS TO PUBLIC")
        op.execute(_give_objects(schema, "CURRENT_USER"))
        op.execute(f"ALTER SCHEMA {schema} OWNER TO CURRENT_USER")
        op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {role}")
        op.execute(f"GRANT {DML} ON ALL TABLES IN SCHEMA {schema} TO {role}")
        op.execute(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}")
        op.execute(f"GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role}, PUBLIC")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT {DML} ON TABLES TO {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {role}")
        op.execute(f"ALTER DEFAULT PRIVILEGES IN SCHEMA {schema} GRANT EXECUTE ON FUNCTIONS TO {role}")
        op.execute(
            f"DO $$ BEGIN EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {role}', current_database()); END $$"
        )
