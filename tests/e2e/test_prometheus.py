"""A real Prometheus (Debian's package, installed through tests/system_tools.py when missing) scrapes
`hetsched up`: every service's `metrics_url` from `hetsched status --json` becomes a scrape target, the
alert rules of infra/prometheus/alerts.yml are loaded, replicas are placed and a reservation made from the
CLI, and the HTTP API answers the brief's metrics from every service. A service then stops answering, and
Prometheus's ServiceDown alert goes pending for it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.registry import SERVICES
from tests.system_tools import ensure_tool
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(env: dict[str, str], data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetsched.cli", *args, "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return dict(json.loads(response.read()))


def test_a_real_prometheus_scrapes_every_service_of_hetsched_up(tmp_path: Path) -> None:
    prometheus = ensure_tool("prometheus", "prometheus")
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}  # embedded servers
    up = subprocess.Popen(
        [sys.executable, "-m", "hetsched.cli", "up", "--data-dir", str(data_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    prom: subprocess.Popen[str] | None = None
    try:

        def healthy() -> dict[str, Any] | None:
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            status = _cli(env, data_dir, "status", "--json")
            if status.returncode != 0:
                return None
            report: dict[str, Any] = json.loads(status.stdout)
            services = report.get("services", {})
            if len(services) == len(SERVICES) and all(
                s.get("status") == "ok" and s.get("metrics_url") for s in services.values()
            ):
                return report
            return None

        report = wait_for_sync(healthy, START_TIMEOUT_S, interval_s=1.0, what="every service healthy with metrics")
        targets = {name: urllib.parse.urlparse(s["metrics_url"]) for name, s in report["services"].items()}
        port = _free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "infra" / "prometheus" / "alerts.yml")],
            "scrape_configs": [
                {
                    "job_name": name,
                    "metrics_path": url.path,
                    "static_configs": [{"targets": [url.netloc]}],
                }
                for name, url in sorted(targets.items())
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = subprocess.Popen(
            [
                str(prometheus),
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        base = f"http://127.0.0.1:{port}"

        def all_up() -> bool:
            assert prom is not None and prom.poll() is None, prom.stdout.read() if prom and prom.stdout else ""
            try:
                results = _query(base, "up")
            except OSError:
                return False
            return len(results) == len(SERVICES) and all(r["value"][1] == "1" for r in results)

        wait_for_sync(all_up, 60, interval_s=0.5, what="Prometheus scrapes every service")
        rules = _get(f"{base}/api/v1/rules")
        loaded = [r["name"] for g in rules["data"]["groups"] for r in g["rules"]]
        assert loaded, "the alert rules are loaded"

        # Work for the metrics to show: replicas placed (one TP=2 group), a reservation made.
        for i, extra in enumerate((["--tp", "2"], [])):
            placed = _cli(
                env,
                data_dir,
                "place",
                "--model",
                "llama3-8b",
                "--tenant",
                "prom",
                "--context-tokens",
                "4096",
                "--backend",
                "gpu",
                "--request-id",
                f"prom-{i}",
                *extra,
            )
            assert placed.returncode == 0, placed.stdout + placed.stderr
        reserved = _cli(
            env,
            data_dir,
            "reserve",
            "--tenant",
            "prom",
            "--policy",
            "soft",
            "--count",
            "8",
            "--sku",
            "L40S-48GB",
            "--region",
            "us-west-1",
        )
        assert reserved.returncode == 0, reserved.stdout + reserved.stderr

        wanted = {
            "hetsched_ledger_commits_total": "capacity-ledger",
            "hetsched_hbm_utilization_ratio": "capacity-ledger",
            "hetsched_accelerator_hbm_utilization_ratio": "capacity-ledger",
            "hetsched_hbm_free_bytes": "capacity-ledger",
            "hetsched_tp_groups": "capacity-ledger",
            "hetsched_placement_decision_seconds_count": "placement",
            "hetsched_placements_total": "placement",
            "hetsched_tpu_fragmentation_ratio": "placement",
            "hetsched_reservation_fill_rate": "reservation-filler",
            "hetsched_reservation_fill_rate_overall": "reservation-filler",
            "hetsched_topology_last_profile_timestamp_seconds": "topology-discovery",
            "hetsched_nodes": "topology-discovery",
            "hetsched_replicas": "placement",
            "hetsched_cross_domain_budget_bytes_per_second": "capacity-ledger",
            "hetsched_events_dead_lettered_total": "capacity-ledger",
            "hetsched_outbox_quarantined_total": "placement",
            "process_cpu_seconds_total": "rebalancer",
        }

        def answered() -> dict[str, list[dict[str, Any]]] | None:
            found = {name: _query(base, name) for name in wanted}
            return found if all(found.values()) else None

        found = wait_for_sync(answered, 60, interval_s=1.0, what="Prometheus holds the metrics")
        for name, job in wanted.items():
            assert any(r["metric"].get("job") == job for r in found[name]), (name, found[name])
        commits = sum(float(r["value"][1]) for r in found["hetsched_ledger_commits_total"])
        assert commits >= 2
        groups = {
            (r["metric"]["degree"], r["metric"]["nvlinked"]): float(r["value"][1]) for r in found["hetsched_tp_groups"]
        }
        assert groups.get(("2", "true"), 0) >= 1, groups
        assert float(found["hetsched_reservation_fill_rate_overall"][0]["value"][1]) >= 0

        # One service stops answering (SIGSTOP: its process, metrics thread included, freezes; `up` does not
        # restart a stopped child): within seconds ServiceDown is pending for it (its `for:` is 1m), and for it only.
        state = json.loads((data_dir / "stack.json").read_text())
        stopped = int(state["services"]["rebalancer"])
        os.kill(stopped, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()

            def pending() -> list[dict[str, Any]] | None:
                alerts = _get(f"{base}/api/v1/alerts")["data"]["alerts"]
                down = [a for a in alerts if a["labels"]["alertname"] == "ServiceDown"]
                return down or None

            down = wait_for_sync(pending, 30, interval_s=0.5, what="ServiceDown pending for the stopped service")
            print(f"\nServiceDown pending {time.monotonic() - stopped_at:.1f}s after SIGSTOP")
            assert [(a["labels"]["job"], a["state"]) for a in down] == [("rebalancer", "pending")], down
            assert down[0]["labels"]["priority"] == "P0"
        finally:
            os.kill(stopped, signal.SIGCONT)
    finally:
        if prom is not None:
            prom.send_signal(signal.SIGTERM)
            try:
                prom.wait(timeout=30)
            except subprocess.TimeoutExpired:
                prom.kill()
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
