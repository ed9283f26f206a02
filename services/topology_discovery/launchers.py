"""How the agent's supervisor starts one replica part's engine: the command and environment per engine kind
(docs/ENGINES.md, "Launchers"). Pure functions of the assignment, the port and the settings.

* ``vllm``: ``vllm serve <checkpoint> <placement's arguments> --served-model-name <model> --host --port``
* ``sglang``: ``python -m sglang.launch_server <placement's arguments> --served-model-name --host --port``

  both with the engine's own multi-node arguments for this node's rank when the replica spans several
  nodes (``shared.domain.placement.commands.node_command``, what ``hetsched place --emit`` prints)
* ``sim``: hetsched's simulated engine (``python -m hetsched.engines.sim_server``) with vLLM's arguments
* ``custom``: a command template (``HETSCHED_AGENT_ENGINE_COMMAND``) with ``{model}``, ``{checkpoint}``,
  ``{host}``, ``{port}``, ``{tp}``, ``{pp}``, ``{devices}``, ``{replica_id}``, ``{rank}``, ``{ranks}``,
  ``{head_node}`` and ``{dtype}`` filled in

Every engine gets the binding's devices (``CUDA_VISIBLE_DEVICES`` in PCI bus order), the placement's
environment, and ``HETSCHED_REPLICA_ID`` / ``HETSCHED_NODE`` naming what it runs for.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shared.contracts.engines import Assignment
from shared.domain.placement.commands import node_command

ENGINE_KINDS = ("vllm", "sglang", "sim", "custom")


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
    kind = settings.engine
    if kind in ("vllm", "sglang"):
        args = _without(vllm if kind == "vllm" else sglang, "--host", "--port", "--served-model-name")
        binding = assignment.binding
        try:
            argv, _env = node_command(
                kind,
                [*args, *served, *listen],
                {},
                node=binding.node if binding is not None else assignment.head_node,
                rank=assignment.rank,
                ranks=assignment.ranks,
                head_node=assignment.head_node,
                allocation_id=assignment.replica_id,
            )
        except ValueError as exc:
            raise LaunchError(str(exc)) from exc
        if kind == "sglang":
            argv = [settings.python, *argv[1:]]  # the agent's Python, where SGLang is installed with it
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
