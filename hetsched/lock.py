"""One `hetsched up` per data dir: the lock it holds while it runs, and how the CLI tells whether one runs.

The lock is ``flock`` on ``<data-dir>/up.lock``, taken before `up` writes anything else there and held
until the process ends; the kernel drops it however the process ends (a SIGKILL leaves no stale lock).
The file holds the holder's pid, for the message a second `up` prints. This module imports nothing
heavy: a second `up` refuses before the rest of the command line loads (``refuse_second_up``).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "up.lock"
ALREADY_RUNNING_EXIT = 4
"""`hetsched up` found another one running from the same data dir and changed nothing."""
LOCK_CONTENTION_S = 0.3
"""How long `up` retries a lock that is taken: a CLI call checks for a running stack by taking it for a moment."""


class StackRunning(RuntimeError):
    """Another `hetsched up` runs from this data dir: a second one must not touch its files."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid else "pid unknown"
        super().__init__(f"a stack is already running from {data_dir} ({who}); stop it first or set HETSCHED_DATA_DIR")
        self.data_dir = data_dir
        self.pid = pid


@dataclass
class StackLock:
    """The data dir's lock, held by the running `hetsched up`."""

    path: Path
    fd: int

    @classmethod
    def acquire(cls, data_dir: Path) -> StackLock:
        """Take the lock before anything else in the data dir is written; ``StackRunning`` (naming the
        holder's pid) when another process holds it. Never waits more than ``LOCK_CONTENTION_S``."""
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + LOCK_CONTENTION_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.02)
                    continue
                pid = _holder_pid(fd)
                os.close(fd)
                raise StackRunning(data_dir, pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path=path, fd=fd)

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with the next `up` opening it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _holder_pid(fd: int) -> int | None:
    """The pid the lock's holder wrote (it writes it just after taking the lock: wait a moment for it)."""
    deadline = time.monotonic() + 0.5
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text.isdigit():
            return int(text)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def lock_holder(data_dir: Path) -> StackRunning | None:
    """The running `hetsched up` of ``data_dir`` (as the refusal a second one gets), or None. Takes the
    lock for a moment when it is free, which ``StackLock.acquire`` tolerates."""
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: no `up` ever ran there
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return StackRunning(data_dir, _holder_pid(fd))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def stack_running(data_dir: Path) -> bool:
    """Whether a `hetsched up` runs from ``data_dir``."""
    return lock_holder(data_dir) is not None


def _invoked_as_up(argv: list[str]) -> list[str] | None:
    """The options after ``up`` when this process is `hetsched up ...` (the console script, `python -m
    hetsched` or `python -m hetsched.cli`, whose ``argv[0]`` is ``-m`` while the package loads), else None."""
    if len(argv) < 2 or argv[1] != "up":
        return None
    program = Path(argv[0])
    if argv[0] == "-m" or program.name == "hetsched" or program.parts[-2:] == ("hetsched", "__main__.py"):
        return argv[2:]
    return None


def refuse_second_up(argv: list[str]) -> None:
    """`hetsched up` beside a running one: print the refusal and exit ``ALREADY_RUNNING_EXIT`` now, before
    every command's module is imported (seconds on a busy machine). Anything unclear (help asked, settings
    that do not load) is left to the command itself, which takes the lock and refuses the same way."""
    options = _invoked_as_up(argv)
    if options is None or "--help" in options:
        return
    data_dir: str | None = None
    for i, option in enumerate(options):
        if option == "--data-dir" and i + 1 < len(options):
            data_dir = options[i + 1]
        elif option.startswith("--data-dir="):
            data_dir = option.split("=", 1)[1]
    try:
        from shared.infra.settings import load_settings

        settings = load_settings(kit={"data_dir": data_dir}) if data_dir else load_settings()
    except Exception:
        return
    running = lock_holder(settings.kit.data_dir)
    if running is not None:
        sys.stderr.write(f"error: {running}\n")
        raise SystemExit(ALREADY_RUNNING_EXIT)
