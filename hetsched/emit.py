"""`hetsched place --emit`: turn a placed reply's `launch` and `binding` into the text an operator pastes.

Pure formatting (no IO), so the exact lines are unit-tested (tests/unit/test_emit.py):

* ``vllm``: ``CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,3,2 taskset -c 0-23,48-71 vllm serve <args>``
* ``sglang``: the same prefix, then ``python -m sglang.launch_server <args>``
* ``env``: one ``KEY=value`` line per variable (for an env file or ``export``)

``taskset -c`` pins the engine (and the workers it spawns, which inherit the mask) to the CPUs of the
GPUs' NUMA node when the binding names one; without a CPU set the line has no taskset. Every word is
shell-quoted, so a model path with spaces survives the paste.
"""

from __future__ import annotations

import shlex
from enum import StrEnum

from shared.contracts.base import Rejected
from shared.contracts.placement import EngineLaunch, NodeBinding, PlaceReply


class EmitKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    ENV = "env"


class NothingToEmit(ValueError):
    """The reply carries no launch (rejected, queued, a TPU slice, or a service without bindings)."""


def _environment(launch: EngineLaunch, binding: list[NodeBinding] | None) -> dict[str, str]:
    env = dict(launch.env)
    if "CUDA_VISIBLE_DEVICES" not in env and binding:  # the binding is the source of truth for devices
        env["CUDA_VISIBLE_DEVICES"] = binding[0].cuda_visible_devices
    return env


def emit_text(reply: PlaceReply | Rejected, kind: EmitKind | str) -> str:
    """The launch line (``vllm``/``sglang``) or the environment lines (``env``) of a placed reply, for
    the first node of its binding. Raises ``NothingToEmit`` when the reply is not placed or has no
    ``launch``, ``ValueError`` for an unknown kind."""
    kind = EmitKind(kind)
    if not isinstance(reply, PlaceReply) or reply.status != "placed" or reply.launch is None:
        why = f"status {reply.status}" if reply.status != "placed" else "the reply carries no launch"
        raise NothingToEmit(f"nothing to launch for {reply.request_id}: {why}")
    env = _environment(reply.launch, reply.binding)
    if kind is EmitKind.ENV:
        return "\n".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    if kind is EmitKind.VLLM:
        command = ["vllm", "serve", *reply.launch.vllm]
    else:
        command = ["python", "-m", "sglang.launch_server", *reply.launch.sglang]
    cpu_set = reply.binding[0].cpu_set if reply.binding else None
    pin = ["taskset", "-c", cpu_set] if cpu_set else []
    words = [f"{key}={shlex.quote(value)}" for key, value in env.items()] + [shlex.join([*pin, *command])]
    return " ".join(words)


def emit_note(reply: PlaceReply | Rejected) -> str | None:
    """A line for stderr when the emitted text covers only part of the replica: it spans several nodes
    (each node starts its own process with its own binding; the line is the first node's)."""
    if not isinstance(reply, PlaceReply) or not reply.binding or len(reply.binding) < 2:
        return None
    others = ", ".join(f"{b.node} (CUDA_VISIBLE_DEVICES={b.cuda_visible_devices})" for b in reply.binding[1:])
    return f"the replica spans {len(reply.binding)} nodes; this is the line for {reply.binding[0].node}; also: {others}"
