"""Fault-injection points for tests: a setting names a fault, and the service calls the hook where a crash
would hurt most (e.g. ``HETSCHED_RESERVATION_FAULT_AFTER_RECORD``)."""

from __future__ import annotations

import os
from collections.abc import Callable

EXIT_STATUS = 70


def _exit() -> None:
    os._exit(EXIT_STATUS)  # no cleanup, no flush: what a SIGKILL leaves


def _nothing() -> None:
    return None


def fault_hook(mode: str | None) -> Callable[[], None]:
    """A function that ends the process at once (exit status 70, as a SIGKILL would leave things) when
    ``mode`` is ``"exit"``; otherwise one that does nothing."""
    return _exit if mode == "exit" else _nothing
