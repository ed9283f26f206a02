"""``fault_hook``: `exit` ends the process as a SIGKILL would (``os._exit``, status 70); anything else is a
no-op."""

from __future__ import annotations

import os

import pytest

from shared.infra import faults


def test_exit_calls_os_exit_70_and_anything_else_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    for mode in (None, "", "crash", "EXIT"):
        faults.fault_hook(mode)()
    assert exits == []
    faults.fault_hook("exit")()
    assert exits == [70]
