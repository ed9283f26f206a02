"""The agent's side of simulated GPU telemetry: the node's GPUs from the inventory, its engines from the
supervisor (binding, launch, state, running requests)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from services.topology_discovery.simulated import SimulatedGpus, inventory_gpus
from services.topology_discovery.supervisor import Engine, Supervisor
from shared.contracts.engines import Assignment
from shared.contracts.placement import EngineLaunch, NodeBinding
from shared.contracts.subjects import Subjects
from shared.domain.engines.simulated_gpus import Gpu
from shared.domain.supervision import Phase, Run
from shared.infra.settings import AgentSettings

LOG = logging.getLogger("test-simulated")
HBM = 80 * 2**30
FLEET = """
regions:
  - name: us-west-1
    clusters:
      - name: c1
        racks:
          - name: r1
            power_kw: 40
            nodes:
              - name: h100-01
                sku: H100-SXM-80GB
                gpus: 2
                topology: nvswitch-8
"""


def test_the_nodes_gpus_come_from_the_inventory_and_an_unknown_node_or_file_gives_none(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    assert inventory_gpus(fleet, "h100-01", LOG) == (Gpu(0, HBM), Gpu(1, HBM))
    assert inventory_gpus(fleet, "elsewhere", LOG) is None
    assert inventory_gpus(tmp_path / "missing.yaml", "h100-01", LOG) is None
    assert inventory_gpus(None, "h100-01", LOG) is None


def _engine(replica_id: str, devices: str, fraction: str, phase: Phase, running: int = 0) -> Engine:
    assignment = Assignment(
        replica_id=replica_id,
        tenant="acme",
        model="llama3-8b",
        dtype="bf16",
        tp=len(devices.split(",")),
        head_node="h100-01",
        binding=NodeBinding(node="h100-01", cuda_visible_devices=devices, tp_rank_order=[0]),
        launch=EngineLaunch(vllm=["m", "--gpu-memory-utilization", fraction, "--max-num-seqs", "4"], sglang=[], env={}),
    )
    run = Run(replica_id=replica_id, phase=phase, since=datetime(2026, 1, 1, tzinfo=UTC))
    return Engine(assignment=assignment, port=8100, run=run, running_requests=running)


def test_each_gpu_reads_what_the_supervisors_engines_hold_of_it(tmp_path: Path) -> None:
    supervisor = Supervisor(
        node="h100-01",
        rpc=cast(Any, None),
        jetstream=cast(Any, None),
        subjects=Subjects("hetsched"),
        clock=lambda: datetime(2026, 1, 1, tzinfo=UTC),
        settings=AgentSettings(engine="sim"),
        log_dir=tmp_path,
        log=LOG,
        models={},
    )
    gpus = SimulatedGpus(gpus=(Gpu(0, HBM), Gpu(1, HBM)), supervisor=supervisor)
    assert [(s.index, s.memory_used_bytes, s.memory_free_bytes) for s in gpus.samples()] == [(0, 0, HBM), (1, 0, HBM)]
    supervisor.engines["al-1"] = _engine("al-1", "0", "0.8", Phase.LOADING)
    assert gpus.samples()[0].memory_used_bytes == int(0.8 * HBM * 0.5)
    supervisor.engines["al-1"] = _engine("al-1", "0", "0.8", Phase.READY, running=1)
    supervisor.engines["al-2"] = _engine("al-2", "1", "0.5", Phase.STARTING)
    first, second = gpus.samples()
    assert (first.memory_used_bytes, first.memory_free_bytes, first.utilization_pct) == (
        int(0.8 * HBM),
        HBM - int(0.8 * HBM),
        25.0,
    )
    assert (second.memory_used_bytes, second.utilization_pct) == (0, 0.0)
