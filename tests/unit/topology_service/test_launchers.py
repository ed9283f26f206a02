"""The agent's launchers: each engine kind's command and environment for one replica part on its node."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest

from services.topology_discovery.launchers import (
    LaunchError,
    LaunchSettings,
    engine_command,
    parse_cpu_set,
)
from services.topology_discovery.supervisor import Engine, Supervisor
from shared.contracts.engines import Assignment
from shared.contracts.placement import EngineLaunch, NodeBinding
from shared.contracts.subjects import Subjects
from shared.domain.placement.commands import rendezvous_port
from shared.domain.supervision import Phase, Run
from shared.infra.settings import AgentSettings

LAUNCH = EngineLaunch(
    vllm=["meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "2", "--max-model-len", "8192"],
    sglang=["--model-path", "meta-llama/Llama-3.1-8B-Instruct", "--tp-size", "2"],
    env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"},
)


def part(**extra: object) -> Assignment:
    fields: dict[str, object] = {
        "replica_id": "al-1",
        "tenant": "acme",
        "model": "llama3-8b",
        "dtype": "bf16",
        "sku": "H100-SXM-80GB",
        "tp": 2,
        "head_node": "n1",
        "binding": NodeBinding(node="n1", cuda_visible_devices="3,2", tp_rank_order=[3, 2], cpu_set="0-3,8"),
        "launch": LAUNCH,
    } | extra
    return Assignment.model_validate(fields)


def settings(engine: str, **extra: object) -> LaunchSettings:
    return LaunchSettings(engine=engine, host="0.0.0.0", python="python3", **extra)  # type: ignore[arg-type]


def test_vllm_serves_the_checkpoint_under_the_catalog_name_on_the_given_port() -> None:
    command = engine_command(part(), port=8123, settings=settings("vllm"))
    assert command.argv == (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--tensor-parallel-size", "2", "--max-model-len",
        "8192", "--served-model-name", "llama3-8b", "--host", "0.0.0.0", "--port", "8123",
    )  # fmt: skip
    # The binding's devices win over the launch's first-node environment; what it runs for is named.
    assert command.env["CUDA_VISIBLE_DEVICES"] == "3,2" and command.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert command.env["HETSCHED_REPLICA_ID"] == "al-1" and command.env["HETSCHED_NODE"] == "n1"
    assert command.cpus == frozenset({0, 1, 2, 3, 8})


def test_sglang_and_the_simulated_engine() -> None:
    sglang = engine_command(part(), port=9000, settings=settings("sglang"))
    assert sglang.argv[:3] == ("python3", "-m", "sglang.launch_server")  # the agent's own Python
    assert sglang.argv[3:] == (
        "--model-path", "meta-llama/Llama-3.1-8B-Instruct", "--tp-size", "2", "--served-model-name", "llama3-8b",
        "--host", "0.0.0.0", "--port", "9000",
    )  # fmt: skip
    sim = engine_command(part(), port=9001, settings=settings("sim", sim_speedup=50.0))
    assert sim.argv[:5] == ("python3", "-m", "hetsched.engines.sim_server", "--model", "llama3-8b")
    assert "meta-llama/Llama-3.1-8B-Instruct" not in sim.argv  # the checkpoint is vLLM's, not the simulator's
    assert sim.argv[-4:] == ("--sku", "H100-SXM-80GB", "--speedup", "50")
    assert ("--port", "9001") == sim.argv[sim.argv.index("--port") : sim.argv.index("--port") + 2]


def test_a_multi_node_replica_gives_each_rank_its_engines_own_arguments() -> None:
    head = part(ranks=2, rank=0)
    worker = part(ranks=2, rank=1, binding=NodeBinding(node="n2", cuda_visible_devices="0", tp_rank_order=[0]))
    port = str(rendezvous_port("al-1"))  # the same on every node: worked out from the replica id
    for rank, assignment in ((0, head), (1, worker)):
        argv = engine_command(assignment, port=9000, settings=settings("sglang")).argv
        assert argv[-6:] == ("--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", f"n1:{port}")
    vllm_head = engine_command(head, port=9000, settings=settings("vllm")).argv
    tail = ("--nnodes", "2", "--node-rank", "0", "--master-addr", "n1", "--master-port", port)
    assert vllm_head[-8:] == tail and "--headless" not in vllm_head
    vllm_worker = engine_command(worker, port=9000, settings=settings("vllm"))
    assert vllm_worker.argv[-1] == "--headless" and ("--node-rank", "1") == vllm_worker.argv[-7:-5]
    assert vllm_worker.env["HETSCHED_NODE"] == "n2" and vllm_worker.env["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_custom_template_is_filled_and_a_bad_one_refused() -> None:
    template = "my-engine --model {checkpoint} --port {port} --tp {tp} --gpus {devices} --id {replica_id}"
    argv = engine_command(part(), port=7000, settings=settings("custom", command_template=template)).argv
    assert argv == (
        "my-engine", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--port", "7000", "--tp", "2", "--gpus", "3,2",
        "--id", "al-1",
    )  # fmt: skip
    with pytest.raises(LaunchError, match="does not fill"):
        engine_command(part(), port=1, settings=settings("custom", command_template="x {nope}"))
    with pytest.raises(LaunchError, match="needs a command template"):
        engine_command(part(), port=1, settings=settings("custom"))
    with pytest.raises(LaunchError, match="unknown engine kind"):
        engine_command(part(), port=1, settings=settings("tgi"))


def test_cpu_sets() -> None:
    assert parse_cpu_set("0-2,8,10-11") == frozenset({0, 1, 2, 8, 10, 11})
    assert parse_cpu_set(None) is None and parse_cpu_set("") is None
    with pytest.raises(ValueError):
        parse_cpu_set("5-2")
    with pytest.raises(LaunchError, match="CPU set"):
        bad = NodeBinding(node="n1", cuda_visible_devices="0", tp_rank_order=[0], cpu_set="a-b")
        engine_command(part(binding=bad), port=1, settings=settings("vllm"))


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "engines"


def supervisor() -> Supervisor:
    return Supervisor(
        node="n1",
        rpc=cast(Any, None),
        jetstream=cast(Any, None),
        subjects=Subjects("hetsched"),
        clock=lambda: datetime(2026, 1, 1, tzinfo=UTC),
        settings=AgentSettings(engine="vllm", advertise_host="n1.example"),
        log_dir=Path("/nonexistent"),
        log=logging.getLogger("test"),
    )


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_supervisor_reads_an_engines_status_from_its_metrics(engine: str) -> None:
    """The captured expositions of vLLM and SGLang give one `engine_status` each; the KV cache's bytes are
    the capacity the engine reports times the model's KV bytes per token."""
    sup = supervisor()
    run = Run(replica_id="al-1", phase=Phase.READY, since=datetime(2026, 1, 1, tzinfo=UTC), pid=7)
    running = Engine(assignment=part(), port=8100, run=run)
    first = sup.status_event(running, (FIXTURES / f"{engine}.prom").read_text())
    assert first is not None and first.replica_id == "al-1" and first.node == "n1" and first.healthy
    assert first.engine == engine and first.kv_total_bytes > 0
    assert first.kv_used_bytes == round((first.kv_usage or 0) * first.kv_total_bytes)
    second = sup.status_event(running, (FIXTURES / f"{engine}.2.prom").read_text())
    assert second is not None and second.generation_tokens_per_s is not None  # a window: rates now
    assert sup.endpoint(running) == "http://n1.example:8100"
    assert sup.status_event(running, "<html>502 Bad Gateway</html>") is None  # not an engine's: nothing
