"""The README documents every setting and the two quick-start commands CI relies on."""

from __future__ import annotations

from pathlib import Path

from shared.infra.settings import env_vars
from shared.infra.settings_doc import readme_table, table

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_in_the_readme_table() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [name for name in env_vars() if f"`{name}`" not in readme]
    assert not missing


def test_the_readme_settings_table_is_the_one_generated_from_the_models() -> None:
    current = readme_table((REPO / "README.md").read_text())
    assert current, "README.md lost the settings table's markers"
    assert current == table(), "README's settings table drifted: run `python -m shared.infra.settings_doc --write`"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    assert command in readme and command in ci
