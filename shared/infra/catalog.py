"""Reads catalog and inventory files (YAML) and hands their contents to the pure parsers."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any, TypeVar

import yaml

from shared.domain.admission import parse_model_groups
from shared.domain.fleet import Fleet
from shared.domain.hardware import Sku, merge_catalogs, parse_sku_catalog
from shared.domain.inventory import InventoryError, parse_inventory, referenced_topo_files
from shared.domain.models import ModelSpec, merge_model_catalogs, parse_model_catalog
from shared.domain.routing import Region, parse_regions

CATALOG_PACKAGE = "shared.catalog"

T = TypeVar("T")


def packaged_file(name: str) -> Path:
    return Path(str(files(CATALOG_PACKAGE).joinpath(name)))


def demo_fleet_path() -> Path:
    return packaged_file("demo_fleet.yaml")


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise InventoryError(str(path), f"not valid YAML: {exc}") from exc


def load_skus(extra: Path | None = None) -> dict[str, Sku]:
    """The shipped SKU catalog, with a user's catalog file merged over it."""
    skus = parse_sku_catalog(_yaml(packaged_file("skus.yaml")))
    if extra is not None:
        skus = merge_catalogs(skus, parse_sku_catalog(_yaml(extra)))
    return skus


def _read_inventory(path: Path) -> tuple[dict[str, Any], dict[str, str], str]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InventoryError(str(path), f"cannot read: {exc.strerror}") from exc
    try:
        doc = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise InventoryError(str(path), f"not valid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise InventoryError(str(path), "expected a mapping at the top level")
    digest = hashlib.sha256(raw)
    texts: dict[str, str] = {}
    for name in sorted(referenced_topo_files(doc)):
        topo_path = (path.parent / name).resolve()
        try:
            texts[name] = topo_path.read_text()
        except OSError as exc:
            raise InventoryError(str(path), f"topo_file {name!r}: {exc.strerror}") from exc
        digest.update(name.encode() + b"\0" + texts[name].encode())
    return doc, texts, digest.hexdigest()[:32]


def inventory_fingerprint(path: Path) -> str:
    """Digest of the inventory file and every topo file it names (no parsing of the fleet)."""
    return _read_inventory(path)[2]


def load_inventory(path: Path, *, skus: dict[str, Sku] | None = None) -> tuple[Fleet, str]:
    """The fleet an inventory file describes and a fingerprint of the file and every topo file it names."""
    doc, texts, fingerprint = _read_inventory(path)
    fleet = parse_inventory(doc, skus=skus if skus is not None else load_skus(), topo_texts=texts)
    return fleet, fingerprint


def load_model_groups(path: Path | None, models: Mapping[str, ModelSpec]) -> dict[str, tuple[str, ...]]:
    """Model groups (several engines answering one API): the shipped file, or ``path`` instead of it."""
    return parse_model_groups(_yaml(path if path is not None else packaged_file("model_groups.yaml")), models)


def load_regions(path: Path | None = None) -> dict[str, Region]:
    """Regions with their RTTs, prices, power and PUE: the shipped file, or ``path`` instead of it."""
    return parse_regions(_yaml(path if path is not None else packaged_file("regions.yaml")))


def watch_file(path: Path, read: Callable[[Path], T]) -> Callable[[], T | None]:
    """A poll of ``path``: ``read(path)`` each time its modification time changed since the last poll (or
    since this call, for the first), None while it has not. A file that is gone raises ``OSError``."""
    seen = [path.stat().st_mtime_ns if path.exists() else 0]

    def changed() -> T | None:
        mtime = path.stat().st_mtime_ns
        if mtime == seen[0]:
            return None
        seen[0] = mtime
        return read(path)

    return changed


def watch_regions(path: Path | None) -> Callable[[], dict[str, Region] | None]:
    """The regions file's contents each time it changes (prices move: operators edit it); None while it has
    not. The shipped file (``path`` None) never changes."""
    if path is None:
        return lambda: None
    return watch_file(path, load_regions)


def load_models(extra: Path | None = None) -> dict[str, ModelSpec]:
    """The shipped model catalog, with a user's model catalog merged over it."""
    models = parse_model_catalog(_yaml(packaged_file("models.yaml")))
    if extra is not None:
        models = merge_model_catalogs(models, parse_model_catalog(_yaml(extra)))
    return models
