"""`hetsched place --emit`: the exact text an operator pastes, from a hand-built reply."""

from __future__ import annotations

import shlex
from typing import Any

import pytest
from typer.testing import CliRunner

import hetsched.cli as cli
from hetsched.cli import common
from hetsched.emit import EmitKind, NothingToEmit, emit_note, emit_text, node_lines
from shared.contracts.base import ErrorBody, Rejected
from shared.contracts.placement import EngineLaunch, NodeBinding, PlaceReply, TpuSlice
from shared.contracts.subjects import Rpc
from shared.domain.placement.commands import RENDEZVOUS_PORTS, node_command, rendezvous_port

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


HEAD = "# node hgx-01 (rank 0 of 1), allocation alloc-1"
PREFIX = "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,3,2 HETSCHED_ALLOCATION_ID=alloc-1 HETSCHED_NODE=hgx-01"


def test_vllm_line() -> None:
    assert emit_text(_placed(), EmitKind.VLLM) == (
        f"{HEAD}\n{PREFIX} taskset -c 0-23,48-71 vllm serve "
        "meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4 --gpu-memory-utilization 0.351 --max-model-len 8192 "
        "--max-num-seqs 16 --dtype bfloat16 --kv-cache-dtype auto --quantization fp8"
    )


def test_sglang_line() -> None:
    assert emit_text(_placed(), "sglang") == (
        f"{HEAD}\n{PREFIX} taskset -c 0-23,48-71 python -m "
        "sglang.launch_server --model-path meta-llama/Meta-Llama-3-70B --tp-size 4 --mem-fraction-static 0.351"
    )


def test_env_lines() -> None:
    assert emit_text(_placed(), EmitKind.ENV).splitlines() == [
        HEAD,
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES=0,1,3,2",
        "HETSCHED_ALLOCATION_ID=alloc-1",
        "HETSCHED_NODE=hgx-01",
    ]


def test_no_cpu_set_no_taskset_and_devices_from_the_binding() -> None:
    binding = [NodeBinding(node="n", cuda_visible_devices="4,5", tp_rank_order=[4, 5], numa_node=None, cpu_set=None)]
    line = emit_text(_placed(binding=binding, env={}), "vllm").splitlines()[1]
    assert line.startswith(
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=4,5 HETSCHED_ALLOCATION_ID=alloc-1 HETSCHED_NODE=n "
        "vllm serve meta-llama/Meta-Llama-3-70B "
    )
    assert "taskset" not in line


def test_the_line_survives_the_shell() -> None:
    reply = _placed()
    assert reply.launch is not None
    reply.launch.vllm[0] = "/models/llama 70b"  # a local path with a space
    comment, line = emit_text(reply, "vllm").splitlines()
    assert shlex.split(comment, comments=True) == []  # the shell skips it
    words = shlex.split(line)
    assert words[:9] == [
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES=0,1,3,2",
        "HETSCHED_ALLOCATION_ID=alloc-1",
        "HETSCHED_NODE=hgx-01",
        "taskset",
        "-c",
        "0-23,48-71",
        "vllm",
        "serve",
    ]
    assert words[9] == "/models/llama 70b"


@pytest.mark.parametrize(
    "reply",
    [
        PlaceReply(status="rejected", request_id="req-1", error=ErrorBody(code="no_capacity", message="full")),
        PlaceReply(status="queued", request_id="req-1", queue_position=2),
        PlaceReply(status="placed", request_id="req-1"),  # no engine arguments (e.g. no checkpoint for int4)
    ],
    ids=["rejected", "queued", "no-launch"],
)
def test_nothing_to_emit(reply: PlaceReply) -> None:
    with pytest.raises(NothingToEmit, match="nothing to launch for req-1"):
        emit_text(reply, "vllm")


def test_unknown_kind() -> None:
    with pytest.raises(ValueError):
        emit_text(_placed(), "trtllm")


# -- a replica on two GH200 nodes: one line per node, with the engine's multi-node arguments ---------------

GH200 = [
    NodeBinding(node="dgx-gh200-01", cuda_visible_devices="0", tp_rank_order=[0], numa_node=0, cpu_set="0-71"),
    NodeBinding(node="dgx-gh200-02", cuda_visible_devices="0", tp_rank_order=[0], numa_node=0, cpu_set="0-71"),
]


def _two_nodes(allocation_id: str | None = "al-7") -> PlaceReply:
    reply = _placed(binding=GH200, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"})
    return reply.model_copy(update={"allocation_id": allocation_id, "tp": 2})


def _lines(text: str) -> list[tuple[str, list[str]]]:
    rows = text.splitlines()
    return [(rows[i], shlex.split(rows[i + 1])) for i in range(0, len(rows), 2)]


def test_two_gh200_nodes_get_a_vllm_line_each_with_their_rank_and_the_heads_address() -> None:
    port = str(rendezvous_port("al-7"))
    (head_comment, head), (worker_comment, worker) = _lines(emit_text(_two_nodes(), "vllm"))
    assert head_comment == "# node dgx-gh200-01 (rank 0 of 2), allocation al-7"
    assert worker_comment == "# node dgx-gh200-02 (rank 1 of 2), allocation al-7"
    for words, name in ((head, "dgx-gh200-01"), (worker, "dgx-gh200-02")):
        assert words[:4] == [
            "CUDA_DEVICE_ORDER=PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES=0",
            "HETSCHED_ALLOCATION_ID=al-7",
            f"HETSCHED_NODE={name}",
        ]
        assert words[4:9] == ["taskset", "-c", "0-71", "vllm", "serve"]
        assert words[9 : 9 + len(VLLM_ARGS)] == VLLM_ARGS  # the same engine arguments on every node
    multi = ["--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank"]
    assert head[-len(multi) - 5 :] == [*multi, "0", "--master-addr", "dgx-gh200-01", "--master-port", port]
    assert worker[-len(multi) - 6 :] == [
        *multi,
        "1",
        "--master-addr",
        "dgx-gh200-01",
        "--master-port",
        port,
        "--headless",
    ]


def test_two_gh200_nodes_get_an_sglang_line_each_meeting_at_the_head() -> None:
    address = f"dgx-gh200-01:{rendezvous_port('al-7')}"
    (_, head), (_, worker) = _lines(emit_text(_two_nodes(), "sglang"))
    assert head[-6:] == ["--nnodes", "2", "--node-rank", "0", "--dist-init-addr", address]
    assert worker[-6:] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", address]
    assert head[4:9] == ["taskset", "-c", "0-71", "python", "-m"] and worker[9] == "sglang.launch_server"


def test_the_env_of_each_node_names_its_node_and_devices() -> None:
    text = emit_text(_two_nodes(), "env")
    assert text.split("\n# ")[1].splitlines() == [
        "node dgx-gh200-02 (rank 1 of 2), allocation al-7",
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES=0",
        "HETSCHED_ALLOCATION_ID=al-7",
        "HETSCHED_NODE=dgx-gh200-02",
    ]


def test_a_dry_run_names_no_allocation_and_meets_on_the_request_ids_port() -> None:
    lines = node_lines(_two_nodes(allocation_id=None), "vllm")
    assert [line.comment for line in lines] == [
        "# node dgx-gh200-01 (rank 0 of 2), dry run: no allocation reserved",
        "# node dgx-gh200-02 (rank 1 of 2), dry run: no allocation reserved",
    ]
    assert all("HETSCHED_ALLOCATION_ID" not in line.env for line in lines)
    assert lines[1].argv[lines[1].argv.index("--master-port") + 1] == str(rendezvous_port("req-42"))


def test_node_command_is_one_ranks_argv_and_environment() -> None:
    argv, env = node_command(
        "sglang",
        ["--model-path", "m", "--tp-size", "2"],
        {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"},
        node="b",
        rank=1,
        ranks=2,
        head_node="a",
        cuda_visible_devices="3",
        allocation_id="al-9",
    )
    assert argv == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        f"a:{rendezvous_port('al-9')}",
    ]
    assert env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "3",
        "HETSCHED_ALLOCATION_ID": "al-9",
        "HETSCHED_NODE": "b",
    }
    one, _ = node_command("vllm", ["m"], {}, node="a", allocation_id="al-9")
    assert one == ["vllm", "serve", "m"]  # one node: no multi-node arguments
    with pytest.raises(ValueError, match="rank 2"):
        node_command("vllm", ["m"], {}, node="a", rank=2, ranks=2, allocation_id="al-9")
    with pytest.raises(ValueError, match="rendezvous"):
        node_command("vllm", ["m"], {}, node="a", rank=0, ranks=2)
    with pytest.raises(ValueError, match="no sglang arguments"):
        node_command("sglang", [], {}, node="a")


def test_the_rendezvous_port_is_stable_and_in_its_range() -> None:
    ports = {rendezvous_port(f"al-{i}") for i in range(200)}
    assert all(RENDEZVOUS_PORTS[0] <= port <= RENDEZVOUS_PORTS[1] for port in ports)
    assert len(ports) > 190 and rendezvous_port("al-1") == rendezvous_port("al-1")


# -- a TPU slice --------------------------------------------------------------------------------------------

TPU_ARGS = ["meta-llama/Meta-Llama-3-8B", "--tensor-parallel-size", "4", "--max-model-len", "4096"]


def _tpu() -> PlaceReply:
    return PlaceReply(
        status="placed",
        request_id="req-9",
        allocation_id="al-t",
        backend="tpu",
        tp=4,
        tpu_slice=TpuSlice(pod="v5e-pod-1", origin=[0, 4], shape=[2, 2]),
        launch=EngineLaunch(vllm=TPU_ARGS, sglang=[], env={"PJRT_DEVICE": "TPU"}),
    )


def test_a_tpu_slice_gets_its_vllm_tpu_line() -> None:
    assert emit_text(_tpu(), "vllm").splitlines() == [
        "# TPU slice v5e-pod-1 origin 0,4 shape 2x2, allocation al-t",
        "PJRT_DEVICE=TPU HETSCHED_ALLOCATION_ID=al-t HETSCHED_NODE=v5e-pod-1 vllm serve " + shlex.join(TPU_ARGS),
    ]
    assert "TPU VM" in (emit_note(_tpu()) or "")
    with pytest.raises(NothingToEmit, match="no sglang arguments for a TPU slice"):
        emit_text(_tpu(), "sglang")


def test_notes_say_where_the_nodes_meet_and_warn_of_unequal_nodes() -> None:
    assert emit_note(_placed()) is None
    note = emit_note(_two_nodes())
    assert note is not None and f"dgx-gh200-01:{rendezvous_port('al-7')}" in note and "warning" not in note
    uneven = [
        NodeBinding(node="a", cuda_visible_devices="0,1,2,3", tp_rank_order=[0, 1, 2, 3]),
        NodeBinding(node="b", cuda_visible_devices="4,5", tp_rank_order=[4, 5]),
    ]
    assert "unequal GPU counts (a 4, b 2)" in (emit_note(_placed(binding=uneven)) or "")


# -- the command: stdout holds only the pasteable text; no launch exits 1 with the reply on stderr ------------

PLACE = ["place", "--model", "llama3-70b", "--tenant", "acme", "--context-tokens", "8192"]


def _run(reply: PlaceReply, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    monkeypatch.setattr(common, "with_rpc", lambda _data_dir, _what, _work: reply)
    return CliRunner().invoke(cli.app, [*PLACE, *args])


def test_place_emit_prints_only_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(_placed(), monkeypatch, "--emit", "vllm")
    assert result.exit_code == 0, result.output
    assert result.stdout == emit_text(_placed(), "vllm") + "\n"
    assert result.stdout.splitlines()[0] == HEAD


def test_place_emit_env(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _run(_placed(), monkeypatch, "--emit", "env")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == emit_text(_placed(), "env").splitlines()


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


def test_place_dry_run_emits_the_lines_from_explain_without_reserving(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    dry = _two_nodes(allocation_id=None)

    def answer(_data_dir: Any, what: str, _work: Any) -> PlaceReply:
        asked.append(what)
        return dry

    monkeypatch.setattr(common, "with_rpc", answer)
    result = CliRunner().invoke(cli.app, [*PLACE, "--dry-run", "--emit", "sglang"])
    assert result.exit_code == 0, result.output
    assert asked == [Rpc.PLACEMENT_EXPLAIN.value]  # decided, not placed; no lease renewed
    assert result.stdout == emit_text(dry, "sglang") + "\n"
    assert "dry run: no allocation reserved" in result.stdout.splitlines()[0]
    assert "join it at dgx-gh200-01:" in result.stderr


def test_place_dry_run_alone_prints_the_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def answer(_data_dir: Any, what: str, _work: Any) -> PlaceReply:
        asked.append(what)
        return _two_nodes(allocation_id=None)

    monkeypatch.setattr(common, "with_rpc", answer)
    result = CliRunner().invoke(cli.app, [*PLACE, "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert asked == [Rpc.PLACEMENT_EXPLAIN.value]
    assert PlaceReply.model_validate_json(result.stdout).binding == GH200
