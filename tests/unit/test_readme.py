"""The README documents every setting and the two quick-start commands CI relies on."""

from __future__ import annotations

from pathlib import Path

from shared.infra.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def test_every_setting_is_in_the_readme_table() -> None:
    readme = (REPO / "README.md").read_text()
    missing = [name for name in Settings.model_fields if f"`HETSCHED_{name.upper()}`" not in readme]
    assert not missing


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest"
    assert command in readme and command in ci
