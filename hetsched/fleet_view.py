"""Rendering for the CLI: the fleet table and `topo parse` output (JSON shape from API.md)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from shared.contracts.fleet import FleetGetReply
from shared.domain.topology import ParsedTopology, nvlink_domains

GIB = 1024**3


def topology_json(parsed: ParsedTopology) -> dict[str, Any]:
    """`hetsched topo parse --json`: gpus, nics, links, nvlink_domains (API.md)."""
    matrix = parsed.matrix
    return {
        "gpus": [
            {
                "index": g.index,
                "cpu_affinity": g.cpu_affinity,
                "numa_affinity": g.numa_affinity,
                "gpu_numa_id": g.gpu_numa_id,
                "nvlinks": g.nvlinks,
            }
            for g in parsed.gpus
        ],
        "nics": [n.device or n.column for n in parsed.nics],
        "links": [list(row) for row in matrix.codes()],
        "nvlink_domains": [
            {"members": list(d.gpus), "kind": d.kind.value, "cliques": [list(c) for c in d.cliques]}
            for d in nvlink_domains(matrix)
        ],
    }


def render_topology(parsed: ParsedTopology, console: Console) -> None:
    data = topology_json(parsed)
    table = Table("GPU", *[f"GPU{g['index']}" for g in data["gpus"]], "NV links", "CPU affinity", "NUMA")
    for gpu, row in zip(data["gpus"], data["links"], strict=True):
        table.add_row(
            f"GPU{gpu['index']}", *row, str(gpu["nvlinks"]), gpu["cpu_affinity"] or "-", gpu["numa_affinity"] or "-"
        )
    console.print(table)
    if data["nics"]:
        console.print(f"NICs: {', '.join(data['nics'])}")
    for domain in data["nvlink_domains"]:
        cliques = " ".join("{" + ",".join(map(str, c)) + "}" for c in domain["cliques"]) or "-"
        console.print(f"NVLink domain {domain['members']}: {domain['kind']}; cliques {cliques}")


def render_fleet(reply: FleetGetReply, console: Console) -> None:
    """`hetsched fleet`: nodes, NVLink domains with two or more GPUs, TPU pods."""
    nodes = Table("region", "node", "sku", "GPUs", "NVLink layout", "domains", "HBM GiB", "reserved GiB", "state")
    for node in reply.nodes:
        accs = node.accelerators
        domains = {a.domain or "-" for a in accs}
        nodes.add_row(
            node.region,
            node.name,
            node.sku,
            str(len(accs)),
            node.kind or "-",
            str(len(domains)),
            f"{sum(a.hbm_total_bytes for a in accs) / GIB:,.0f}",
            f"{sum(a.hbm_reserved_bytes for a in accs) / GIB:,.1f}",
            node.state,
        )
    console.print(nodes)
    domain_table = Table("NVLink domain", "kind", "GPUs", "largest clique")
    for domain in reply.domains:
        if len(domain.members) < 2:
            continue
        largest = max((len(c) for c in domain.cliques), default=1)
        domain_table.add_row(domain.id, domain.kind, str(len(domain.members)), str(largest))
    console.print(domain_table)
    pods = Table("TPU pod", "region", "type", "shape", "chips", "HBM GiB")
    for pod in reply.tpu_pods:
        hbm = (pod.hbm_per_chip or 0) * pod.chips / GIB
        pods.add_row(pod.name, pod.region, pod.type, "x".join(map(str, pod.shape)), str(pod.chips), f"{hbm:,.0f}")
    console.print(pods)
