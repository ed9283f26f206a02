"""`hetsched place --emit`: the exact text an operator pastes, from a hand-built reply."""

from __future__ import annotations

import shlex
from typing import Any

import pytest
from typer.testing import CliRunner

import hetsched.cli as cli
from hetsched.cli import common
from hetsched.emit import EmitKind, NothingToEmit, emit_note, emit_text
from shared.contracts.base import ErrorBody, Rejected
from shared.contracts.placement import EngineLaunch, NodeBinding, PlaceReply

VLLM_ARGS = [
    "meta-llama/Meta-Llama-3-70B",
    "--tensor-parallel-size",
    "4",
    "--gpu-memory-utilization",
    "0.351",
    "--max-model-len",
    "8192",
    "--max-num-seqs",
    "16",
    "--dtype",
    "bfloat16",
    "--kv-cache-dtype",
    "auto",
    "--quantization",
    "fp8",
]
SGLANG_ARGS = ["--model-path", "meta-llama/Meta-Llama-3-70B", "--tp-size", "4", "--mem-fraction-static", "0.351"]


def _placed(binding: list[NodeBinding] | None = None, env: dict[str, str] | None = None) -> PlaceReply:
    return PlaceReply(
        status="placed",
        request_id="req-42",
        allocation_id="alloc-1",
        tp=4,
        binding=binding
        if binding is not None
        else [
            NodeBinding(
                node="hgx-01",
                cuda_visible_devices="0,1,3,2",
                tp_rank_order=[0, 1, 3, 2],
                numa_node=0,
                cpu_set="0-23,48-71",
            )
        ],
        launch=EngineLaunch(
            vllm=VLLM_ARGS,
            sglang=SGLANG_ARGS,
            env=env if env is not None else {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,3,2"},
        ),
    )


def test_vllm_line() -> None:
    assert emit_text(_placed(), EmitKind.VLLM) == (
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,3,2 taskset -c 0-23,48-71 vllm serve "
        "meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4 --gpu-memory-utilization 0.351 --max-model-len 8192 "
        "--max-num-seqs 16 --dtype bfloat16 --kv-cache-dtype auto --quantization fp8"
    )


def test_sglang_line() -> None:
    assert emit_text(_placed(), "sglang") == (
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,3,2 taskset -c 0-23,48-71 python -m "
        "sglang.launch_server --model-path meta-llama/Meta-Llama-3-70B --tp-size 4 --mem-fraction-static 0.351"
    )


def test_env_lines() -> None:
    assert emit_text(_placed(), EmitKind.ENV) == "CUDA_DEVICE_ORDER=PCI_BUS_ID\nCUDA_VISIBLE_DEVICES=0,1,3,2"


def test_no_cpu_set_no_taskset_and_devices_from_the_binding() -> None:
    binding = [NodeBinding(node="n", cuda_visible_devices="4,5", tp_rank_order=[4, 5], numa_node=None, cpu_set=None)]
    line = emit_text(_placed(binding=binding, env={}), "vllm")
    assert line.startswith("CUDA_VISIBLE_DEVICES=4,5 vllm serve meta-llama/Meta-Llama-3-70B ")
    assert "taskset" not in line


def test_the_line_survives_the_shell() -> None:
    reply = _placed()
    assert reply.launch is not None
    reply.launch.vllm[0] = "/models/llama 70b"  # a local path with a space
    words = shlex.split(emit_text(reply, "vllm"))
    assert words[:7] == [
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES=0,1,3,2",
        "taskset",
        "-c",
        "0-23,48-71",
        "vllm",
        "serve",
    ]
    assert words[7] == "/models/llama 70b"


@pytest.mark.parametrize(
    "reply",
    [
        PlaceReply(status="rejected", request_id="req-1", error=ErrorBody(code="no_capacity", message="full")),
        PlaceReply(status="queued", request_id="req-1", queue_position=2),
        PlaceReply(status="placed", request_id="req-1"),  # a TPU slice, or a service without launch
    ],
    ids=["rejected", "queued", "no-launch"],
)
def test_nothing_to_emit(reply: PlaceReply) -> None:
    with pytest.raises(NothingToEmit, match="nothing to launch for req-1"):
        emit_text(reply, "vllm")


def test_unknown_kind() -> None:
    with pytest.raises(ValueError):
        emit_text(_placed(), "trtllm")


def test_note_only_for_a_replica_on_several_nodes() -> None:
    assert emit_note(_placed()) is None
    two = [
        NodeBinding(node="a", cuda_visible_devices="0,1,2,3", tp_rank_order=[0, 1, 2, 3]),
        NodeBinding(node="b", cuda_visible_devices="4,5,6,7", tp_rank_order=[4, 5, 6, 7]),
    ]
    assert emit_note(_placed(binding=two)) == (
        "the replica spans 2 nodes; this is the line for a; also: b (CUDA_VISIBLE_DEVICES=4,5,6,7)"
    )


# -- the command: stdout holds only the pasteable text; no launch exits 1 with the reply on stderr ------------

PLACE = ["place", "--model", "llama3-70b", "--tenant", "acme", "--context-tokens", "8192"]


def _run(reply: PlaceReply, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    monkeypatch.setattr(common, "with_rpc", lambda _data_dir, _what, _work: reply)
    return CliRunner().invoke(cli.app, [*PLACE, *args])


def test_place_emit_prints_only_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(_placed(), monkeypatch, "--emit", "vllm")
    assert result.exit_code == 0, result.output
    assert result.stdout == emit_text(_placed(), "vllm") + "\n"


def test_place_emit_env(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(_placed(), monkeypatch, "--emit", "env")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=0,1,3,2"]


def test_place_emit_of_a_rejection_exits_1_with_nothing_on_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    rejected = PlaceReply(status="rejected", request_id="req-1", error=ErrorBody(code="no_capacity", message="full"))
    result = _run(rejected, monkeypatch, "--emit", "sglang")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert "no_capacity" in result.stderr


def test_place_emit_refuses_an_unknown_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(_placed(), monkeypatch, "--emit", "trtllm")
    assert result.exit_code == 2  # typer's usage error: the choices are vllm, sglang, env


def test_a_generic_rejection_has_nothing_to_emit() -> None:
    refused = Rejected(request_id="req-1", error=ErrorBody(code="invalid_request", message="field 'tp'"))
    with pytest.raises(NothingToEmit, match="status rejected"):
        emit_text(refused, "env")
    assert emit_note(refused) is None
