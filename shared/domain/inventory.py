"""Fleet inventory documents (API.md "Fleet inventory file") -> a ``Fleet``.

Pure: the caller loads the YAML and reads the ``topo_file`` texts it references (see
``referenced_topo_files``), then hands both in. Every error names where in the document it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from shared.domain.fleet import Accelerator, Fleet, NodeProfile, Rack, TpuPod
from shared.domain.hardware import Sku
from shared.domain.topology import (
    PRESET_NAMES,
    FabricState,
    GpuFabricInfo,
    TopologyParseError,
    from_parsed,
    parse_topo_matrix,
    preset,
)
from shared.domain.topology.tpu import TpuType, all_legal_shapes


class InventoryError(ValueError):
    """The inventory is not usable; ``where`` is a path like ``regions[0].clusters[0].racks[1].nodes[2].sku``."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


def _list(value: Any, where: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InventoryError(where, "expected a list")
    return value


def _map(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InventoryError(where, "expected a mapping")
    return value


def _name(entry: Mapping[str, Any], where: str) -> str:
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InventoryError(f"{where}.name", "expected a non-empty string")
    return name


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InventoryError(where, f"expected a positive integer, got {value!r}")
    return value


def _node_entries(doc: Mapping[str, Any]) -> Iterator[tuple[str, str, str, Mapping[str, Any], Mapping[str, Any], str]]:
    for r, region in enumerate(_list(doc.get("regions"), "regions")):
        rw = f"regions[{r}]"
        region = _map(region, rw)
        for c, cluster in enumerate(_list(region.get("clusters"), f"{rw}.clusters")):
            cw = f"{rw}.clusters[{c}]"
            cluster = _map(cluster, cw)
            for k, rack in enumerate(_list(cluster.get("racks"), f"{cw}.racks")):
                kw = f"{cw}.racks[{k}]"
                rack = _map(rack, kw)
                for n, node in enumerate(_list(rack.get("nodes"), f"{kw}.nodes")):
                    nw = f"{kw}.nodes[{n}]"
                    yield _name(region, rw), _name(cluster, cw), _name(rack, kw), rack, _map(node, nw), nw


def referenced_topo_files(doc: Mapping[str, Any]) -> set[str]:
    """The ``topo_file`` paths the document names (relative to the inventory file)."""
    return {str(node["topo_file"]) for *_rest, node, _w in _node_entries(doc) if node.get("topo_file")}


def _fabric(value: Any, where: str) -> GpuFabricInfo | None:
    if value is None:
        return None
    entry = _map(value, where)
    if "cluster_uuid" not in entry or "clique_id" not in entry:
        raise InventoryError(where, "expected `cluster_uuid` and `clique_id`")
    return GpuFabricInfo(
        cluster_uuid=str(entry["cluster_uuid"]), clique_id=int(entry["clique_id"]), state=FabricState.COMPLETED
    )


def _node(
    *,
    name: str,
    region: str,
    cluster: str,
    rack: str,
    entry: Mapping[str, Any],
    where: str,
    skus: Mapping[str, Sku],
    topo_texts: Mapping[str, str],
) -> NodeProfile:
    sku_name = entry.get("sku")
    if not isinstance(sku_name, str) or sku_name not in skus:
        raise InventoryError(f"{where}.sku", f"unknown SKU {sku_name!r}; known: {', '.join(sorted(skus))}")
    sku = skus[sku_name]
    if sku.is_tpu:
        raise InventoryError(f"{where}.sku", f"{sku_name} is a TPU: describe it under `tpu_pods`")
    topo_file = entry.get("topo_file")
    numa_by_gpu: Sequence[int | None] = ()
    affinity: Sequence[str | None] = ()
    if topo_file:  # a real `nvidia-smi topo -m` wins over a preset
        text = topo_texts.get(str(topo_file))
        if text is None:
            raise InventoryError(f"{where}.topo_file", f"file {topo_file!r} was not provided")
        try:
            parsed = parse_topo_matrix(text)
        except TopologyParseError as exc:
            raise InventoryError(f"{where}.topo_file", f"{topo_file}: {exc}") from exc
        links = from_parsed(parsed)
        gpus = parsed.gpu_count
        if "gpus" in entry and _positive_int(entry["gpus"], f"{where}.gpus") != gpus:
            raise InventoryError(f"{where}.gpus", f"says {entry['gpus']} but {topo_file} shows {gpus} GPUs")
        numa_by_gpu = links.numa
        affinity = [g.cpu_affinity for g in parsed.gpus]
    else:
        gpus = _positive_int(entry.get("gpus", 1), f"{where}.gpus")
        layout = entry.get("topology", "nvswitch-8" if gpus == 8 and sku.nvlink_links >= 18 else "pcie")
        if layout not in PRESET_NAMES:
            raise InventoryError(f"{where}.topology", f"unknown preset {layout!r}; known: {', '.join(PRESET_NAMES)}")
        nv_links = entry.get("nv_links")
        try:
            links = preset(str(layout), gpus=gpus, nv_links=int(nv_links) if nv_links is not None else None)
        except ValueError as exc:
            raise InventoryError(f"{where}.topology", str(exc)) from exc
        numa_by_gpu = links.numa
    hbm = entry.get("hbm_bytes", sku.hbm_bytes)
    fabric = _fabric(entry.get("fabric"), f"{where}.fabric")
    accelerators = tuple(
        Accelerator(
            index=i,
            sku=sku.name,
            hbm_bytes=_positive_int(hbm, f"{where}.hbm_bytes"),
            numa_node=numa_by_gpu[i] if i < len(numa_by_gpu) else None,
            cpu_affinity=affinity[i] if i < len(affinity) else None,
            power_limit_w=sku.tdp_w,
            pcie_gen_max=sku.pcie_gen,
            pcie_width_max=sku.pcie_lanes,
            fabric=fabric,
        )
        for i in range(gpus)
    )
    return NodeProfile(
        name=name, region=region, cluster=cluster, rack=rack, sku=sku.name, accelerators=accelerators, links=links
    )


def _tpu_pod(entry: Any, where: str, regions: set[str]) -> TpuPod:
    entry = _map(entry, where)
    name = _name(entry, where)
    try:
        tpu_type = TpuType(str(entry.get("type")))
    except ValueError:
        raise InventoryError(f"{where}.type", f"expected v5e or v5p, got {entry.get('type')!r}") from None
    shape = tuple(_positive_int(v, f"{where}.shape") for v in _list(entry.get("shape"), f"{where}.shape"))
    if len(shape) != tpu_type.axes:
        raise InventoryError(f"{where}.shape", f"a {tpu_type.value} pod has {tpu_type.axes} axes, got {list(shape)}")
    smallest = min(all_legal_shapes(tpu_type), key=lambda s: sum(s))
    if any(axis < min(smallest) for axis in shape):
        raise InventoryError(f"{where}.shape", f"{list(shape)} holds no legal {tpu_type.value} slice")
    region = entry.get("region")
    if not isinstance(region, str) or (regions and region not in regions):
        raise InventoryError(f"{where}.region", f"unknown region {region!r}")
    cluster = entry.get("cluster")
    return TpuPod(name=name, region=region, type=tpu_type, shape=shape, cluster=str(cluster) if cluster else None)


def parse_inventory(
    doc: Mapping[str, Any], *, skus: Mapping[str, Sku], topo_texts: Mapping[str, str] | None = None
) -> Fleet:
    """Build the fleet a document describes.

    A node entry with ``count: N`` stands for N nodes named ``name.format(i=1..N)`` (``dgx-{i:02d}``).
    Node names must be unique fleet-wide.
    """
    doc = _map(doc, "inventory")
    topo_texts = topo_texts or {}
    nodes: list[NodeProfile] = []
    racks: dict[tuple[str, str, str], Rack] = {}
    regions: list[str] = []
    seen: dict[str, str] = {}
    for region, cluster, rack_name, rack, entry, where in _node_entries(doc):
        if region not in regions:
            regions.append(region)
        power = rack.get("power_kw")
        if power is not None and (isinstance(power, bool) or not isinstance(power, int | float) or power <= 0):
            raise InventoryError(
                f"{where.rsplit('.nodes', 1)[0]}.power_kw", f"expected a positive number, got {power!r}"
            )
        racks.setdefault(
            (region, cluster, rack_name),
            Rack(name=rack_name, region=region, cluster=cluster, power_kw=float(power) if power else None),
        )
        base = _name(entry, where)
        count = _positive_int(entry.get("count", 1), f"{where}.count")
        names = [base] if count == 1 and "{" not in base else [base.format(i=i) for i in range(1, count + 1)]
        for name in names:
            if name in seen:
                raise InventoryError(f"{where}.name", f"node {name!r} already defined at {seen[name]}")
            seen[name] = where
            nodes.append(
                _node(
                    name=name,
                    region=region,
                    cluster=cluster,
                    rack=rack_name,
                    entry=entry,
                    where=where,
                    skus=skus,
                    topo_texts=topo_texts,
                )
            )
    for r, region in enumerate(_list(doc.get("regions"), "regions")):
        name = _name(_map(region, f"regions[{r}]"), f"regions[{r}]")
        if name not in regions:
            regions.append(name)
    pods = tuple(
        _tpu_pod(entry, f"tpu_pods[{i}]", set(regions))
        for i, entry in enumerate(_list(doc.get("tpu_pods"), "tpu_pods"))
    )
    pod_names = [p.name for p in pods]
    if len(set(pod_names)) != len(pod_names):
        raise InventoryError("tpu_pods", "pod names must be unique")
    return Fleet(nodes=tuple(nodes), racks=tuple(racks.values()), tpu_pods=pods, regions=tuple(regions))
