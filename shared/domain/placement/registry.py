"""The plugin registry: every placement plugin by name, with its factory (config mapping -> plugin)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from shared.domain.placement.filters import (
    backend_artifact,
    demand,
    hbm,
    nvlink_group,
    pcie_budget,
    pcie_load,
    rack_power,
    region,
    sku_allow,
    slo,
    tenant_rights,
    tpu_shape,
    tpu_slice,
)
from shared.domain.placement.framework import Framework, PluginFactory, Profile, build_framework
from shared.domain.placement.scores import cost, energy, link, packing, reserve, sku_fit

DEFAULT_REGISTRY: Final[Mapping[str, PluginFactory]] = MappingProxyType(
    {
        module.NAME: module.factory
        for module in (
            demand,
            backend_artifact,
            sku_allow,
            region,
            tenant_rights,
            tpu_shape,
            pcie_budget,
            hbm,
            nvlink_group,
            tpu_slice,
            rack_power,
            pcie_load,
            slo,
            sku_fit,
            link,
            packing,
            cost,
            energy,
            reserve,
        )
    }
)


def framework_for(profile: Profile, registry: Mapping[str, PluginFactory] | None = None) -> Framework:
    """``profile``'s plugins from ``registry`` (default: every plugin of this package)."""
    return build_framework(profile, DEFAULT_REGISTRY if registry is None else registry)
