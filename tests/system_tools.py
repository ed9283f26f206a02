"""Debian-packaged tools the tests need (promtool, amtool, chromium, chromedriver).

    promtool = ensure_tool("promtool", "prometheus")          # -> Path of the binary
    subprocess.run([promtool, "check", "rules", ...], check=True)

A fresh machine does not have them. ``ensure_tool`` returns the binary when it is on ``PATH`` (or in
/usr/bin, /usr/sbin, /usr/lib/chromium); otherwise, when we are root and ``apt-get`` exists, it installs
the package with ``apt-get install -y --no-install-recommends`` (refreshing the package lists once if
apt does not know the package) and looks again. When that is not possible it fails the test with a
message that says what to install: a missing tool is a broken environment, never a skip.

Installs are serialised across processes (pytest-xdist workers, other test sessions) with a file lock,
and apt waits for dpkg's own lock rather than failing when another apt run holds it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Where Debian puts binaries that may not be on a test runner's PATH.
EXTRA_DIRS = (Path("/usr/bin"), Path("/usr/sbin"), Path("/usr/lib/chromium"))
LOCK_FILE = Path("/tmp/hetsched-system-tools.lock")
APT_TIMEOUT_S = 900
# How long apt waits for another apt/dpkg run to release dpkg's lock.
DPKG_LOCK_WAIT_S = 600


def find_tool(binary: str) -> Path | None:
    """The binary's path if it is installed, else None."""
    found = shutil.which(binary)
    if found:
        return Path(found)
    for directory in EXTRA_DIRS:
        candidate = directory / binary
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def ensure_tool(binary: str, debian_package: str) -> Path:
    """The path of ``binary``, installing ``debian_package`` first if it is missing; fails the test if it cannot."""
    found = find_tool(binary)
    if found is not None:
        return found
    apt_get = shutil.which("apt-get")
    if apt_get is None or os.geteuid() != 0:
        why = "apt-get is not available" if apt_get is None else "we are not root"
        pytest.fail(
            f"{binary!r} is not installed and cannot be installed here ({why}): "
            f"run `apt-get install -y --no-install-recommends {debian_package}` as root",
            pytrace=False,
        )
    with _install_lock():
        found = find_tool(binary)  # another process may have installed it while we waited
        if found is None:
            _apt_install(apt_get, debian_package, binary)
            found = find_tool(binary)
    if found is None:
        pytest.fail(
            f"installed Debian package {debian_package!r} but {binary!r} is still not found "
            f"(looked on PATH and in {', '.join(map(str, EXTRA_DIRS))})",
            pytrace=False,
        )
    return found


def _apt_install(apt_get: str, debian_package: str, binary: str) -> None:
    install = [
        apt_get,
        "-o",
        f"DPkg::Lock::Timeout={DPKG_LOCK_WAIT_S}",
        "install",
        "-y",
        "--no-install-recommends",
        debian_package,
    ]
    result = _run(install)
    if result.returncode != 0:
        # Usually stale or empty package lists (a fresh image): refresh them once and retry.
        update = _run([apt_get, "-o", f"DPkg::Lock::Timeout={DPKG_LOCK_WAIT_S}", "update"])
        if update.returncode == 0:
            result = _run(install)
    if result.returncode != 0:
        pytest.fail(
            f"could not install Debian package {debian_package!r} for {binary!r} "
            f"(`{' '.join(install)}` exited {result.returncode}):\n{result.stdout[-4000:]}",
            pytrace=False,
        )


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        return subprocess.run(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=APT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return subprocess.CompletedProcess(command, 124, stdout=f"timed out after {APT_TIMEOUT_S}s\n{output}")


@contextmanager
def _install_lock() -> Iterator[None]:
    with LOCK_FILE.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
