"""Deliberate breaks of service and database code that the suite must catch (a mutation check)."""
