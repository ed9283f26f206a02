"""`hetsched place --emit`: turn a placed reply's `launch` and `binding` into the text an operator pastes,
one line per node of the replica.

Pure formatting (no IO), so the exact lines are unit-tested (tests/unit/test_emit.py). Each node gets a
comment naming it, its rank and the allocation, then its line (``shared.domain.placement.commands``
builds the argv and environment; a node agent runs the same):

* ``vllm``: ``CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,3,2 HETSCHED_ALLOCATION_ID=al-1
  HETSCHED_NODE=hgx-01 taskset -c 0-23,48-71 vllm serve <args>``; a TPU slice gets vLLM TPU's line
* ``sglang``: the same prefix, then ``python -m sglang.launch_server <args>``
* ``env``: one ``KEY=value`` line per variable (for an env file or ``export``)

A replica on several nodes adds the engine's multi-node arguments to each node's line (rank 0 is the
head; the others join it at the head node's name). ``taskset -c`` pins the engine (and the workers it
spawns, which inherit the mask) to the CPUs of the GPUs' NUMA node when the binding names one. Every
word is shell-quoted, so a model path with spaces survives the paste.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from shared.contracts.base import Rejected
from shared.contracts.placement import PlaceReply
from shared.domain.placement.commands import Engine, node_command, rendezvous_port


class EmitKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    ENV = "env"


class NothingToEmit(ValueError):
    """The reply carries no launch for the engine (rejected, queued, no engine arguments, SGLang on TPU)."""


@dataclass(frozen=True, slots=True)
class NodeLine:
    """What one node of the replica runs: its comment, argv and environment."""

    node: str
    rank: int
    ranks: int
    comment: str
    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        """The pasteable line: ``KEY=value ... argv``, every word shell-quoted."""
        words = [f"{key}={shlex.quote(value)}" for key, value in self.env.items()]
        return " ".join([*words, shlex.join(self.argv)])


def _allocation(reply: PlaceReply) -> str:
    return f"allocation {reply.allocation_id}" if reply.allocation_id else "dry run: no allocation reserved"


def node_lines(reply: PlaceReply | Rejected, kind: EmitKind | str) -> list[NodeLine]:
    """Each node's command of a placed reply, in rank order (a TPU slice: one, named after its pod).
    ``env`` takes the environment of the vLLM command. Raises ``NothingToEmit`` when the reply is not
    placed or has no launch for the engine, ``ValueError`` for an unknown kind."""
    kind = EmitKind(kind)
    if not isinstance(reply, PlaceReply) or reply.status != "placed" or reply.launch is None:
        why = f"status {reply.status}" if reply.status != "placed" else "the reply carries no launch"
        raise NothingToEmit(f"nothing to launch for {reply.request_id}: {why}")
    engine = Engine.SGLANG if kind is EmitKind.SGLANG else Engine.VLLM
    args = reply.launch.sglang if engine is Engine.SGLANG else reply.launch.vllm
    if not args:
        where = "a TPU slice" if reply.tpu_slice is not None else "this placement"
        raise NothingToEmit(f"nothing to launch for {reply.request_id}: no {engine} arguments for {where}")
    key = reply.allocation_id or reply.request_id
    if reply.tpu_slice is not None or not reply.binding:
        tpu = reply.tpu_slice
        node = tpu.pod if tpu is not None else (reply.placements[0].node if reply.placements else "?")
        comment = (
            f"# TPU slice {tpu.pod} origin {','.join(map(str, tpu.origin))} shape "
            f"{'x'.join(map(str, tpu.shape))}, {_allocation(reply)}"
            if tpu is not None
            else f"# node {node} (rank 0 of 1), {_allocation(reply)}"
        )
        argv, env = node_command(engine, args, reply.launch.env, node=node, allocation_id=reply.allocation_id)
        return [NodeLine(node, 0, 1, comment, argv, env)]
    ranks = len(reply.binding)
    head = reply.binding[0].node
    lines = []
    for rank, binding in enumerate(reply.binding):
        argv, env = node_command(
            engine,
            args,
            reply.launch.env,
            node=binding.node,
            rank=rank,
            ranks=ranks,
            head_node=head,
            cuda_visible_devices=binding.cuda_visible_devices,
            cpu_set=binding.cpu_set,
            allocation_id=reply.allocation_id,
            rendezvous_key=key,
        )
        comment = f"# node {binding.node} (rank {rank} of {ranks}), {_allocation(reply)}"
        lines.append(NodeLine(binding.node, rank, ranks, comment, argv, env))
    return lines


def emit_text(reply: PlaceReply | Rejected, kind: EmitKind | str) -> str:
    """Per node of a placed reply: its comment, then its launch line (``vllm``/``sglang``) or its
    ``KEY=value`` lines (``env``). Raises ``NothingToEmit``/``ValueError`` as ``node_lines``."""
    kind = EmitKind(kind)
    blocks = []
    for line in node_lines(reply, kind):
        if kind is EmitKind.ENV:
            body = "\n".join(f"{key}={shlex.quote(value)}" for key, value in line.env.items())
        else:
            body = line.shell()
        blocks.append(f"{line.comment}\n{body}")
    return "\n".join(blocks)


def emit_note(reply: PlaceReply | Rejected) -> str | None:
    """A line for stderr about running the emitted lines: a replica spanning several nodes (where they
    meet, and a warning when the nodes hold unequal GPU counts, which neither engine starts), or a TPU
    slice (one host per line)."""
    if not isinstance(reply, PlaceReply) or reply.status != "placed":
        return None
    if reply.tpu_slice is not None:
        return (
            "run the line on the slice's TPU VM; a slice spanning several TPU VM hosts needs vLLM TPU's "
            "multi-host setup (a Ray cluster over its hosts) instead"
        )
    if not reply.binding or len(reply.binding) < 2:
        return None
    head = reply.binding[0].node
    port = rendezvous_port(reply.allocation_id or reply.request_id)
    note = (
        f"the replica spans {len(reply.binding)} nodes: run each line on its node; rank 0 ({head}) serves the API "
        f"and the others join it at {head}:{port} (the name {head} must resolve on every node)"
    )
    counts = Counter(len(b.tp_rank_order) for b in reply.binding)
    if len(counts) > 1:
        per_node = ", ".join(f"{b.node} {len(b.tp_rank_order)}" for b in reply.binding)
        note += f"; warning: the nodes hold unequal GPU counts ({per_node}), and both engines start as many on each"
    return note
