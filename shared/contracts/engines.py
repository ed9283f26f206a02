"""What a node's agent says of the engines it runs (TELEMETRY, `<prefix>.events.telemetry.<name>.<node>`).

`replica_state` is one rank's lifecycle step (API.md "Replica lifecycle"): the agent publishes it each time
the engine process of a replica part on its node changes state, and again every status interval while it
stays, so a late reader learns it. Placement folds the ranks of a replica into the replica's state:
``ready`` once every rank is ready, ``failed`` as soon as one has failed, ``stopped`` once all stopped.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from shared.contracts.base import NAME_MAX, TEXT_MAX, Contract, Int, Request
from shared.contracts.placement import EngineLaunch, NodeBinding

EngineState = Literal["starting", "loading", "ready", "draining", "stopped", "failed"]
"""A rank's engine: its process started (``starting``), it answers but loads the weights (``loading``),
it serves (``ready``), it finishes what it has and takes nothing new (``draining``), it has exited and will
not be restarted (``stopped``), or it crashed more often than allowed or cannot start (``failed``)."""

ENGINE_STATES: tuple[str, ...] = ("starting", "loading", "ready", "draining", "stopped", "failed")


class ReplicaStateEvent(Contract):
    """Payload of `replica_state`: one rank of a replica, as its node's agent runs it."""

    replica_id: str = Field(
        min_length=1, max_length=NAME_MAX, description="The replica's allocation id.", examples=["al-7"]
    )
    node: str = Field(min_length=1, max_length=NAME_MAX, description="Node the rank runs on.", examples=["dgx-1"])
    state: EngineState = Field(description="The rank's engine state.", examples=["ready"])
    rank: Int = Field(default=0, ge=0, le=1024, description="This node's rank among the replica's nodes (0: the head).")
    ranks: Int = Field(default=1, ge=1, le=1024, description="Nodes the replica spans.", examples=[1])
    engine: str = Field(
        default="vllm",
        max_length=NAME_MAX,
        description="Engine kind (`vllm`, `sglang`, `sim`, or a custom one).",
        examples=["vllm"],
    )
    endpoint: str | None = Field(
        default=None,
        max_length=TEXT_MAX,
        description="Base URL of the engine's OpenAI-compatible server (the head rank's, once it is up).",
        examples=["http://10.0.0.7:8100"],
    )
    pid: Int | None = Field(default=None, ge=0, description="The engine's process id on the node.", examples=[4242])
    restarts: Int = Field(default=0, ge=0, description="Times the agent restarted the engine after a crash.")
    reason: str | None = Field(
        default=None,
        max_length=TEXT_MAX,
        description="Why it stopped or failed (exit code, signal, a launcher error).",
        examples=["exited with code 1 (3 crashes in a row)"],
    )


class AssignmentsRequest(Request):
    """`placement.assignments`: the replica parts one node runs (asked by that node's agent, on
    `<prefix>.placement.assignments.<node>`)."""

    node: str = Field(min_length=1, max_length=NAME_MAX, description="The node asking.", examples=["dgx-1"])


class Assignment(Contract):
    """One replica part the node must run: what its agent starts the engine with."""

    replica_id: str = Field(description="The replica's allocation id.", examples=["al-7"])
    tenant: str = Field(description="Owner.", examples=["acme"])
    model: str = Field(description="Catalog model.", examples=["llama3-8b"])
    dtype: str = Field(description="Weight dtype of the placement.", examples=["bf16"])
    sku: str | None = Field(default=None, description="SKU of its accelerators.", examples=["H100-SXM-80GB"])
    backend: Literal["gpu", "tpu"] = Field(default="gpu", description="Backend.", examples=["gpu"])
    tp: Int = Field(description="Tensor-parallel degree.", examples=[4])
    pp: Int = Field(default=1, description="Pipeline stages.", examples=[1])
    rank: Int = Field(default=0, ge=0, description="This node's rank among the replica's nodes (0: the head).")
    ranks: Int = Field(default=1, ge=1, description="Nodes the replica spans.", examples=[1])
    head_node: str = Field(description="The node of rank 0 (where the multi-node group meets).", examples=["dgx-1"])
    binding: NodeBinding | None = Field(
        default=None, description="This node's devices, TP rank order and CPU set (GPU only)."
    )
    launch: EngineLaunch | None = Field(default=None, description="The engine arguments of the placement.")
    draining: bool = Field(default=False, description="The rebalancer moves it off: finish, take nothing new.")
    stop_by: datetime | None = Field(
        default=None,
        description="Stop the engine by then (UTC): a spot preemption's deadline; null when none.",
        examples=[None],
    )
    lease_expires_at: datetime | None = Field(default=None, description="When its lease ends unless renewed (UTC).")


class AssignmentsReply(Contract):
    status: Literal["ok"] = Field(default="ok", description="Always `ok` (refusals come as `Rejected`).")
    node: str = Field(description="Echo.", examples=["dgx-1"])
    assignments: list[Assignment] = Field(default_factory=list, description="Every replica part the node runs.")
