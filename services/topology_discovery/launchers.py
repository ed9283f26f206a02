"""How the agent's supervisor starts one replica part's engine: the command and environment per engine kind
(docs/ENGINES.md, "Launchers"). Pure functions of the assignment, the port and the settings.

* ``vllm``: ``vllm serve <checkpoint> <placement's arguments> --served-model-name <model> --host --port``
* ``sglang``: ``python3 -m sglang.launch_server <placement's arguments> --served-model-name --host --port``
* ``sim``: hetsched's simulated engine (``python -m hetsched.engines.sim_server``) with vLLM's arguments
* ``custom``: a command template (``HETSCHED_AGENT_ENGINE_COMMAND``) with ``{model}``, ``{checkpoint}``,
  ``{host}``, ``{port}``, ``{tp}``, ``{pp}``, ``{devices}``, ``{replica_id}``, ``{rank}``, ``{ranks}``,
  ``{head_node}`` and ``{dtype}`` filled in

Every engine gets the binding's devices (``CUDA_VISIBLE_DEVICES`` in PCI bus order), the placement's
environment, and ``HETSCHED_REPLICA_ID`` / ``HETSCHED_NODE`` naming what it runs for.
"""

from __future__ import annotations

import hashlib
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shared.contracts.engines import Assignment

ENGINE_KINDS = ("vllm", "sglang", "sim", "custom")
GROUP_PORT_BASE = 29500
GROUP_PORTS = 500
"""A multi-node group meets at its head node on a port every rank's agent works out alike from the replica
id alone (``group_port``): ``GROUP_PORT_BASE`` plus the id's hash modulo ``GROUP_PORTS``."""


class LaunchError(ValueError):
    """The engine cannot be started as configured (an unknown kind, a template that does not fill)."""


@dataclass(frozen=True, slots=True)
class EngineCommand:
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cpus: frozenset[int] | None = None
    """CPUs to pin the engine to (the binding's NUMA node), None: no pinning."""


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    engine: str
    host: str
    command_template: str | None = None
    sim_speedup: float = 1.0
    python: str = sys.executable


def _without(args: list[str], *flags: str) -> list[str]:
    """``args`` less each ``flag`` and its value (the supervisor sets host and port itself)."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in flags:
            skip = True
            continue
        if any(arg.startswith(f"{flag}=") for flag in flags):
            continue
        kept.append(arg)
    return kept


def checkpoint_of(assignment: Assignment) -> str:
    """The checkpoint the placement's vLLM arguments name (their first word), else the catalog model."""
    args = assignment.launch.vllm if assignment.launch is not None else []
    return args[0] if args and not args[0].startswith("-") else assignment.model


def parse_cpu_set(text: str | None) -> frozenset[int] | None:
    """``0-23,48-71`` as the CPU numbers; None for none; ``ValueError`` for an unreadable set."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def engine_command(assignment: Assignment, *, port: int, settings: LaunchSettings) -> EngineCommand:
    """The command, environment and CPU set of ``assignment``'s engine on this node, listening on ``port``."""
    launch = assignment.launch
    vllm = list(launch.vllm) if launch is not None else [assignment.model, "--tensor-parallel-size", str(assignment.tp)]
    sglang = (
        list(launch.sglang)
        if launch is not None
        else ["--model-path", assignment.model, "--tp-size", str(assignment.tp)]
    )
    listen = ["--host", settings.host, "--port", str(port)]
    served = ["--served-model-name", assignment.model]
    multi = _multi_node(assignment)
    kind = settings.engine
    if kind == "vllm":
        argv = ["vllm", "serve", *_without(vllm, "--host", "--port", "--served-model-name"), *served, *listen]
        argv = _vllm_ray(assignment, argv + multi["vllm"])
    elif kind == "sglang":
        args = _without(sglang, "--host", "--port", "--served-model-name")
        argv = [settings.python, "-m", "sglang.launch_server", *args, *served, *listen, *multi["sglang"]]
    elif kind == "sim":
        args = _without(vllm[1:] if vllm and not vllm[0].startswith("-") else vllm, "--host", "--port")
        argv = [settings.python, "-m", "hetsched.engines.sim_server", "--model", assignment.model, *args, *listen]
        if assignment.sku:
            argv += ["--sku", assignment.sku]
        argv += ["--speedup", f"{settings.sim_speedup:g}"]
    elif kind == "custom":
        argv = _template(assignment, port=port, settings=settings)
    else:
        raise LaunchError(f"unknown engine kind {kind!r}: one of {', '.join(ENGINE_KINDS)}")
    env = dict(launch.env) if launch is not None else {}
    binding = assignment.binding
    if binding is not None:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = binding.cuda_visible_devices
    env["HETSCHED_REPLICA_ID"] = assignment.replica_id
    env["HETSCHED_NODE"] = binding.node if binding is not None else assignment.head_node
    try:
        cpus = parse_cpu_set(binding.cpu_set if binding is not None else None)
    except ValueError as exc:
        raise LaunchError(f"the binding's CPU set: {exc}") from exc
    return EngineCommand(argv=tuple(argv), env=env, cpus=cpus)


def group_port(replica_id: str) -> int:
    """Where the ranks of a multi-node replica meet on its head node (the same on every node)."""
    digest = hashlib.sha256(replica_id.encode()).digest()
    return GROUP_PORT_BASE + int.from_bytes(digest[:4], "big") % GROUP_PORTS


def _multi_node(assignment: Assignment) -> dict[str, list[str]]:
    """Each engine's own multi-node arguments for this node's rank (none for a one-node replica). SGLang:
    ``--nnodes --node-rank --dist-init-addr`` (python/sglang/srt/server_args.py); vLLM spans nodes through a
    Ray cluster the operator starts (``ray start``), so only the head runs ``vllm serve``, with
    ``--distributed-executor-backend ray`` (docs.vllm.ai, "Distributed inference and serving")."""
    if assignment.ranks <= 1:
        return {"vllm": [], "sglang": []}
    meet = f"{assignment.head_node}:{group_port(assignment.replica_id)}"
    return {
        "vllm": ["--distributed-executor-backend", "ray"],
        "sglang": ["--nnodes", str(assignment.ranks), "--node-rank", str(assignment.rank), "--dist-init-addr", meet],
    }


def _vllm_ray(assignment: Assignment, serve: list[str]) -> list[str]:
    """vLLM across nodes: the head starts the Ray head, then ``vllm serve``; every other rank joins the
    Ray cluster and stays in it (``ray start --block``)."""
    if assignment.ranks <= 1:
        return serve
    ray_port = str(group_port(assignment.replica_id))
    if assignment.rank > 0:
        return ["ray", "start", "--address", f"{assignment.head_node}:{ray_port}", "--block"]
    return ["sh", "-c", f"ray start --head --port {ray_port} && exec {shlex.join(serve)}"]


def _template(assignment: Assignment, *, port: int, settings: LaunchSettings) -> list[str]:
    template = settings.command_template
    if not template:
        raise LaunchError("engine kind `custom` needs a command template (HETSCHED_AGENT_ENGINE_COMMAND)")
    fields = {
        "model": assignment.model,
        "checkpoint": checkpoint_of(assignment),
        "host": settings.host,
        "port": str(port),
        "tp": str(assignment.tp),
        "pp": str(assignment.pp),
        "devices": assignment.binding.cuda_visible_devices if assignment.binding is not None else "",
        "replica_id": assignment.replica_id,
        "rank": str(assignment.rank),
        "ranks": str(assignment.ranks),
        "head_node": assignment.head_node,
        "dtype": assignment.dtype,
    }
    try:
        words = shlex.split(template)
        return [word.format_map(fields) for word in words]
    except (KeyError, IndexError, ValueError) as exc:
        raise LaunchError(f"the engine command template does not fill: {exc!r}") from exc
