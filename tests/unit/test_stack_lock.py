"""One `hetsched up` per data dir (hetsched/lock.py): the lock, who holds it, a stale one after SIGKILL, and
when the fast refusal applies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hetsched.lock import StackLock, StackRunning, _invoked_as_up, lock_holder, stack_running


def test_a_second_lock_names_the_holder_and_the_data_dir(tmp_path: Path) -> None:
    held = StackLock.acquire(tmp_path)
    try:
        with pytest.raises(StackRunning) as refused:
            StackLock.acquire(tmp_path)  # another open file: flock refuses it even in this process
        assert str(refused.value) == (
            f"a stack is already running from {tmp_path} (pid {os.getpid()}); stop it first or set HETSCHED_DATA_DIR"
        )
        assert stack_running(tmp_path)
        running = lock_holder(tmp_path)
        assert running is not None and running.pid == os.getpid()
    finally:
        held.release()
    assert not stack_running(tmp_path)
    StackLock.acquire(tmp_path).release()


def test_no_lock_file_is_no_stack(tmp_path: Path) -> None:
    assert lock_holder(tmp_path / "never-used") is None
    assert not (tmp_path / "never-used").exists()  # asking creates nothing


def test_a_killed_holder_leaves_no_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from hetsched.lock import StackLock; "
            f"StackLock.acquire(Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        running = lock_holder(tmp_path)
        assert running is not None and running.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    assert (tmp_path / "up.lock").read_text().strip() == str(holder.pid)  # the file stays, the lock does not
    assert lock_holder(tmp_path) is None
    lock = StackLock.acquire(tmp_path)
    assert (tmp_path / "up.lock").read_text().strip() == str(os.getpid())
    lock.release()


@pytest.mark.parametrize(
    ("argv", "options"),
    [
        (["/venv/bin/hetsched", "up", "--data-dir", "/d"], ["--data-dir", "/d"]),
        (["-m", "up"], []),  # `python -m hetsched.cli up` while the package loads
        (["/repo/hetsched/__main__.py", "up", "--data-dir=/d"], ["--data-dir=/d"]),
        (["/venv/bin/hetsched", "status"], None),
        (["/venv/bin/pytest", "up"], None),
        (["/venv/bin/hetsched"], None),
    ],
)
def test_the_fast_refusal_applies_to_up_only(argv: list[str], options: list[str] | None) -> None:
    assert _invoked_as_up(argv) == options
