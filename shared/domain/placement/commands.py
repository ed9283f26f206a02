"""One node's engine command for a placed replica: the argv and environment that start its part.

A placement's launch arguments (``binding.launch``/``tpu_launch``) are the same on every node; what one
node runs adds its own devices (``CUDA_VISIBLE_DEVICES`` of its binding), its CPU pinning, the
allocation it serves, and, when the replica spans several nodes, the engine's own multi-node arguments:

* vLLM (multiprocessing across nodes, https://docs.vllm.ai/en/latest/serving/parallelism_scaling/,
  "Running vLLM with MultiProcessing"): every node runs ``vllm serve`` with the same TP/PP sizes and
  ``--nnodes N --node-rank R --master-addr <head> --master-port <port>``; ranks above 0 add
  ``--headless`` (no API server: the head serves). The flags are ``ParallelConfig``'s ``nnodes``,
  ``node_rank``, ``master_addr``, ``master_port`` (vllm/config/parallel.py: "for multi-node distributed
  inference when distributed_executor_backend is mp"), so ``--distributed-executor-backend mp`` is
  explicit. Ray is the other documented way (``ray start`` on every node first); these lines need none.
* SGLang (https://docs.sglang.io/references/multi_node_deployment/multi_node.html): every node runs
  ``sglang.launch_server`` with the same ``--tp-size``/``--pp-size`` and
  ``--nnodes N --node-rank R --dist-init-addr <head>:<port>``.

The head address is the head node's name as placement knows it (the fleet's node name): the nodes must
resolve it to an address they reach each other on. The port is derived from the allocation id
(``rendezvous_port``), so two replicas whose heads share a node meet on different ports.

Pure: no IO. The CLI (``hetsched place --emit``) prints these; a node agent runs them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from enum import StrEnum

__all__ = [
    "ALLOCATION_ENV",
    "NODE_ENV",
    "RENDEZVOUS_PORTS",
    "Engine",
    "node_command",
    "rendezvous_port",
]

ALLOCATION_ENV = "HETSCHED_ALLOCATION_ID"
NODE_ENV = "HETSCHED_NODE"
RENDEZVOUS_PORTS = (20000, 29999)
"""The range ``rendezvous_port`` draws from (inclusive): below Linux's ephemeral ports (32768 and up)
and clear of the engines' HTTP defaults (vLLM 8000, SGLang 30000)."""


class Engine(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


def rendezvous_port(key: str) -> int:
    """The port a multi-node replica's ranks meet on at its head: a stable function of ``key`` (the
    allocation id; a request id on a dry run) in ``RENDEZVOUS_PORTS``."""
    low, high = RENDEZVOUS_PORTS
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big")
    return low + digest % (high - low + 1)


def _multi_node(engine: Engine, *, rank: int, ranks: int, head: str, port: int) -> list[str]:
    if engine is Engine.VLLM:
        words = ["--distributed-executor-backend", "mp", "--nnodes", str(ranks), "--node-rank", str(rank)]
        words += ["--master-addr", head, "--master-port", str(port)]
        return [*words, "--headless"] if rank > 0 else words
    return ["--nnodes", str(ranks), "--node-rank", str(rank), "--dist-init-addr", f"{head}:{port}"]


def node_command(
    engine: Engine | str,
    args: Sequence[str],
    env: Mapping[str, str],
    *,
    node: str,
    rank: int = 0,
    ranks: int = 1,
    head_node: str | None = None,
    cuda_visible_devices: str | None = None,
    cpu_set: str | None = None,
    allocation_id: str | None = None,
    rendezvous_key: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start rank ``rank`` (of ``ranks`` nodes) of a replica on ``node``.

    ``engine``: ``vllm`` or ``sglang``; ``args``/``env``: the placement's ``launch.vllm`` or
    ``launch.sglang`` and ``launch.env``. ``cuda_visible_devices``/``cpu_set``: this node's binding (None on
    a TPU slice, or without a binding): the devices replace the launch's first-node ones, the CPU set
    prefixes ``taskset -c``. ``head_node``: the node of rank 0 (default: ``node``). ``allocation_id`` goes
    into the environment as ``HETSCHED_ALLOCATION_ID`` (left out when None: a dry run); ``HETSCHED_NODE`` is
    ``node``. The rendezvous port comes from ``rendezvous_key`` (default: the allocation id); a replica on
    one node has no multi-node arguments.

    Raises ``ValueError`` for an unknown engine, an engine without arguments (SGLang on a TPU slice), a
    rank outside ``0..ranks-1``, or a multi-node replica without a key for its port.
    """
    engine = Engine(engine)
    if not args:
        raise ValueError(f"the placement has no {engine} arguments")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of {ranks} nodes")
    environment = dict(env)
    if cuda_visible_devices is not None:
        environment.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        environment["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    if allocation_id is not None:
        environment[ALLOCATION_ENV] = allocation_id
    environment[NODE_ENV] = node
    program = ["vllm", "serve"] if engine is Engine.VLLM else ["python", "-m", "sglang.launch_server"]
    argv = [*program, *args]
    if ranks > 1:
        key = rendezvous_key or allocation_id
        if not key:
            raise ValueError("a replica on several nodes needs an allocation id (or a key) for its rendezvous port")
        argv += _multi_node(engine, rank=rank, ranks=ranks, head=head_node or node, port=rendezvous_port(key))
    if cpu_set:
        argv = ["taskset", "-c", cpu_set, *argv]
    return argv, environment
