"""Accelerator SKUs: datasheet facts the rest of the domain reasons with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class CatalogError(ValueError):
    """A catalog entry is missing a field or has a value of the wrong kind."""


@dataclass(frozen=True, slots=True)
class Sku:
    """One accelerator kind. ``hbm_bytes`` is nominal; discovery reports each device's real size."""

    name: str
    vendor: str
    family: str
    hbm_bytes: int
    memory_bandwidth_bytes_per_s: float
    tdp_w: float
    pcie_gen: int | None
    pcie_lanes: int | None
    nvlink_links: int
    bf16_tflops: float
    price_usd_per_hour: float
    source: str

    @property
    def is_tpu(self) -> bool:
        return self.vendor == "google"


def _number(entry: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> float | None:
    value = entry.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise CatalogError(f"{where}.{key}: expected a non-negative number, got {value!r}")
    return float(value)


def parse_sku_catalog(data: Mapping[str, Any]) -> dict[str, Sku]:
    """SKUs from a catalog document (``{"skus": {NAME: {...}}}``); raises CatalogError naming the field."""
    entries = data.get("skus")
    if not isinstance(entries, Mapping):
        raise CatalogError("catalog: expected a mapping under `skus`")
    skus: dict[str, Sku] = {}
    for name, entry in entries.items():
        where = f"skus.{name}"
        if not isinstance(entry, Mapping):
            raise CatalogError(f"{where}: expected a mapping")
        pcie_gen = _number(entry, "pcie_gen", where, optional=True)
        pcie_lanes = _number(entry, "pcie_lanes", where, optional=True)
        skus[str(name)] = Sku(
            name=str(name),
            vendor=str(entry.get("vendor", "")),
            family=str(entry.get("family", "")),
            hbm_bytes=int(_number(entry, "hbm_bytes", where) or 0),
            memory_bandwidth_bytes_per_s=_number(entry, "memory_bandwidth_bytes_per_s", where) or 0.0,
            tdp_w=_number(entry, "tdp_w", where) or 0.0,
            pcie_gen=int(pcie_gen) if pcie_gen is not None else None,
            pcie_lanes=int(pcie_lanes) if pcie_lanes is not None else None,
            nvlink_links=int(_number(entry, "nvlink_links", where) or 0),
            bf16_tflops=_number(entry, "bf16_tflops", where) or 0.0,
            price_usd_per_hour=_number(entry, "price_usd_per_hour", where) or 0.0,
            source=str(entry.get("source", "")),
        )
    return skus


def merge_catalogs(base: Mapping[str, Sku], override: Mapping[str, Sku]) -> dict[str, Sku]:
    """A user's catalog adds SKUs and replaces same-named ones whole."""
    return {**base, **override}


_GIB = 1024**3


def sku_from_device_name(name: str, memory_bytes: int | None) -> str | None:
    """Catalog SKU for a device name as NVML / nvidia-smi print it ("NVIDIA H100 80GB HBM3"), or None.

    Memory disambiguates variants that share a name (GH200 96 vs 144 GB, A100 40 vs 80 GB).
    """
    text = name.upper().replace("NVIDIA", "").strip()
    gib = (memory_bytes or 0) / _GIB
    pcie = "PCIE" in text
    if "GH200" in text:
        return "GH200-144GB" if gib > 110 else "GH200-96GB"
    if "H200" in text:
        return "H200-SXM-141GB"
    if "H100" in text:
        return "H100-PCIE-80GB" if pcie or "NVL" in text else "H100-SXM-80GB"
    if "L40S" in text:
        return "L40S-48GB"
    if "A100" in text:
        size = "80GB" if gib > 50 or "80GB" in text else "40GB"
        return f"A100-{'PCIE' if pcie else 'SXM'}-{size}"
    return None
